"""Every cluster-launcher YAML in clusters/ passes Ray's own schema (ray/autoscaler/ray-schema.json, as
ray.autoscaler's validate_config applies it), and its TPU slice is one Ray's TPU helpers accept."""

import pathlib

import pytest
import yaml

CLUSTERS = sorted((pathlib.Path(__file__).resolve().parents[1] / "clusters").glob("*.yaml"))


def test_there_are_tpu_cluster_configs():
    assert {p.stem for p in CLUSTERS} >= {"tpu-v4-8", "tpu-v4-32", "tpu-v5e-16"}


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
def test_cluster_yaml_passes_rays_schema(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(path.read_text())
    # What `ray up` does: merge the GCP provider's defaults.yaml, then check against ray-schema.json
    # (raises jsonschema.ValidationError naming the bad key).
    validate_config(prepare_config(config))
    assert config["provider"]["type"] == "gcp"
    tpu = config["available_node_types"]["ray_tpu"]
    assert "acceleratorType" in tpu["node_config"]
    assert any("podray[tpu]" in c for c in config["worker_setup_commands"])


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
def test_cluster_slice_matches_the_documented_run_fields(path):
    """The `run.tpu_topology`/`run.tpu_version` written in each file's usage line validate."""
    from podray import config as config_lib

    usage = next(line for line in path.read_text().splitlines() if "ray submit" in line)
    sets = [tok for tok in usage.split() if tok.startswith("run.")]
    config = config_lib.load(None, sets)
    assert config.run.tpu_topology and config.run.tpu_version
