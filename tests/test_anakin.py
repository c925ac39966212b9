"""Anakin end to end: it learns, it averages gradients across devices, it repeats and resumes exactly."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from podray import config as config_lib
from podray.anakin import AnakinProgram
from podray.host import HostContext
from podray.metrics import read_jsonl
from podray.training import train


def _host(n: int) -> HostContext:
    devices = tuple(jax.local_devices()[:n])
    return HostContext(0, 1, devices, devices)


def _config(preset=None, **sections) -> config_lib.Config:
    overrides = [f"{k}={v}" for k, v in sections.items()]
    config = config_lib.load(preset, overrides + ["run.tensorboard=false", "run.progress=false"])
    return config


def _run_program(config, n_devices, calls):
    program = AnakinProgram(config, _host(n_devices).mesh())
    state = program.initial_state(config.seed)
    metrics = []
    for _ in range(calls):
        state, m = program.step(state)
        metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics


@pytest.mark.parametrize("preset", ["anakin_cartpole", "anakin_impala_cartpole"])
def test_agent_learns_cartpole(preset, tmp_path):
    config = _config(preset, **{"run.devices": "[0]"})
    summary = train(config, run_dir=tmp_path)
    assert summary.final_mean_return >= 400, summary
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["final_mean_return"] >= 400
    assert {"final_mean_return", "env_steps", "wall_s", "steps_per_s"} <= saved.keys()


@pytest.mark.parametrize("agent", ["ppo", "impala"])
def test_four_devices_match_one_device(agent):
    """Same global batch on 1 and 4 devices: the same parameters (gradients averaged over devices).

    PPO runs one minibatch per epoch here: with several, which samples share a minibatch depends on
    the device count (each device shuffles its own shard), so only the full-batch step is the same math.
    """
    config = _config(
        None,
        **{
            "agent.name": agent,
            "env.num_envs": 8,
            "anakin.rollout_length": 16,
            "agent.num_minibatches": 1,
            "agent.epochs": 2,
            "anakin.updates_per_call": 4,
            "total_env_steps": 8 * 16 * 8,
        },
    )
    one, m1 = _run_program(config, 1, 2)
    four, m4 = _run_program(config, 4, 2)
    leaves1, leaves4 = jax.tree.leaves(one.train.params), jax.tree.leaves(four.train.params)
    for a, b in zip(leaves1, leaves4):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(m1[-1]["loss"], m4[-1]["loss"], rtol=1e-3, atol=1e-5)
    assert m1[-1]["episodes"] == m4[-1]["episodes"]
    # and the parameters really moved
    init = jax.device_get(AnakinProgram(config, _host(1).mesh()).initial_state(config.seed))
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(init.train.params), leaves1))


def test_same_seed_same_devices_is_bitwise_repeatable():
    config = _config(None, **{"env.num_envs": 8, "anakin.updates_per_call": 3, "total_env_steps": 8 * 128 * 6})
    a, ma = _run_program(config, 2, 2)
    b, mb = _run_program(config, 2, 2)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(ma, mb):
        assert jax.tree.all(jax.tree.map(np.array_equal, x, y))
    other = config_lib.load(None, ["seed=1", "env.num_envs=8", "anakin.updates_per_call=3"])
    c, _ = _run_program(other, 2, 1)
    assert not np.array_equal(jax.tree.leaves(a.train.params)[0], jax.tree.leaves(c.train.params)[0])


class _Interrupt(Exception):
    pass


class _FailAt:
    def __init__(self, step):
        self.step = step

    def write(self, step, metrics):
        if step >= self.step:
            raise _Interrupt(f"interrupted at update {step}")

    def close(self):
        pass


def test_resume_after_interruption_is_bitwise_identical(tmp_path):
    overrides = {
        "env.num_envs": 8,
        "anakin.updates_per_call": 2,
        "run.checkpoint_every": 4,
        "total_env_steps": 8 * 128 * 10,
        "run.devices": "[0, 1]",
    }
    config = _config(None, **overrides)
    full = train(config, run_dir=tmp_path / "full")

    with pytest.raises(_Interrupt):
        train(config, run_dir=tmp_path / "cut", extra_sinks=[_FailAt(6)])
    from podray.checkpoint import Checkpointer

    assert Checkpointer(tmp_path / "cut" / "checkpoints").latest_step() == 4
    resumed = train(config, run_dir=tmp_path / "cut", resume=True)
    for x, y in zip(
        jax.tree.leaves(jax.device_get(full.final_state)), jax.tree.leaves(jax.device_get(resumed.final_state))
    ):
        np.testing.assert_array_equal(x, y)
    assert resumed.final_mean_return == full.final_mean_return
    steps = [row["step"] for row in read_jsonl(tmp_path / "cut" / "metrics.jsonl")]
    assert steps == [2, 4, 6, 8, 10]


def test_checkpoint_restores_onto_the_resuming_programs_devices(tmp_path):
    """A checkpoint restores onto the mesh of the program that resumes it, not the devices that saved
    it (as after a restart on other hosts): saved from devices 0-1, restored by a program on 2-3."""
    from podray.checkpoint import Checkpointer

    config = _config(None, **{"env.num_envs": 8, "anakin.updates_per_call": 2, "total_env_steps": 8 * 128 * 4})
    devices = jax.local_devices()
    saver = AnakinProgram(config, HostContext(0, 1, tuple(devices[:2]), tuple(devices[:2])).mesh())
    state, _ = saver.step(saver.initial_state(config.seed))
    Checkpointer(tmp_path).save(2, state, {"calls": 1})
    resumer = AnakinProgram(config, HostContext(0, 1, tuple(devices[2:4]), tuple(devices[2:4])).mesh())
    restored, meta = Checkpointer(tmp_path).restore_latest(resumer.abstract_state(config.seed))
    assert meta["calls"] == 1
    for leaf in jax.tree.leaves(restored):
        assert leaf.sharding.device_set == set(devices[2:4])
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(restored))):
        np.testing.assert_array_equal(a, b)
    resumer.step(restored)  # the resuming program runs on what it restored


def test_replicas_share_a_device_and_differ():
    config = _config(
        None,
        **{"anakin.replicas": 3, "anakin.updates_per_call": 2, "total_env_steps": 4 * 128 * 2, "run.devices": "[0]"},
    )
    state, metrics = _run_program(config, 1, 1)
    kernel = jax.tree.leaves(state.train.params)[0]
    assert kernel.shape[0] == 3
    assert not np.array_equal(kernel[0], kernel[1])
    assert metrics[0]["loss"].shape == (3,)


def _podray(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs the `podray` command line in a fresh Python process."""
    return subprocess.run([sys.executable, "-m", "podray.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_default_cli_job_end_to_end(tmp_path):
    """`podray train` with the default preset (in this process: it needs no Ray), shortened, writes the
    whole run directory."""
    run = tmp_path / "run"
    proc = _podray(
        "train", "--run-dir", str(run), "--set", "total_env_steps=51200", "--set", "anakin.updates_per_call=25"
    )
    assert proc.returncode == 0, proc.stderr
    assert "done (local): final mean return" in proc.stdout
    assert "env steps" in proc.stdout and "steps/s" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["env_steps"] == 51200 and summary["steps_per_s"] > 0
    assert summary["final_mean_return"] > 20  # learning has started
    assert (run / "config.yaml").exists() and (run / "metrics.jsonl").exists()
    assert any((run / "tensorboard").iterdir())
    assert any((run / "checkpoints").iterdir())
    # and --resume of a finished run (here in-process, without Ray) is a no-op that reports the same steps
    proc = _podray("train", "--in-process", "--resume", str(run))
    assert proc.returncode == 0, proc.stderr
    # --resume with a larger total_env_steps extends the run; fields the checkpoint depends on are refused
    proc = _podray("train", "--in-process", "--resume", str(run), "--set", "total_env_steps=102400")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["env_steps"] == 102400
    assert "total_env_steps: 102400" in (run / "config.yaml").read_text()
    assert [row["env_steps"] for row in read_jsonl(run / "metrics.jsonl")][-2:] == [51200, 102400]
    proc = _podray("train", "--resume", str(run), "--set", "agent.learning_rate=1e-3", timeout=60)
    assert proc.returncode == 2 and "agent.learning_rate: cannot be changed when resuming" in proc.stderr


def test_compile_cache_second_run_loads_instead_of_compiling(tmp_path):
    """With run.compile_cache set, a second run of the same config loads its executables from the cache
    (counted: compilations that did not come from the cache) and logs the same metrics; 'off' turns
    the cache off again."""
    from podray.host import configure_compile_cache

    backend_compiles, cache_hits = [], []

    def on_duration(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            backend_compiles.append(event)

    def on_event(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            cache_hits.append(event)

    cache = tmp_path / "cache"
    config = config_lib.load(
        "anakin_cartpole",
        ["total_env_steps=5120", "anakin.updates_per_call=2", "run.tensorboard=false", "run.progress=false"]
        + [f"run.compile_cache={cache}"],
    )
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    compiled = []
    try:
        for name in ("first", "second"):
            before = len(backend_compiles) - len(cache_hits)
            summary = train(config, run_dir=tmp_path / name)
            compiled.append(len(backend_compiles) - len(cache_hits) - before)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)
        assert configure_compile_cache("off") is None
    assert any(cache.iterdir())
    assert compiled[0] >= 2 and compiled[1] == 0, compiled  # the init and the training call at least
    assert cache_hits and summary.compile_s > 0
    timing = {"time", "steps_per_s", "compile_s"}
    first, second = (
        [{k: v for k, v in row.items() if k not in timing} for row in read_jsonl(tmp_path / name / "metrics.jsonl")]
        for name in ("first", "second")
    )
    assert len(first) == 2 and first == second  # 4 fake devices x 4 envs x 128 steps, 2 updates a call
