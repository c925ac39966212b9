"""The Ray layer: host workers form one JAX program, TPU slices get one worker per host, a lost host is
restarted from its checkpoint, metrics reach Ray's export, and `podray train` cleans up its own Ray."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import jax
import numpy as np
import pytest
from conftest import FAKE_TPU_SLICE

from podray import config as config_lib
from podray.checkpoint import CheckpointError
from podray.cluster import ClusterError, HostGroup, train_on_ray
from podray.host import HostContext
from podray.metrics import read_jsonl
from podray.training import train


def _config(**fields) -> config_lib.Config:
    overrides = [f"{k}={v}" for k, v in fields.items()]
    return config_lib.load(None, overrides + ["run.tensorboard=false", "run.progress=false"])


# The equivalence setting of tests/test_anakin.py: one PPO minibatch per epoch, so the math of a
# global batch does not depend on how it is split over devices.
SMALL = {
    "env.num_envs": 8,
    "anakin.rollout_length": 16,
    "agent.num_minibatches": 1,
    "agent.epochs": 2,
    "anakin.updates_per_call": 4,
    "total_env_steps": 8 * 16 * 8,
}


def test_two_hosts_of_two_devices_match_one_host_of_four(ray_cluster, tmp_path):
    config = _config(**SMALL, **{"run.hosts": 2, "run.cpu_devices": 2})
    (result,) = train_on_ray(config, run_dir=tmp_path / "ray", return_params=True)
    hosts = result["hosts"]
    assert [h["process_index"] for h in hosts] == [0, 1]
    assert all(h["global_devices"] == 4 for h in hosts)
    # Both hosts hold the same parameters (gradients were averaged across all 4 devices of 2 processes).
    for a, b in zip(hosts[0]["params"], hosts[1]["params"]):
        np.testing.assert_array_equal(a, b)
    # And they are those of one process driving 4 devices with the same global batch.
    devices = tuple(jax.local_devices()[:4])
    local = train(_config(**SMALL), run_dir=tmp_path / "local", host=HostContext(0, 1, devices, devices))
    for a, b in zip(hosts[0]["params"], jax.tree.leaves(jax.device_get(local.final_state.train.params))):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    assert result["env_steps"] == local.env_steps
    # Only process 0 wrote the logs; the run log has its start and finish.
    rows = read_jsonl(tmp_path / "ray" / "metrics.jsonl")
    assert [r["updates"] for r in rows] == [4, 8]
    events = [e["event"] for e in read_jsonl(tmp_path / "ray" / "run_log.jsonl")]
    assert events == ["start", "finish"]


def test_two_host_checkpoint_resumes_in_one_process_on_as_many_devices(ray_cluster, tmp_path):
    """2 hosts x 2 devices checkpoint; 1 process x 4 devices resumes it (the same total, so the same
    shards); 1 process x 2 devices, which would hold half the environments, is refused by name and
    nothing is moved aside."""
    devices = tuple(jax.local_devices()[:4])  # this process's 4 devices (JAX started before the driver)
    run_dir = tmp_path / "run"
    fields = {k: v for k, v in SMALL.items() if k != "env.num_envs"}
    config = _config(
        **{**fields, "env.envs_per_device": 2, "run.checkpoint_every": 4, "run.hosts": 2, "run.cpu_devices": 2}
    )
    (result,) = train_on_ray(config, run_dir=run_dir, return_params=True)
    saved = result["hosts"][0]["params"]
    more = config_lib.resume_overrides(config, ["total_env_steps=1536", "run.hosts=1", "run.cpu_devices=4"])
    summary = train(more, run_dir=run_dir, resume=True, host=HostContext(0, 1, devices, devices))
    assert summary.env_steps == 1536
    assert [r["updates"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [4, 8, 12]
    assert any(not np.allclose(a, b) for a, b in zip(saved, jax.tree.leaves(summary.final_state.train.params)))
    fewer = config_lib.resume_overrides(config, ["total_env_steps=2048", "run.hosts=1", "run.cpu_devices=2"])
    two = tuple(jax.local_devices()[:2])
    with pytest.raises(CheckpointError, match="another total number of devices"):
        train(fewer, run_dir=run_dir, resume=True, host=HostContext(0, 1, two, two))
    assert not (run_dir / "checkpoints_damaged").exists()


def test_fake_tpu_slice_gets_one_worker_per_host(ray_cluster):
    s = FAKE_TPU_SLICE
    config = _config(**{"run.tpu_topology": s["topology"], "run.tpu_version": s["version"]})
    group = HostGroup.place(config, timeout_s=60)
    try:
        assert len(group.workers) == s["hosts"]
        tpu_nodes = {n.node_id for n in ray_cluster.list_all_nodes() if n is not ray_cluster.head_node}
        assert {n["node_id"] for n in group.nodes} == tpu_nodes  # one worker on each TPU host
        # JAX process i is TPU worker i of the slice.
        assert [n["tpu_worker_id"] for n in group.nodes] == [str(i) for i in range(s["hosts"])]
        assert {n["tpu_name"] for n in group.nodes} == {s["name"]}
        # The only slice is taken: a second group times out with a fix that names the slice fields.
        with pytest.raises(ClusterError, match=r"could not place a TPU slice .* set run.tpu_topology"):
            HostGroup.place(config, timeout_s=3)
    finally:
        group.stop()


def test_killed_host_worker_is_restored_from_checkpoint(ray_cluster, tmp_path, host_killer):
    upc = 4
    config = _config(
        **{
            "env.num_envs": 8,
            "anakin.rollout_length": 16,
            "anakin.updates_per_call": upc,
            "total_env_steps": 8 * 16 * upc * 6,  # 6 calls
            "run.checkpoint_every": upc,
            "run.hosts": 2,
            "run.cpu_devices": 2,
        }
    )
    run_dir = tmp_path / "run"
    killer = host_killer(run_dir, at_update=2 * upc)
    (result,) = train_on_ray(config, run_dir=run_dir, on_group=killer)
    assert result["env_steps"] == config.total_env_steps  # the full budget
    restart = killer.restart(lost_updates_at_most=config.run.checkpoint_every)
    assert restart["lost_env_steps"] <= config.run.checkpoint_every * 8 * 16
    # The step count is continuous: one row per call, no gap, no repeat.
    assert [r["updates"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [upc * (i + 1) for i in range(6)]


def test_run_out_of_restarts_ends_with_clear_error_and_checkpoints_intact(ray_cluster, tmp_path):
    upc = 4
    config = _config(
        **{
            "env.num_envs": 8,
            "anakin.rollout_length": 16,
            "anakin.updates_per_call": upc,
            "total_env_steps": 8 * 16 * upc * 50,
            "run.checkpoint_every": upc,
            "run.hosts": 1,  # the same path as for many hosts, at a fraction of the start-up
            "run.cpu_devices": 1,
            "run.max_restarts": 0,
        }
    )

    def kill_host_0_after_a_checkpoint(group):
        def kill():
            while not any(p.name.isdigit() for p in (tmp_path / "checkpoints").glob("*")):
                time.sleep(0.05)
            os.kill(group.nodes[0]["pid"], signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()

    with pytest.raises(ClusterError, match=r"run.max_restarts=0 .* intact .* podray train --resume"):
        train_on_ray(config, run_dir=tmp_path, on_group=kill_host_0_after_a_checkpoint)
    assert read_jsonl(tmp_path / "run_log.jsonl")[-1]["event"] == "failed"
    steps = [int(p.name) for p in (tmp_path / "checkpoints").glob("*") if p.name.isdigit()]
    assert steps and all(s % upc == 0 for s in steps)


def test_replicas_report_separately_through_ray_metrics_export(ray_cluster, tmp_path):
    """Two seeds run as two independent groups; each has its own run directory, and each one's custom
    metric (podray_episode_return, tagged replica=SEED) is scraped from Ray's Prometheus export."""
    name = f"metrics_{uuid.uuid4().hex[:8]}"
    config = _config(**{"name": name, "total_env_steps": 4 * 128 * 50 * 6, "run.seeds": "[3,4]"})
    port = ray_cluster.head_node.metrics_export_port
    seen: dict[str, str] = {}
    stop = threading.Event()

    def scrape_loop():
        while not stop.is_set() and len(seen) < 2:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                text = ""
            for line in text.splitlines():
                if line.startswith("ray_podray_episode_return{") and f'run="{name}"' in line:
                    for seed in ("3", "4"):
                        if f'replica="{seed}"' in line:
                            seen[seed] = line
            time.sleep(0.3)

    poller = threading.Thread(target=scrape_loop, daemon=True)
    poller.start()
    try:
        results = train_on_ray(config, run_dir=tmp_path)
        poller.join(timeout=15)
    finally:
        stop.set()
    assert sorted(seen) == ["3", "4"], f"custom metric not exported on http://127.0.0.1:{port}/metrics: {seen}"
    assert all('host="0"' in line for line in seen.values())
    assert [pathlib.Path(r["run_dir"]).name for r in results] == ["seed-3", "seed-4"]
    assert config_lib.from_dict(config_lib.load_yaml(str(tmp_path / "config.yaml"))).run.seeds == [3, 4]
    returns = [[row["mean_return"] for row in read_jsonl(tmp_path / f"seed-{s}" / "metrics.jsonl")] for s in (3, 4)]
    assert returns[0] != returns[1]  # independent seeds


def _processes_with(tag: str) -> list[int]:
    pids = []
    for environ in pathlib.Path("/proc").glob("[0-9]*/environ"):
        try:
            if tag.encode() in environ.read_bytes():
                pids.append(int(environ.parent.name))
        except OSError:
            pass
    return pids


def _train_watched(run_dir: pathlib.Path, *flags: str) -> tuple[str, str, int]:
    """Runs `podray train` (shortened) as from a user's shell, in a fresh process; returns its stdout,
    stderr and the most processes seen at once that carry its tag (set in its environment, so that only
    this command's processes, Ray's included, are counted). Fails if any outlives it by 15 s."""
    tag = f"PODRAY_TEST_TAG={uuid.uuid4().hex}"
    # As from a user's shell: no cluster address, no fake-device flag of this test session.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "XLA_FLAGS")}
    env[tag.split("=")[0]] = tag.split("=")[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "podray.cli", "train", *flags, "--run-dir", str(run_dir)]
        + ["--set", "total_env_steps=25600", "anakin.updates_per_call=5", "run.tensorboard=false"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    during: list[int] = []

    def watch():
        while proc.poll() is None:
            found = _processes_with(tag)
            if len(found) > len(during):
                during[:] = found
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    out, err = proc.communicate(timeout=480)  # Ray start-up on a loaded 2-core machine can take minutes
    watcher.join()
    assert proc.returncode == 0, err
    # Ray's processes get their signal as the command exits and need a moment to go (over a second on
    # a loaded machine); a leaked one would still be there after the deadline.
    deadline = time.monotonic() + 15.0
    while _processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_with(tag) == [], "processes of this podray train outlived it by 15 s"
    return out, err, len(during)


def test_cli_runs_in_process_unless_ray_is_asked_for_with_the_same_result(tmp_path):
    """`podray train` of a run that needs no Ray starts no Ray (one process from start to end); with
    --ray it starts a local Ray, runs through a host worker and leaves no process behind; both runs of
    the same seed log the same metrics."""
    out, err, processes = _train_watched(tmp_path / "local")
    assert "done (local): final mean return" in out
    assert "[local] env steps" in out and "compiled in" in out
    assert processes == 1, f"{processes} processes: the default job started more than itself"
    assert "HostWorker" not in out + err

    out, err, processes = _train_watched(tmp_path / "ray", "--ray")
    assert "done (ray): final mean return" in out
    assert "HostWorker" in out + err  # the run went through a Ray host worker
    assert processes >= 3  # the command, Ray's own processes, the host worker
    assert json.loads((tmp_path / "ray" / "summary.json").read_text())["env_steps"] == 25600

    timing = {"time", "steps_per_s", "compile_s"}
    rows = [
        [{k: v for k, v in row.items() if k not in timing} for row in read_jsonl(tmp_path / name / "metrics.jsonl")]
        for name in ("local", "ray")
    ]
    assert len(rows[0]) == 10 and rows[0] == rows[1]


@pytest.mark.parametrize(
    "override, field",
    [
        ("run.hosts=0", "run.hosts"),
        ("run.max_restarts=-1", "run.max_restarts"),
        ("run.seeds=[1,1]", "run.seeds"),
        ("run.tpu_topology=2x2x2", "run.tpu_topology"),
        ("run.tpu_version=v9", "run.tpu_topology"),
        ("run.tpu_topology=2x2x2 run.tpu_version=v9", "run.tpu_version"),
        ("run.tpu_topology=3x7 run.tpu_version=v4", "run.tpu_topology"),
    ],
)
def test_bad_cluster_fields_are_named(override, field):
    with pytest.raises(config_lib.ConfigError, match=field.replace(".", r"\.")):
        config_lib.load(None, override.split())


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--ray"], "--ray"),
        (["--dashboard"], "--dashboard"),
        (["--address", "auto"], "--address"),
        (["--set", "run.hosts=2"], "run.hosts"),
        (["--set", "run.seeds=[0,1]"], "run.seeds"),
    ],
)
def test_in_process_refuses_what_needs_ray_before_anything_starts(flags, named, capsys, compile_counter):
    from podray import cli

    assert cli.main(["train", "--in-process", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--in-process runs one host without Ray; drop {named}" in err and len(err.splitlines()) == 1
    assert compile_counter == []
