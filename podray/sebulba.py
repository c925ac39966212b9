"""Sebulba: actor threads step envpool batches on the host and act on actor devices; a learner updates
on separate learner devices and publishes versioned parameters back (Hessel, Kroiss et al., 2021).

The story of a run:
  1. The local devices split into actor devices and learner devices (config.sebulba).
  2. The learner step (podray.learners) and the policy are compiled, once, before anything starts.
  3. `threads_per_actor_device` actor threads per actor device (podray.actors) each step their own
     envpool batch of `actor_batch_size` environments and run the jitted policy on their device. Every
     `rollout_length` steps a thread puts its time-major trajectory straight onto the learner devices,
     split along the batch axis, and hands it over through a bounded queue.
  4. The learner takes `learner_batch_size / actor_batch_size` trajectories from the queue (dropping any
     whose policy lag exceeds `max_policy_lag`), runs `agent.update` replicated over the learner
     devices with gradients averaged across them, and publishes the new parameters, with their version,
     to every actor device.
  5. Every `log_every` updates the metrics go to the sinks; checkpoints hold the learner state.

Across hosts (run.hosts > 1, one process per host) every host runs all of the above on its own devices:
its actor threads step its own environments (seeded apart from every other host's) on its actor
devices and put their trajectories on its own learner devices. The learner mesh spans the learner
devices of every host; in each step every host contributes its k local trajectories as its shards of
the global learner batch (sebulba.learner_batch_size is global: each host gathers 1/hosts of it), the
gradients are averaged over every learner device of every host, and every host publishes the new
parameters from its own replica to its own actor devices. The hosts move in lockstep, one learner step
at a time; a host whose actors stall fails its gather after sebulba.timeout_s, and the Ray driver then
stops the group (the other hosts wait in a collective) and restarts it from the latest checkpoint.
Errors: any exception in an actor thread stops the run and is re-raised by the learner with its
traceback; every wait has a timeout; `stop()` joins every thread and closes every environment.

What makes Sebulba non-deterministic (unlike Anakin): which actor thread's trajectory the learner takes
next, and which parameter version an actor finds, depend on thread timing. Seeds still fix the
environments' seeds, the initial parameters and every PRNG key.
"""

from __future__ import annotations

import math
import queue as queue_lib
import sys
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from podray import config as config_lib
from podray import preemption
from podray.actors import ActorThread, ParamsStore, Rollout
from podray.actors.params import local_copy
from podray.agents import Agent, build_agent
from podray.envs import host_envs
from podray.host import HostContext, check_devices, compiler_options
from podray.learners import LEARNER_AXIS, Learner, LearnerState
from podray.program import Summary


class SebulbaProgram:
    """Actors, learner and the queue between them, for one config on this host's devices.

    Args:
      config: a validated Config with architecture 'sebulba'.
      host: the HostContext; sebulba.actor_devices / learner_devices index its local devices.
      agent: an agent to run (default: podray.agents.build_agent from the config); the same object
        can run under Anakin.
      env_factory: (thread index) -> HostEnv, to replace the config's environments (tests).
    """

    def __init__(self, config: config_lib.Config, host: HostContext, agent: Agent | None = None, env_factory=None):
        check_devices(config, len(host.local_devices))
        self.config = config
        self.host = host
        s = config.sebulba
        self.actor_devices = [host.local_devices[i] for i in s.actor_devices]
        self.local_learner_devices = [host.local_devices[i] for i in s.learner_devices]
        # The learner mesh: the learner devices of every host, host by host.
        self.learner_devices = [devices[i] for devices in host.devices_by_host() for i in s.learner_devices]
        self.spec, self.channels_first = host_envs.env_spec(config.env.name)
        self.frame_skip = 4 if self.channels_first else 1  # Atari: 4 frames per agent step
        self.steps_per_update = s.learner_batch_size * s.rollout_length  # over every host
        self.num_updates = math.ceil(config.total_env_steps / self.steps_per_update)
        self.agent = agent or build_agent(config, self.spec, self.num_updates, len(self.learner_devices))
        self.mesh = Mesh(np.asarray(self.learner_devices, dtype=object), (LEARNER_AXIS,))
        # Batch sizes are decoupled: a learner step takes k pieces of `piece` environments each from every
        # host; an actor trajectory is one piece, or is cut into several when this host's share of the
        # learner batch is smaller than an actor batch.
        self.host_batch = s.learner_batch_size // host.process_count
        self.piece = min(s.actor_batch_size, self.host_batch)
        self.learner = Learner(
            self.agent,
            self.mesh,
            self.host_batch // self.piece,
            channels_first=self.channels_first,
            local_devices=self.local_learner_devices,
        )
        self.policy = jax.jit(self._policy, compiler_options=compiler_options(self.actor_devices))
        self.params = ParamsStore(self.actor_devices)
        self.queue: queue_lib.Queue[Rollout] = queue_lib.Queue(maxsize=s.queue_size)
        self._env_factory = env_factory or self._make_env
        self.threads: list[ActorThread] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._compiled_step = None
        self._in_flight = None  # metrics of the newest learner step (see learner_step)
        # Measured by gather(): policy lags of trajectories taken, drops, queue occupancy.
        self.lags: list[int] = []
        self.dropped = 0
        self.queue_sizes: list[int] = []

    # ---- compiled pieces -----------------------------------------------------------------------------

    def _policy(self, params: Any, obs: jax.Array, key: jax.Array):
        key, act_key = jax.random.split(key)
        obs = host_envs.to_channels_last(obs, self.channels_first)
        action, out = self.agent.act(params, obs, jax.random.split(act_key, obs.shape[0]))
        return key, action, out.logits, out.value

    def _raw_obs_shape(self) -> tuple[int, ...]:
        shape = self.spec.obs_shape
        return (shape[-1], *shape[:-1]) if self.channels_first else shape

    def compile(self, state: LearnerState) -> float:
        """Compiles the learner step and the policy on every actor device; returns the seconds taken."""
        start = time.perf_counter()
        s = self.config.sebulba
        trajectory = self.learner.abstract_trajectory(
            s.rollout_length, self.piece * self.host.process_count, self._raw_obs_shape(), self.spec.obs_dtype
        )
        self._compiled_step = self.learner.step.lower(state, (trajectory,) * self.learner.k).compile()
        obs = np.zeros((s.actor_batch_size, *self._raw_obs_shape()), self.spec.obs_dtype)
        for device in self.actor_devices:
            params = jax.device_put(local_copy(state.train.params), device)
            key = jax.device_put(jax.random.PRNGKey(0), device)
            jax.block_until_ready(self.policy(params, jax.device_put(obs, device), key))
        return time.perf_counter() - start

    def learner_step(self, state: LearnerState, rollouts: Sequence[Rollout]) -> tuple[LearnerState, Any]:
        """One learner update on k rollouts.

        Asynchronous, but at most two steps are in flight: before returning, it waits for the previous
        step to finish. Without that bound a slow learner would queue steps (and the trajectories they
        hold) without limit, and its version would run ahead of the parameters actors can use.
        """
        step = self._compiled_step or self.learner.step
        state, metrics = step(state, tuple(self.learner.from_hosts(r.trajectory) for r in rollouts))
        if self._in_flight is not None:
            jax.block_until_ready(self._in_flight)
        self._in_flight = metrics
        return state, metrics

    # ---- actors --------------------------------------------------------------------------------------

    def _make_env(self, index: int) -> host_envs.HostEnv:
        s, e = self.config.sebulba, self.config.env
        num_envs = s.envs_per_actor_thread or s.actor_batch_size
        options = host_envs.HostEnvOptions.from_config(e)
        seed = self.config.seed * 1_000_003 + index * num_envs  # index counts threads over every host
        return host_envs.HostEnv(e.name, num_envs, s.actor_batch_size, seed=seed, options=options)

    def _fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error
        self._stop.set()

    def raise_if_failed(self) -> None:
        """Re-raises the first exception of any actor thread (its traceback included)."""
        if self._error is not None:
            raise self._error

    def start(self, params: Any, version: int) -> None:
        """Publishes `params` as `version` to every actor device and starts the actor threads."""
        s = self.config.sebulba
        self.params.publish(params, version, wait=True)
        self._stop.clear()
        # Thread indices count over every host, so that no two hosts seed the same environments or keys.
        first = self.host.process_index * len(self.actor_devices) * s.threads_per_actor_device
        for d, device in enumerate(self.actor_devices):
            for j in range(s.threads_per_actor_device):
                thread = ActorThread(
                    index=first + d * s.threads_per_actor_device + j,
                    make_env=self._env_factory,
                    policy=self.policy,
                    device=device,
                    params=self.params,
                    queue=self.queue,
                    learner_sharding=self.learner.local_batch_sharding,
                    rollout_length=s.rollout_length,
                    batch_size=s.actor_batch_size,
                    piece_size=self.piece,
                    seed=self.config.seed,
                    bootstrap_discount=self.config.agent.discount,
                    stop=self._stop,
                    on_error=self._fail,
                )
                thread.start()
                self.threads.append(thread)

    def gather(self, version: int) -> list[Rollout]:
        """The next k rollouts whose policy lag (version - rollout.version) is within max_policy_lag.

        Raises an actor's exception as soon as one fails, and TimeoutError if no rollout arrives for
        sebulba.timeout_s seconds.
        """
        s = self.config.sebulba
        rollouts: list[Rollout] = []
        self.queue_sizes.append(self.queue.qsize())
        deadline = time.monotonic() + s.timeout_s
        while len(rollouts) < self.learner.k:
            self.raise_if_failed()
            try:
                rollout = self.queue.get(timeout=0.05)
            except queue_lib.Empty:
                if time.monotonic() > deadline:
                    alive = sum(t.is_alive() for t in self.threads)
                    raise TimeoutError(
                        f"sebulba: no trajectory from the actors for {s.timeout_s:.0f} s ({alive} of "
                        f"{len(self.threads)} actor threads alive); raise sebulba.timeout_s if they are just slow"
                    ) from None
                continue
            lag = version - rollout.version
            if lag > s.max_policy_lag:
                self.dropped += 1
                continue
            self.lags.append(lag)
            rollouts.append(rollout)
            deadline = time.monotonic() + s.timeout_s
        return rollouts

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops and joins every actor thread (each closes its environments); drains the queue."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        while True:
            try:
                self.queue.get_nowait()
            except queue_lib.Empty:
                break
        alive = [t.name for t in self.threads if t.is_alive()]
        self.threads = [t for t in self.threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"sebulba: actor threads {alive} did not stop within {timeout_s:.0f} s")


# Row keys that are also reported per host, as host_<key> (this host's value; the Ray dashboard's
# per-host gauges read them), while the key itself holds the value over every host.
HOST_KEYS = ("steps_per_s", "frames_per_s", "policy_lag", "queue_occupancy", "learner_wait_fraction")


class _Reporter:
    """Turns the counters of the actors and the learner into one row of metrics per report.

    Over several hosts the row holds totals (env steps/s, frames/s, dropped trajectories, episodes) and
    means (policy lag, queue occupancy, learner wait; the return over every finished episode) over
    every host, gathered with one small collective per report; host_<key> keeps this host's values and
    slowest_host_frames_per_s the slowest host's. Every host reports at the same updates (lockstep), so
    the collective never waits on a host that is not reporting.
    """

    def __init__(self, program: SebulbaProgram):
        self.program = program
        self.time = time.perf_counter()
        self.prev = self._totals()
        self.learner_wait_s = 0.0
        self.learner_step_s = math.nan
        self.updates = 0
        self.recent_returns: list[float] = []

    def _totals(self) -> dict[str, float]:
        keys = ("env_steps", "env_calls", "env_s", "inference_calls", "inference_s", "put_s")
        return {k: float(sum(getattr(t.stats, k) for t in self.program.threads)) for k in keys}

    def row(self, metrics: dict[str, Any], updates: int, env_steps: int) -> dict[str, float]:
        p = self.program
        now = time.perf_counter()
        totals = self._totals()
        d = {k: totals[k] - self.prev[k] for k in totals}
        elapsed = max(now - self.time, 1e-9)
        returns = []
        for t in p.threads:
            while t.stats.episode_returns:
                returns.append(t.stats.episode_returns.popleft())
        if returns:
            self.recent_returns = returns
        steps_per_s = d["env_steps"] / elapsed  # what the actors produced in this interval
        row = {k: float(np.mean(v)) for k, v in jax.device_get(metrics).items()}
        lags = p.lags or [0]
        row.update(
            env_steps=env_steps,
            updates=updates,
            steps_per_s=steps_per_s,
            frames_per_s=steps_per_s * p.frame_skip,
            learner_steps_per_s=self.updates * p.steps_per_update / elapsed,
            actor_env_step_s=d["env_s"] / max(d["env_calls"], 1),
            actor_inference_s=d["inference_s"] / max(d["inference_calls"], 1),
            actor_queue_wait_s=d["put_s"] / max(len(p.threads), 1) / elapsed,
            learner_step_s=self.learner_step_s,
            learner_wait_fraction=self.learner_wait_s / elapsed,
            queue_occupancy=float(np.mean(p.queue_sizes or [0])),
            queue_occupancy_max=float(np.max(p.queue_sizes or [0])),
            policy_lag=float(np.mean(lags)),
            policy_lag_max=float(np.max(lags)),
            dropped_trajectories=float(p.dropped),
            mean_return=float(np.mean(returns)) if returns else math.nan,
            episodes=float(len(returns)),
        )
        p.lags.clear()
        p.queue_sizes.clear()
        self.prev, self.time, self.learner_wait_s, self.updates = totals, now, 0.0, 0
        return self._over_hosts(row, returns)

    def _over_hosts(self, row: dict[str, float], returns: list[float]) -> dict[str, float]:
        p = self.program
        row.update({f"host_{k}": row[k] for k in HOST_KEYS})
        row["hosts"] = float(p.host.process_count)
        row["learner_devices"] = float(len(p.learner_devices))  # the learner mesh, over every host
        if p.host.process_count == 1:
            row["slowest_host_frames_per_s"] = row["frames_per_s"]
            return row
        from jax.experimental import multihost_utils

        local = np.array(
            [
                row["steps_per_s"],
                row["policy_lag"],
                row["policy_lag_max"],
                row["queue_occupancy"],
                row["learner_wait_fraction"],
                row["dropped_trajectories"],
                float(np.sum(returns)) if returns else 0.0,
                float(len(returns)),
            ],
            np.float32,
        )
        every = np.asarray(multihost_utils.process_allgather(local), np.float64)  # [hosts, 8]
        steps, lag, lag_max, occupancy, wait, dropped, return_sum, episodes = every.T
        row.update(
            steps_per_s=float(steps.sum()),
            frames_per_s=float(steps.sum()) * p.frame_skip,
            slowest_host_frames_per_s=float(steps.min()) * p.frame_skip,
            policy_lag=float(lag.mean()),
            policy_lag_max=float(lag_max.max()),
            queue_occupancy=float(occupancy.mean()),
            learner_wait_fraction=float(wait.mean()),
            dropped_trajectories=float(dropped.sum()),
            mean_return=float(return_sum.sum() / episodes.sum()) if episodes.sum() else math.nan,
            episodes=float(episodes.sum()),
        )
        return row


def run(
    config: config_lib.Config, host: HostContext, sinks, checkpointer=None, resume: bool = False, run_dir: str = ""
) -> Summary:
    """Runs Sebulba for `config` on `host`'s local devices and reports to `sinks`.

    Args:
      config: a validated Config with architecture 'sebulba'.
      host: this process's HostContext: its actors use its local actor devices; the learner mesh spans
        the learner devices of every host (host.devices).
      sinks: a metrics sink (podray.metrics.Sinks).
      checkpointer: a podray.checkpoint.Checkpointer, or None for no checkpoints.
      resume: continue from the checkpointer's latest checkpoint (the learner state and counters; the
        environments start new episodes).
      run_dir: recorded in the summary.
    Returns:
      The run's Summary; final_mean_return is the mean unclipped score of the games finished in the
      last report interval that had any.
    """
    start = time.perf_counter()
    return run_program(SebulbaProgram(config, host), sinks, checkpointer, resume, run_dir, start)


def run_program(
    program: SebulbaProgram, sinks, checkpointer=None, resume: bool = False, run_dir: str = "", start: float = None
) -> Summary:
    """The learner loop of `run` for a built program (tests pass programs with their own envs or agent)."""
    start = time.perf_counter() if start is None else start
    config = program.config
    s = config.sebulba
    version, elapsed_before = 0, 0.0
    if resume and checkpointer is not None and checkpointer.latest_step() is not None:
        state, meta = checkpointer.restore_latest(program.learner.abstract_state(config.seed))
        version, elapsed_before = int(meta["updates"]), float(meta.get("wall_s", 0.0))
    else:
        state = program.learner.initial_state(config.seed)
    compile_s = program.compile(state)

    reporter = _Reporter(program)
    last_return = math.nan
    steady_start, steady_steps = None, 0
    # A signal (podray.preemption) ends the run after a learner step that every learner host agrees on,
    # with a report and a checkpoint there; the actors are then joined like at the end of a run.
    agreement = preemption.StopAgreement(program.mesh, preemption.STOP)
    program.start(state.train.params, version)
    try:
        while version < program.num_updates:
            wait_start = time.perf_counter()
            rollouts = program.gather(version)
            reporter.learner_wait_s += time.perf_counter() - wait_start
            step_start = time.perf_counter()
            state, metrics = program.learner_step(state, rollouts)
            del rollouts  # the trajectories' device buffers are freed as soon as the step is done
            last = version + 1 == program.num_updates
            stopping = agreement.should_stop() and not last
            report = (version + 1) % s.log_every == 0 or last or stopping
            if report:  # one sync per report: the time of a learner step from dispatch to result
                jax.block_until_ready(metrics)
                reporter.learner_step_s = time.perf_counter() - step_start
            version += 1
            reporter.updates += 1
            program.params.publish(state.train.params, version)
            if report:
                row = reporter.row(metrics, version, version * program.steps_per_update)
                row["compile_s"] = compile_s
                if not math.isnan(row["mean_return"]):
                    last_return = row["mean_return"]
                if steady_start is None:
                    steady_start = time.perf_counter()
                    steady_from = version
                else:
                    steady_steps = (version - steady_from) * program.steps_per_update
                sinks.write(version, row)
                every = config.run.checkpoint_every
                if checkpointer is not None and (last or stopping or (every and version % every == 0)):
                    meta = {
                        "updates": version,
                        "env_steps": version * program.steps_per_update,
                        "wall_s": elapsed_before + time.perf_counter() - start,
                        "config": config.to_dict(),
                    }
                    checkpointer.save(version, state, meta)
            if stopping:
                raise preemption.Preempted(
                    preemption.STOP.signal_name or "SIGTERM",
                    version if checkpointer is not None else None,
                    version * program.steps_per_update,
                    str(checkpointer.directory) if checkpointer is not None else "",
                    run_dir,
                )
        jax.block_until_ready(state)
        program.params.publish(state.train.params, version, wait=True)  # every actor copy, current
    except BaseException:
        try:
            program.stop()
        except RuntimeError as stop_error:  # keep the run's own error; say what else went wrong
            print(f"podray: while stopping after an error: {stop_error}", file=sys.stderr)
        raise
    program.stop()
    end = time.perf_counter()
    wall = elapsed_before + end - start
    env_steps = program.num_updates * program.steps_per_update
    steady = steady_steps / (end - steady_start) if steady_start is not None and steady_steps else 0.0
    return Summary(
        final_mean_return=last_return,
        env_steps=env_steps,
        wall_s=wall,
        steps_per_s=env_steps / wall,
        updates=program.num_updates,
        run_dir=run_dir,
        replica_returns=[last_return],
        compile_s=compile_s,
        steady_steps_per_s=steady,
        final_state=state,
        actor_params=[program.params.latest(d)[1] for d in program.actor_devices],
    )
