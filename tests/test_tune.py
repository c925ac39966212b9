"""podray tune: studies are checked before Ray starts a trial; a grid completes and ranks its trials;
PBT exploits through checkpoints and the exploiting trial carries on from the restored step count; an
interrupted study resumes with Tuner.restore and finishes."""

import csv
import json
import os
import pathlib
import signal

import pytest
import yaml
from conftest import FAKE_TPU_SLICE
from ray import tune

from podray import cli
from podray import config as config_lib
from podray.cluster import HostGroup
from podray.config import ConfigError
from podray.tuning import load_study, parse, resume_study, run_study, trainable
from podray.tuning import spec as spec_lib
from podray.tuning import study as study_lib

# A trial of a few seconds: a small network, one epoch of one minibatch, 256 env steps per report.
TINY = {
    "total_env_steps": 2048,
    "env.envs_per_device": 4,
    "anakin.rollout_length": 16,
    "anakin.updates_per_call": 4,
    "agent.epochs": 1,
    "agent.num_minibatches": 1,
    "network.width": 16,
    "run.tensorboard": False,
}
STEPS_PER_REPORT = 4 * 16 * 4
DEPTHS = {"choice": [1, 2]}
V4_16 = {"accelerator": "tpu", "tpu_topology": FAKE_TPU_SLICE["topology"], "tpu_version": FAKE_TPU_SLICE["version"]}
"""Resources of a trial on one slice like conftest's fake one (v4 2x2x2: 2 hosts of 4 chips)."""


def _write_study(tmp_path: pathlib.Path, name: str = "study", **keys) -> pathlib.Path:
    data = {"name": name, "base": "anakin_cartpole", "overrides": dict(TINY), **keys}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _tune_results(study_dir: pathlib.Path, trial_id: str) -> list[dict]:
    """Every result Tune recorded for a trial (its result.json), in order."""
    (trial_dir,) = [p for p in study_dir.iterdir() if p.is_dir() and trial_id in p.name]
    return [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """The test session's one local Ray (conftest.ray_cluster: 4 logical CPUs and a fake TPU slice)."""
    import ray

    yield ray


# --------------------------------------------------------------------------------------------------
# Rejected before Ray: no Ray call, no trial


@pytest.mark.parametrize(
    "keys, field",
    [
        ({"search": {"network.depht": {"grid": [1, 2]}}}, "search.network.depht"),
        ({"search": {"bogus.depth": {"grid": [1, 2]}}}, "search.bogus.depth"),
        ({"search": {"network": {"grid": [1, 2]}}}, "search.network"),
        ({"search": {"network.depth": {"normal": [1, 2]}}}, "search.network.depth"),
        ({"search": {"network.depth": [1, 2]}}, "search.network.depth"),
        ({"search": {"network.depth": {"grid": []}}}, "search.network.depth"),
        ({"search": {"network.depth": {"uniform": [1, 4]}}}, "search.network.depth"),  # int field
        ({"search": {"agent.learning_rate": {"uniform": [1e-3, 1e-4]}}}, "search.agent.learning_rate"),
        ({"search": {"agent.learning_rate": {"loguniform": [0.0, 1e-3]}}}, "search.agent.learning_rate"),
        ({"search": {"agent.learning_rate": {"randint": [1, 4]}}}, "search.agent.learning_rate"),
        ({"search": {"network.depth": {"grid": [0, 2]}}}, "network.depth"),  # value fails validation
        ({"search": {"agent.discount": {"uniform": [0.9, 1.1]}}}, "agent.discount"),  # range end fails
        (
            {"search": {"env.envs_per_device": {"grid": [4, 3]}, "agent.num_minibatches": {"grid": [1, 5]}}},
            "agent.num_minibatches",  # 3 envs x 16 steps do not split into 5 minibatches
        ),
        ({"search": {"run.cpu_devices": {"grid": [1, 2]}}}, "search.run.cpu_devices"),
        ({"metric": "reward"}, "metric"),
        ({"mode": "maximum"}, "mode"),
        ({"scheduler": {"name": "hyperband"}}, "scheduler.name"),
        ({"scheduler": {"name": "asha", "grace_period": 10**9}}, "scheduler.grace_period"),
        ({"scheduler": {"name": "asha", "reduction_factor": 1}}, "scheduler.reduction_factor"),
        ({"scheduler": {"name": "pbt", "perturbation_interval": 512}}, "scheduler.mutations"),
        (
            {"scheduler": {"name": "pbt", "perturbation_interval": 512, "mutations": {"network.depth": DEPTHS}}},
            "scheduler.mutations.network.depth",  # would change shapes: a checkpoint would not fit
        ),
        (
            {
                "scheduler": {
                    "name": "pbt",
                    "perturbation_interval": 512,
                    "mutations": {"agent.learning_rate": {"grid": [1e-3, 2e-3]}},
                }
            },
            "scheduler.mutations.agent.learning_rate",
        ),
        ({"resources": {"cpus": 0}}, "resources.cpus"),
        ({"resources": {"accelerator": "fpga"}}, "resources.accelerator"),
        ({"resources": {"hosts": 2, "accelerator": "tpu"}}, "resources.hosts"),  # give the slice instead
        ({"resources": {"hosts": 2, "accelerator": "gpu"}}, "resources.hosts"),
        ({"resources": {"tpu_topology": "2x2x2"}}, "resources.tpu_version"),
        ({"resources": {"accelerator": "tpu", "tpu_version": "v4"}}, "resources.tpu_topology"),
        ({"resources": {**V4_16, "tpu_topology": "3x7"}}, "resources.tpu_topology"),
        ({"resources": {**V4_16, "tpu_version": "v9"}}, "resources.tpu_version"),
        ({"resources": {**V4_16, "accelerator": "cpu"}}, "resources.accelerator"),
        ({"resources": {**V4_16, "hosts": 4}}, "resources.hosts"),  # the slice has 2
        ({"resources": {**V4_16, "devices": 2}}, "resources.devices"),  # a trial takes all 4 chips of a host
        ({"resources": V4_16, "overrides": {**TINY, "env.num_envs": 4}}, "env.num_envs"),  # 4 envs, 8 chips
        ({"overrides": {**TINY, "run.tpu_topology": "2x2x2", "run.tpu_version": "v4"}}, "run.tpu_topology"),
        ({"search": {"run.tpu_topology": {"grid": ["2x2x2"]}}}, "search.run.tpu_topology"),
        ({"resources": {"devices": 3}, "overrides": {**TINY, "env.num_envs": 4}}, "env.num_envs"),
        ({"samples": 0}, "samples"),
        ({"base": "no_such_preset"}, "base"),
        ({"overrides": {"network.depht": 2}}, "overrides.network.depht"),
        ({"serach": {}}, "serach"),
    ],
)
def test_bad_study_is_rejected_before_ray(tmp_path, monkeypatch, capsys, keys, field):
    def ray_must_not_start(*args, **kwargs):
        raise AssertionError("the study reached Ray")

    monkeypatch.setattr(study_lib, "connect", ray_must_not_start)
    path = _write_study(tmp_path, **keys)
    with pytest.raises(ConfigError) as info:
        load_study(path)
    assert str(info.value).startswith(field), info.value
    # The command line says the same in one line, exit status 2, and creates no study directory.
    assert cli.main(["tune", str(path), "--storage", str(tmp_path / "storage")]) == 2
    assert capsys.readouterr().err.startswith(f"podray: error: {field}")
    assert not (tmp_path / "storage").exists()


def test_impossible_resources_are_rejected_before_trials(tmp_path, ray_session):
    for resources, field in [({"cpus": 64}, "resources.cpus"), ({"accelerator": "gpu"}, "resources.devices")]:
        spec = load_study(_write_study(tmp_path, resources=resources))
        with pytest.raises(ConfigError, match=f"^{field}: a trial needs"):
            run_study(spec, storage=tmp_path / "storage", name="impossible", verbose=0)
        assert not (tmp_path / "storage" / "impossible").exists()


@pytest.mark.parametrize("path", sorted(pathlib.Path("tune_configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_studies_validate(path):
    base = yaml.safe_load(path.read_text())["base"]
    assert base in config_lib.preset_names()
    spec = load_study(path)
    assert spec.search and spec.metric == "mean_return"


def test_cli_set_overrides_the_base_of_every_trial(tmp_path):
    spec = load_study(_write_study(tmp_path), ["agent.learning_rate=1e-3"])
    assert spec.base_config["agent"]["learning_rate"] == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match="^agent.learning_rate"):
        load_study(_write_study(tmp_path), ["agent.learning_rate=-1"])


def test_schedulers_count_time_in_env_steps(tmp_path):
    asha = load_study(_write_study(tmp_path, scheduler={"name": "asha", "grace_period": 512}))
    scheduler = study_lib.make_scheduler(asha)
    assert scheduler._time_attr == "env_steps" and scheduler._max_t == 2048
    assert [milestone for milestone, _ in scheduler._brackets[0]._rungs] == [2048, 1024, 512]  # ASHA's rungs
    rates = {"loguniform": [1e-4, 1e-3]}
    pbt = load_study(
        _write_study(
            tmp_path,
            search={"network.depth": {"grid": [1, 2]}},
            scheduler={"name": "pbt", "perturbation_interval": 512, "mutations": {"agent.learning_rate": rates}},
        )
    )
    scheduler = study_lib.make_scheduler(pbt)
    assert scheduler._time_attr == "env_steps" and scheduler._perturbation_interval == 512
    space = study_lib.param_space(pbt)  # the mutated field gets an initial distribution too
    assert set(space) == {"network.depth", "agent.learning_rate"}
    explore = scheduler._custom_explore_fn
    assert explore({"agent.learning_rate": 5e-3, "network.depth": 2}) == {
        "agent.learning_rate": 1e-3,
        "network.depth": 2,
    }


# --------------------------------------------------------------------------------------------------
# The reporting sink and checkpoint restores (no Ray trial)


def test_sink_reports_each_row_with_the_checkpoint_of_its_step(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "8" / "state").mkdir(parents=True)
    (run_dir / "checkpoints" / "8" / "state" / "data").write_text("x")
    (run_dir / "config.yaml").write_text(config_lib.dump_yaml(config_lib.Config()))
    reports = []

    def report(metrics, checkpoint=None):
        files = None
        if checkpoint is not None:
            root = pathlib.Path(checkpoint.path)
            files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
            files.append(json.loads((root / "checkpoint.json").read_text()))
        reports.append((dict(metrics), files))

    sink = trainable.TuneReportSink(run_dir, "t1", report=report)
    sink.write(4, {"mean_return": 10.0, "env_steps": 100, "steps_per_s": 5.0})
    assert reports == []  # held back until its checkpoint would exist
    sink.write(8, {"mean_return": float("nan"), "env_steps": 200, "steps_per_s": 6.0})
    sink.close()  # a closing (possibly failed) run reports nothing
    assert len(reports) == 1 and reports[0][1] is None  # step 4 has no checkpoint
    sink.flush()
    (first, _), (second, files) = reports
    assert first["mean_return"] == 10.0 and first["frames_per_s"] == 5.0 and first["restores"] == 0
    assert second["mean_return"] == 10.0  # no episode finished: the previous return is carried
    assert second["env_steps"] == 200
    assert files[:-1] == ["checkpoint.json", "checkpoints/8/state/data", "config.yaml"]
    assert {k: files[-1][k] for k in ("trial_id", "updates", "env_steps")} == {
        "trial_id": "t1",
        "updates": 8,
        "env_steps": 200,
    }
    assert files[-1]["row"] == second  # the row travels with its checkpoint
    assert not (run_dir / "tune_stage").exists()


def test_a_trial_restored_at_the_end_of_its_budget_reports_the_restored_row(tmp_path):
    """Tune may restore a trial from a checkpoint of its last step (a pause that lands after the last
    report, or a PBT clone of a trial's final checkpoint). The restored run has nothing left to run; it
    must still report, or the trial's last result stays the stale one from before the restore."""
    from podray.training import train

    config = config_lib.load(None, [f"{k}={v}" for k, v in TINY.items()] + ["run.checkpoint_every=4"])
    source_reports = []
    source = tmp_path / "source"
    sink = trainable.TuneReportSink(source, "a", report=lambda m, checkpoint=None: source_reports.append(m))
    train(config, run_dir=source, extra_sinks=[sink])
    sink.flush()
    last = source_reports[-1]
    assert last["env_steps"] == 2048
    final = trainable.orbax_steps(source / "checkpoints")[-1]
    stage = trainable.stage_checkpoint(
        source, final, {"trial_id": "a", "updates": final, "env_steps": 2048, "row": last}, tmp_path / "ckpt"
    )

    run_dir = tmp_path / "clone"
    record = trainable.restore_run_dir(stage, run_dir, config)
    reports = []
    sink = trainable.TuneReportSink(
        run_dir, "b", report=lambda m, checkpoint=None: reports.append((m, checkpoint)), restored_row=record["row"]
    )
    trainable.launch(config, run_dir, resume=True, sink=sink)
    sink.flush()
    ((row, checkpoint),) = reports
    assert row["env_steps"] == 2048 and row["mean_return"] == last["mean_return"]
    assert row["restores"] == 1 and row["restored_env_steps"] == 2048
    assert checkpoint is not None  # still exploitable by others


def test_restore_rejects_a_checkpoint_whose_shapes_do_not_fit(tmp_path):
    source = tmp_path / "ckpt"
    (source / "checkpoints" / "8").mkdir(parents=True)
    (source / "config.yaml").write_text(config_lib.dump_yaml(config_lib.Config()))
    (source / "checkpoint.json").write_text(json.dumps({"trial_id": "a", "updates": 8, "env_steps": 200}))
    config = config_lib.from_dict({"agent": {"learning_rate": 1e-3}})
    record = trainable.restore_run_dir(source, tmp_path / "run", config)
    assert record["changes"] == {"agent.learning_rate": [2.5e-4, 1e-3]} and record["env_steps"] == 200
    assert trainable.orbax_steps(tmp_path / "run" / "checkpoints") == [8]
    with pytest.raises(ConfigError, match="^network.depth: the checkpoint of trial a does not fit"):
        trainable.restore_run_dir(source, tmp_path / "run", config_lib.from_dict({"network": {"depth": 3}}))


# --------------------------------------------------------------------------------------------------
# Studies on Ray


def test_grid_of_four_trials_completes_and_ranks_the_best_first(tmp_path, ray_session, capsys):
    path = _write_study(
        tmp_path,
        name="grid",
        search={"env.envs_per_device": {"grid": [4, 8]}, "network.depth": {"grid": [1, 2]}},
        concurrency=2,
    )
    code = cli.main(["tune", str(path), "--storage", str(tmp_path / "storage"), "--name", "grid"])
    out = capsys.readouterr().out
    assert code == 0, out
    study_dir = tmp_path / "storage" / "grid"
    summary = json.loads((study_dir / "trials.json").read_text())
    rows = summary["trials"]
    assert len(rows) == 4 and {r["status"] for r in rows} == {"TERMINATED"}
    assert {(r["env.envs_per_device"], r["network.depth"]) for r in rows} == {(4, 1), (4, 2), (8, 1), (8, 2)}
    returns = [r["mean_return"] for r in rows]
    assert returns == sorted(returns, reverse=True) and returns[0] > 0
    assert summary["best"] == rows[0]
    # The table printed starts with the best trial; the best line names its config and metrics.
    table = out[out.index("rank") :].splitlines()
    assert rows[0]["trial"] in table[1] and f"best trial {rows[0]['trial']}" in out
    for row in rows:  # every compiled call reported once, and the run went its whole length
        assert row["env_steps"] == 2048
        assert row["iterations"] == 2048 // (row["env.envs_per_device"] * 16 * 4)
        assert (pathlib.Path(row["run_dir"]) / "summary.json").exists()
    with (study_dir / "trials.csv").open() as f:
        assert [r["trial"] for r in csv.DictReader(f)] == [r["trial"] for r in rows]
    for png in ("return_vs_env_steps.png", "best_return_vs_batch_depth.png"):
        assert (study_dir / png).read_bytes()[:4] == b"\x89PNG"


def test_pbt_exploits_and_the_exploiting_trial_continues_from_the_restored_steps(tmp_path, ray_session):
    rates = {"loguniform": [1e-4, 3e-2]}
    path = _write_study(
        tmp_path,
        name="pbt",
        search={"agent.learning_rate": rates},
        scheduler={
            "name": "pbt",
            "perturbation_interval": 5 * STEPS_PER_REPORT,  # one perturbation, at 1280 of 2048 steps
            "quantile_fraction": 0.5,
            "resample_probability": 0.0,
            "synch": True,  # both trials meet at each perturbation: an exploit is certain
            "mutations": {"agent.learning_rate": rates},
        },
        samples=2,
        concurrency=2,
    )
    result = run_study(load_study(path), storage=tmp_path / "storage", name="pbt", verbose=0)
    rows = result.outputs.rows
    assert result.unfinished == 0 and {r["status"] for r in rows} == {"TERMINATED"}, rows
    exploits = 0
    for row in rows:
        restores = trainable.read_restores(row["run_dir"])
        history = _tune_results(result.study_dir, row["trial"])
        for count, record in enumerate(restores, start=1):
            if record["from_trial"] != row["trial"]:  # an exploit: another trial's checkpoint
                exploits += 1
                assert set(record["changes"]) <= {"agent.learning_rate"}  # shape-free only
            else:  # synch PBT pauses the trials that wait; they resume from their own checkpoint
                assert record["changes"] == {}
            restored = record["env_steps"]
            assert restored > 0 and restored % STEPS_PER_REPORT == 0
            first_after = next(h for h in history if h["restores"] == count)
            assert first_after["restored_env_steps"] == restored
            assert first_after["env_steps"] == restored + STEPS_PER_REPORT  # the step count carried on
        assert history[-1]["env_steps"] == 2048
        rate = history[-1]["config"]["agent.learning_rate"]
        assert 1e-4 <= rate <= 3e-2  # perturbations clipped to the range
        ran = config_lib.load_yaml(str(pathlib.Path(row["run_dir"]) / "config.yaml"))
        assert ran["agent"]["learning_rate"] == pytest.approx(rate)  # the program ran the mutated rate
    assert exploits >= 1, rows


def test_a_trial_of_two_hosts_runs_through_the_ray_layer(tmp_path, ray_session):
    """resources.hosts: 2 makes each trial one multi-host JAX program of two host workers (processes
    joined by jax.distributed on loopback), placed in the trial's own placement group; the trial
    reports every row that host 0 writes, with checkpoints."""
    path = _write_study(
        tmp_path,
        name="hosts",
        search={"network.depth": {"grid": [1]}},
        resources={"cpus": 1, "accelerator": "cpu", "devices": 1, "hosts": 2},
        concurrency=1,
    )
    result = run_study(load_study(path), storage=tmp_path / "storage", name="hosts", verbose=0)
    ((row,),) = [result.outputs.rows]
    assert row["status"] == "TERMINATED" and row["error"] == "" and row["env_steps"] == 2048, row
    history = _tune_results(result.study_dir, row["trial"])
    per_report = 2 * STEPS_PER_REPORT  # 2 hosts x 1 device x 4 envs
    assert [h["env_steps"] for h in history] == list(range(per_report, 2049, per_report))
    assert all(h["restores"] == 0 for h in history)
    run_dir = pathlib.Path(row["run_dir"])
    events = [json.loads(line) for line in (run_dir / "run_log.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "start" and events[0]["hosts"] == 2 and events[-1]["event"] == "finish"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] == 2048


# --------------------------------------------------------------------------------------------------
# Trials on TPU slices (conftest's fake v4-16 slice: JAX does not run there, placement does)


def test_a_tpu_slice_study_reserves_whole_slices(tmp_path, monkeypatch):
    """resources.tpu_topology/tpu_version give each trial one slice: its hosts and chips per host follow
    from the topology, each trial's program is a run on that slice (run.tpu_*), and the trial's
    placement group asks for its own CPU bundle, then one bundle per host (the slice's head resource on
    host 0's), all on one slice."""
    spec = load_study(_write_study(tmp_path, resources=V4_16))
    r = spec.resources
    assert (r.accelerator, r.hosts, r.devices, r.tpu_topology, r.tpu_version) == ("tpu", 2, 4, "2x2x2", "v4")
    config = spec_lib.trial_config(spec.base_config, {}, r)
    assert (config.run.tpu_topology, config.run.tpu_version, config.run.hosts) == ("2x2x2", "v4", 1)
    assert config.run.cpu_devices == 0
    assert spec_lib.total_env_steps(config, 8) == 2048  # the batch splits over 2 hosts x 4 chips
    hosts_path = []
    monkeypatch.setattr(trainable, "_launch_hosts", lambda *args: hosts_path.append(args) or "hosts")
    assert trainable.launch(config, tmp_path / "run", False, sink=None) == "hosts"  # through the Ray layer
    request = study_lib.resource_request(r)
    assert request.bundles == [{"CPU": 1.0}, {"TPU": 4.0, "TPU-v4-16-head": 1.0}, {"TPU": 4.0}]
    assert request.required_resources == {"CPU": 1.0, "TPU": 8.0, "TPU-v4-16-head": 1.0}
    kwargs = r.placement_options()  # with the bundles, what Tune's placement group is made of
    assert kwargs["strategy"] is None  # topology_strategy replaces it
    assert kwargs["topology_strategy"] == {"ray.io/tpu-slice-name": "STRICT_PACK"}
    assert kwargs["bundle_label_selector"] == [
        {},
        {"ray.io/tpu-pod-type": "v4-16", "ray.io/tpu-worker-id": "0"},
        {"ray.io/tpu-pod-type": "v4-16"},
    ]
    # The study directory's study.yaml (read back by --resume) keeps the slice; the same slice in the base
    # config is accepted.
    assert parse.from_dict(spec.to_dict()).resources == r
    same = load_study(
        _write_study(
            tmp_path, resources=V4_16, overrides={**TINY, "run.tpu_topology": "2x2x2", "run.tpu_version": "v4"}
        )
    )
    assert same.resources == r
    # Other studies keep their plain request.
    assert study_lib.resource_request(load_study(_write_study(tmp_path)).resources).strategy == "PACK"


def _bundle_nodes(pg) -> list[str]:
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)
    return [table["bundles_to_node_id"][i] for i in range(len(table["bundles_to_node_id"]))]


def test_a_tpu_trial_places_one_host_worker_per_host_of_its_slice(tmp_path, ray_session):
    """The trial's placement group (as Tune creates it) lands on the fake slice: every bundle on one
    slice, host bundle i on TPU worker i; a second trial's group waits (the slice's head resource is
    taken), so Tune runs as many TPU trials as there are slices. From inside the trial's bundle, the Ray
    layer places one host worker per TPU host in the trial's bundles, ordered by TPU worker id, and
    stopping the group leaves the trial's reservation alone."""
    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec = load_study(_write_study(tmp_path, resources=V4_16))
    config = spec_lib.trial_config(spec.base_config, {}, spec.resources)
    request = study_lib.resource_request(spec.resources)
    labels = {n["NodeID"]: n.get("Labels") or {} for n in ray.nodes() if n.get("Alive")}
    pg = request.to_placement_group()
    other = None
    try:
        assert ray.wait([pg.ready()], timeout=60)[0], "the trial's placement group was not placed"
        nodes = _bundle_nodes(pg)
        assert {labels[n].get("ray.io/tpu-slice-name") for n in nodes} == {FAKE_TPU_SLICE["name"]}
        assert [labels[n]["ray.io/tpu-worker-id"] for n in nodes[1:]] == ["0", "1"]
        other = request.to_placement_group()
        assert not ray.wait([other.ready()], timeout=2)[0], "a second trial got a slice the cluster lacks"

        @ray.remote(num_cpus=1)
        def place_hosts_from_the_trial(config):
            group = HostGroup.place(config, timeout_s=60, placement=trainable.host_placement())
            try:
                return ray.get_runtime_context().get_node_id(), group.nodes
            finally:
                group.stop()

        # As Tune starts a trial: in bundle 0, its children captured by the trial's group.
        strategy = PlacementGroupSchedulingStrategy(pg, 0, placement_group_capture_child_tasks=True)
        ref = place_hosts_from_the_trial.options(scheduling_strategy=strategy).remote(config)
        trial_node, hosts = ray.get(ref, timeout=60)
        assert trial_node == nodes[0]
        assert [h["node_id"] for h in hosts] == nodes[1:]  # one host worker per host bundle, no other node
        assert [h["tpu_worker_id"] for h in hosts] == ["0", "1"]  # JAX process i is TPU worker i
        assert {h["tpu_name"] for h in hosts} == {FAKE_TPU_SLICE["name"]}
        assert placement_group_table(pg)["state"] == "CREATED"  # the trial's reservation is not the group's
    finally:
        for group in (pg, other):
            if group is not None:
                remove_placement_group(group)


def test_borrowed_slice_bundles_are_ordered_by_tpu_worker_id(tmp_path, ray_session):
    """Whatever order the caller's bundles hold the hosts in, JAX process i runs on TPU worker i."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    spec = load_study(_write_study(tmp_path, resources=V4_16))
    config = spec_lib.trial_config(spec.base_config, {}, spec.resources)
    pod = {"ray.io/tpu-pod-type": FAKE_TPU_SLICE["pod_type"]}
    pg = placement_group(
        [{"CPU": 1}, {"TPU": 4}, {"TPU": 4}],  # host bundles: worker 1 first, then worker 0
        bundle_label_selector=[{}, {**pod, "ray.io/tpu-worker-id": "1"}, {**pod, "ray.io/tpu-worker-id": "0"}],
    )
    try:
        assert ray.wait([pg.ready()], timeout=60)[0]
        nodes = _bundle_nodes(pg)
        group = HostGroup.place(config, timeout_s=60, placement=(pg, 1))
        try:
            assert [h["tpu_worker_id"] for h in group.nodes] == ["0", "1"]
            assert [h["node_id"] for h in group.nodes] == [nodes[2], nodes[1]]
        finally:
            group.stop()
    finally:
        remove_placement_group(pg)


def test_a_tpu_study_is_rejected_without_a_slice_for_it(tmp_path, ray_session):
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    fits = load_study(_write_study(tmp_path, resources=V4_16))
    study_lib.check_cluster(fits)  # the fake v4-16 slice is there
    lost_host = [
        dict(n, Alive=False) if (n.get("Labels") or {}).get("ray.io/tpu-worker-id") == "1" else n for n in alive
    ]
    with pytest.raises(
        ConfigError, match=r"^resources\.tpu_topology: .* no complete slice .* pod types of its TPU hosts: v4-16;"
    ):
        spec_lib.check_cluster(fits, lost_host)
    for resources, field in [
        ({**V4_16, "tpu_topology": "2x2x4"}, "resources.tpu_topology"),  # v4-32: 4 hosts; the cluster has v4-16
        ({**V4_16, "cpus": 2}, "resources.cpus"),  # the trial runs on a slice host; they have 1 CPU each
    ]:
        spec = load_study(_write_study(tmp_path, resources=resources))
        with pytest.raises(ConfigError, match=f"^{field}: "):
            run_study(spec, storage=tmp_path / "storage", name="no_slice", verbose=0)
        assert not (tmp_path / "storage" / "no_slice").exists()


class _InterruptOnce(tune.Callback):
    """A Tune callback that interrupts the study (as Ctrl+C does) after `after` results, once: the
    marker file keeps the restored study (which unpickles this callback) from interrupting again."""

    def __init__(self, marker: pathlib.Path, after: int):
        self.marker, self.after, self.seen = marker, after, 0

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.seen += 1
        if self.seen >= self.after and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGUSR1)  # Tune's SIGINT handler also handles SIGUSR1


def test_interrupted_study_resumes_and_finishes(tmp_path, ray_session):
    path = _write_study(tmp_path, name="resume", search={"network.depth": {"grid": [1, 2]}}, concurrency=2)
    spec = load_study(path)
    marker = tmp_path / "interrupted"
    first = run_study(
        spec, storage=tmp_path / "storage", name="resume", callbacks=[_InterruptOnce(marker, after=3)], verbose=0
    )
    assert marker.exists() and first.unfinished >= 1
    done_before = {r["trial"]: r["env_steps"] for r in first.outputs.rows}
    assert min(done_before.values()) < 2048

    second = resume_study(first.study_dir)
    rows = second.outputs.rows
    assert second.unfinished == 0 and len(rows) == 2 and {r["status"] for r in rows} == {"TERMINATED"}
    assert all(r["env_steps"] == 2048 for r in rows)
    resumed = [r for r in rows if r["restores"] >= 1]
    assert resumed, rows
    for row in resumed:
        (record,) = trainable.read_restores(row["run_dir"])
        assert record["from_trial"] == row["trial"] and record["changes"] == {}
        history = _tune_results(second.study_dir, row["trial"])
        first_after = next(h for h in history if h["restores"] == 1)
        assert first_after["env_steps"] == record["env_steps"] + STEPS_PER_REPORT


def test_resume_needs_a_study_directory(tmp_path):
    with pytest.raises(ConfigError, match="^--resume"):
        resume_study(tmp_path)
    assert parse.from_dict(yaml.safe_load(_write_study(tmp_path).read_text())).name == "study"
