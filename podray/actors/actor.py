"""An actor thread: steps its own envpool batch, runs the policy on its actor device, and hands
time-major trajectories, already split over the learner devices, to the learner through a bounded queue.

The story of one step: wait for envpool (GIL released) -> copy the observations to the actor device ->
the jitted policy samples actions (GIL released inside XLA) -> send the actions to envpool. While one
thread waits on its environments, another thread of the same device runs inference: the device is
shared without locks. After T steps per environment, the trajectory [T+1, B, ...] is put straight onto
the learner devices with one `jax.device_put` to a NamedSharding that splits the batch axis.

Bookkeeping is per environment (a write index `t[e]` per environment), so the same code serves
envpool's sync mode (every step returns every environment, all rows finish together and the buffers
are handed over without a copy) and its async mode (each step returns whichever environments are
ready; finished rows are gathered until a batch of them is complete).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import numpy as np

from podray.actors.params import ParamsStore
from podray.agents import ActorOut, Trajectory
from podray.envs.host_envs import HostEnv


@dataclass
class Rollout:
    """What an actor hands to the learner.

    Attributes:
      trajectory: a Trajectory [T(+1), B, ...] already on the learner devices, batch axis sharded.
      version: the oldest parameter version that chose any of its actions.
      actor: index of the actor thread that made it.
    """

    trajectory: Trajectory
    version: int
    actor: int


@dataclass
class ActorStats:
    """Counters of one actor thread, read by the learner at each report (cumulative, monotone).

    Attributes:
      env_steps: environment steps taken (every environment of every batch).
      env_calls / env_s: envpool step calls and the time spent waiting in them.
      inference_calls / inference_s: policy calls and their time (device copy in and out included).
      put_s: time blocked on a full queue.
      rollouts: trajectories handed over.
      episode_returns: unclipped game scores of finished games, drained by the reader.
    """

    env_steps: int = 0
    env_calls: int = 0
    env_s: float = 0.0
    inference_calls: int = 0
    inference_s: float = 0.0
    put_s: float = 0.0
    rollouts: int = 0
    episode_returns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))


class _Buffers:
    """Numpy buffers of one rollout for N environments, time-major."""

    def __init__(self, T: int, n: int, obs_shape, obs_dtype, num_actions: int):
        self.obs = np.empty((T + 1, n, *obs_shape), obs_dtype)
        self.action = np.empty((T, n), np.int32)
        self.reward = np.empty((T, n), np.float32)
        self.discount = np.empty((T, n), np.float32)
        self.logits = np.empty((T, n, num_actions), np.float32)
        self.value = np.empty((T, n), np.float32)

    def take(self, ids: np.ndarray) -> Trajectory:
        """Copies the rows of environments `ids` out (async mode)."""
        return self.trajectory(lambda x: np.take(x, ids, axis=1))

    def trajectory(self, f: Callable = lambda x: x) -> Trajectory:
        return Trajectory(
            obs=f(self.obs),
            action=f(self.action),
            reward=f(self.reward),
            discount=f(self.discount),
            actor_out=ActorOut(logits=f(self.logits), value=f(self.value)),
        )


class ActorThread(threading.Thread):
    """One actor thread with its own envpool batch.

    Args:
      index: the thread's index (seeds its environments and PRNG key).
      make_env: builds this thread's HostEnv (called inside the thread, closed when it ends).
      policy: jitted (params, obs [B, ...], key) -> (key, action [B], logits [B, A], value [B]).
      device: the actor device this thread runs the policy on.
      params: the store the learner publishes to.
      queue: the bounded queue to the learner.
      learner_sharding: a NamedSharding that splits axis 1 (the batch) over the learner devices.
      rollout_length: T.
      batch_size: environments per trajectory (the actor batch).
      piece_size: environments per hand-over (a divisor of batch_size): a trajectory is cut along the
        batch into pieces of this size when the learner batch is smaller than the actor batch.
      seed: the run's seed.
      bootstrap_discount: the agent's discount gamma, for the value of an episode cut by the time
        limit (see _loop).
      stop: set when the run ends; the thread then returns within about `poll_s`.
      on_error: called with any exception raised in the thread (the run then ends with it).
      poll_s: the slice of every blocking wait, after which `stop` is checked again.
    """

    def __init__(
        self,
        index: int,
        make_env: Callable[[int], HostEnv],
        policy: Callable,
        device: jax.Device,
        params: ParamsStore,
        queue,
        learner_sharding: jax.sharding.NamedSharding,
        rollout_length: int,
        batch_size: int,
        seed: int,
        stop: threading.Event,
        on_error: Callable[[BaseException], None],
        poll_s: float = 0.1,
        piece_size: int | None = None,
        bootstrap_discount: float = 1.0,
    ):
        super().__init__(name=f"podray-actor-{index}", daemon=True)
        self.index = index
        self._make_env = make_env
        self._policy = policy
        self.device = device
        self._params = params
        self._queue = queue
        self._sharding = learner_sharding
        self._T = rollout_length
        self._B = batch_size
        self._piece = piece_size or batch_size
        self._seed = seed
        self._gamma = bootstrap_discount
        self._stop_event = stop
        self._on_error = on_error
        self._poll_s = poll_s
        self.stats = ActorStats()
        self.max_queue_size_seen = 0

    def run(self) -> None:
        env = None
        try:
            env = self._make_env(self.index)
            self._loop(env)
        except BaseException as e:  # noqa: BLE001 - every error ends the run, with its traceback
            self._on_error(e)
        finally:
            if env is not None:
                env.close()

    def _put(self, rollout: Rollout) -> None:
        start = time.perf_counter()
        while not self._stop_event.is_set():
            try:
                self._queue.put(rollout, timeout=self._poll_s)
                self.max_queue_size_seen = max(self.max_queue_size_seen, self._queue.qsize())
                break
            except Exception:  # queue.Full: the learner is behind; check stop and retry
                continue
        self.stats.put_s += time.perf_counter() - start

    def _emit(self, trajectory: Trajectory, version: int) -> None:
        # One host-to-device transfer per leaf and piece, straight onto the learner devices, split over
        # the batch.
        for start in range(0, self._B, self._piece):
            piece = trajectory
            if self._piece != self._B:
                piece = jax.tree.map(lambda x, a=start: x[:, a : a + self._piece], trajectory)
            on_learners = jax.device_put(piece, self._sharding)
            self._put(Rollout(trajectory=on_learners, version=version, actor=self.index))
            self.stats.rollouts += 1

    def _loop(self, env: HostEnv) -> None:
        T, B, N = self._T, self._B, env.num_envs
        spec = env.spec
        obs_shape = env.raw_obs_shape  # envpool's layout (the policy moves channels)
        new_buffers = lambda: _Buffers(T, N, obs_shape, spec.obs_dtype, spec.num_actions)  # noqa: E731
        buf = new_buffers()
        t = np.zeros(N, np.int64)  # write index of each environment in the current rows
        has_prev = np.zeros(N, bool)  # an action is in flight for this environment
        truncated = np.zeros(N, bool)  # the last recorded step of this environment hit the time limit
        oldest = np.full(N, np.iinfo(np.int64).max)  # oldest version that acted in each row
        staged: list[tuple[Trajectory, int]] = []  # async: finished rows waiting for a full batch
        staged_count = 0
        key = jax.device_put(jax.random.PRNGKey(self._seed * 1_000_003 + self.index), self.device)
        stats = self.stats

        obs, ids = env.reset()
        step = None
        while not self._stop_event.is_set():
            # Record the results of the previous actions of these environments. envpool's reset step
            # is no transition (its action was ignored): nothing is recorded, and the first observation
            # of the new episode takes the slot of the last one of the old (whose step had discount 0).
            if step is not None:
                prev = has_prev[ids] & ~step.first
                pid = ids[prev]
                buf.reward[t[pid], pid] = step.reward[prev]
                buf.discount[t[pid], pid] = step.discount[prev]
                t[pid] += 1
                truncated[pid] = step.truncated[prev]
                # A time limit cut the episode: its return goes on past the last observation, whose
                # value the policy computed when it acted on it (that action was ignored). Within a
                # row the next slot holds the next episode's first observation, so that value is
                # folded into the reward and the discount set to 0. A row that ended on the truncated
                # step already has the last observation as its bootstrap, with discount 1.
                cut = ids[step.first & truncated[ids]]
                cut = cut[t[cut] > 0]
                buf.reward[t[cut] - 1, cut] += self._gamma * buf.value[t[cut], cut]
                buf.discount[t[cut] - 1, cut] = 0.0
                truncated[ids[step.first]] = False
                for r in step.episode_return[step.episode_done]:
                    stats.episode_returns.append(float(r))
            finished = t[ids] == T
            finishing = ids[finished]
            buf.obs[t[ids], ids] = obs  # (the bootstrap observation of finishing rows)
            if finishing.size:
                version = int(oldest[finishing].min())
                if finishing.size == N == B:  # sync mode: hand the whole buffers over, no copy
                    old, buf = buf, new_buffers()
                    self._emit(old.trajectory(), version)
                else:
                    staged.append((buf.take(finishing), version))
                    staged_count += finishing.size
                t[finishing] = 0
                oldest[finishing] = np.iinfo(np.int64).max
                buf.obs[0, finishing] = obs[finished]
                while staged_count >= B:
                    batch, staged, staged_count = _split_staged(staged, B)
                    self._emit(*batch)

            version, params = self._params.latest(self.device)
            start = time.perf_counter()
            key, action, logits, value = self._policy(params, jax.device_put(obs, self.device), key)
            action, logits, value = jax.device_get((action, logits, value))
            stats.inference_s += time.perf_counter() - start
            stats.inference_calls += 1
            buf.action[t[ids], ids] = action
            buf.logits[t[ids], ids] = logits
            buf.value[t[ids], ids] = value
            oldest[ids] = np.minimum(oldest[ids], version)
            has_prev[ids] = True

            start = time.perf_counter()
            env.send(action, ids)
            step = env.recv()
            stats.env_s += time.perf_counter() - start
            stats.env_calls += 1
            stats.env_steps += len(step.env_id)
            obs, ids = step.obs, step.env_id


def _split_staged(staged, B: int):
    """Takes exactly B environments' rows from the staged list; returns ((trajectory, version), rest, count)."""
    taken, count, rest = [], 0, []
    for i, (traj, version) in enumerate(staged):
        n = traj.action.shape[1]
        if count + n <= B:
            taken.append((traj, version))
            count += n
        else:
            need = B - count
            if need:
                taken.append((jax.tree.map(lambda x, n=need: x[:, :n], traj), version))
            rest.append((jax.tree.map(lambda x, n=need: x[:, n:], traj), version))
            rest.extend(staged[i + 1 :])
            break
        if count == B:
            rest.extend(staged[i + 1 :])
            break
    trajectory = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *[tr for tr, _ in taken])
    version = min(v for _, v in taken)
    rest_count = sum(tr.action.shape[1] for tr, _ in rest)
    return (trajectory, version), rest, rest_count
