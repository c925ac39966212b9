"""The learner: one compiled step that gathers actor trajectories into the learner batch and runs
`agent.update` replicated over the learner devices, gradients averaged across them.

`shard_map` over a 1-D mesh of the learner devices (axis LEARNER_AXIS): the training state is
replicated, each trajectory's batch axis is split over the devices (the actors put it there already),
and each device concatenates its own shards of the k actor trajectories, so gathering the learner
batch moves no data between devices. The agent averages gradients over LEARNER_AXIS, which keeps the
replicas identical. The step is compiled once, before the actors start, and the state is donated.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podray.agents import Agent, TrainState, Trajectory
from podray.envs.host_envs import to_channels_last
from podray.host import compiler_options

LEARNER_AXIS = "learner"


@struct.dataclass
class LearnerState:
    """What the learner carries between steps (replicated over the learner devices).

    Attributes:
      train: the agent's TrainState.
      key: [2] PRNG key of the learner (split at every step).
    """

    train: TrainState
    key: chex.Array


class Learner:
    """The compiled learner step for an agent over a mesh of learner devices.

    Args:
      agent: the agent (the same object type Anakin runs).
      mesh: a 1-D mesh of the learner devices, axis named LEARNER_AXIS.
      trajectories_per_step: k, the actor trajectories gathered into one learner batch.
      channels_first: observations arrive [.., C, H, W] (envpool Atari) and are moved on device.
    """

    def __init__(self, agent: Agent, mesh: Mesh, trajectories_per_step: int, channels_first: bool = False):
        self.agent = agent
        self.mesh = mesh
        self.k = trajectories_per_step
        self.channels_first = channels_first
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P(None, LEARNER_AXIS))
        step = jax.shard_map(
            self._step,
            mesh=mesh,
            in_specs=(P(), (P(None, LEARNER_AXIS),) * self.k),
            out_specs=(P(), P()),
            # rlax's scans start from unannotated constants; replication holds because every gradient
            # is averaged over LEARNER_AXIS (as in Anakin).
            check_vma=False,
        )
        options = compiler_options(mesh.devices.flat)
        self.step = jax.jit(step, donate_argnums=0, compiler_options=options)
        self.init = jax.jit(self._init, out_shardings=self.replicated, compiler_options=options)

    def _init(self, key: chex.PRNGKey) -> LearnerState:
        params_key, key = jax.random.split(key)
        return LearnerState(train=self.agent.init(params_key), key=key)

    def _step(self, state: LearnerState, trajectories: tuple[Trajectory, ...]) -> tuple[LearnerState, Any]:
        # This device's shards of the k trajectories, side by side: [T(+1), k * B_actor / devices, ...].
        trajectory = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *trajectories)
        trajectory = trajectory.replace(obs=to_channels_last(trajectory.obs, self.channels_first))
        key, update_key = jax.random.split(state.key)
        update_key = jax.random.fold_in(update_key, jax.lax.axis_index(LEARNER_AXIS))
        train, metrics = self.agent.update(state.train, trajectory, update_key, LEARNER_AXIS)
        return LearnerState(train=train, key=key), metrics

    def initial_state(self, seed: int) -> LearnerState:
        """The state before the first step (the same parameters on every learner device)."""
        return self.init(jax.device_put(jax.random.PRNGKey(seed), self.replicated))

    def abstract_state(self, seed: int) -> LearnerState:
        """Shapes and shardings of the state (what a checkpoint restores into)."""
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self.replicated)
        return jax.eval_shape(self.init, key)

    def abstract_trajectory(self, rollout_length: int, actor_batch: int, obs_shape, obs_dtype) -> Trajectory:
        """The shape of one actor trajectory as it arrives (for compiling before the actors start)."""
        T, B, A = rollout_length, actor_batch, self.agent.spec.num_actions
        s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)  # noqa: E731
        from podray.agents import ActorOut

        return Trajectory(
            obs=s((T + 1, B, *obs_shape), jnp.dtype(obs_dtype)),
            action=s((T, B), jnp.int32),
            reward=s((T, B), jnp.float32),
            discount=s((T, B), jnp.float32),
            actor_out=ActorOut(logits=s((T, B, A), jnp.float32), value=s((T, B), jnp.float32)),
        )
