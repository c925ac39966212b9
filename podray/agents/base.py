"""The agent interface shared by Anakin and Sebulba, and the values passed through it.

An agent is pure functions and nothing else: no threads, no Ray, no devices (shared/DESIGN.md).
- `init(key) -> TrainState`: parameters and optimizer state.
- `act(params, obs, key) -> (action, ActorOut)`: what the actor needs; ActorOut carries what the loss
  needs (behaviour logits and values).
- `loss(params, trajectory) -> (loss, metrics)`.
- `update(state, trajectory, key, axis_name) -> (state, metrics)`: one learner step on a batch of
  experience; gradients are averaged over the named mesh axes, so the same code is a single-device
  update, a replicated update over all devices (Anakin), or over the learner devices (Sebulba).
Trajectories are time-major `[T, B, ...]`, as rlax expects.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import chex
import jax
import jax.numpy as jnp
import optax
from flax import struct

from podray.agents.networks import ActorCritic, ActorCriticOutput
from podray.config import AgentConfig, NetworkConfig, sgd_schedule
from podray.envs.spec import EnvSpec

AxisName = Hashable | Sequence[Hashable] | None


@struct.dataclass
class ActorOut:
    """What acting records for the loss.

    Attributes:
      logits: [..., num_actions] behaviour policy logits.
      value: [...] behaviour value estimate.
    """

    logits: chex.Array
    value: chex.Array


@struct.dataclass
class Trajectory:
    """A time-major batch of experience from B environments over T steps.

    Attributes:
      obs: [T + 1, B, *obs_shape]; obs[t] is seen before action[t], obs[T] is the bootstrap.
      action: [T, B] int actions.
      reward: [T, B] reward after action[t].
      discount: [T, B] 0 where the episode ended after action[t], else 1 (not yet times gamma).
      actor_out: ActorOut with leaves [T, B, ...] from the behaviour policy.
    """

    obs: chex.Array
    action: chex.Array
    reward: chex.Array
    discount: chex.Array
    actor_out: ActorOut


@struct.dataclass
class TrainState:
    """Learner state. Attributes: params, opt_state, and `updates`, the count of update() calls."""

    params: Any
    opt_state: Any
    updates: chex.Array


def mean_over(x: Any, axis_name: AxisName) -> Any:
    """Averages a pytree over the named mesh axes (identity when there are none)."""
    if axis_name is None:
        return x
    return jax.lax.pmean(x, axis_name)


class Agent:
    """Base of the actor-critic agents: the network, the optimizer, and acting.

    Args:
      config: the agent's hyperparameters.
      network: the network's shape.
      spec: the environment's observation and action spec.
      num_updates: update() calls in the whole run (sets the learning-rate schedule).
    """

    scan_unroll: bool | None = None
    """Unroll the loops over epochs and minibatches (True), keep them as scans (False), or choose by
    backend (None): on CPU a conv-net gradient inside a scan runs far slower than unrolled
    (jax-ml/jax#12868; see docs/sebulba.md for our measurement), so pixel torsos unroll on CPU."""

    def __init__(self, config: AgentConfig, network: NetworkConfig, spec: EnvSpec, num_updates: int):
        self.config = config
        self.epochs, self.num_minibatches = sgd_schedule(config)
        self.spec = spec
        self.network = ActorCritic(config=network, num_actions=spec.num_actions, obs_rank=len(spec.obs_shape))
        self.num_updates = num_updates
        self.optimizer = self._make_optimizer()

    def optimizer_steps_per_update(self) -> int:
        """Optimizer steps in one update() (for the learning-rate schedule)."""
        return self.epochs * self.num_minibatches

    def _unroll(self) -> bool:
        if self.scan_unroll is not None:
            return self.scan_unroll
        return jax.default_backend() == "cpu" and self.network.config.torso != "mlp"

    def _make_optimizer(self) -> optax.GradientTransformation:
        c = self.config
        total = max(1, self.num_updates * self.optimizer_steps_per_update())
        lr = optax.linear_schedule(c.learning_rate, 0.0, total) if c.anneal_lr else c.learning_rate
        if c.optimizer == "adam":
            opt = optax.adam(lr, eps=c.adam_eps)
        else:
            opt = optax.rmsprop(lr, eps=c.adam_eps, decay=0.99, eps_in_sqrt=c.optimizer == "rmsprop")
        chain = [optax.clip_by_global_norm(c.max_grad_norm)] if c.max_grad_norm > 0 else []
        return optax.chain(*chain, opt)

    def init(self, key: chex.PRNGKey) -> TrainState:
        """Initial parameters and optimizer state (the key is consumed)."""
        dummy = jnp.zeros((1, *self.spec.obs_shape), self.spec.obs_dtype)
        params = self.network.init(key, dummy)
        return TrainState(params=params, opt_state=self.optimizer.init(params), updates=jnp.zeros((), jnp.int32))

    def state_partition(self, replicated: Any, sharded: Any) -> Any:
        """How the architectures lay this agent's TrainState over the devices that share an update: a
        pytree prefix of the state whose leaves are `replicated` (the same on every device: parameters,
        optimizer state) or `sharded` (one shard per device along the leaves' leading axis, e.g. a
        replay buffer). The architecture passes the PartitionSpecs of its mesh. Actor-critics keep
        everything replicated."""
        del sharded
        return replicated

    def apply(self, params: Any, obs: chex.Array) -> ActorCriticOutput:
        return self.network.apply(params, obs)

    def act(self, params: Any, obs: chex.Array, key: chex.PRNGKey) -> tuple[chex.Array, ActorOut]:
        """Samples actions for a batch of observations.

        Args:
          params: network parameters.
          obs: [B, *obs_shape] observations.
          key: one PRNG key, or [B] keys, one per environment (consumed).
        Returns:
          (action [B] int32, ActorOut with logits [B, A] and value [B]).
        """
        if key.ndim == 1:
            noise = jax.random.gumbel(key, (obs.shape[0], self.spec.num_actions))
        else:
            noise = self.action_noise(key)
        return self.act_with_noise(params, obs, noise)

    def action_noise(self, keys: chex.Array) -> chex.Array:
        """Gumbel noise [..., A] for `act_with_noise`, one draw per key of `keys` [..., 2].

        Drawing it for a whole rollout at once, outside the sequential loop, is what Anakin does: on
        CPU each in-loop random draw is a small rolled loop of its own (threefry), a visible cost per step.
        """
        draw = lambda k: jax.random.gumbel(k, (self.spec.num_actions,))  # noqa: E731
        for _ in range(keys.ndim - 1):
            draw = jax.vmap(draw)
        return draw(keys)

    def act_greedy(self, params: Any, obs: chex.Array, key: chex.PRNGKey) -> chex.Array:
        """The most probable action [B] for every observation (`podray eval --greedy`); `key` is unused
        here (agents that search use it to break ties)."""
        del key
        return jnp.argmax(self.apply(params, obs).logits, axis=-1).astype(jnp.int32)

    def act_with_noise(self, params: Any, obs: chex.Array, noise: chex.Array) -> tuple[chex.Array, ActorOut]:
        """`act` with the randomness given: the Gumbel-max sample argmax(logits + noise), which is what
        jax.random.categorical computes, so act(key) == act_with_noise(action_noise(key))."""
        out = self.apply(params, obs)
        action = jnp.argmax(out.logits + noise, axis=-1)
        return action.astype(jnp.int32), ActorOut(logits=out.logits, value=out.value)

    def _apply_gradients(self, state: TrainState, grads: Any, axis_name: AxisName) -> tuple[Any, Any]:
        grads = mean_over(grads, axis_name)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    def sgd(
        self,
        state: TrainState,
        data: Any,
        key: chex.PRNGKey,
        loss_fn,
        batch_axis: int,
        axis_name: AxisName = None,
    ) -> tuple[TrainState, dict[str, chex.Array]]:
        """`epochs` passes of `num_minibatches` gradient steps of `loss_fn` over `data`.

        Args:
          state: the state before the update.
          data: a pytree whose leaves all have the per-device batch on axis `batch_axis` (PPO: flat
            samples on axis 0; IMPALA: a time-major Trajectory, environments on axis 1).
          key: shuffles the batch once per epoch (consumed; unused for one minibatch of one epoch).
          loss_fn: (params, minibatch, axis_name) -> (loss, metrics).
          batch_axis: the axis that is shuffled and split into minibatches.
          axis_name: mesh axes that share the batch; gradients are averaged over them.
        Returns:
          (the state after one more update, the metrics averaged over steps and devices).
        """
        grad_fn = jax.grad(loss_fn, has_aux=True)

        def minibatch_step(carry, minibatch):
            params, opt_state = carry
            grads, metrics = grad_fn(params, minibatch, axis_name)
            params, opt_state = self._apply_gradients(
                TrainState(params=params, opt_state=opt_state, updates=state.updates), grads, axis_name
            )
            return (params, opt_state), metrics

        carry = (state.params, state.opt_state)
        if self.epochs == 1 and self.num_minibatches == 1:
            carry, metrics = minibatch_step(carry, data)
        else:
            n = jax.tree.leaves(data)[0].shape[batch_axis]
            m = self.num_minibatches

            def split(x, perm):
                x = jnp.take(x, perm, axis=batch_axis)
                x = x.reshape(x.shape[:batch_axis] + (m, n // m) + x.shape[batch_axis + 1 :])
                return jnp.moveaxis(x, batch_axis, 0)  # [m, ..., n / m, ...]

            def epoch(carry, epoch_key):
                perm = shuffle(epoch_key, n)
                minibatches = jax.tree.map(lambda x: split(x, perm), data)
                return loop(minibatch_step, carry, minibatches)

            # Unrolled as Python loops, not scan(unroll=True): a scan of length 1 (one epoch) still
            # lowers to a while loop, and a conv gradient inside one ran 14x slower on CPU (22.7 s
            # against 1.6 s for a Pong update of 16 x 64 samples in 4 minibatches).
            loop = _unrolled_scan if self._unroll() else jax.lax.scan
            carry, metrics = loop(epoch, carry, jax.random.split(key, self.epochs))
        params, opt_state = carry
        metrics = mean_over(jax.tree.map(jnp.mean, metrics), axis_name)
        return TrainState(params=params, opt_state=opt_state, updates=state.updates + 1), metrics

    def loss(self, params: Any, trajectory: Trajectory) -> tuple[chex.Array, dict[str, chex.Array]]:
        raise NotImplementedError

    def update(
        self, state: TrainState, trajectory: Trajectory, key: chex.PRNGKey, axis_name: AxisName = None
    ) -> tuple[TrainState, dict[str, chex.Array]]:
        raise NotImplementedError


def _unrolled_scan(f, carry, xs):
    """jax.lax.scan(f, carry, xs) as a Python loop over the leading axis: no while loop in the program."""
    ys = []
    for i in range(jax.tree.leaves(xs)[0].shape[0]):
        carry, y = f(carry, jax.tree.map(lambda x, i=i: x[i], xs))
        ys.append(y)
    return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def shuffle(key: chex.PRNGKey, n: int, rounds: int = 2) -> chex.Array:
    """A random permutation of range(n), int32 [n], for minibatch shuffling.

    jax.random.permutation sorts (key, value) pairs with a comparator, which XLA:CPU runs about 10x
    slower than a sort of one uint32 array (2.9 ms against 0.29 ms for n = 8192 here: a third of a PPO
    update at 64 CartPole envs). So each round packs the index into the low ceil(log2 n) bits and random
    bits above it, and sorts that one array. Indices whose random bits tie keep their order within a
    round; the next round, with fresh bits, breaks up those pairs (jax.random.permutation also uses
    several rounds for the same reason).
    """
    index_bits = max(1, (n - 1).bit_length())
    if index_bits > 24:
        return jax.random.permutation(key, n)  # too few random bits left above the index
    mask = jnp.uint32((1 << index_bits) - 1)
    index = jnp.arange(n, dtype=jnp.uint32)
    perm = None
    for round_key in jax.random.split(key, rounds):
        order = jnp.sort((jax.random.bits(round_key, (n,), jnp.uint32) << index_bits) | index) & mask
        perm = order if perm is None else perm[order]
    return perm.astype(jnp.int32)


def normalize(x: chex.Array, axis_name: AxisName = None, eps: float = 1e-8) -> chex.Array:
    """(x - mean) / std, with the statistics of the whole batch across the named mesh axes."""
    mean = mean_over(x.mean(), axis_name)
    var = mean_over(jnp.square(x).mean(), axis_name) - jnp.square(mean)
    return (x - mean) / (jnp.sqrt(jnp.maximum(var, 0.0)) + eps)


def ratio_metrics(ratio: chex.Array, epsilon: float) -> dict[str, chex.Array]:
    """How far a clipped surrogate's policy moved from the acting one: approximate KL and the
    fraction of ratios outside [1 - epsilon, 1 + epsilon]."""
    return {
        "approx_kl": jnp.mean((ratio - 1.0) - jnp.log(ratio)),
        "clip_fraction": jnp.mean(jnp.abs(ratio - 1.0) > epsilon),
    }


def log_prob(logits: chex.Array, action: chex.Array) -> chex.Array:
    """log pi(action) for logits [..., A] and int actions [...]."""
    logp = jax.nn.log_softmax(logits)
    return jnp.take_along_axis(logp, action[..., None], axis=-1)[..., 0]


def entropy(logits: chex.Array) -> chex.Array:
    logp = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
