"""Batched JAX environments with automatic reset and episode statistics, for Anakin.

Any discrete-action gymnax environment can be used by name. The whole step, reset included, is a pure
JAX function, so Anakin can vmap it over a batch and scan it over a rollout inside one compiled
program. gymnax resets an environment inside `step` when its episode ends; we add the bookkeeping of
episode returns, so that reported returns are those of completed episodes only.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import struct

from podray.envs.spec import EnvSpec


@struct.dataclass
class EnvState:
    """State of a batch of B environments.

    Attributes:
      inner: the gymnax state, each leaf [B, ...].
      episode_return: [B] return of the episode in progress.
      episode_length: [B] steps of the episode in progress.
    """

    inner: Any
    episode_return: chex.Array
    episode_length: chex.Array


@struct.dataclass
class TimeStep:
    """The result of stepping B environments once.

    Attributes:
      obs: [B, *obs_shape] next observation (the first of a new episode where `done`).
      reward: [B] reward of this transition.
      discount: [B] 0 where the episode ended on this transition, else 1.
      done: [B] bool, the episode ended on this transition.
      episode_return: [B] return of the episode that ended here (0 where not `done`).
      episode_length: [B] length of the episode that ended here (0 where not `done`).
    """

    obs: chex.Array
    reward: chex.Array
    discount: chex.Array
    done: chex.Array
    episode_return: chex.Array
    episode_length: chex.Array


def _gymnax():
    import gymnax

    return gymnax


def check_name(name: str) -> None:
    """Raises ConfigError unless `name` is a discrete-action gymnax environment."""
    from podray.config import ConfigError

    gymnax = _gymnax()
    if name not in gymnax.registered_envs:
        raise ConfigError(
            f"env.name: '{name}' is not a JAX (gymnax) environment; Anakin runs one of "
            f"{', '.join(gymnax.registered_envs)}"
        )
    env, params = gymnax.make(name)
    space = env.action_space(params)
    if not hasattr(space, "n"):
        raise ConfigError(f"env.name: '{name}' has continuous actions; podray's agents need a discrete action space")


def check_config(name: str, torso: str) -> None:
    """Raises ConfigError unless `name` is a discrete-action gymnax environment whose observations
    suit the network torso (pixel torsos need [H, W, C]); envpool names get a hint to use Sebulba."""
    from podray.config import ConfigError

    try:
        check_name(name)
    except ConfigError as e:
        from podray.envs import host_envs

        if name in host_envs.registered_tasks():
            raise ConfigError(f"{e}; '{name}' is an envpool task: use architecture=sebulba") from None
        raise
    if torso != "mlp" and len(observation_shape(name)) != 3:
        raise ConfigError(
            f"network.torso: '{torso}' needs image observations [H, W, C]; {name} has "
            f"shape {observation_shape(name)}; use network.torso=mlp"
        )


@functools.lru_cache(maxsize=None)
def observation_shape(name: str) -> tuple[int, ...]:
    gymnax = _gymnax()
    env, params = gymnax.make(name)
    # Traced, not compiled: validation must not start XLA.
    obs, _ = jax.eval_shape(env.reset, jax.ShapeDtypeStruct((2,), jnp.uint32), params)
    return tuple(obs.shape)


class JaxEnv:
    """A batch of gymnax environments with auto-reset. Methods are pure and jit/vmap-friendly."""

    def __init__(self, name: str):
        check_name(name)
        self._env, self._params = _gymnax().make(name)
        obs_space = self._env.observation_space(self._params)
        self.spec = EnvSpec(
            name=name,
            obs_shape=tuple(obs_space.shape),
            obs_dtype=str(jnp.dtype(obs_space.dtype)),
            num_actions=int(self._env.action_space(self._params).n),
        )

    def reset(self, keys: chex.Array) -> tuple[EnvState, chex.Array]:
        """Resets B environments.

        Args:
          keys: [B] PRNG keys, one per environment (consumed).
        Returns:
          (state, obs) with obs [B, *obs_shape].
        """
        obs, inner = jax.vmap(self._env.reset, in_axes=(0, None))(keys, self._params)
        # Strong dtypes (gymnax leaves some weakly typed): a state restored from a checkpoint is strongly
        # typed, and the same types make a resumed run compile the same program (compilation cache hits).
        inner = jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype), inner)
        zeros = jnp.zeros(keys.shape[:1], jnp.float32)
        state = EnvState(inner=inner, episode_return=zeros, episode_length=zeros.astype(jnp.int32))
        return state, obs.astype(self.spec.obs_dtype)

    def prepare(self, keys: chex.Array) -> tuple[chex.Array, tuple[chex.Array, Any]]:
        """The randomness of steps to come, for keys of any batch shape [..., 2]: each key splits into a
        step key and a reset key, as in gymnax's own auto-resetting step, and the reset key gives the
        fresh episode (first obs, gymnax state) that replaces an episode ending on that step.

        Anakin prepares a whole rollout at once, outside its sequential loop: gymnax computes a reset
        on every step anyway and selects it where an episode ended, so this is the same work vectorised,
        and on CPU each in-loop random draw is a small rolled loop of its own.
        Returns:
          (step_keys [..., 2], (obs [..., *obs_shape], gymnax state [..., ...])).
        """
        split, reset = jax.random.split, lambda k: self._env.reset_env(k, self._params)  # noqa: E731
        for _ in range(keys.ndim - 1):
            split, reset = jax.vmap(split), jax.vmap(reset)
        pair = split(keys)
        obs, inner = reset(pair[..., 1, :])
        return pair[..., 0, :], (obs.astype(self.spec.obs_dtype), inner)

    def step(self, state: EnvState, action: chex.Array, keys: chex.Array) -> tuple[EnvState, TimeStep]:
        """Steps B environments once, resetting those whose episode ends.

        Args:
          state: the batch state.
          action: [B] int actions.
          keys: [B] PRNG keys (consumed).
        """
        return self.step_prepared(state, action, *self.prepare(keys))

    def step_prepared(
        self, state: EnvState, action: chex.Array, step_keys: chex.Array, resets: tuple[chex.Array, Any]
    ) -> tuple[EnvState, TimeStep]:
        """`step` with its randomness from `prepare`: step keys [B] and fresh episodes [B, ...]."""
        obs, inner, reward, terminated, _ = jax.vmap(self._env.step_env, in_axes=(0, 0, 0, None))(
            step_keys, state.inner, action, self._params
        )
        truncated = jax.vmap(self._env.is_truncated, in_axes=(0, None))(inner, self._params)
        done = jnp.logical_or(terminated, truncated)

        def select(fresh, x, old):  # the fresh episode where one ended, in the state's own dtype
            return jnp.where(done.reshape(done.shape + (1,) * (x.ndim - 1)), fresh, x).astype(old.dtype)

        reset_obs, reset_inner = resets
        inner = jax.tree.map(select, reset_inner, inner, state.inner)
        obs = select(reset_obs, obs, reset_obs)
        # A time-limit truncation also cuts the return (discount 0), as in PureJaxRL: bootstrapping
        # from the final observation would need a second network call on every step.
        reward = reward.astype(jnp.float32)
        episode_return = state.episode_return + reward
        episode_length = state.episode_length + 1
        ts = TimeStep(
            obs=obs,
            reward=reward,
            discount=1.0 - done.astype(jnp.float32),
            done=done,
            episode_return=jnp.where(done, episode_return, 0.0),
            episode_length=jnp.where(done, episode_length, 0),
        )
        new_state = EnvState(
            inner=inner,
            episode_return=jnp.where(done, 0.0, episode_return),
            episode_length=jnp.where(done, 0, episode_length),
        )
        return new_state, ts
