"""Anakin: acting and learning fused into one compiled program, replicated over every device.

The story of one compiled call, per device and per replica (replicas share a device through vmap):
  reset -> [ scan over the rollout: act, step the environments ] -> agent.update (gradients averaged
  over the device axis of the mesh) -> repeat `updates_per_call` times -> aggregated metrics.
`shard_map` places the environments' batch axis on the mesh's device axis and keeps parameters
replicated, so the same program spans 1 CPU, 4 fake CPU devices, or every core of a multi-host pod.
Python only calls the compiled function and reads one small dict of metrics per call.
"""

from __future__ import annotations

import math
import time
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from podray import checkpoint, preemption
from podray import config as config_lib
from podray.agents import TrainState, Trajectory, build_agent
from podray.envs.jax_envs import EnvState, JaxEnv
from podray.host import DEVICE_AXIS, HostContext, check_devices, compiler_options
from podray.program import Summary


@struct.dataclass
class RunnerState:
    """Everything a run carries between calls, for R replicas and B environments in all.

    Attributes:
      train: TrainState, leaves [R, ...], replicated over devices (parts that the agent's
        state_partition shards, such as a replay, are [R, devices, ...] with one shard per device).
      env: EnvState, leaves [R, B, ...], the environment axis sharded over devices.
      obs: [R, B, *obs_shape] current observations, sharded like `env`.
      key: [R, 2] PRNG keys, replicated.
    """

    train: TrainState
    env: EnvState
    obs: chex.Array
    key: chex.Array


def _global_env_ids(envs_per_device: int) -> chex.Array:
    """Global indices of this device's environments (the same numbering on any device count)."""
    return jax.lax.axis_index(DEVICE_AXIS) * envs_per_device + jnp.arange(envs_per_device)


def _per_env_keys(key: chex.PRNGKey, env_ids: chex.Array) -> chex.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, env_ids)


def _single_replica(f):
    """vmap over a replica axis of size 1, written as squeeze/expand: XLA CPU runs the batched dots
    that vmap makes about 5% slower than plain ones (measured on PPO CartPole)."""

    def g(*args):
        out = f(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    return g


class AnakinProgram:
    """The compiled Anakin program for one config over one mesh.

    Args:
      config: a validated Config.
      mesh: a 1-D mesh whose axis is named `podray.host.DEVICE_AXIS`.
      agent: the agent to run (default: build_agent from the config); the same object runs under Sebulba.
    """

    def __init__(self, config: config_lib.Config, mesh: jax.sharding.Mesh, agent=None):
        check_devices(config, mesh.size)
        self.config = config
        self.mesh = mesh
        self.env = JaxEnv(config.env.name)
        k = config.anakin
        self.num_devices = mesh.size
        self.num_envs = config_lib.num_envs(config, mesh.size)
        self.envs_per_device = self.num_envs // mesh.size
        self.steps_per_update = self.num_envs * k.rollout_length  # per replica
        updates = math.ceil(config.total_env_steps / self.steps_per_update)
        self.num_calls = math.ceil(updates / k.updates_per_call)
        self.num_updates = self.num_calls * k.updates_per_call
        self.agent = agent or build_agent(config, self.env.spec, self.num_updates, mesh.size)
        # The agent says which parts of its state are per-device shards (a replay) rather than replicated.
        train_spec = self.agent.state_partition(P(), P(None, DEVICE_AXIS))
        self._state_spec = RunnerState(train=train_spec, env=P(None, DEVICE_AXIS), obs=P(None, DEVICE_AXIS), key=P())
        # check_vma=False: rlax's scans start from unannotated constants; replication of the
        # parameters holds because every gradient is averaged over the device axis.
        shard = lambda f, in_specs, out_specs: jax.shard_map(  # noqa: E731
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        over_replicas = jax.vmap if k.replicas > 1 else _single_replica
        options = compiler_options(mesh.devices.flat)
        self.init = jax.jit(shard(over_replicas(self._init_replica), P(), self._state_spec), compiler_options=options)
        self.step = jax.jit(
            shard(over_replicas(self._call_replica), (self._state_spec,), (self._state_spec, P())),
            donate_argnums=0,
            compiler_options=options,
        )

    # ---- the per-device, per-replica program -------------------------------------------------------

    def _init_replica(self, key: chex.PRNGKey) -> RunnerState:
        params_key, env_key, run_key = jax.random.split(key, 3)
        train = self.agent.init(params_key)  # the same on every device: same key
        env_ids = _global_env_ids(self.envs_per_device)
        env_state, obs = self.env.reset(_per_env_keys(env_key, env_ids))
        return RunnerState(train=train, env=env_state, obs=obs, key=run_key)

    def _update(self, state: RunnerState, _: Any) -> tuple[RunnerState, dict[str, chex.Array]]:
        """One rollout of T steps on every environment, then one agent update."""
        key, rollout_key, update_key = jax.random.split(state.key, 3)
        env_ids = _global_env_ids(self.envs_per_device)
        params = state.train.params

        def env_step(carry, randomness):
            env_state, obs = carry
            noise, step_keys, resets = randomness
            action, actor_out = self.agent.act_with_noise(params, obs, noise)
            env_state, ts = self.env.step_prepared(env_state, action, step_keys, resets)
            transition = (obs, action, ts.reward, ts.discount, actor_out, ts.episode_return, ts.done)
            return (env_state, ts.obs), transition

        # All of the rollout's randomness (action noise, environment keys, fresh episodes for resets) in
        # vectorised computations before the sequential loop: on CPU every random draw inside the loop
        # would be a small rolled loop of its own. Keys come from global environment indices, so any
        # device count draws the same numbers for the same environment.
        T = self.config.anakin.rollout_length
        step_keys = jax.random.split(rollout_key, 2 * T).reshape(2, T, -1)
        per_env = jax.vmap(_per_env_keys, in_axes=(0, None))
        act_keys, env_keys = per_env(step_keys[0], env_ids), per_env(step_keys[1], env_ids)  # [T, B, 2]
        randomness = (self.agent.action_noise(act_keys), *self.env.prepare(env_keys))
        (env_state, obs), (obs_t, action, reward, discount, actor_out, ep_return, done) = jax.lax.scan(
            env_step, (state.env, state.obs), randomness
        )
        trajectory = Trajectory(
            obs=jnp.concatenate([obs_t, obs[None]], axis=0),
            action=action,
            reward=reward,
            discount=discount,
            actor_out=actor_out,
        )
        device_update_key = jax.random.fold_in(update_key, jax.lax.axis_index(DEVICE_AXIS))
        train, metrics = self.agent.update(state.train, trajectory, device_update_key, DEVICE_AXIS)
        metrics["return_sum"] = jax.lax.psum(ep_return.sum(), DEVICE_AXIS)
        metrics["episodes"] = jax.lax.psum(done.sum().astype(jnp.float32), DEVICE_AXIS)
        return RunnerState(train=train, env=env_state, obs=obs, key=key), metrics

    def _call_replica(self, state: RunnerState) -> tuple[RunnerState, dict[str, chex.Array]]:
        """`updates_per_call` updates; metrics averaged over them, episode sums summed."""
        state, metrics = jax.lax.scan(self._update, state, None, length=self.config.anakin.updates_per_call)
        summed = ("return_sum", "episodes")
        return state, {k: v.sum() if k in summed else v.mean() for k, v in metrics.items()}

    # ---- host side -----------------------------------------------------------------------------------

    def initial_state(self, seed: int) -> RunnerState:
        """The state before the first call, for `config.anakin.replicas` replicas of `seed`."""
        keys = np.asarray(jax.random.split(jax.random.PRNGKey(seed), self.config.anakin.replicas))
        # Every process builds the same keys; each places them on its own devices (multi-host safe).
        keys = jax.make_array_from_callback(keys.shape, NamedSharding(self.mesh, P()), lambda index: keys[index])
        return self.init(keys)

    def abstract_state(self, seed: int) -> RunnerState:
        """Shapes, dtypes and shardings of the state (what a checkpoint restores into)."""
        keys = jax.ShapeDtypeStruct(
            (self.config.anakin.replicas, 2), jnp.uint32, sharding=NamedSharding(self.mesh, P())
        )
        return checkpoint.on_mesh(jax.eval_shape(self.init, keys), self._state_spec, self.mesh)


def _mean_return(metrics: dict[str, Any]) -> tuple[float, list[float]]:
    """Mean return over completed episodes, averaged over replicas (NaN where none completed)."""
    per_replica = [float(r / e) if e > 0 else math.nan for r, e in zip(metrics["return_sum"], metrics["episodes"])]
    finite = [r for r in per_replica if not math.isnan(r)]
    return (sum(finite) / len(finite) if finite else math.nan), per_replica


def run(
    config: config_lib.Config, host: HostContext, sinks, checkpointer=None, resume: bool = False, run_dir: str = ""
) -> Summary:
    """Runs Anakin for `config` on `host`'s devices and reports to `sinks`.

    Args:
      config: a validated Config.
      host: this process's HostContext; its mesh spans every device of every host.
      sinks: a metrics sink (podray.metrics.Sinks); only process 0 should pass real sinks.
      checkpointer: a podray.checkpoint.Checkpointer, or None for no checkpoints.
      resume: continue from the checkpointer's latest checkpoint.
      run_dir: recorded in the summary.
    Returns:
      The run's Summary.
    """
    start = time.perf_counter()
    program = AnakinProgram(config, host.mesh())
    k = config.anakin
    steps_per_call = program.steps_per_update * k.updates_per_call * k.replicas
    start_call, elapsed_before = 0, 0.0
    if resume and checkpointer is not None and checkpointer.latest_step() is not None:
        state, meta = checkpointer.restore_latest(program.abstract_state(config.seed))
        start_call, elapsed_before = int(meta["calls"]), float(meta.get("wall_s", 0.0))
    else:
        state = program.initial_state(config.seed)
    compile_start = time.perf_counter()
    step = program.step.lower(state).compile()
    compile_s = time.perf_counter() - compile_start

    last_return, replica_returns = math.nan, [math.nan] * k.replicas
    report_time = time.perf_counter()
    steady_start, steady_steps = None, 0

    def report(call: int, metrics: Any) -> None:
        nonlocal last_return, replica_returns, report_time, steady_start, steady_steps
        metrics = jax.device_get(metrics)  # the only host sync of a call, one call behind the device
        now = time.perf_counter()
        mean_return, per_replica = _mean_return(metrics)
        if not math.isnan(mean_return):
            last_return, replica_returns = mean_return, per_replica
        updates = (call + 1) * k.updates_per_call
        row = {k_: float(v.mean()) for k_, v in metrics.items() if k_ not in ("return_sum", "episodes")}
        row.update(
            env_steps=updates * program.steps_per_update * k.replicas,
            updates=updates,
            mean_return=mean_return,
            episodes=float(metrics["episodes"].sum()),
            steps_per_s=steps_per_call / max(now - report_time, 1e-9),
            compile_s=compile_s,
        )
        if steady_start is None:
            steady_start = now
        else:
            steady_steps += steps_per_call
        report_time = now
        sinks.write(updates, row)

    # A signal (podray.preemption) ends the run at a call boundary that every host agrees on, with a
    # checkpoint there: the resumed run continues from exactly that state.
    agreement = preemption.StopAgreement(program.mesh, preemption.STOP)
    pending = None
    for call in range(start_call, program.num_calls):
        state, metrics = step(state)  # dispatched asynchronously
        if pending is not None:
            report(*pending)
        pending = (call, metrics)
        done_updates = (call + 1) * k.updates_per_call
        last = call == program.num_calls - 1
        every = config.run.checkpoint_every
        stopping = agreement.should_stop() and not last
        if checkpointer is not None and (last or stopping or (every and done_updates % every == 0)):
            report(*pending)
            pending = None
            wall = elapsed_before + time.perf_counter() - start
            meta = {
                "calls": call + 1,
                "updates": done_updates,
                "wall_s": wall,
                "env_steps": done_updates * program.steps_per_update * k.replicas,
                "config": config.to_dict(),
            }
            checkpointer.save(done_updates, state, meta)
        if stopping:
            if pending is not None:
                report(*pending)
            raise preemption.Preempted(
                preemption.STOP.signal_name or "SIGTERM",
                done_updates if checkpointer is not None else None,
                done_updates * program.steps_per_update * k.replicas,
                str(checkpointer.directory) if checkpointer is not None else "",
                run_dir,
            )
    if pending is not None:
        report(*pending)
    jax.block_until_ready(state)
    end = time.perf_counter()
    wall = elapsed_before + end - start
    env_steps = program.num_updates * program.steps_per_update * k.replicas
    steady = steady_steps / (end - steady_start) if steady_start is not None and end > steady_start else 0.0
    return Summary(
        final_mean_return=last_return,
        env_steps=env_steps,
        wall_s=wall,
        steps_per_s=env_steps / wall,
        updates=program.num_updates,
        run_dir=run_dir,
        replica_returns=replica_returns,
        compile_s=compile_s,
        steady_steps_per_s=steady,
        final_state=state,
    )
