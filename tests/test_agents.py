"""Agents and networks as pure functions, under jit and vmap."""

import dataclasses

import flax.linen as nn
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from podray.agents import ActorOut, Trajectory, make_agent
from podray.agents.networks import ActorCritic, make_torso
from podray.config import AgentConfig, NetworkConfig
from podray.envs.spec import EnvSpec

SPEC = EnvSpec("test", (4,), "float32", 3)


def _trajectory(key, T=8, B=5, spec=SPEC):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return Trajectory(
        obs=jax.random.normal(k1, (T + 1, B, *spec.obs_shape)).astype(spec.obs_dtype),
        action=jax.random.randint(k2, (T, B), 0, spec.num_actions),
        reward=jax.random.normal(k3, (T, B)),
        discount=(jax.random.uniform(k4, (T, B)) > 0.2).astype(jnp.float32),
        actor_out=ActorOut(logits=jnp.zeros((T, B, spec.num_actions)), value=jnp.zeros((T, B))),
    )


def _gae_reference(r, d, v, gamma, lam):
    T = r.shape[0]
    adv = np.zeros_like(r)
    last = np.zeros(r.shape[1:])
    for t in reversed(range(T)):
        delta = r[t] + gamma * d[t] * v[t + 1] - v[t]
        last = delta + gamma * lam * d[t] * last
        adv[t] = last
    return adv


def test_ppo_advantages_match_reference():
    agent = make_agent(AgentConfig(name="ppo"), NetworkConfig(), SPEC, num_updates=10)
    state = agent.init(jax.random.PRNGKey(0))
    traj = _trajectory(jax.random.PRNGKey(1))
    values = np.random.RandomState(0).randn(8, 5).astype(np.float32)
    traj = traj.replace(actor_out=traj.actor_out.replace(value=jnp.asarray(values)))
    adv, target = jax.jit(agent.advantages)(state.params, traj)
    bootstrap = np.asarray(agent.apply(state.params, traj.obs[-1]).value)
    v = np.concatenate([values, bootstrap[None]])
    expected = _gae_reference(np.asarray(traj.reward), np.asarray(traj.discount), v, 0.99, 0.95)
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target, expected + values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["ppo", "impala"])
def test_update_is_finite_and_lowers_the_loss_under_jit(name):
    config = AgentConfig(name=name, learning_rate=1e-2, anneal_lr=False, epochs=1, num_minibatches=1)
    agent = make_agent(config, NetworkConfig(), SPEC, num_updates=10)
    state = agent.init(jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(2)
    traj = _trajectory(key)
    # behaviour = current policy, so the loss is the on-policy one
    out = agent.apply(state.params, traj.obs[:-1])
    traj = traj.replace(actor_out=ActorOut(logits=out.logits, value=out.value))
    loss_before, metrics = jax.jit(agent.loss)(state.params, traj)
    assert all(np.isfinite(v) for v in jax.tree.leaves(metrics))
    update = jax.jit(agent.update)
    for _ in range(20):
        state, _ = update(state, traj, key)
    loss_after, _ = agent.loss(state.params, traj)
    assert int(state.updates) == 20
    assert float(loss_after) < float(loss_before)


def test_impala_on_policy_ratios_are_one():
    agent = make_agent(AgentConfig(name="impala"), NetworkConfig(), SPEC, num_updates=1)
    state = agent.init(jax.random.PRNGKey(0))
    traj = _trajectory(jax.random.PRNGKey(3))
    out = agent.apply(state.params, traj.obs[:-1])
    traj = traj.replace(actor_out=ActorOut(logits=out.logits, value=out.value))
    _, metrics = agent.loss(state.params, traj)
    np.testing.assert_allclose(metrics["mean_rho"], 1.0, rtol=1e-5)


def test_act_with_one_key_or_per_env_keys_under_vmap():
    agent = make_agent(AgentConfig(), NetworkConfig(), SPEC, num_updates=1)
    state = agent.init(jax.random.PRNGKey(0))
    obs = jnp.ones((6, 4))
    action, out = jax.jit(agent.act)(state.params, obs, jax.random.PRNGKey(1))
    assert action.shape == (6,) and action.dtype == jnp.int32 and out.logits.shape == (6, 3)
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    action2, _ = jax.jit(agent.act)(state.params, obs, keys)
    assert action2.shape == (6,)
    # vmapped over replicas of parameters
    params = jax.tree.map(lambda x: jnp.stack([x, x]), state.params)
    actions, _ = jax.vmap(agent.act, in_axes=(0, None, None))(params, obs, jax.random.PRNGKey(1))
    assert actions.shape == (2, 6)


@pytest.mark.parametrize(
    "torso, shape, dtype",
    [("mlp", (10, 5), "float32"), ("nature_cnn", (84, 84, 4), "uint8"), ("impala_resnet", (84, 84, 4), "uint8")],
)
def test_networks_output_shapes_and_depth(torso, shape, dtype):
    counts = []
    for depth in (1, 2):
        config = NetworkConfig(torso=torso, depth=depth, width=32, shared_torso=torso != "mlp")
        net = ActorCritic(config=config, num_actions=6, obs_rank=len(shape))
        obs = jnp.zeros((3, *shape), dtype)
        params = net.init(jax.random.PRNGKey(0), obs)
        out = jax.jit(net.apply)(params, obs)
        assert out.logits.shape == (3, 6) and out.value.shape == (3,)
        counts.append(sum(x.size for x in jax.tree.leaves(params)))
    assert counts[1] > counts[0]  # depth is a real knob


@pytest.mark.parametrize("torso", ["nature_cnn", "impala_resnet"])
def test_pixel_torso_in_chunks_matches_the_whole_batch(torso):
    """network.chunk_rows changes how many rows a conv takes at a time, not the parameters, outputs or
    gradients (float sums in another order)."""
    obs = jax.random.randint(jax.random.PRNGKey(1), (3, 5, 84, 84, 4), 0, 255).astype(jnp.uint8)

    def run(rows):
        config = NetworkConfig(torso=torso, depth=1, width=32, chunk_rows=rows)
        net = ActorCritic(config=config, num_actions=6, obs_rank=3)
        params = net.init(jax.random.PRNGKey(0), obs[0])
        loss = lambda p: jnp.sum(net.apply(p, obs).logits ** 2) + jnp.sum(net.apply(p, obs).value)  # noqa: E731
        return params, jax.jit(net.apply)(params, obs), jax.jit(jax.grad(loss))(params)

    whole, chunked = run(0), run(4)  # 15 rows in pieces of 4, 4, 4, 3
    assert jax.tree.structure(whole[0]) == jax.tree.structure(chunked[0])
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 84, 84, 3), (3, 21, 21, 4), (2, 11, 11, 2), (1, 6, 7, 1), (2, 3, 9, 9, 2)])
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool_matches_flax_in_value_and_gradient(shape, ties):
    """The IMPALA-ResNet's pool (on CPU its own forward pass, which records each window's first
    maximum, and a gradient routed by it) gives nn.max_pool's output and gradient, ties included: the
    first maximum of a window gets its gradient, odd and even sizes, overlapping windows."""
    from podray.agents.networks import max_pool

    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    if ties:
        x = jnp.round(x)  # many equal maxima per window
    flax_pool = lambda v: nn.max_pool(v, (3, 3), strides=(2, 2), padding="SAME")  # noqa: E731
    np.testing.assert_array_equal(jax.jit(max_pool)(x), flax_pool(x))
    w = jax.random.normal(jax.random.PRNGKey(1), flax_pool(x).shape)
    ours = jax.jit(jax.grad(lambda v: jnp.sum(max_pool(v) * w)))(x)
    theirs = jax.grad(lambda v: jnp.sum(flax_pool(v) * w))(x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert int(jnp.sum(ours != 0)) > 0


@pytest.mark.parametrize("shape", [(3, 84, 84, 4), (2, 10, 6, 1), (2, 8, 7, 3)])
def test_paired_column_convolution_matches_the_plain_one(shape):
    """The IMPALA-ResNet's first convolution (on CPU computed on column pairs, with a kernel that
    spans them) gives the plain 3x3 SAME convolution's output and gradients, for images with at most
    4 channels and an even width (an odd width, or more channels, stays with lax)."""
    from podray.agents import networks

    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    kernel = jax.random.normal(jax.random.PRNGKey(1), (3, 3, shape[-1], 16))
    dn = jax.lax.conv_dimension_numbers(x.shape, kernel.shape, ("NHWC", "HWIO", "NHWC"))
    ours = lambda x, k: networks._conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn)  # noqa: E731
    plain = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn)  # noqa: E731
    np.testing.assert_allclose(jax.jit(ours)(x, kernel), plain(x, kernel), rtol=1e-5, atol=1e-4)
    w = jax.random.normal(jax.random.PRNGKey(2), plain(x, kernel).shape)
    grads = jax.jit(jax.grad(lambda x, k: jnp.sum(ours(x, k) * w), argnums=(0, 1)))(x, kernel)
    expected = jax.grad(lambda x, k: jnp.sum(plain(x, k) * w), argnums=(0, 1))(x, kernel)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-3)
    paired = shape[-1] <= 4 and shape[2] % 2 == 0
    jaxpr = str(jax.make_jaxpr(ours)(x, kernel))
    assert ("custom_vjp_call" in jaxpr) == paired
    wide = jax.random.normal(jax.random.PRNGKey(3), (2, 8, 8, 16))  # 16 channels: lax's convolution
    k16 = jax.random.normal(jax.random.PRNGKey(4), (3, 3, 16, 16))
    assert "custom_vjp_call" not in str(jax.make_jaxpr(ours)(wide, k16))


def test_separate_torsos_have_separate_parameters():
    shared = ActorCritic(config=NetworkConfig(shared_torso=True), num_actions=2)
    split = ActorCritic(config=dataclasses.replace(NetworkConfig(), shared_torso=False), num_actions=2)
    obs = jnp.zeros((1, 4))
    n = lambda net: sum(x.size for x in jax.tree.leaves(net.init(jax.random.PRNGKey(0), obs)))
    assert n(split) > n(shared)


def test_act_with_noise_is_categorical_sampling():
    """act(key) is jax.random.categorical; Anakin's pre-drawn noise gives the same actions."""
    agent = make_agent(AgentConfig(), NetworkConfig(), SPEC, num_updates=1)
    params = agent.init(jax.random.PRNGKey(0)).params
    obs = jax.random.normal(jax.random.PRNGKey(1), (64, 4))
    keys = jax.random.split(jax.random.PRNGKey(2), 64)
    action, out = agent.act(params, obs, keys)
    expected = jax.vmap(jax.random.categorical)(keys, out.logits)
    np.testing.assert_array_equal(np.asarray(action), np.asarray(expected))
    again, _ = agent.act_with_noise(params, obs, agent.action_noise(keys))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(action))
    one, out1 = agent.act(params, obs, keys[0])
    np.testing.assert_array_equal(np.asarray(one), np.asarray(jax.random.categorical(keys[0], out1.logits)))


@pytest.mark.parametrize("n", [1, 2, 7, 128, 8192, 100_000])
def test_shuffle_is_a_permutation_that_depends_on_the_key(n):
    from podray.agents.base import shuffle

    perms = [np.asarray(jax.jit(shuffle, static_argnums=1)(jax.random.PRNGKey(k), n)) for k in range(3)]
    for p in perms:
        np.testing.assert_array_equal(np.sort(p), np.arange(n))
    if n > 2:
        assert not np.array_equal(perms[0], perms[1])


def test_shuffle_positions_are_uniform():
    """Where index i lands is uniform over positions: a chi-square check over many keys."""
    from podray.agents.base import shuffle

    n, draws = 16, 4000
    perms = np.asarray(jax.jit(jax.vmap(lambda k: shuffle(k, n)))(jax.random.split(jax.random.PRNGKey(0), draws)))
    counts = np.stack([(perms == i).sum(0) for i in range(n)])  # [index, position]
    expected = draws / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    dof = (n - 1) ** 2
    assert chi2 < dof + 5 * np.sqrt(2 * dof), chi2


@pytest.mark.parametrize("shape", [(32, 4), (5, 7, 4)])
def test_dense_gradient_matches_plain_dot(shape):
    """networks._matmul's hand-written gradient (the CPU weight-gradient layout) is the exact gradient."""
    from podray.agents.networks import _matmul

    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    f = lambda m: lambda x, w: jnp.sum(jnp.sin(m(x, w)))  # noqa: E731
    got = jax.grad(f(_matmul), argnums=(0, 1))(x, w)
    want = jax.grad(f(jnp.matmul), argnums=(0, 1))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)


def test_normalize_uses_the_whole_batch_across_devices():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from podray.agents.base import normalize

    x = jax.random.normal(jax.random.PRNGKey(0), (6, 8)) * 3.0 + 1.0
    x = x.at[:, 4:].add(5.0)  # the two halves have different statistics
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("d",))
    sharded = jax.shard_map(lambda y: normalize(y, "d"), mesh=mesh, in_specs=P(None, "d"), out_specs=P(None, "d"))(x)
    expected = (x - x.mean()) / x.std()
    np.testing.assert_allclose(sharded, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(normalize(x), expected, rtol=1e-4, atol=1e-4)


def _zero_value_head(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "Dense_1" in jax.tree_util.keystr(path) else x, params
    )


def test_impala_normalized_advantages_ignore_the_reward_scale():
    config = AgentConfig(name="impala", normalize_advantages=True, value_coef=0.0, entropy_coef=0.0)
    agent = make_agent(config, NetworkConfig(), SPEC, num_updates=1)
    params = agent.init(jax.random.PRNGKey(0)).params
    params = _zero_value_head(params)  # the V-trace advantages are then linear in the rewards
    traj = _trajectory(jax.random.PRNGKey(4))
    out = agent.apply(params, traj.obs[:-1])
    traj = traj.replace(actor_out=ActorOut(logits=out.logits, value=out.value))
    scaled = traj.replace(reward=traj.reward * 100.0)

    def flat_grad(a, t):
        return jax.flatten_util.ravel_pytree(jax.grad(lambda p: a.loss(p, t)[0])(params))[0]

    np.testing.assert_allclose(flat_grad(agent, scaled), flat_grad(agent, traj), rtol=1e-3, atol=1e-6)
    raw = make_agent(dataclasses.replace(config, normalize_advantages=False), NetworkConfig(), SPEC, num_updates=1)
    np.testing.assert_allclose(flat_grad(raw, scaled), 100.0 * flat_grad(raw, traj), rtol=1e-3, atol=1e-5)


def test_impala_surrogate_clip_is_a_trust_region_on_the_vtrace_policy_gradient():
    """With `surrogate_clip` (APPO) the policy loss is PPO's clipped surrogate on V-trace advantages:
    on-policy it has IMPALA's gradient; where every ratio is past 1 + eps on an advantage's side it
    gives none, and past 1 - eps it keeps the full one."""
    base = AgentConfig(name="impala", normalize_advantages=True, value_coef=0.0, entropy_coef=0.0)
    clipped = dataclasses.replace(base, surrogate_clip=0.1)
    plain_agent = make_agent(base, NetworkConfig(), SPEC, num_updates=1)
    agent = make_agent(clipped, NetworkConfig(), SPEC, num_updates=1)
    params = plain_agent.init(jax.random.PRNGKey(0)).params
    traj = _trajectory(jax.random.PRNGKey(5))
    out = agent.apply(params, traj.obs[:-1])

    def flat_grad(a, t, p=params):
        return jax.flatten_util.ravel_pytree(jax.grad(lambda q: a.loss(q, t)[0])(p))[0]

    on_policy = traj.replace(actor_out=ActorOut(logits=out.logits, value=out.value))
    g = flat_grad(agent, on_policy)
    assert float(jnp.abs(g).max()) > 0
    np.testing.assert_allclose(g, flat_grad(plain_agent, on_policy), rtol=1e-4, atol=1e-7)
    _, metrics = agent.loss(params, on_policy)
    assert float(metrics["clip_fraction"]) == 0.0 and abs(float(metrics["approx_kl"])) < 1e-6

    # A zero value head and positive rewards: every raw advantage is positive.
    raw = make_agent(dataclasses.replace(clipped, normalize_advantages=False), NetworkConfig(), SPEC, num_updates=1)
    params0 = _zero_value_head(params)
    out0 = agent.apply(params0, traj.obs[:-1])
    onehot = jax.nn.one_hot(traj.action, SPEC.num_actions)
    positive = on_policy.replace(reward=jnp.abs(traj.reward) + 0.1)
    # The behaviour policy took each action far less often than the current one: rho > 1 + eps.
    rare = positive.replace(actor_out=ActorOut(logits=out0.logits - 3.0 * onehot, value=out0.value))
    _, metrics = raw.loss(params0, rare)
    assert float(metrics["clip_fraction"]) == 1.0 and float(metrics["mean_rho"]) > 1.1
    np.testing.assert_allclose(flat_grad(raw, rare, params0), 0.0, atol=1e-7)
    # Far more often: rho < 1 - eps, where a positive advantage is not clipped.
    common = positive.replace(actor_out=ActorOut(logits=out0.logits + 3.0 * onehot, value=out0.value))
    assert float(jnp.abs(flat_grad(raw, common, params0)).max()) > 1e-4


def test_impala_minibatches_are_sequential_steps_on_shuffled_environments():
    """IMPALA with epochs x num_minibatches: each step is the one-step update on a minibatch of whole
    sequences (environments of the batch, in the order the epoch's key shuffles them)."""
    from podray.agents.base import shuffle

    def agent_with(epochs, minibatches):
        config = AgentConfig(
            name="impala", learning_rate=1e-2, anneal_lr=False, epochs=epochs, num_minibatches=minibatches
        )
        return make_agent(config, NetworkConfig(), SPEC, num_updates=10)

    B, key = 6, jax.random.PRNGKey(4)
    traj = _trajectory(jax.random.PRNGKey(5), B=B)
    many, one = agent_with(2, 3), agent_with(1, 1)
    assert many.optimizer_steps_per_update() == 6 and one.optimizer_steps_per_update() == 1
    state = many.init(jax.random.PRNGKey(0))
    got, metrics = jax.jit(many.update)(state, traj, key)
    assert int(got.updates) == 1 and all(np.isfinite(v) for v in jax.tree.leaves(metrics))

    want = state
    for epoch_key in jax.random.split(key, 2):
        perm = np.asarray(shuffle(epoch_key, B))
        for rows in perm.reshape(3, B // 3):
            minibatch = jax.tree.map(lambda x, r=rows: x[:, r], traj)
            want, _ = jax.jit(one.update)(want, minibatch, key)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # and the minibatches really moved the parameters apart from a single whole-batch step
    single, _ = jax.jit(one.update)(state, traj, key)
    assert not np.allclose(jax.tree.leaves(single.params)[0], jax.tree.leaves(got.params)[0])


def test_rmsprop_torch_puts_eps_after_the_square_root():
    """'rmsprop_torch' (torchbeast's and Cleanba's optimizer) is invariant to the loss scale when eps is
    small beside the gradients; optax's 'rmsprop' adds eps inside the square root, where it dominates
    small gradients."""

    def first_update(optimizer, scale):
        config = AgentConfig(optimizer=optimizer, adam_eps=1e-8, max_grad_norm=0.0, anneal_lr=False)
        agent = make_agent(config, NetworkConfig(), SPEC, num_updates=1)
        params = {"w": jnp.ones(3)}
        grads = {"w": scale * jnp.array([1e-3, -2e-3, 4e-3])}
        updates, _ = agent.optimizer.update(grads, agent.optimizer.init(params), params)
        return np.asarray(updates["w"])

    np.testing.assert_allclose(first_update("rmsprop_torch", 1.0), first_update("rmsprop_torch", 100.0), rtol=1e-2)
    assert not np.allclose(first_update("rmsprop", 1.0), first_update("rmsprop", 100.0), rtol=1e-1)


def test_value_head_scale_zero_starts_the_value_at_zero():
    config = NetworkConfig(torso="nature_cnn", depth=1, width=32, shared_torso=True, value_head_scale=0.0)
    net = ActorCritic(config=config, num_actions=6, obs_rank=3)
    obs = jax.random.randint(jax.random.PRNGKey(1), (5, 84, 84, 4), 0, 255).astype(jnp.uint8)
    params = net.init(jax.random.PRNGKey(0), obs)
    out = jax.jit(net.apply)(params, obs)
    np.testing.assert_array_equal(np.asarray(out.value), 0.0)
    assert np.std(np.asarray(out.logits)) > 0  # the policy head keeps its own init


@pytest.mark.parametrize("torso, shape", [("mlp", (5,)), ("nature_cnn", (84, 84, 4))])
def test_layer_norm_keeps_dense_features_alive(torso, shape):
    """Dense features whose biases drifted far below their pre-activations are zero in every state (dead);
    with network.layer_norm the pre-activations are normalised per state, and about half stay active."""
    obs = jax.random.uniform(jax.random.PRNGKey(1), (16, *shape))
    for layer_norm in (False, True):
        config = NetworkConfig(torso=torso, depth=1, width=64, activation="relu", layer_norm=layer_norm)
        torso_net = make_torso(config, obs_rank=len(shape))
        params = torso_net.init(jax.random.PRNGKey(0), obs)
        assert ("LayerNorm_0" in params["params"]) == layer_norm
        dense = "Dense_0"
        shifted = jax.tree.map(lambda x: x, params)
        shifted["params"][dense]["bias"] = params["params"][dense]["bias"] - 1e3
        active = np.asarray(jax.jit(torso_net.apply)(shifted, obs) > 0).mean(axis=-1)  # [16] per state
        if layer_norm:
            assert np.all((active > 0.3) & (active < 0.7)), active
        else:
            np.testing.assert_array_equal(active, 0.0)
