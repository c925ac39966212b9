"""Batched search over a learned model with mctx: MuZero's PUCT search or Gumbel MuZero.

The user supplies a `Model` (two pure functions of the parameters: the root and a recurrent step in
latent space); `make_search` returns one function (params, obs, key) -> SearchOutput that searches
for every observation of a batch at once, inside jit, with no Python in the loop. The tree lives in
mctx's arrays ([B, num_simulations + 1, ...]); nothing here is C++ or host code.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import chex
import jax.numpy as jnp
import mctx

from podray.config import SearchConfig


class ModelOutput(NamedTuple):
    """What the model predicts at a latent state.

    Attributes:
      latent: [B, ...] the latent state.
      prior_logits: [B, A] policy logits.
      value: [B] scalar value estimate.
      reward: [B] scalar reward of the transition into this state (0 at the root).
    """

    latent: chex.Array
    prior_logits: chex.Array
    value: chex.Array
    reward: chex.Array


class Model(NamedTuple):
    """A learned model, as two pure functions of the parameters.

    Attributes:
      root: (params, obs [B, *obs_shape]) -> ModelOutput at the observed states.
      recurrent: (params, latent [B, ...], action [B] int32) -> ModelOutput of the next latent states.
      discount: gamma, the discount of one step inside the tree.
    """

    root: Callable[[Any, chex.Array], ModelOutput]
    recurrent: Callable[[Any, chex.Array, chex.Array], ModelOutput]
    discount: float


@chex.dataclass(frozen=True)
class SearchOutput:
    """What one search over a batch returns.

    Attributes:
      action: [B] int32, the action to take (never an invalid one).
      policy: [B, A] the search policy (sums to 1; the policy target of the loss). MuZero: the root's
        visit counts normalised; Gumbel: softmax(prior logits + completed Q-values).
      root_value: [B] the search's value of the root (mean of the backed-up values).
      prior_logits: [B, A] the network's policy logits at the root.
    """

    action: chex.Array
    policy: chex.Array
    root_value: chex.Array
    prior_logits: chex.Array


POLICIES = ("muzero", "gumbel")
VALUE_NORMALIZATIONS = ("tree", "siblings")


def qtransform_by_tree_min_max(tree: mctx.Tree, node_index: chex.Numeric, *, epsilon: float = 1e-8) -> chex.Array:
    """Q-values of a node's children normalised to [0, 1] by the minimum and maximum over the tree.

    MuZero's MinMaxStats (Schrittwieser et al., 2020, Appendix B): the bounds are those of every
    visited edge's Q-value r + gamma * V in the whole tree and of the node's own value, not only of
    the node's siblings. An unvisited child scores the node's value (as mctx's
    qtransform_by_parent_and_siblings does) rather than MuZero's 0: with 0, a child whose prior is
    low is never tried once a sibling's Q-value sets the top of the range, even when the values
    say it is better.

    Args:
      tree: an unbatched mctx tree (mctx vmaps its qtransform over the batch).
      node_index: scalar index of the parent node.
      epsilon: the smallest denominator (search.min_value_range; 1e-8 guards a tree whose Q-values
        are all equal).
    Returns:
      [num_actions] normalised Q-values in [0, 1].
    """
    visited = tree.children_visits > 0  # [N, A]
    all_q = tree.children_rewards + tree.children_discounts * tree.children_values
    node_value = tree.node_values[node_index]
    low = jnp.minimum(jnp.min(jnp.where(visited, all_q, jnp.inf)), node_value)
    high = jnp.maximum(jnp.max(jnp.where(visited, all_q, -jnp.inf)), node_value)
    q = jnp.where(tree.children_visits[node_index] > 0, tree.qvalues(node_index), node_value)
    return jnp.clip((q - low) / jnp.maximum(high - low, epsilon), 0.0, 1.0)


def temperature_at(config: SearchConfig, progress: chex.Array) -> chex.Array:
    """The acting temperature at `progress` (the fraction of the run's updates done, in [0, 1]): it
    halves at each fraction listed in `config.temperature_decay` (MuZero's Atari schedule: [0.5, 0.75]
    gives 1, 0.5, 0.25)."""
    temperature = jnp.float32(config.temperature)
    for boundary in config.temperature_decay:
        temperature = jnp.where(progress >= boundary, 0.5 * temperature, temperature)
    return temperature


def make_search(config: SearchConfig, model: Model, num_actions: int):
    """Builds the batched search of `config` over `model`.

    Args:
      config: the `search:` section (already validated).
      model: the learned model to search over.
      num_actions: A, the size of the discrete action space.
    Returns:
      search(params, obs [B, *obs_shape], key, temperature=config.temperature, invalid_actions=None,
      greedy=False) -> SearchOutput. The key is consumed; `temperature` (a scalar, may be traced) only
      affects the MuZero policy's action sampling; `invalid_actions` is [B, A] bool, True where not
      allowed. `greedy` (static) searches without exploration and picks the search's best action: for
      `muzero`, no Dirichlet noise at the root and the most visited action (temperature 0); for
      `gumbel`, no Gumbel noise, so the action is the top of sequential halving (what evaluation plays).
    """
    max_depth = config.max_depth or None

    def recurrent_fn(params, rng_key, action, latent):
        del rng_key  # the model is deterministic
        out = model.recurrent(params, latent, action)
        step = mctx.RecurrentFnOutput(
            reward=out.reward,
            discount=jnp.full_like(out.reward, model.discount),
            prior_logits=out.prior_logits,
            value=out.value,
        )
        return step, out.latent

    epsilon = max(config.min_value_range, 1e-8)  # the smallest denominator of every min-max normalisation
    if config.value_normalization == "tree":
        qtransform = functools.partial(qtransform_by_tree_min_max, epsilon=epsilon)
    else:
        qtransform = functools.partial(mctx.qtransform_by_parent_and_siblings, epsilon=epsilon)

    def search(
        params: Any,
        obs: chex.Array,
        key: chex.PRNGKey,
        temperature: chex.Numeric | None = None,
        invalid_actions: chex.Array | None = None,
        greedy: bool = False,
    ) -> SearchOutput:
        root_out = model.root(params, obs)
        root = mctx.RootFnOutput(prior_logits=root_out.prior_logits, value=root_out.value, embedding=root_out.latent)
        common = dict(num_simulations=config.num_simulations, invalid_actions=invalid_actions, max_depth=max_depth)
        if config.policy == "gumbel":
            out = mctx.gumbel_muzero_policy(
                params,
                key,
                root,
                recurrent_fn,
                **common,
                qtransform=functools.partial(
                    mctx.qtransform_completed_by_mix_value, rescale_values=True, epsilon=epsilon
                ),
                max_num_considered_actions=min(config.max_num_considered_actions, num_actions),
                gumbel_scale=0.0 if greedy else config.gumbel_scale,
            )
        else:
            out = mctx.muzero_policy(
                params,
                key,
                root,
                recurrent_fn,
                **common,
                qtransform=qtransform,
                dirichlet_fraction=0.0 if greedy else config.dirichlet_fraction,
                dirichlet_alpha=config.dirichlet_alpha,
                pb_c_init=config.pb_c_init,
                pb_c_base=config.pb_c_base,
                temperature=0.0 if greedy else (config.temperature if temperature is None else temperature),
            )
        policy = out.action_weights
        if invalid_actions is not None:
            # mctx already gives invalid actions no visits (MuZero) or zero weight (Gumbel); this keeps
            # the policy exactly 0 there and renormalises away the float dust.
            policy = jnp.where(invalid_actions, 0.0, policy)
            policy = policy / jnp.sum(policy, axis=-1, keepdims=True)
        return SearchOutput(
            action=out.action.astype(jnp.int32),
            policy=policy,
            root_value=out.search_tree.summary().value,
            prior_logits=root_out.prior_logits,
        )

    return search


def policy_entropy(policy: chex.Array) -> chex.Array:
    """Entropy [...] of probability vectors [..., A] (0 * log 0 taken as 0)."""
    return -jnp.sum(jnp.where(policy > 0, policy * jnp.log(jnp.where(policy > 0, policy, 1.0)), 0.0), axis=-1)
