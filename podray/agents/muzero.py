"""MuZero (Schrittwieser et al., 2020): a learned model searched with mctx, trained from a replay.

Acting runs the search (podray/search/) inside the jitted policy: act(params, obs, key) returns the
search's action, and its ActorOut carries the search policy (as logits, log pi) and the root value,
the targets the loss needs. The same object runs under Anakin and Sebulba.

Learning: `update(state, trajectory)` turns the new trajectory [T, B] into replay items, adds them
to the replay buffer held in the learner state (flashbax; one shard per device), samples
replay.replay_ratio x the new transitions from it, and takes gradient steps on the K-step unrolled
loss. Each item is one state with everything its unroll needs: the observation, the next K actions,
and targets for K + 1 positions (n-step values bootstrapped from the search's root values, the
search policies, the rewards), with masks. Targets are computed when the trajectory arrives, within
it: a trajectory's rows need not continue each other across updates (under Sebulba they come from
different actor threads), so an unroll never crosses into another update's data. Past an episode's
end the model is trained on an absorbing state (value and reward 0, no policy target); positions past
the trajectory's end while the episode goes on are masked out. With agent.consistency_coef > 0 the
loss also trains the dynamics' latents towards the representation of the observations reached
(EfficientZero's consistency loss), and each item holds those observations.
"""

from __future__ import annotations

from typing import Any

import chex
import flashbax
import jax
import jax.numpy as jnp
import optax
import rlax
from flax import struct

from podray.agents.base import ActorOut, Agent, AxisName, TrainState, Trajectory, _unrolled_scan, mean_over
from podray.agents.muzero_network import MuZeroNetwork, flatten_latent
from podray.config import AgentConfig, ConfigError, NetworkConfig, ReplayConfig, SearchConfig
from podray.envs.spec import EnvSpec
from podray.search import Model, ModelOutput, make_search, policy_entropy, temperature_at


@struct.dataclass
class MuZeroParams:
    """What acting needs. Attributes: network (flax parameters of MuZeroNetwork) and progress, a
    float32 scalar, the fraction of the run's updates done (sets the search temperature's schedule,
    so actors that receive parameters also receive the schedule's position)."""

    network: Any
    progress: chex.Array


@struct.dataclass
class MuZeroState(TrainState):
    """The learner state: TrainState (params are MuZeroParams, opt_state is over params.network) and
    `replay`, the flashbax buffer state of this device's shard, every leaf with a leading axis of 1
    (laid along the device axis by the architectures: see Agent.state_partition)."""

    replay: Any


@struct.dataclass
class ReplayItem:
    """One replay item: a state and what a K-step unroll from it learns. Shapes for one item:

    Attributes:
      obs: [*obs_shape] the observation at t.
      action: [K] int32, actions t .. t+K-1.
      reward: [K] reward targets of the unroll's transitions (0 in the absorbing state).
      value: [K + 1] n-step value targets at t .. t+K (0 in the absorbing state).
      policy: [K + 1, A] search policies at t .. t+K (uniform where masked).
      reward_mask, value_mask, policy_mask: [K], [K + 1], [K + 1] float32, 1 where the target is known.
      next_obs: [C, *obs_shape] the observations at t+1 .. t+C, the targets of the consistency loss
        (C = the consistency steps; None when the loss is off, so the replay stores no more frames).
        Where the episode ended or the trajectory ran out they are zeros, masked by policy_mask[1:].
      bootstrap_value, bootstrap_scale, bootstrap_offset: [K + 1] each, held only with
        agent.value_bootstrap 'reanalyse' (None otherwise): the value each target bootstraps from
        (the search's root value), its factor in the target (0 where the target is 0), and how many
        items further on in the replay the observation it bootstraps from is stored (0 where it is
        not: the observation after the trajectory's last step). A fresh value v of that observation
        makes the target value + bootstrap_scale * (v - bootstrap_value); see `reanalyse`.
    """

    obs: chex.Array
    action: chex.Array
    reward: chex.Array
    value: chex.Array
    policy: chex.Array
    reward_mask: chex.Array
    value_mask: chex.Array
    policy_mask: chex.Array
    next_obs: chex.Array | None = None
    bootstrap_value: chex.Array | None = None
    bootstrap_scale: chex.Array | None = None
    bootstrap_offset: chex.Array | None = None


def n_step_parts(
    reward: chex.Array, discount: chex.Array, n: int, gamma: float
) -> tuple[chex.Array, chex.Array, chex.Array]:
    """The parts of n-step value targets [T, B] within one trajectory, before the bootstrap value.

    z_t = sum_{i<m} gamma^i (prod_{j<i} d_{t+j}) r_{t+i} + gamma^m (prod_{j<m} d_{t+j}) v_{t+m}, with
    m = min(n, T - t): near the trajectory's end the target bootstraps earlier.

    Args:
      reward, discount: [T, B] (discount 0 where the episode ended after step t).
      n: the steps of the target.
      gamma: discount factor.
    Returns:
      (partial [T, B], the rewards' sum; scale [T, B], the bootstrap value's factor; index [T] int32,
      t + m, the step whose value is bootstrapped from (T: the observation after the last step)).
    """
    T = reward.shape[0]
    pad = lambda x: jnp.concatenate([x, jnp.zeros((n,) + x.shape[1:], x.dtype)])  # noqa: E731
    r, d = pad(reward), pad(discount)
    t = jnp.arange(T)[:, None]
    partial, scale = jnp.zeros_like(reward), jnp.ones_like(reward)
    for i in range(n):
        inside = t + i < T
        partial = partial + jnp.where(inside, scale * r[i : i + T], 0.0)
        scale = jnp.where(inside, scale * gamma * d[i : i + T], scale)
    return partial, scale, jnp.minimum(jnp.arange(T) + n, T)


def n_step_targets(
    reward: chex.Array, discount: chex.Array, value: chex.Array, bootstrap: chex.Array, n: int, gamma: float
) -> chex.Array:
    """n-step value targets [T, B] within one trajectory (see n_step_parts).

    Args:
      reward, discount: [T, B] (discount 0 where the episode ended after step t).
      value: [T, B] value estimates v_t (the search's root values).
      bootstrap: [B] value estimate of the observation after the last step.
      n: the steps of the target.
      gamma: discount factor.
    """
    partial, scale, index = n_step_parts(reward, discount, n, gamma)
    return partial + scale * jnp.concatenate([value, bootstrap[None]], axis=0)[index]


def _windows(x: chex.Array, length: int, fill: Any) -> chex.Array:
    """[T, B, ...] -> [T, B, length, ...]: out[t, :, k] = x[t + k], or `fill` past the end."""
    T = x.shape[0]
    padded = jnp.concatenate([x, jnp.full((length,) + x.shape[1:], fill, x.dtype)])
    return jnp.stack([padded[k : k + T] for k in range(length)], axis=2)


def make_items(
    trajectory: Trajectory,
    bootstrap: chex.Array,
    unroll_steps: int,
    td_steps: int,
    gamma: float,
    consistency_steps: int = 0,
    reanalyse: bool = False,
) -> ReplayItem:
    """Replay items [T, B] (one per step) from a trajectory [T, B] and the value [B] of its last
    observation; see ReplayItem. The search policy is softmax(actor_out.logits). With
    `consistency_steps` C > 0 each item also holds the next C observations; with `reanalyse`, what a
    fresh bootstrap value needs (the replay stores the items of a trajectory [T, B] row after row, so
    the item of step t + j of a row is j places after step t's)."""
    K = unroll_steps
    T, B = trajectory.action.shape
    A = trajectory.actor_out.logits.shape[-1]
    partial, scale, index = n_step_parts(trajectory.reward, trajectory.discount, td_steps, gamma)
    stale = jnp.concatenate([trajectory.actor_out.value, bootstrap[None]], axis=0)[index]  # [T, B]
    value = partial + scale * stale
    d = _windows(trajectory.discount, K + 1, 1.0)  # past the end: unknown, counted as alive
    alive = jnp.concatenate([jnp.ones((T, B, 1)), jnp.cumprod(d[..., :K], axis=-1)], axis=-1)  # [T, B, K+1]
    t = jnp.arange(T)[:, None, None]
    in_chunk = (t + jnp.arange(K + 1) < T).astype(jnp.float32)  # [T, 1, K+1]
    absorbed = 1.0 - alive
    policy = jax.nn.softmax(trajectory.actor_out.logits)
    items = ReplayItem(
        obs=trajectory.obs[:-1],
        action=_windows(trajectory.action.astype(jnp.int32), K, 0),
        reward=_windows(trajectory.reward, K, 0.0) * alive[..., :K],
        value=_windows(value, K + 1, 0.0) * alive,
        policy=_windows(policy, K + 1, 1.0 / A),
        reward_mask=jnp.maximum(in_chunk[..., :K], absorbed[..., :K]) * jnp.ones((T, B, K)),
        value_mask=jnp.maximum(in_chunk, absorbed),
        policy_mask=in_chunk * alive,
        next_obs=_windows(trajectory.obs[1:], consistency_steps, 0) if consistency_steps else None,
    )
    if not reanalyse:
        return items
    # Position k of item t bootstraps from step index[t + k], k + offset[t + k] items after t (0: not stored).
    offset = jnp.broadcast_to(jnp.where(index < T, index - jnp.arange(T), 0)[:, None], (T, B))
    offsets = _windows(offset.astype(jnp.int32), K + 1, 0)
    return items.replace(
        bootstrap_value=_windows(stale, K + 1, 0.0),
        bootstrap_scale=_windows(scale, K + 1, 0.0) * alive,
        bootstrap_offset=jnp.where(offsets > 0, offsets + jnp.arange(K + 1, dtype=jnp.int32), 0),
    )


def bootstrap_observations(buffer_state: Any, indices: chex.Array, offsets: chex.Array) -> chex.Array:
    """The observations [N, K + 1, *obs_shape] stored `offsets` [N, K + 1] slots after the items at
    `indices` [N] of a flashbax item buffer's state (modulo its capacity: the replay is a ring)."""
    stored = buffer_state.experience.obs[0]  # [capacity, *obs_shape]
    return stored[(indices[:, None] + offsets) % stored.shape[0]]


def reanalyse(items: ReplayItem, fresh: chex.Array) -> ReplayItem:
    """Items [N] whose value targets bootstrap from `fresh` [N, K + 1], new values of the observations
    `bootstrap_offset` points at, instead of the search's root values they were stored with (where the
    observation is not stored, the stored target stays)."""
    new = jnp.where(items.bootstrap_offset > 0, fresh - items.bootstrap_value, 0.0)
    return items.replace(value=items.value + items.bootstrap_scale * new)


def scale_gradient(x: chex.Array, scale: float) -> chex.Array:
    """x in the forward pass; its gradient times `scale` in the backward pass."""
    return x * scale + jax.lax.stop_gradient(x) * (1.0 - scale)


def _cross_entropy(target: chex.Array, logits: chex.Array) -> chex.Array:
    return -jnp.sum(target * jax.nn.log_softmax(logits), axis=-1)


class MuZero(Agent):
    """MuZero with an mctx search, categorical value/reward heads and a flashbax replay.

    Args:
      config: the agent's hyperparameters (unroll_steps, td_steps, support_size, ...).
      network: the representation torso's shape (also the latent width).
      spec: the environment's spec.
      num_updates: update() calls in the whole run (the learning-rate and temperature schedules).
      search: the `search:` section.
      replay: the `replay:` section; capacity and batch_size are split over `num_devices`.
      num_devices: the devices that share each update (Anakin: the mesh; Sebulba: the learner devices).
    """

    def __init__(
        self,
        config: AgentConfig,
        network: NetworkConfig,
        spec: EnvSpec,
        num_updates: int,
        search: SearchConfig | None = None,
        replay: ReplayConfig | None = None,
        num_devices: int = 1,
    ):
        self.config = config
        self.spec = spec
        self.num_updates = num_updates
        self.search_config = search or SearchConfig()
        self.replay_config = replay or ReplayConfig()
        self.num_devices = num_devices
        self.epochs, self.num_minibatches = 1, 1
        s, r, A = self.search_config, self.replay_config, spec.num_actions
        if s.policy == "gumbel" and s.max_num_considered_actions > A:
            raise ConfigError(
                f"search.max_num_considered_actions: {s.max_num_considered_actions} is more than the {A} actions "
                f"of this environment; use at most {A}"
            )
        for name in ("capacity", "batch_size"):
            if getattr(r, name) % num_devices:
                raise ConfigError(
                    f"replay.{name}: {getattr(r, name)} does not split over {num_devices} devices; "
                    f"use a multiple of {num_devices}"
                )
        S = config.support_size
        self.num_bins = 2 * S + 1
        self.tx = rlax.muzero_pair(-S, S, self.num_bins, rlax.SIGNED_HYPERBOLIC_PAIR)
        self.network = MuZeroNetwork(
            config=network,
            num_actions=A,
            num_bins=self.num_bins,
            obs_rank=len(spec.obs_shape),
            dynamics_blocks=config.dynamics_blocks,
            consistency=config.consistency_coef > 0,
            latent_channels=config.latent_channels,
        )
        # The unroll steps the consistency loss trains (0: none, the loss is off).
        self.consistency_steps = (config.consistency_steps or config.unroll_steps) if config.consistency_coef > 0 else 0
        self.reanalyse = config.value_bootstrap == "reanalyse"
        self.optimizer = self._make_optimizer()
        self.capacity = r.capacity // num_devices
        self.batch_size = r.batch_size // num_devices
        common = dict(
            max_length=self.capacity,
            min_length=1,
            sample_batch_size=self.batch_size,
            add_sequences=True,
            add_batches=True,
        )
        if r.sampling == "prioritized":
            self.buffer = flashbax.make_prioritised_item_buffer(
                **common,
                priority_exponent=r.priority_exponent,
                device="tpu" if jax.default_backend() == "tpu" else "cpu",
            )
        else:
            self.buffer = flashbax.make_item_buffer(**common)
        self.search = make_search(s, Model(root=self._root, recurrent=self._recurrent, discount=config.discount), A)

    # ---- the model, as the search sees it ------------------------------------------------------------

    def scalar(self, logits: chex.Array) -> chex.Array:
        """Scalars [...] from categorical logits [..., num_bins] (two-hot support, then h^-1)."""
        return self.tx.apply_inv(jax.nn.softmax(logits))

    def _root(self, network: Any, obs: chex.Array) -> ModelOutput:
        latent = self.network.apply(network, obs, method=MuZeroNetwork.represent)
        logits, value_logits = self.network.apply(network, latent, method=MuZeroNetwork.predict)
        value = self.scalar(value_logits)
        return ModelOutput(latent=latent, prior_logits=logits, value=value, reward=jnp.zeros_like(value))

    def _recurrent(self, network: Any, latent: chex.Array, action: chex.Array) -> ModelOutput:
        latent, reward_logits = self.network.apply(network, latent, action, method=MuZeroNetwork.dynamics)
        logits, value_logits = self.network.apply(network, latent, method=MuZeroNetwork.predict)
        return ModelOutput(
            latent=latent, prior_logits=logits, value=self.scalar(value_logits), reward=self.scalar(reward_logits)
        )

    # ---- Agent interface -------------------------------------------------------------------------------

    def _make_optimizer(self) -> optax.GradientTransformation:
        # The learning rate is annealed per update() in `_learn` (the number of gradient steps per update
        # is known only from the trajectory's shape), so the optimizer itself has a constant rate.
        c = self.config
        if c.optimizer == "adam":
            opt = optax.adam(c.learning_rate, eps=c.adam_eps)
        else:
            opt = optax.rmsprop(c.learning_rate, eps=c.adam_eps, decay=0.99, eps_in_sqrt=c.optimizer == "rmsprop")
        chain = [optax.clip_by_global_norm(c.max_grad_norm)] if c.max_grad_norm > 0 else []
        return optax.chain(*chain, opt)

    def _dummy_item(self) -> ReplayItem:
        K, A = self.config.unroll_steps, self.spec.num_actions
        f = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
        return ReplayItem(
            obs=jnp.zeros(self.spec.obs_shape, self.spec.obs_dtype),
            action=jnp.zeros((K,), jnp.int32),
            reward=f(K),
            value=f(K + 1),
            policy=f(K + 1, A),
            reward_mask=f(K),
            value_mask=f(K + 1),
            policy_mask=f(K + 1),
            next_obs=(
                jnp.zeros((self.consistency_steps, *self.spec.obs_shape), self.spec.obs_dtype)
                if self.consistency_steps
                else None
            ),
            bootstrap_value=f(K + 1) if self.reanalyse else None,
            bootstrap_scale=f(K + 1) if self.reanalyse else None,
            bootstrap_offset=jnp.zeros((K + 1,), jnp.int32) if self.reanalyse else None,
        )

    def init(self, key: chex.PRNGKey) -> MuZeroState:
        """Parameters, optimizer state and an empty replay shard (the key is consumed)."""
        obs = jnp.zeros((1, *self.spec.obs_shape), self.spec.obs_dtype)
        network = self.network.init(key, obs, jnp.zeros((1,), jnp.int32))
        replay = jax.tree.map(lambda x: x[None], self.buffer.init(self._dummy_item()))
        return MuZeroState(
            params=MuZeroParams(network=network, progress=jnp.zeros((), jnp.float32)),
            opt_state=self.optimizer.init(network),
            updates=jnp.zeros((), jnp.int32),
            replay=replay,
        )

    def state_partition(self, replicated: Any, sharded: Any) -> MuZeroState:
        """Everything replicated but the replay, which is one shard per device."""
        return MuZeroState(params=replicated, opt_state=replicated, updates=replicated, replay=sharded)

    def act(self, params: MuZeroParams, obs: chex.Array, key: chex.PRNGKey) -> tuple[chex.Array, ActorOut]:
        """Searches from every observation of the batch.

        Args:
          params: MuZeroParams.
          obs: [B, *obs_shape].
          key: one PRNG key, or [B] keys (the search draws its noise for the batch from the first).
        Returns:
          (action [B] int32, ActorOut with logits = log(search policy) [B, A] and value = root value [B]).
        """
        key = key if key.ndim == 1 else key[0]
        out = self.search(params.network, obs, key, temperature_at(self.search_config, params.progress))
        logits = jnp.log(jnp.maximum(out.policy, jnp.finfo(jnp.float32).tiny))
        return out.action, ActorOut(logits=logits, value=out.root_value)

    def act_greedy(self, params: MuZeroParams, obs: chex.Array, key: chex.PRNGKey) -> chex.Array:
        """The search's best action for every observation, without exploration noise (`make_search`'s
        greedy mode): what `podray eval --greedy` plays. `key` breaks ties between equal actions."""
        key = key if key.ndim == 1 else key[0]
        return self.search(params.network, obs, key, greedy=True).action

    def action_noise(self, keys: chex.Array) -> chex.Array:
        """The search draws its own noise: the 'noise' is the keys themselves ([..., 2])."""
        return keys

    def act_with_noise(self, params: MuZeroParams, obs: chex.Array, noise: chex.Array) -> tuple[chex.Array, ActorOut]:
        """`act` with keys [B, 2] from `action_noise`."""
        return self.act(params, obs, noise)

    def unroll(self, network: Any, items: ReplayItem) -> tuple[chex.Array, chex.Array, chex.Array, chex.Array]:
        """The model unrolled K steps along the items' actions.

        Args:
          network: MuZeroNetwork parameters.
          items: ReplayItem with a leading batch axis N.
        Returns:
          (policy logits [N, K+1, A], value logits [N, K+1, bins], reward logits [N, K, bins], the
          dynamics' latents [N, K, *latent_shape] at steps 1..K). The gradient into each dynamics step is
          halved (MuZero, Appendix G).
        """
        apply = self.network.apply
        latent = apply(network, items.obs, method=MuZeroNetwork.represent)
        policy, value = apply(network, latent, method=MuZeroNetwork.predict)

        def step(latent, action):
            latent, reward = apply(network, scale_gradient(latent, 0.5), action, method=MuZeroNetwork.dynamics)
            return latent, (*apply(network, latent, method=MuZeroNetwork.predict), reward, latent)

        # A scan over the K steps: the program holds one step's forward and backward pass, not K. Dense
        # dynamics scan well on any backend; convolutional ones (a spatial latent) are unrolled where
        # the agent unrolls its conv-net loops (on CPU a conv gradient inside a scan is far slower).
        loop = _unrolled_scan if self.config.latent_channels and self._unroll() else jax.lax.scan
        _, (policies, values, rewards, latents) = loop(step, latent, jnp.swapaxes(items.action, 0, 1))
        move = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731  [K, N, ...] -> [N, K, ...]
        return (
            jnp.concatenate([policy[:, None], move(policies)], 1),
            jnp.concatenate([value[:, None], move(values)], 1),
            move(rewards),
            move(latents),
        )

    def replay_loss(
        self, network: Any, items: ReplayItem, weights: chex.Array | None = None
    ) -> tuple[chex.Array, tuple[dict[str, chex.Array], chex.Array]]:
        """The K-step loss of a batch of items [N].

        Cross-entropies of the policy (against the search policy), the value (against the two-hot of
        h(n-step target)) and the reward (against the two-hot of h(reward)); the unrolled steps' terms
        are scaled by 1/K (MuZero's gradient scaling). `weights` [N] are importance weights (1 if None).
        With agent.consistency_coef > 0, the consistency loss of the first C unrolled latents is added.
        Returns (loss, (metrics, priorities [N] = |predicted value - target| at the root)).
        """
        c = self.config
        K = c.unroll_steps
        policy_logits, value_logits, reward_logits, latents = self.unroll(network, items)
        step_scale = jnp.concatenate([jnp.ones((1,)), jnp.full((K,), 1.0 / K)])
        policy_ce = _cross_entropy(items.policy, policy_logits) * items.policy_mask  # [N, K+1]
        value_ce = _cross_entropy(self.tx.apply(items.value), value_logits) * items.value_mask
        reward_ce = _cross_entropy(self.tx.apply(items.reward), reward_logits) * items.reward_mask  # [N, K]
        per_item = (
            jnp.sum((policy_ce + c.value_coef * value_ce) * step_scale, axis=-1)
            + c.reward_coef * jnp.sum(reward_ce, axis=-1) / K
        )
        consistency = None
        if self.consistency_steps:
            consistency = self.consistency_loss(network, latents, items)  # [N]
            per_item = per_item + c.consistency_coef * consistency
        weights = jnp.ones_like(per_item) if weights is None else weights
        loss = jnp.mean(weights * per_item)
        root_value = self.scalar(value_logits[:, 0])
        priorities = jnp.abs(jax.lax.stop_gradient(root_value) - items.value[:, 0])
        metrics = {
            "loss": loss,
            "policy_loss": jnp.mean(jnp.sum(policy_ce * step_scale, -1)),
            "value_loss": jnp.mean(jnp.sum(value_ce * step_scale, -1)),
            "reward_loss": jnp.mean(jnp.sum(reward_ce, -1)) / K,
            "value_prediction": jnp.mean(root_value),
            "value_target": jnp.mean(items.value[:, 0]),
        }
        if consistency is not None:
            metrics["consistency_loss"] = jnp.mean(consistency)
        return loss, (metrics, priorities)

    def consistency_loss(self, network: Any, latents: chex.Array, items: ReplayItem) -> chex.Array:
        """EfficientZero's consistency loss [N]: minus the cosine similarity of the prediction head's
        output on the dynamics' latents [N, K, *latent_shape] at steps 1..C and the gradient-stopped projection
        of the representation of the observations reached (items.next_obs [N, C, ...]), summed over
        the steps within the episode (EfficientZero sums its unrolled terms)."""
        apply, C = self.network.apply, self.consistency_steps
        predicted = apply(network, latents[:, :C], True, method=MuZeroNetwork.project)
        N = items.next_obs.shape[0]
        observed = apply(
            network, items.next_obs.reshape((N * C,) + items.next_obs.shape[2:]), method=MuZeroNetwork.represent
        )
        observed = observed.reshape((N, C) + observed.shape[1:])
        target = jax.lax.stop_gradient(apply(network, observed, False, method=MuZeroNetwork.project))
        unit = lambda x: x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-8)  # noqa: E731
        cosine = jnp.sum(unit(predicted) * unit(target), axis=-1)  # [N, C]
        return -jnp.sum(cosine * items.policy_mask[:, 1 : C + 1], axis=-1)

    def loss(self, params: MuZeroParams, trajectory: Trajectory) -> tuple[chex.Array, dict[str, chex.Array]]:
        """The loss of every item of one trajectory [T, B] (targets from its search, no replay)."""
        items = self.items(jax.lax.stop_gradient(params.network), trajectory)
        flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), items)
        loss, (metrics, _) = self.replay_loss(params.network, flat)
        return loss, metrics

    def items(self, network: Any, trajectory: Trajectory) -> ReplayItem:
        """Replay items [T, B] of a trajectory; the last observation's value comes from `network`."""
        bootstrap = self._root(network, trajectory.obs[-1]).value
        c = self.config
        return make_items(
            trajectory, bootstrap, c.unroll_steps, c.td_steps, c.discount, self.consistency_steps, self.reanalyse
        )

    def trajectory_stats(self, network: Any, trajectory: Trajectory) -> dict[str, chex.Array]:
        """What the network makes of the new trajectory [T, B], from one representation of its
        observations:

        - model_consistency: how well one dynamics step predicts the next state's representation, the
          mean cosine similarity of g(h(o_t), a_t) and h(o_{t+1}) over steps within an episode (1 is a
          perfect match). A metric of the raw latents: the consistency loss (when on) trains their
          projections, not the latents themselves, to agree.
        - search_entropy, prior_entropy: the mean entropy of the search policy, and of the network's
          own policy, at the observations acted on.
        - search_prior_kl: the mean KL(search policy || that policy), how far the search moved the
          policy; near 0 while the model's Q-values do not yet tell the actions apart.
        """
        apply, rank = self.network.apply, self.network.latent_rank
        latent = apply(network, trajectory.obs, method=MuZeroNetwork.represent)  # [T+1, B, *latent_shape]
        predicted, _ = apply(network, latent[:-1], trajectory.action, method=MuZeroNetwork.dynamics)
        predicted, target = flatten_latent(predicted, rank), flatten_latent(latent[1:], rank)
        cosine = jnp.sum(predicted * target, -1) / (
            jnp.linalg.norm(predicted, axis=-1) * jnp.linalg.norm(target, axis=-1) + 1e-8
        )
        alive = trajectory.discount > 0
        prior_logits, _ = apply(network, latent[:-1], method=MuZeroNetwork.predict)
        log_prior = jax.nn.log_softmax(prior_logits)
        log_search = jax.nn.log_softmax(trajectory.actor_out.logits)
        return {
            "model_consistency": jnp.sum(jnp.where(alive, cosine, 0.0)) / jnp.maximum(jnp.sum(alive), 1),
            "search_entropy": jnp.mean(policy_entropy(jnp.exp(log_search))),
            "prior_entropy": jnp.mean(policy_entropy(jnp.exp(log_prior))),
            "search_prior_kl": jnp.mean(jnp.sum(jnp.exp(log_search) * (log_search - log_prior), axis=-1)),
        }

    def gradient_steps(self, new_transitions: int) -> int:
        """Gradient steps of an update that brings `new_transitions` (on this device)."""
        r = self.replay_config
        return max(1, int(round(r.replay_ratio * new_transitions / self.batch_size)))

    def learn_step(
        self, network: Any, opt_state: Any, items: ReplayItem, weights: chex.Array | None, axis_name: AxisName
    ) -> tuple[Any, Any, dict[str, chex.Array], chex.Array]:
        """One gradient step on a batch of items, gradients averaged over `axis_name`.

        Returns (network, opt_state, metrics, priorities [N]); the learning rate is the optimizer's
        (the anneal is applied by `update`).
        """
        grads, (metrics, priorities) = jax.grad(self.replay_loss, has_aux=True)(network, items, weights)
        grads = mean_over(grads, axis_name)
        updates, opt_state = self.optimizer.update(grads, opt_state, network)
        return updates, opt_state, metrics, priorities

    def update(
        self, state: MuZeroState, trajectory: Trajectory, key: chex.PRNGKey, axis_name: AxisName = None
    ) -> tuple[MuZeroState, dict[str, chex.Array]]:
        """Adds the trajectory [T, B] to this device's replay, then takes replay_ratio x T x B / batch
        gradient steps on samples from it (none until the replay holds replay.min_size transitions)."""
        c, r = self.config, self.replay_config
        T, B = trajectory.action.shape
        if T * B > self.capacity:
            raise ConfigError(
                f"replay.capacity: {r.capacity} holds {self.capacity} transitions per device, fewer than the "
                f"{T * B} one update adds there; use at least {T * B * self.num_devices}"
            )
        network = state.params.network
        items = self.items(network, trajectory)
        buffer_state = jax.tree.map(lambda x: x[0], state.replay)
        buffer_state = self.buffer.add(buffer_state, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), items))
        fill = jnp.where(buffer_state.is_full, self.capacity, buffer_state.current_index)
        ready = fill * self.num_devices >= r.min_size
        lr_scale = 1.0 - state.updates.astype(jnp.float32) / self.num_updates if c.anneal_lr else 1.0
        prioritized = r.sampling == "prioritized"
        steps = self.gradient_steps(T * B)

        def step(carry, step_key):
            network, opt_state, buffer_state = carry
            items, indices, probabilities = self._sample(buffer_state, step_key, fill)
            if self.reanalyse:
                # The bootstrap values from the parameters this update started from (a target network
                # that moves once per update), on the observations stored further on in the replay.
                items = reanalyse(items, self._stored_values(state.params.network, buffer_state, indices, items))
            weights = None
            if prioritized:
                weights = (fill.astype(jnp.float32) * probabilities) ** (-r.importance_exponent)
                weights = weights / jax.lax.stop_gradient(_max_over(jnp.max(weights), axis_name))
            updates, new_opt_state, metrics, priorities = self.learn_step(network, opt_state, items, weights, axis_name)
            updates = jax.tree.map(lambda u: lr_scale * u, updates)
            new_network = optax.apply_updates(network, updates)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ready, n, o), new, old)  # noqa: E731
            network, opt_state = keep(new_network, network), keep(new_opt_state, opt_state)
            if prioritized:
                buffer_state = self.buffer.set_priorities(buffer_state, indices, priorities + 1e-6)
            return (network, opt_state, buffer_state), metrics

        loop = _unrolled_scan if self._unroll() else jax.lax.scan
        (network, opt_state, buffer_state), metrics = loop(
            step, (network, state.opt_state, buffer_state), jax.random.split(key, steps)
        )
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics.update(self.trajectory_stats(network, trajectory))
        metrics.update(
            root_value=jnp.mean(trajectory.actor_out.value),
            buffer_fill=fill.astype(jnp.float32) / self.capacity,
            replay_ratio=ready.astype(jnp.float32) * steps * self.batch_size / (T * B),
            gradient_steps=ready.astype(jnp.float32) * steps,
        )
        metrics = mean_over(metrics, axis_name)
        updates = state.updates + 1
        params = MuZeroParams(network=network, progress=updates.astype(jnp.float32) / self.num_updates)
        return (
            MuZeroState(
                params=params,
                opt_state=opt_state,
                updates=updates,
                replay=jax.tree.map(lambda x: x[None], buffer_state),
            ),
            metrics,
        )

    def _sample(self, buffer_state: Any, key: chex.PRNGKey, fill: chex.Array) -> tuple[ReplayItem, Any, Any]:
        """A batch of items from this device's replay: (items [N], their slots in the replay [N] or
        None, their sampling probabilities [N] or None). Uniform sampling draws the slots itself when
        reanalysing (flashbax's uniform item buffer does not return them)."""
        if self.replay_config.sampling == "prioritized":
            sample = self.buffer.sample(buffer_state, key)
            return sample.experience, sample.indices, sample.probabilities
        if not self.reanalyse:
            return self.buffer.sample(buffer_state, key).experience, None, None
        indices = jax.random.randint(key, (self.batch_size,), 0, fill)
        return jax.tree.map(lambda x: x[0, indices], buffer_state.experience), indices, None

    def _stored_values(self, network: Any, buffer_state: Any, indices: chex.Array, items: ReplayItem) -> chex.Array:
        """The value [N, K + 1] under `network` (gradient stopped) of the observation each target of the
        items at `indices` bootstraps from, read from the replay `bootstrap_offset` slots further on
        (the value there is unused where the offset is 0)."""
        obs = bootstrap_observations(buffer_state, indices, items.bootstrap_offset)
        value = self._root(jax.lax.stop_gradient(network), obs.reshape((-1,) + obs.shape[2:])).value
        return value.reshape(obs.shape[:2])


def _max_over(x: chex.Array, axis_name: AxisName) -> chex.Array:
    return x if axis_name is None else jax.lax.pmax(x, axis_name)
