"""podray.search: mctx's MuZero and Gumbel MuZero policies over a user model, under jit."""

import dataclasses

import jax
import jax.numpy as jnp
import mctx
import numpy as np
import pytest

from podray.config import SearchConfig
from podray.search import Model, ModelOutput, make_search, qtransform_by_tree_min_max, temperature_at

A = 3
GAMMA = 0.99


def _random_model(seed: int = 0) -> Model:
    """A fixed random model: latents of 8 features, linear maps to logits, values and rewards."""
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    w_obs = jax.random.normal(k[0], (4, 8))
    w_act = jax.random.normal(k[1], (A, 8))
    w_logits = jax.random.normal(k[2], (8, A))
    w_value = jax.random.normal(k[3], (8,))
    w_reward = jax.random.normal(k[4], (8,))

    def out(latent, reward):
        return ModelOutput(
            latent=latent, prior_logits=latent @ w_logits, value=jnp.tanh(latent @ w_value), reward=reward
        )

    def root(params, obs):
        latent = jnp.tanh(obs @ w_obs)
        return out(latent, jnp.zeros(obs.shape[0]))

    def recurrent(params, latent, action):
        latent = jnp.tanh(latent + w_act[action])
        return out(latent, jnp.tanh(latent @ w_reward))

    return Model(root=root, recurrent=recurrent, discount=GAMMA)


def _trap_model() -> Model:
    """A perfect model (rewards and values) of a two-step problem whose prior prefers the wrong action.

    Latent [depth, first action]. From the root, action 0 pays 0.5 at once and nothing after; action
    2 pays 0 at once and 1 on the next step (whatever the second action); action 1 pays nothing. The
    prior prefers action 0; only looking ahead shows action 2's return (0.99 against 0.5).
    """

    def root(params, obs):
        B = obs.shape[0]
        return ModelOutput(
            latent=jnp.zeros((B, 2)),
            prior_logits=jnp.tile(jnp.array([1.5, 0.0, 0.0]), (B, 1)),
            value=jnp.full(B, GAMMA),
            reward=jnp.zeros(B),
        )

    def recurrent(params, latent, action):
        depth, first = latent[:, 0], latent[:, 1]
        reward = jnp.where(
            depth == 0, jnp.where(action == 0, 0.5, 0.0), jnp.where((depth == 1) & (first == 2), 1.0, 0.0)
        )
        first = jnp.where(depth == 0, action.astype(jnp.float32), first)
        B = latent.shape[0]
        return ModelOutput(
            latent=jnp.stack([depth + 1, first], axis=1),
            prior_logits=jnp.zeros((B, A)),
            value=jnp.where((depth == 0) & (first == 2), 1.0, 0.0),  # the value of the state reached
            reward=reward,
        )

    return Model(root=root, recurrent=recurrent, discount=GAMMA)


POLICIES = [
    SearchConfig(policy="muzero", num_simulations=16),
    SearchConfig(policy="muzero", num_simulations=16, value_normalization="siblings", temperature=0.0),
    SearchConfig(policy="gumbel", num_simulations=8, max_num_considered_actions=A),
]


@pytest.mark.parametrize("config", POLICIES, ids=["muzero", "muzero-siblings-greedy", "gumbel"])
def test_actions_are_valid_and_the_policy_sums_to_one(config):
    B = 16
    search = jax.jit(make_search(config, _random_model(), A))
    obs = jax.random.normal(jax.random.PRNGKey(1), (B, 4))
    invalid = jnp.zeros((B, A), bool).at[:, 1].set(True).at[: B // 2, 0].set(True)  # half the rows: only 2
    for seed in range(4):
        out = search(None, obs, jax.random.PRNGKey(seed), invalid_actions=invalid)
        action, policy = np.asarray(out.action), np.asarray(out.policy)
        assert action.shape == (B,) and policy.shape == (B, A) and out.root_value.shape == (B,)
        assert not np.asarray(invalid)[np.arange(B), action].any()
        assert np.all(action[: B // 2] == 2)
        np.testing.assert_allclose(policy.sum(-1), 1.0, atol=1e-5)
        assert np.all(policy[:, 1] == 0.0) and np.all(policy[: B // 2, 0] == 0.0)
        assert np.all(np.isfinite(np.asarray(out.root_value)))


@pytest.mark.parametrize("config", POLICIES, ids=["muzero", "muzero-siblings-greedy", "gumbel"])
def test_search_finds_the_better_action_the_prior_misses(config):
    B = 256
    config = dataclasses.replace(config, num_simulations=24)
    out = jax.jit(make_search(config, _trap_model(), A))(None, jnp.zeros((B, 1)), jax.random.PRNGKey(0))
    prior = jax.nn.softmax(jnp.array([1.5, 0.0, 0.0]))
    chosen = float(np.mean(np.asarray(out.action) == 2))
    # more than twice as often as the prior (0.155); PUCT with siblings' min-max scores the unvisited
    # action at the bottom of the range, so it finds action 2 in fewer rows than the other variants
    assert chosen > 2 * float(prior[2]), chosen
    assert float(np.mean(np.asarray(out.policy)[:, 2])) > float(prior[2])


@pytest.mark.parametrize("config", [POLICIES[0], POLICIES[2]], ids=["muzero", "gumbel"])
def test_greedy_search_plays_the_best_action_whatever_the_key(config):
    """Greedy (evaluation): no exploration noise and no sampling, so the action does not depend on the
    key (for PUCT, but for rows whose visit counts tie: mctx breaks ties with the key) and for PUCT it
    is the most visited action; on the trap problem it is the better action, 2."""
    B = 64
    search = jax.jit(make_search(config, _random_model(), A), static_argnames="greedy")
    obs = jax.random.normal(jax.random.PRNGKey(1), (B, 4))
    greedy = [search(None, obs, jax.random.PRNGKey(seed), greedy=True) for seed in range(3)]
    rows = np.ones(B, bool)
    if config.policy == "muzero":
        policy = np.asarray(greedy[0].policy)
        top = np.sort(policy, axis=-1)
        rows = top[:, -1] > top[:, -2]  # a single most visited action
        assert rows.mean() > 0.5
        np.testing.assert_array_equal(np.asarray(greedy[0].action)[rows], policy.argmax(-1)[rows])
    for out in greedy[1:]:
        np.testing.assert_array_equal(np.asarray(out.action)[rows], np.asarray(greedy[0].action)[rows])
    sampled = [np.asarray(search(None, obs, jax.random.PRNGKey(seed)).action) for seed in range(3)]
    assert any((a != sampled[0]).any() for a in sampled[1:])  # the acting search does sample
    trap = jax.jit(
        make_search(dataclasses.replace(config, num_simulations=24), _trap_model(), A), static_argnames="greedy"
    )
    out = trap(None, jnp.zeros((8, 1)), jax.random.PRNGKey(0), greedy=True)
    np.testing.assert_array_equal(np.asarray(out.action), 2)


def test_gumbel_with_one_simulation_returns_a_valid_policy():
    config = SearchConfig(policy="gumbel", num_simulations=1, max_num_considered_actions=2)
    out = jax.jit(make_search(config, _random_model(), A))(None, jnp.ones((5, 4)), jax.random.PRNGKey(0))
    policy = np.asarray(out.policy)
    np.testing.assert_allclose(policy.sum(-1), 1.0, atol=1e-5)
    assert np.all(policy >= 0) and np.all((0 <= np.asarray(out.action)) & (np.asarray(out.action) < A))


def _noisy_model(spread: float) -> Model:
    """Every action leads to the same state but for a value that differs by action by at most
    `spread` (the model's noise while it cannot yet tell actions apart); the prior is uniform."""
    offsets = spread * jnp.array([0.0, 0.3, 1.0])

    def root(params, obs):
        B = obs.shape[0]
        return ModelOutput(
            latent=jnp.zeros((B, 1)), prior_logits=jnp.zeros((B, A)), value=jnp.zeros(B), reward=jnp.zeros(B)
        )

    def recurrent(params, latent, action):
        B = latent.shape[0]
        return ModelOutput(
            latent=latent + 1.0, prior_logits=jnp.zeros((B, A)), value=offsets[action], reward=jnp.zeros(B)
        )

    return Model(root=root, recurrent=recurrent, discount=GAMMA)


@pytest.mark.parametrize("policy", ["gumbel", "muzero"])
def test_min_value_range_keeps_noise_sized_q_differences_from_peaking_the_policy(policy):
    """Q-values 0.01 apart: min-max normalisation stretches them to [0, 1] and the search policy
    peaks on the top one; with min_value_range 1 they stay 0.01 apart and the policy stays near the
    uniform prior. Differences as large as the floor still move the policy."""
    B = 64
    obs = jnp.zeros((B, 1))

    def policy_of(spread, floor):
        config = SearchConfig(policy=policy, num_simulations=16, max_num_considered_actions=A, min_value_range=floor)
        return np.asarray(
            jax.jit(make_search(config, _noisy_model(spread), A))(None, obs, jax.random.PRNGKey(0)).policy
        )

    stretched, floored = policy_of(0.01, 0.0).mean(0), policy_of(0.01, 1.0).mean(0)
    assert stretched[2] > 0.5, stretched  # gumbel: about 0.94; PUCT's visit counts: about 0.55
    np.testing.assert_allclose(floored, 1.0 / A, atol=0.05)
    assert policy_of(1.0, 1.0).mean(0)[2] > floored[2] + 0.1


def test_tree_min_max_normalises_over_the_whole_tree():
    """Q-values of the root's children (the root's value for unvisited ones) scaled by the min and max
    over every visited edge and the root's value."""
    config = SearchConfig(policy="muzero", num_simulations=12, dirichlet_fraction=0.0)
    model = _random_model(3)
    root_out = model.root(None, jnp.ones((1, 4)))
    root = mctx.RootFnOutput(prior_logits=root_out.prior_logits, value=root_out.value, embedding=root_out.latent)

    def recurrent_fn(params, key, action, latent):
        out = model.recurrent(params, latent, action)
        return mctx.RecurrentFnOutput(
            reward=out.reward, discount=jnp.full_like(out.reward, GAMMA), prior_logits=out.prior_logits, value=out.value
        ), out.latent

    tree = mctx.muzero_policy(
        None, jax.random.PRNGKey(0), root, recurrent_fn, num_simulations=config.num_simulations
    ).search_tree
    single = jax.tree.map(lambda x: x[0], tree)
    q = np.asarray(qtransform_by_tree_min_max(single, 0))
    visits = np.asarray(single.children_visits)
    edge_q = np.asarray(single.children_rewards + single.children_discounts * single.children_values)[visits > 0]
    root_value = float(single.node_values[0])
    low, high = min(edge_q.min(), root_value), max(edge_q.max(), root_value)
    raw = np.where(visits[0] > 0, np.asarray(single.qvalues(0)), root_value)
    expected = (raw - low) / (high - low)
    np.testing.assert_allclose(q, expected, atol=1e-5)
    assert np.all((0 <= q) & (q <= 1))


def test_temperature_halves_at_each_fraction_of_the_run():
    config = SearchConfig(temperature=1.0, temperature_decay=[0.5, 0.75])
    got = [float(temperature_at(config, jnp.float32(p))) for p in (0.0, 0.49, 0.5, 0.8, 1.0)]
    assert got == [1.0, 1.0, 0.5, 0.25, 0.25]
    assert float(temperature_at(SearchConfig(temperature=0.3), jnp.float32(0.9))) == pytest.approx(0.3)
