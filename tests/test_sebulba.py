"""Sebulba end to end: it learns, it spans learner devices, it bounds lag and queues, it fails loudly and
stops cleanly, it resumes, and it runs the same agent object as Anakin."""

import math
import re
import threading
import time
import traceback
from typing import Any

import gymnax  # noqa: F401  (its import runs a few JAX ops; validation must add none)
import jax
import numpy as np
import pytest

from podray import config as config_lib
from podray import validation
from podray.agents import make_agent
from podray.anakin import AnakinProgram
from podray.checkpoint import Checkpointer
from podray.config import ConfigError
from podray.envs import host_envs
from podray.host import HostContext
from podray.metrics import read_jsonl
from podray.sebulba import SebulbaProgram, run_program
from podray.training import train


def _host(n: int = 4) -> HostContext:
    devices = tuple(jax.local_devices()[:n])
    return HostContext(0, 1, devices, devices)


def _config(preset="sebulba_cartpole", *overrides) -> config_lib.Config:
    base = ["run.cpu_devices=0", "run.tensorboard=false", "run.progress=false"]
    return config_lib.load(preset, base + list(overrides))


class _Rows:
    def __init__(self):
        self.rows = []

    def write(self, step, metrics):
        self.rows.append(dict(metrics))

    def close(self):
        pass


def _started(config: config_lib.Config) -> tuple[SebulbaProgram, Any]:
    """A compiled program whose actor threads are running with version 0 of the initial parameters."""
    program = SebulbaProgram(config, _host())
    state = program.learner.initial_state(0)
    program.compile(state)
    program.start(state.train.params, 0)
    return program, state


def _no_actor_threads_alive():
    return not [t for t in threading.enumerate() if t.name.startswith("podray-actor")]


@pytest.mark.slow
def test_impala_learns_cartpole_from_envpool(tmp_path):
    config = _config("sebulba_cartpole")  # 1.2M env steps
    summary = train(config, run_dir=tmp_path)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    # Sebulba's actor threads make each run's data differ with the machine's timing, and one report's
    # episodes are few: the last 3 reports together must hold 400.
    last = [row["mean_return"] for row in rows[-3:]]
    assert len(rows) >= 3 and sum(last) / 3 >= 400, (last, summary)
    for key in (
        "steps_per_s",
        "frames_per_s",
        "actor_env_step_s",
        "actor_inference_s",
        "learner_step_s",
        "queue_occupancy",
        "policy_lag",
        "mean_return",
    ):
        assert key in rows[-1], key
    assert _no_actor_threads_alive()
    # `podray bench probe` on this run: the trained policy depends on the state, the initial one hardly.
    from podray.bench import probe

    result = probe.probe_run(tmp_path, frames=256)
    init, trained = result["init"], result["trained"]
    assert result["checkpoint_step"] > 0 and result["frames"] == 256
    assert trained["features"] == config.network.width and 0.0 <= trained["dead_fraction"] <= 1.0
    assert abs(sum(trained["mean_probs"]) - 1.0) < 1e-3
    assert max(trained["logit_spread"]) > 10 * max(init["logit_spread"])
    # and layer by layer: two dense layers in each of the two torsos (policy, value), with their dead
    # fraction and spread over states
    assert sorted(trained["layers"]) == [f"MLPTorso_{i}/Dense_{j}" for i in (0, 1) for j in (0, 1)]
    assert all(0.0 <= v["dead"] <= 1.0 and v["spread"] > 0 for v in trained["layers"].values())


@pytest.mark.parametrize(
    "agent",
    [
        ["agent.name=ppo"],
        ["agent.surrogate_clip=0.2", "agent.normalize_advantages=true"],  # IMPALA with a trust region (APPO)
    ],
    ids=["ppo", "impala_surrogate_clip"],
)
def test_clipped_agents_learn_cartpole_from_envpool(tmp_path, agent):
    """PPO, and IMPALA with PPO's clipped surrogate on its V-trace advantages: several epochs over each
    learner batch, the lag corrected by the clipped ratio, reach the same bar as IMPALA on envpool
    CartPole in a quarter of its budget."""
    config = _config(
        "sebulba_cartpole",
        *agent,
        "agent.optimizer=adam",
        "agent.learning_rate=2.5e-3",
        "agent.epochs=4",
        "agent.num_minibatches=4",
        "total_env_steps=300000",  # PPO: 200k reached 400 on a quiet machine, but 369 once beside a training run
    )
    summary = train(config, run_dir=tmp_path)
    assert summary.final_mean_return >= 400, summary
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    if config.agent.name == "impala":
        assert 0.0 <= rows[-1]["clip_fraction"] <= 1.0 and "approx_kl" in rows[-1]
    assert _no_actor_threads_alive()


def test_pong_two_learner_devices_runs_updates():
    """1 actor device with 2 threads, 2 learner devices: finite losses, identical replicas, split batches."""
    config = _config(
        "sebulba_pong",
        "sebulba.actor_devices=[0]",
        "sebulba.learner_devices=[1, 2]",
        "sebulba.threads_per_actor_device=2",
        "sebulba.actor_batch_size=4",
        "sebulba.learner_batch_size=8",
        "sebulba.rollout_length=5",
        "network.width=32",
        "total_env_steps=120",  # 3 updates of 8 x 5 steps
    )
    program, state = _started(config)
    learner_devices = set(program.learner_devices)
    try:
        for version in range(3):
            rollouts = program.gather(version)
            assert len(rollouts) == 2  # learner batch 8 = 2 actor trajectories of 4
            for r in rollouts:
                obs = r.trajectory.obs
                assert obs.shape == (6, 4, 4, 84, 84) and obs.dtype == np.uint8
                shards = obs.addressable_shards
                assert {s.device for s in shards} == learner_devices
                assert all(s.data.shape == (6, 2, 4, 84, 84) for s in shards)
            state, metrics = program.learner_step(state, rollouts)
            metrics = jax.device_get(metrics)
            assert all(math.isfinite(float(v)) for v in metrics.values()), metrics
            program.params.publish(state.train.params, version + 1)
    finally:
        program.stop()
    assert _no_actor_threads_alive()
    for leaf in jax.tree.leaves(state.train.params):
        shards = leaf.addressable_shards
        assert {s.device for s in shards} == learner_devices
        np.testing.assert_array_equal(np.asarray(shards[0].data), np.asarray(shards[1].data))
    assert int(state.train.updates) == 3


def test_learner_batch_smaller_than_the_actor_batch_cuts_trajectories_into_pieces():
    """Decoupled batch sizes both ways: actor batch 8, learner batch 4 over 2 learner devices."""
    config = _config(
        "sebulba_cartpole",
        "sebulba.learner_devices=[1, 2]",
        "sebulba.actor_batch_size=8",
        "sebulba.learner_batch_size=4",
        "sebulba.rollout_length=5",
        "total_env_steps=60",  # 3 updates of 4 x 5 steps
    )
    program, state = _started(config)
    try:
        pieces = []
        for version in range(3):
            (rollout,) = program.gather(version)
            obs = rollout.trajectory.obs
            assert obs.shape == (6, 4, 4)
            assert all(s.data.shape == (6, 2, 4) for s in obs.addressable_shards)
            pieces.append(np.asarray(obs))
            state, _ = program.learner_step(state, [rollout])
    finally:
        program.stop()
    assert int(state.train.updates) == 3
    assert not np.array_equal(pieces[0], pieces[1])  # the two halves of one trajectory, not one twice
    assert _no_actor_threads_alive()


def test_policy_lag_and_queue_stay_bounded():
    """Many fast actors and a slow learner: lag never exceeds its bound, the queue never its size."""
    config = _config(
        "sebulba_cartpole",
        "sebulba.threads_per_actor_device=4",
        "sebulba.actor_batch_size=8",
        "sebulba.learner_batch_size=8",
        "sebulba.rollout_length=8",
        "sebulba.queue_size=2",
        "sebulba.max_policy_lag=1",
        "sebulba.log_every=5",
        "total_env_steps=2560",  # 40 updates
    )
    program = SebulbaProgram(config, _host())
    slow_step = program.learner_step

    def learner_step(state, rollouts):  # a slower learner, so that trajectories wait in the queue
        time.sleep(0.02)
        return slow_step(state, rollouts)

    program.learner_step = learner_step
    sink = _Rows()
    run_program(program, sink)
    assert len(sink.rows) == 8
    assert max(row["policy_lag_max"] for row in sink.rows) <= 1
    assert max(row["queue_occupancy"] for row in sink.rows) <= 2
    assert all(t.max_queue_size_seen <= 2 for t in program.threads)
    assert sink.rows[-1]["dropped_trajectories"] > 0  # the bound was exercised, not vacuous
    assert _no_actor_threads_alive()


class _BrokenEnv(host_envs.HostEnv):
    def __init__(self, *args, break_after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.break_after = break_after
        self.calls = 0

    def recv(self):
        self.calls += 1
        if self.calls > self.break_after:
            raise ValueError("broken environment: the emulator crashed")
        return super().recv()


def test_exception_in_actor_thread_ends_the_run_and_stop_joins_every_thread():
    config = _config("sebulba_cartpole", "sebulba.threads_per_actor_device=2", "sebulba.timeout_s=120")

    def make_env(index):
        # Thread 1 breaks after a few hundred steps; thread 0 keeps running until stopped.
        return _BrokenEnv("CartPole-v1", 16, 16, seed=index, break_after=10**9 if index == 0 else 300)

    program = SebulbaProgram(config, _host(), env_factory=make_env)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="broken environment") as info:
        run_program(program, _Rows())
    assert time.perf_counter() - start < 30  # ends within seconds of the failure, far below the timeout
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "recv" in frames and "_loop" in frames  # the actor thread's own traceback
    assert _no_actor_threads_alive()
    assert program.threads == []


def test_resume_continues_from_the_checkpoint(tmp_path):
    config = _config(
        "sebulba_cartpole", "total_env_steps=40960", "sebulba.log_every=10", "run.checkpoint_every=20"
    )  # 40 updates of 32 x 32 steps

    class Interrupt(Exception):
        pass

    class FailAt(_Rows):
        def write(self, step, metrics):
            if step >= 30:
                raise Interrupt(step)

    with pytest.raises(Interrupt):
        train(config, run_dir=tmp_path, extra_sinks=[FailAt()])
    assert _no_actor_threads_alive()
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 20
    summary = train(config, run_dir=tmp_path, resume=True)
    assert summary.updates == 40
    assert int(jax.device_get(summary.final_state.train.updates)) == 40
    steps = [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == [10, 20, 30, 40]


def test_the_same_agent_object_runs_under_anakin_and_sebulba():
    anakin_config = config_lib.load(
        "anakin_impala_cartpole",
        ["env.num_envs=8", "anakin.rollout_length=8", "anakin.updates_per_call=1", "total_env_steps=64"],
    )
    sebulba_config = _config("sebulba_cartpole", "total_env_steps=4096", "sebulba.log_every=2")
    spec, _ = host_envs.env_spec("CartPole-v1")
    agent = make_agent(sebulba_config.agent, sebulba_config.network, spec, num_updates=100)

    anakin = AnakinProgram(anakin_config, _host(2).mesh(), agent=agent)
    assert anakin.env.spec.obs_shape == spec.obs_shape and anakin.env.spec.num_actions == spec.num_actions
    state, metrics = anakin.step(anakin.initial_state(0))
    assert math.isfinite(float(jax.device_get(metrics["loss"]).mean()))

    sebulba = SebulbaProgram(sebulba_config, _host(), agent=agent)
    summary = run_program(sebulba, _Rows())
    assert anakin.agent is agent and sebulba.agent is agent and sebulba.learner.agent is agent
    assert summary.updates == 4
    assert all(
        math.isfinite(float(x)) for x in jax.tree.leaves(jax.device_get(summary.final_state.train.params))[0].ravel()
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sebulba.learner_devices=[0]"], "sebulba.learner_devices: device(s) [0] are also in sebulba.actor_devices"),
        (["sebulba.learner_devices=[7]", "run.cpu_devices=4"], "sebulba.learner_devices: index 7 is out of range"),
        (["sebulba.learner_devices=[1, 2, 3]"], "sebulba.actor_batch_size: 16 does not split over 3 learner devices"),
        (["sebulba.learner_batch_size=24"], "sebulba.learner_batch_size: 24 must be a multiple"),
        (["env.name=Pongg-v5"], "env.name: 'Pongg-v5' is not an envpool task"),
        (["env.name=Catch-bsuite"], "use architecture=anakin"),
        (["sebulba.envs_per_actor_thread=24"], "sebulba.envs_per_actor_thread"),
        (["network.torso=nature_cnn"], "network.torso"),
        (["env.max_episode_steps=-1"], "env.max_episode_steps: must be >= 0"),
    ],
)
def test_bad_sebulba_config_is_rejected_before_compiling(overrides, message, compile_counter):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validation.validate(config_lib.load("sebulba_cartpole", overrides, check=False), num_devices=4)
    assert compile_counter == []


def test_envpool_name_with_anakin_points_to_sebulba():
    with pytest.raises(ConfigError, match="'Pong-v5' is an envpool task: use architecture=sebulba"):
        validation.validate(config_lib.load(None, ["env.name=Pong-v5"]))
