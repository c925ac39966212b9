"""Preemption and faults: SIGTERM/SIGINT save a checkpoint at an agreed update boundary and exit 143/130
with one line; resumes are continuous (bitwise for Anakin); damaged checkpoints fall back to the newest
good one; a checkpoint of another config names the field; an unwritable run directory is found before
compilation; a failed save keeps the previous checkpoint."""

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from podray import config as config_lib
from podray import preemption
from podray.checkpoint import Checkpointer, CheckpointError
from podray.metrics import read_jsonl
from podray.training import train

# Anakin, small: 4 fake devices x 2 envs, 16 steps, 2 updates per call (256 env steps per update).
ANAKIN = [
    "env.num_envs=8",
    "anakin.rollout_length=16",
    "anakin.updates_per_call=2",
    "agent.anneal_lr=false",
    "agent.epochs=1",
    "agent.num_minibatches=1",
    "network.depth=1",
    "network.width=16",  # the total budget then leaves the math alone (the resume shortens it)
    "run.tensorboard=false",
    "run.progress=false",
]
PER_UPDATE = 8 * 16


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "podray.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_rows(run_dir: pathlib.Path, rows: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if path.exists() and len(path.read_text().splitlines()) >= rows:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {rows} rows in {path} within {timeout} s")


def _signal_and_wait(proc: subprocess.Popen, signum: int, limit_s: float = 30) -> tuple[str, str, float]:
    sent = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=limit_s + 30)
    return out, err, time.monotonic() - sent


def _assert_one_line_stop(err: str, signal_name: str, run_dir: pathlib.Path) -> int:
    assert "PC: @" not in err and "*** SIG" not in err and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"podray: stopped by {signal_name} at update "), err
    assert f"podray train --resume {run_dir}" in last
    return int(last.split(" at update ")[1].split()[0])


@pytest.fixture
def compilation_cache(tmp_path):
    """A JAX persistent compilation cache shared by this test's processes: the interrupted run, its
    resume and the uninterrupted run compile the same program once."""
    from jax._src import compilation_cache

    cache = str(tmp_path / "jax_cache")
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = [getattr(jax.config, name) for name in names]
    compilation_cache.reset_cache()  # JAX reads the directory once, at its first compilation
    jax.config.update(names[0], cache)
    jax.config.update(names[1], 0)
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    yield env
    for name, value in zip(names, before):
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def test_sigterm_in_process_anakin_saves_at_the_boundary_and_resumes_bitwise(tmp_path, compilation_cache):
    run_dir = tmp_path / "cut"
    args = ["train", "--in-process", "--run-dir", str(run_dir), "--set", *ANAKIN, "total_env_steps=10000000"]
    proc = _start(args, env=compilation_cache)
    _wait_for_rows(run_dir, 2, proc)
    out, err, took = _signal_and_wait(proc, signal.SIGTERM)
    assert proc.returncode == 143, err
    assert took < 30
    stopped_at = _assert_one_line_stop(err, "SIGTERM", run_dir)
    # The checkpoint is at the last logged update (the boundary after the signal), and the log says so.
    assert Checkpointer(run_dir / "checkpoints").latest_step() == stopped_at
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["updates"] == stopped_at
    event = read_jsonl(run_dir / "run_log.jsonl")[-1]
    assert event["event"] == "stopped" and event["signal"] == "SIGTERM" and event["updates"] == stopped_at
    assert 0 < event["time"] - event["signal_time"] < 30  # saved within the grace period

    # Resume for 3 more calls; the result is bitwise that of a run never interrupted.
    total = (stopped_at + 6) * PER_UPDATE
    config = config_lib.load(None, [*ANAKIN, f"total_env_steps={total}"])
    resumed = train(config, run_dir=run_dir, resume=True)
    full = train(config, run_dir=tmp_path / "full")
    for x, y in zip(jax.tree.leaves(jax.device_get(full.final_state)), jax.tree.leaves(resumed.final_state)):
        np.testing.assert_array_equal(x, np.asarray(y))
    updates = [r["updates"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert updates == list(range(2, stopped_at + 7, 2))  # continuous: no gap, no repeat


def test_sigint_in_process_sebulba_joins_actors_and_resumes_continuously(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["run.tensorboard=false", "run.progress=false", "sebulba.log_every=4", "total_env_steps=100000000"]
    overrides.insert(0, "run.cpu_devices=0")  # this test session already fakes 4 devices
    proc = _start(["train", "sebulba_cartpole", "--in-process", "--run-dir", str(run_dir), "--set", *overrides])
    _wait_for_rows(run_dir, 1, proc)
    out, err, took = _signal_and_wait(proc, signal.SIGINT)
    assert proc.returncode == 130, err
    assert took < 30
    stopped_at = _assert_one_line_stop(err, "SIGINT", run_dir)
    assert Checkpointer(run_dir / "checkpoints").latest_step() == stopped_at
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[-1]["updates"] == stopped_at
    steps_per_update = rows[-1]["env_steps"] // stopped_at

    config = config_lib.load("sebulba_cartpole", [*overrides[:4], f"total_env_steps={(stopped_at + 8) * 1024}"])
    summary = train(config, run_dir=run_dir, resume=True)
    assert summary.env_steps == (stopped_at + 8) * steps_per_update
    assert int(jax.device_get(summary.final_state.train.updates)) == stopped_at + 8
    updates = [r["updates"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert updates == sorted(set(updates)) and updates[-1] == stopped_at + 8
    assert not [t for t in threading.enumerate() if t.name.startswith("podray-actor")]


def _two_host_config(**extra) -> list[str]:
    return [*ANAKIN, "run.hosts=2", "run.cpu_devices=2", *[f"{k}={v}" for k, v in extra.items()]]


def test_sigterm_to_the_driver_of_a_two_host_ray_run(ray_cluster, tmp_path):
    """Both hosts save at the same update (a collective save), the driver exits 143 with one line, and the
    run resumes continuously."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = ["train", "--address", ray_cluster.address, "--run-dir", str(run_dir), "--set"]
    proc = _start([*args, *_two_host_config(total_env_steps=10000000)], env=env)
    _wait_for_rows(run_dir, 2, proc)
    out, err, took = _signal_and_wait(proc, signal.SIGTERM)
    assert proc.returncode == 143, err
    assert took < 30
    stopped_at = _assert_one_line_stop(err, "SIGTERM", run_dir)
    assert Checkpointer(run_dir / "checkpoints").latest_step() == stopped_at
    events = [e["event"] for e in read_jsonl(run_dir / "run_log.jsonl")]
    assert events == ["start", "stopped"]

    from podray.cluster import train_on_ray

    total = (stopped_at + 4) * PER_UPDATE
    config = config_lib.load(None, _two_host_config(total_env_steps=total))
    (result,) = train_on_ray(config, run_dir=run_dir, resume=True)
    assert result["env_steps"] == total
    updates = [r["updates"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert updates == list(range(2, stopped_at + 5, 2))


def test_a_preempted_host_worker_saves_first_and_the_driver_restarts_with_nothing_lost(ray_cluster, tmp_path):
    from podray.cluster import train_on_ray

    config = config_lib.load(None, _two_host_config(total_env_steps=24 * PER_UPDATE))
    run_dir = tmp_path / "run"
    signalled = []

    def preempt_host_1(group):
        if signalled:
            return  # the restarted group runs to the end

        def preempt():
            while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
                time.sleep(0.05)
            os.kill(group.nodes[1]["pid"], signal.SIGTERM)  # what the VM of a preempted host sends

        signalled.append(group.nodes[1]["pid"])
        threading.Thread(target=preempt, daemon=True).start()

    (result,) = train_on_ray(config, run_dir=run_dir, on_group=preempt_host_1)
    assert signalled and result["env_steps"] == config.total_env_steps
    log = read_jsonl(run_dir / "run_log.jsonl")
    stops = [e for e in log if e["event"] == "stopped"]
    restarts = [e for e in log if e["event"] == "restart"]
    assert len(stops) == 1 and len(restarts) == 1 and log[-1]["event"] == "finish"
    assert restarts[0]["lost_updates"] == 0 and restarts[0]["resumed_from_updates"] == stops[0]["updates"]
    assert [r["updates"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(2, 25, 2))


# ---- checkpoints: damaged, of another config, failed saves ------------------------------------------


def _saved(directory: pathlib.Path, steps=(1, 2, 3)) -> Checkpointer:
    checkpointer = Checkpointer(directory, keep=5)
    for step in steps:
        checkpointer.save(step, {"w": np.full((4, 3), step, np.float32)}, {"updates": step})
    return checkpointer


def _damage(step_dir: pathlib.Path) -> None:
    """Truncates every array data file of a step (what a half-written copy or a full disk leaves)."""
    for path in (step_dir / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[:5])


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_and_says_so(tmp_path):
    _saved(tmp_path / "checkpoints").close()
    _damage(tmp_path / "checkpoints" / "3")
    said = []
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=5, say=said.append)
    state, meta = checkpointer.restore_latest({"w": np.zeros((4, 3), np.float32)})
    assert meta["updates"] == 2 and float(np.asarray(state["w"])[0, 0]) == 2.0
    assert "update 3" in said[0] and "damaged" in said[0]
    assert "resuming from update 2" in said[-1]
    # The damaged one is moved aside, not deleted, and the next save of step 3 works.
    assert [p.name.split("-")[0] for p in (tmp_path / "checkpoints_damaged").iterdir()] == ["3"]
    checkpointer.save(3, {"w": np.full((4, 3), 3, np.float32)}, {"updates": 3})
    assert checkpointer.all_steps() == [1, 2, 3]


def test_all_checkpoints_damaged_is_a_clear_error_and_nothing_is_deleted(tmp_path):
    _saved(tmp_path / "checkpoints").close()
    _damage(tmp_path / "checkpoints" / "1")
    (tmp_path / "checkpoints" / "2" / "state" / "_METADATA").unlink()  # a missing file
    _damage(tmp_path / "checkpoints" / "3")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=5, say=lambda s: None)
    with pytest.raises(CheckpointError, match=r"no readable checkpoint .*update 3: .*update 1: .*nothing was deleted"):
        checkpointer.restore_latest({"w": np.zeros((4, 3), np.float32)})
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_a_checkpoint_of_another_config_names_the_field_before_compiling(tmp_path, compile_counter):
    config = config_lib.load(None, [*ANAKIN, "total_env_steps=512"])
    made = Checkpointer(tmp_path / "checkpoints")
    made.save(2, {"w": np.zeros(3, np.float32)}, {"updates": 2, "config": config.to_dict()})
    made.close()
    other = config_lib.load(None, [*ANAKIN, "total_env_steps=512", "network.width=8"])
    compile_counter.clear()
    with pytest.raises(
        config_lib.ConfigError, match=r"network\.width: the checkpoint of update 2 .* network\.width=16, this run has 8"
    ):
        train(other, run_dir=tmp_path, resume=True)
    assert compile_counter == []


def test_an_unwritable_run_directory_is_found_before_compiling(tmp_path, compile_counter):
    """As root too: a run directory under a regular file cannot be created by anyone."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = config_lib.load(None, ANAKIN)
    with pytest.raises(config_lib.ConfigError, match=r"run directory .*a-file/run is not writable"):
        train(config, run_dir=blocker / "run")
    assert compile_counter == []
    proc = subprocess.run(
        [sys.executable, "-m", "podray.cli", "train", "--in-process", "--run-dir", str(blocker / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("podray: error: run directory")


def test_a_failed_save_keeps_the_previous_checkpoint_and_ends_the_run_with_the_reason(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    real_save, calls = ocp.CheckpointManager.save, []

    def full_disk_on_the_second_save(self, step, *args, **kwargs):
        calls.append(step)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk_on_the_second_save)
    config = config_lib.load(None, [*ANAKIN, "total_env_steps=2048", "run.checkpoint_every=2"])
    with pytest.raises(
        CheckpointError, match=r"update 4 .*No space left on device.*previous checkpoint is kept \(update 2\)"
    ):
        train(config, run_dir=tmp_path)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [2]
    assert read_jsonl(tmp_path / "run_log.jsonl")[-1]["event"] == "failed"


def test_a_second_signal_stops_at_once():
    with preemption.handle_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and stop.signal_name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # the same stop delivered twice (terminal group + driver)
        time.sleep(0.05)
        assert stop.signal_name == "SIGTERM"
        time.sleep(preemption.SAME_STOP_S)
        with pytest.raises(preemption.StopNow) as raised:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
        assert raised.value.exit_status == 143
    assert signal.getsignal(signal.SIGTERM) is not preemption._handler
