"""MuZero end to end: Anakin resumes bitwise with its replay and reports the search metrics; Sebulba
searches on the actor device and learns from its replay on Pong; one agent object runs under both."""

import json
import math
import threading

import gymnax  # noqa: F401  (its import runs a few JAX ops)
import jax
import numpy as np
import pytest

from podray import cli
from podray import config as config_lib
from podray.agents import build_agent
from podray.anakin import AnakinProgram
from podray.checkpoint import Checkpointer
from podray.envs import host_envs
from podray.host import HostContext
from podray.metrics import read_jsonl
from podray.sebulba import SebulbaProgram, run_program
from podray.training import train


def _host(n: int) -> HostContext:
    devices = tuple(jax.local_devices()[:n])
    return HostContext(0, 1, devices, devices)


def _config(preset, *overrides) -> config_lib.Config:
    return config_lib.load(preset, ["run.tensorboard=false", "run.progress=false", *overrides])


class _Rows:
    def __init__(self):
        self.rows = []

    def write(self, step, metrics):
        self.rows.append(dict(metrics))

    def close(self):
        pass


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


@pytest.mark.parametrize("preset, floor", [("anakin_muzero_catch", 0.8), ("anakin_muzero_cartpole", 400.0)])
def test_anakin_muzero_learns(preset, floor, tmp_path):
    """The presets as users run them (their own budgets: Catch 30k env steps, CartPole 100k)."""
    config = _config(preset, "run.devices=[0]")
    summary = train(config, run_dir=tmp_path)
    assert summary.final_mean_return >= floor, summary
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["replay_ratio"] == pytest.approx(config.replay.replay_ratio)
    # `podray eval --greedy` plays the trained agent with the run's own search (its policy, simulations
    # and considered actions), taking the search's best action.
    assert cli.main(["eval", str(tmp_path), "--episodes", "8", "--greedy"]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["policy"] == "greedy" and result["episodes"] == 8
    # Greedy play is its own measure, not the training return: CartPole's greedy episodes average
    # 370-400 where the run's last training episodes average 486; random play scores about 22.
    assert result["mean"] >= (300.0 if preset == "anakin_muzero_cartpole" else 0.5), result


def test_anakin_muzero_resume_with_the_replay_is_bitwise_identical(tmp_path):
    config = _config(
        "anakin_muzero_catch",
        "env.num_envs=8",
        "anakin.rollout_length=8",
        "anakin.updates_per_call=2",
        "run.checkpoint_every=4",
        "total_env_steps=640",  # 10 updates
        "replay.capacity=1024",
        "replay.min_size=64",
        "replay.batch_size=32",
        "replay.sampling=prioritized",
        "search.num_simulations=4",
        "network.width=32",
        "run.devices=[0, 1]",
    )
    full = train(config, run_dir=tmp_path / "full")
    with pytest.raises(_Interrupt):
        train(config, run_dir=tmp_path / "cut", extra_sinks=[_FailAt(6)])
    assert Checkpointer(tmp_path / "cut" / "checkpoints").latest_step() == 4
    resumed = train(config, run_dir=tmp_path / "cut", resume=True)
    full_state, resumed_state = jax.device_get(full.final_state), jax.device_get(resumed.final_state)
    for x, y in zip(jax.tree.leaves(full_state), jax.tree.leaves(resumed_state)):
        np.testing.assert_array_equal(x, y)
    # the replay is in the state, one shard per device, and it was filled
    replay = full_state.train.replay
    assert jax.tree.leaves(replay)[0].shape[:2] == (1, 2)  # [replicas, devices, ...]
    assert int(np.asarray(replay.current_index).max()) > 0
    rows = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    names = ("root_value", "search_entropy", "prior_entropy", "search_prior_kl", "reward_loss", "model_consistency")
    names += ("buffer_fill", "replay_ratio")
    for name in names:
        assert all(math.isfinite(row[name]) for row in rows), name
    assert rows[-1]["buffer_fill"] > 0 and rows[-1]["replay_ratio"] > 0


def _no_actor_threads_alive():
    return not [t for t in threading.enumerate() if t.name.startswith("podray-actor")]


def test_sebulba_muzero_pong_runs_updates_with_finite_losses():
    """1 actor device (the search runs there) and 1 learner device (the replay lives there)."""
    config = _config(
        "sebulba_muzero_pong",
        "run.cpu_devices=0",
        "sebulba.threads_per_actor_device=1",
        "sebulba.actor_batch_size=4",
        "sebulba.learner_batch_size=4",
        "sebulba.rollout_length=6",
        "sebulba.log_every=1",
        "network.width=32",
        "search.num_simulations=4",
        "replay.capacity=256",
        "replay.min_size=24",
        "replay.batch_size=8",
        "run.checkpoint_every=0",
        "total_env_steps=96",  # 4 updates of 4 x 6 steps
    )
    program = SebulbaProgram(config, _host(2))
    rows = _Rows()
    summary = run_program(program, rows)
    assert _no_actor_threads_alive()
    assert summary.updates == 4
    for row in rows.rows:
        for name in ("loss", "policy_loss", "value_loss", "reward_loss", "root_value", "search_entropy"):
            assert math.isfinite(row[name]), (name, row)
    assert rows.rows[-1]["buffer_fill"] == pytest.approx(96 / 256)
    assert rows.rows[-1]["replay_ratio"] > 0


def test_the_same_muzero_agent_runs_under_anakin_and_sebulba():
    anakin_config = _config(
        "anakin_muzero_cartpole", "env.num_envs=8", "anakin.rollout_length=8", "anakin.updates_per_call=1"
    )
    sebulba_config = _config(
        "sebulba_muzero_cartpole",
        "run.cpu_devices=0",
        "total_env_steps=2048",
        "sebulba.log_every=2",
        "replay.min_size=256",
    )
    spec, _ = host_envs.env_spec("CartPole-v1")
    agent = build_agent(sebulba_config, spec, num_updates=100, num_devices=1)
    anakin = AnakinProgram(anakin_config, _host(1).mesh(), agent=agent)
    state, metrics = anakin.step(anakin.initial_state(0))
    assert math.isfinite(float(jax.device_get(metrics["loss"]).mean()))
    sebulba = SebulbaProgram(sebulba_config, _host(2), agent=agent)
    summary = run_program(sebulba, _Rows())
    assert anakin.agent is agent and sebulba.agent is agent and sebulba.learner.agent is agent
    assert summary.updates == 4
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(summary.final_state.train.params)))
