"""The learner: one compiled step that gathers actor trajectories into the learner batch and runs
`agent.update` replicated over the learner devices, gradients averaged across them.

`shard_map` over a 1-D mesh of the learner devices (axis LEARNER_AXIS): the training state is
replicated, each trajectory's batch axis is split over the devices (the actors put it there already),
and each device concatenates its own shards of the k actor trajectories, so gathering the learner
batch moves no data between devices. The agent averages gradients over LEARNER_AXIS, which keeps the
replicas identical. The step is compiled once, before the actors start, and the state is donated.

Across hosts the mesh spans the learner devices of every host, host by host. Actors put their
trajectories on their own host's learner devices (`local_batch_sharding`); `from_hosts` declares those
per-device buffers the host's shards of a global trajectory (host h holds batch slices h*L .. h*L+L-1
of L learner devices per host), so no trajectory crosses hosts: only the gradients' all-reduce does.
"""

from __future__ import annotations

from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podray import checkpoint
from podray.agents import Agent, TrainState, Trajectory
from podray.envs.host_envs import to_channels_last
from podray.host import compiler_options

LEARNER_AXIS = "learner"


@struct.dataclass
class LearnerState:
    """What the learner carries between steps (replicated over the learner devices, but for the parts
    of the agent's state that its `state_partition` shards, such as a replay).

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
      local_devices: this process's learner devices, in mesh order (default: every device of the mesh,
        a single-process run).
    """

    def __init__(
        self,
        agent: Agent,
        mesh: Mesh,
        trajectories_per_step: int,
        channels_first: bool = False,
        local_devices: Sequence[jax.Device] | None = None,
    ):
        self.agent = agent
        self.mesh = mesh
        self.k = trajectories_per_step
        self.channels_first = channels_first
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P(None, LEARNER_AXIS))
        local = list(local_devices) if local_devices is not None else list(mesh.devices.flat)
        self.hosts = mesh.devices.size // len(local)
        if self.hosts == 1:
            self.local_batch_sharding = self.batch_sharding
        else:
            local_mesh = Mesh(np.asarray(local, dtype=object), (LEARNER_AXIS,))
            self.local_batch_sharding = NamedSharding(local_mesh, P(None, LEARNER_AXIS))
        # The agent says which parts of its state are per-device shards (a replay) rather than replicated.
        state_spec = LearnerState(train=agent.state_partition(P(), P(LEARNER_AXIS)), key=P())
        self._state_spec = state_spec
        step = jax.shard_map(
            self._step,
            mesh=mesh,
            in_specs=(state_spec, (P(None, LEARNER_AXIS),) * self.k),
            out_specs=(state_spec, P()),
            # rlax's scans start from unannotated constants; replication holds because every gradient
            # is averaged over LEARNER_AXIS (as in Anakin).
            check_vma=False,
        )
        options = compiler_options(mesh.devices.flat)
        self.step = jax.jit(step, donate_argnums=0, compiler_options=options)
        init = jax.shard_map(self._init, mesh=mesh, in_specs=P(), out_specs=state_spec, check_vma=False)
        self.init = jax.jit(init, compiler_options=options)

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

    def from_hosts(self, trajectory: Trajectory) -> Trajectory:
        """This host's trajectory [T(+1), B, ...] (on its learner devices, `local_batch_sharding`) as
        its shards of the global trajectory [T(+1), B * hosts, ...] over every host's learner devices.

        Every host calls this in the same step with its own trajectory; no data moves. A single-host
        learner returns `trajectory` as it is.
        """
        if self.hosts == 1:
            return trajectory

        def global_array(x: jax.Array) -> jax.Array:
            shape = (x.shape[0], x.shape[1] * self.hosts, *x.shape[2:])
            shards = [shard.data for shard in x.addressable_shards]
            return jax.make_array_from_single_device_arrays(shape, self.batch_sharding, shards)

        return jax.tree.map(global_array, trajectory)

    def initial_state(self, seed: int) -> LearnerState:
        """The state before the first step (the same parameters on every learner device)."""
        key = np.asarray(jax.random.PRNGKey(seed))
        # Every process holds the same key and places it on its own learner devices (multi-host safe).
        return self.init(jax.make_array_from_callback(key.shape, self.replicated, lambda index: key[index]))

    def abstract_state(self, seed: int) -> LearnerState:
        """Shapes and shardings of the state (what a checkpoint restores into)."""
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self.replicated)
        return checkpoint.on_mesh(jax.eval_shape(self.init, key), self._state_spec, self.mesh)

    def abstract_trajectory(self, rollout_length: int, actor_batch: int, obs_shape, obs_dtype) -> Trajectory:
        """The shape of one global trajectory of `actor_batch` environments (over every host) as the
        step takes it (for compiling before the actors start)."""
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
