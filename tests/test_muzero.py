"""The MuZero agent: targets, transforms, the unrolled loss, the replay in its state, under jit and
over devices; its config checks; Anakin and Sebulba runs of it."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from podray import config as config_lib
from podray.agents import ActorOut, MuZero, Trajectory, build_agent
from podray.agents.muzero import bootstrap_observations, make_items, n_step_targets, reanalyse
from podray.agents.muzero_network import MuZeroNetwork
from podray.config import AgentConfig, ConfigError, NetworkConfig, ReplayConfig, SearchConfig
from podray.envs.spec import EnvSpec
from podray.host import HostContext

SPEC = EnvSpec("test", (4,), "float32", 3)
K = 3


def _agent(num_devices=1, replay=None, **agent_fields):
    fields = dict(name="muzero", unroll_steps=K, td_steps=3, support_size=5, learning_rate=3e-3, anneal_lr=False)
    fields.update(agent_fields)
    replay = replay or ReplayConfig(capacity=256, min_size=0, batch_size=16, replay_ratio=1.0)
    search = SearchConfig(policy="gumbel", num_simulations=4, max_num_considered_actions=3)
    return MuZero(AgentConfig(**fields), NetworkConfig(width=32), SPEC, 100, search, replay, num_devices)


def _trajectory(key, T=8, B=4, logits=None):
    k = jax.random.split(key, 5)
    return Trajectory(
        obs=jax.random.normal(k[0], (T + 1, B, 4)),
        action=jax.random.randint(k[1], (T, B), 0, 3),
        reward=jax.random.normal(k[2], (T, B)),
        discount=(jax.random.uniform(k[3], (T, B)) > 0.2).astype(jnp.float32),
        actor_out=ActorOut(
            logits=jax.random.normal(k[4], (T, B, 3)) if logits is None else logits, value=jnp.ones((T, B))
        ),
    )


def _fit(agent, state, flat, steps, metric):
    """`steps` gradient steps on one fixed batch of items [N]; the value of `metric` after each."""

    @jax.jit
    def step(network, opt_state):
        updates, opt_state, metrics, _ = agent.learn_step(network, opt_state, flat, None, None)
        return jax.tree.map(jnp.add, network, updates), opt_state, metrics

    network, opt_state, values = state.params.network, state.opt_state, []
    for _ in range(steps):
        network, opt_state, metrics = step(network, opt_state)
        values.append(float(metrics[metric]))
    return values


def test_h_transform_and_two_hot_round_trip():
    x = jnp.linspace(-80.0, 80.0, 321)
    np.testing.assert_allclose(rlax.signed_parabolic(rlax.signed_hyperbolic(x)), x, rtol=1e-4, atol=1e-3)
    agent = _agent(support_size=10)
    probs = jax.jit(agent.tx.apply)(x)
    assert probs.shape == (321, 21)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert int(jnp.max(jnp.sum(probs > 0, -1))) <= 2  # two-hot
    np.testing.assert_allclose(jax.jit(agent.tx.apply_inv)(probs), x, rtol=1e-3, atol=2e-3)
    # and the scalar read from logits is the same map
    np.testing.assert_allclose(agent.scalar(jnp.log(probs + 1e-30)), x, rtol=1e-3, atol=2e-3)


def test_n_step_targets_match_a_reference_within_the_trajectory():
    T, B, n, gamma = 7, 3, 3, 0.9
    rng = np.random.RandomState(0)
    r, v = rng.randn(T, B).astype(np.float32), rng.randn(T, B).astype(np.float32)
    d = (rng.rand(T, B) > 0.3).astype(np.float32)
    boot = rng.randn(B).astype(np.float32)
    got = jax.jit(n_step_targets, static_argnums=(4, 5))(r, d, v, boot, n, gamma)
    values = np.concatenate([v, boot[None]])
    expected = np.zeros((T, B), np.float32)
    for t in range(T):
        for b in range(B):
            total, scale = 0.0, 1.0
            m = min(n, T - t)
            for i in range(m):
                total += scale * r[t + i, b]
                scale *= gamma * d[t + i, b]
            expected[t, b] = total + scale * values[t + m, b]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_items_absorb_past_episode_ends_and_mask_past_the_trajectory():
    T, B = 5, 1
    traj = _trajectory(jax.random.PRNGKey(0), T, B)
    traj = traj.replace(discount=jnp.array([[1.0], [0.0], [1.0], [1.0], [1.0]]), reward=jnp.ones((T, B)))
    items = make_items(traj, jnp.zeros(B), unroll_steps=3, td_steps=2, gamma=1.0)
    # From t=0: steps 0 and 1 in the episode, which ends after step 1; positions 2, 3 are absorbing.
    np.testing.assert_array_equal(items.value_mask[0, 0], [1, 1, 1, 1])
    np.testing.assert_array_equal(items.policy_mask[0, 0], [1, 1, 0, 0])
    np.testing.assert_array_equal(items.reward[0, 0], [1, 1, 0])
    np.testing.assert_array_equal(items.reward_mask[0, 0], [1, 1, 1])
    np.testing.assert_allclose(items.value[0, 0], [2, 1, 0, 0])
    # From t=3: positions 0, 1 inside the trajectory, 2 and 3 past its end while the episode goes on.
    np.testing.assert_array_equal(items.value_mask[3, 0], [1, 1, 0, 0])
    np.testing.assert_array_equal(items.policy_mask[3, 0], [1, 1, 0, 0])
    np.testing.assert_array_equal(items.reward_mask[3, 0], [1, 1, 0])
    np.testing.assert_array_equal(items.action[0, 0], np.asarray(traj.action[:3, 0]))


def test_unroll_has_k_steps_and_the_loss_falls_on_a_fixed_batch():
    agent = _agent()
    state = agent.init(jax.random.PRNGKey(0))
    items = agent.items(state.params.network, _trajectory(jax.random.PRNGKey(1), T=8, B=8))
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), items)
    policy, value, reward, latents = jax.jit(agent.unroll)(state.params.network, flat)
    assert policy.shape == (64, K + 1, 3) and value.shape == (64, K + 1, 11) and reward.shape == (64, K, 11)
    assert latents.shape == (64, K, 32)

    losses = _fit(agent, state, flat, 30, "loss")
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses


def test_consistency_items_hold_the_next_observations_and_the_loss_learns_them():
    """With the consistency loss on, each item holds the C observations after its state (zeros where
    the episode ended or the trajectory ran out, all masked); training on a fixed batch raises the
    cosine similarity of the dynamics' predictions to the representation of those observations."""
    C = 2
    agent = _agent(consistency_coef=2.0, consistency_steps=C)
    state = agent.init(jax.random.PRNGKey(0))
    traj = _trajectory(jax.random.PRNGKey(1), T=8, B=8)
    items = agent.items(state.params.network, traj)
    assert items.next_obs.shape == (8, 8, C, 4)
    np.testing.assert_array_equal(items.next_obs[2, :, 0], traj.obs[3])
    np.testing.assert_array_equal(items.next_obs[2, :, 1], traj.obs[4])
    np.testing.assert_array_equal(items.next_obs[7, :, 1], 0.0)  # past the trajectory's end
    assert float(items.policy_mask[7, :, 2].max()) == 0.0
    assert _agent().items(state.params.network, traj).next_obs is None  # the loss off: no frames stored
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), items)

    consistency = _fit(agent, state, flat, 40, "consistency_loss")
    masked = float(jnp.mean(jnp.sum(flat.policy_mask[:, 1 : C + 1], -1)))  # the loss's floor is -masked
    assert all(math.isfinite(x) for x in consistency)
    assert consistency[-1] < consistency[0] and consistency[-1] < -0.3 * masked, (consistency, masked)
    # and through the replay in the learner state
    update = jax.jit(agent.update)
    for i in range(2):
        state, metrics = update(state, _trajectory(jax.random.PRNGKey(i)), jax.random.PRNGKey(10 + i))
    assert math.isfinite(float(metrics["consistency_loss"]))
    assert jax.tree.leaves(state.replay.experience.next_obs)[0].shape[-2:] == (C, 4)


def test_spatial_latent_unrolls_a_feature_map_and_its_loss_falls_on_pixels():
    """agent.latent_channels > 0: on a pixel torso the latent is a feature map [H, W, C] min-max scaled
    over the whole map, the dynamics convolutional; the K-step loss with the consistency loss falls on
    a fixed batch of frames, and the search acts with it."""
    spec = EnvSpec("pixels", (44, 44, 4), "uint8", 3)  # the Nature CNN's feature map is 2x2 here
    fields = dict(name="muzero", unroll_steps=K, td_steps=3, support_size=5, learning_rate=3e-3, anneal_lr=False)
    agent = MuZero(
        AgentConfig(**fields, latent_channels=8, dynamics_blocks=1, consistency_coef=1.0, consistency_steps=2),
        NetworkConfig(torso="nature_cnn", width=32),
        spec,
        100,
        SearchConfig(policy="gumbel", num_simulations=4, max_num_considered_actions=3),
        ReplayConfig(capacity=256, min_size=0, batch_size=16, replay_ratio=1.0),
    )
    state = agent.init(jax.random.PRNGKey(0))
    k = jax.random.split(jax.random.PRNGKey(1), 2)
    traj = _trajectory(k[0], T=6, B=4).replace(
        obs=jax.random.randint(k[1], (7, 4, 44, 44, 4), 0, 256).astype(jnp.uint8)
    )
    latent = agent.network.apply(state.params.network, traj.obs[0], method=MuZeroNetwork.represent)
    assert latent.shape == (4, 2, 2, 8)
    np.testing.assert_allclose(latent.min(axis=(1, 2, 3)), 0.0, atol=1e-6)
    np.testing.assert_allclose(latent.max(axis=(1, 2, 3)), 1.0, atol=1e-3)
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), agent.items(state.params.network, traj))
    policy, value, reward, latents = jax.jit(agent.unroll)(state.params.network, flat)
    assert policy.shape == (24, K + 1, 3) and reward.shape == (24, K, 11) and latents.shape == (24, K, 2, 2, 8)

    losses = _fit(agent, state, flat, 30, "loss")
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses
    action, out = jax.jit(agent.act)(state.params, traj.obs[0], jax.random.PRNGKey(2))
    assert action.shape == (4,) and bool(jnp.all((action >= 0) & (action < 3)))
    np.testing.assert_allclose(jnp.exp(out.logits).sum(-1), 1.0, atol=1e-5)
    stats = jax.jit(agent.trajectory_stats)(state.params.network, traj)
    assert -1.0 <= float(stats["model_consistency"]) <= 1.0


def test_update_fills_the_replay_and_samples_at_the_replay_ratio():
    replay = ReplayConfig(capacity=128, min_size=48, batch_size=16, replay_ratio=2.0)
    agent = _agent(replay=replay)
    state = agent.init(jax.random.PRNGKey(0))
    update = jax.jit(agent.update)
    act = jax.jit(agent.act)
    action, out = act(state.params, jnp.ones((4, 4)), jax.random.PRNGKey(2))
    assert action.shape == (4,) and out.logits.shape == (4, 3)
    np.testing.assert_allclose(jax.nn.softmax(out.logits).sum(-1), 1.0, atol=1e-5)
    fills, ratios = [], []
    for i in range(5):
        before = state.params.network
        state, metrics = update(state, _trajectory(jax.random.PRNGKey(i)), jax.random.PRNGKey(10 + i))
        fills.append(float(metrics["buffer_fill"]))
        ratios.append(float(metrics["replay_ratio"]))
        moved = any(
            not np.allclose(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params.network))
        )
        assert moved == (fills[-1] * 128 >= 48)
        assert all(math.isfinite(float(v)) for v in metrics.values())
    assert fills == [32 / 128, 64 / 128, 96 / 128, 1.0, 1.0]  # 32 new transitions per update, then full
    assert ratios == [0.0, 2.0, 2.0, 2.0, 2.0]  # 4 steps of 16 per 32 new, once 48 are stored
    assert int(state.updates) == 5 and float(state.params.progress) == pytest.approx(0.05)
    assert jax.tree.leaves(state.replay)[0].shape[0] == 1  # the device axis of the shard


def test_trajectory_stats_measure_how_far_the_search_moved_the_policy():
    agent = _agent()
    network = agent.init(jax.random.PRNGKey(0)).params.network
    trajectory = _trajectory(jax.random.PRNGKey(1))
    latent = agent.network.apply(network, trajectory.obs[:-1], method=type(agent.network).represent)
    prior_logits, _ = agent.network.apply(network, latent, method=type(agent.network).predict)
    prior = jax.nn.softmax(prior_logits)
    # a search that left the prior as it was
    same = agent.trajectory_stats(network, trajectory.replace(actor_out=ActorOut(prior_logits, jnp.ones((8, 4)))))
    assert float(same["search_prior_kl"]) == pytest.approx(0.0, abs=1e-5)
    entropy = -np.sum(np.asarray(prior) * np.log(np.asarray(prior)), -1).mean()
    assert float(same["prior_entropy"]) == pytest.approx(entropy, rel=1e-5)
    # a search that put nearly all the mass on action 0: KL = -log prior(0) + the search's own entropy term
    peaked = jnp.log(jnp.array([1.0 - 2e-6, 1e-6, 1e-6]))
    moved = agent.trajectory_stats(
        network, trajectory.replace(actor_out=ActorOut(jnp.broadcast_to(peaked, (8, 4, 3)), jnp.ones((8, 4))))
    )
    assert float(moved["search_prior_kl"]) == pytest.approx(float(jnp.mean(-jnp.log(prior[..., 0]))), rel=1e-3)
    assert -1.0 <= float(moved["model_consistency"]) <= 1.0


@pytest.mark.parametrize("sampling", ["uniform", "prioritized"])
def test_reanalysed_targets_bootstrap_from_the_observations_stored_n_steps_on(sampling):
    """With value_bootstrap 'reanalyse', an item's targets bootstrap from new values of the
    observations the replay holds n steps on, found by slot arithmetic that survives the ring's wrap:
    the observations of two trajectories encode v + 1, with v the search's values they were acted
    on, and reanalysing every stored item with those values gives the targets n_step_targets makes
    from v + 1 (and from the stored value where the bootstrap observation is the trajectory's last)."""
    T, B, n = 8, 4, 3
    replay = ReplayConfig(capacity=48, min_size=0, batch_size=16, replay_ratio=1.0, sampling=sampling)
    agent = _agent(replay=replay, td_steps=n, value_bootstrap="reanalyse", discount=0.9)
    buffer_state = jax.tree.map(lambda x: x[0], agent.init(jax.random.PRNGKey(0)).replay)
    expected = []
    for i in range(2):  # 64 items into 48 slots: the second trajectory wraps over the first's rows 0, 1
        traj = _trajectory(jax.random.PRNGKey(i), T, B)
        value = jax.random.normal(jax.random.PRNGKey(10 + i), (T, B))
        obs = jnp.zeros((T + 1, B, 4)).at[:T, :, 0].set(value + 1.0).at[T, :, 0].set(-100.0)
        traj = traj.replace(obs=obs, actor_out=traj.actor_out.replace(value=value))
        boot = jax.random.normal(jax.random.PRNGKey(20 + i), (B,))
        items = make_items(traj, boot, K, n, 0.9, reanalyse=True)
        fresh = make_items(traj.replace(actor_out=traj.actor_out.replace(value=value + 1.0)), boot, K, n, 0.9)
        expected.append(jnp.swapaxes(fresh.value, 0, 1).reshape(B * T, K + 1))  # in the replay's order
        buffer_state = agent.buffer.add(buffer_state, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), items))
    # slots 32..47, 0..15 hold the second trajectory; 16..31 the first's rows 2 and 3
    slots = jnp.arange(48)
    stored = jax.tree.map(lambda x: x[0, slots], buffer_state.experience)
    obs = bootstrap_observations(buffer_state, slots, stored.bootstrap_offset)
    got = reanalyse(stored, obs[..., 0]).value
    want = jnp.concatenate([expected[1][16:32], expected[0][16:32], expected[1][:16]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert bool(jnp.any(jnp.abs(got - stored.value) > 0.1))  # the new values changed the targets
    assert float(jnp.max(obs[..., 0])) > -100.0 and bool(jnp.all(stored.bootstrap_offset <= n + K))

    # the agent's update samples slots and reanalyses with its own network, finitely
    state = agent.init(jax.random.PRNGKey(0))
    update = jax.jit(agent.update)
    for i in range(3):
        state, metrics = update(state, _trajectory(jax.random.PRNGKey(i)), jax.random.PRNGKey(10 + i))
    assert float(metrics["gradient_steps"]) == 2 and all(math.isfinite(float(v)) for v in metrics.values())
    items, indices, _ = agent._sample(jax.tree.map(lambda x: x[0], state.replay), jax.random.PRNGKey(5), 48)
    np.testing.assert_array_equal(
        items.obs, jax.tree.map(lambda x: x[0], state.replay).experience.obs[0][indices]
    )  # the slots returned are the items' own


def test_prioritized_replay_updates_finite():
    replay = ReplayConfig(capacity=128, min_size=0, batch_size=16, replay_ratio=1.0, sampling="prioritized")
    agent = _agent(replay=replay)
    state = agent.init(jax.random.PRNGKey(0))
    update = jax.jit(agent.update)
    for i in range(3):
        state, metrics = update(state, _trajectory(jax.random.PRNGKey(i)), jax.random.PRNGKey(10 + i))
    assert all(math.isfinite(float(v)) for v in metrics.values())


def test_four_devices_on_quarters_equal_one_device_on_the_whole_batch():
    """A gradient step on 4 devices, each given a quarter of a batch of replay items, equals the step
    on 1 device given the whole batch (gradients averaged over devices), to float tolerance."""
    one, four = _agent(1), _agent(4)
    state = one.init(jax.random.PRNGKey(0))
    items = one.items(state.params.network, _trajectory(jax.random.PRNGKey(1), T=8, B=8))
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), items)  # 64 items

    def step(agent, axis):
        def f(network, opt_state, batch):
            updates, opt_state, metrics, _ = agent.learn_step(network, opt_state, batch, None, axis)
            metrics = metrics if axis is None else jax.lax.pmean(metrics, axis)
            return jax.tree.map(jnp.add, network, updates), opt_state, metrics

        return f

    net1, _, m1 = jax.jit(step(one, None))(state.params.network, state.opt_state, flat)
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("d",))
    sharded = jax.shard_map(
        step(four, "d"), mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P(), P()), check_vma=False
    )
    net4, _, m4 = jax.jit(sharded)(state.params.network, state.opt_state, flat)
    for a, b in zip(jax.tree.leaves(net1), jax.tree.leaves(net4)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-4)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(state.params.network), jax.tree.leaves(net1)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["search.num_simulations=0"], "search.num_simulations"),
        (["search.temperature=-0.5"], "search.temperature"),
        (["search.min_value_range=-1"], "search.min_value_range"),
        (["replay.replay_ratio=0"], "replay.replay_ratio"),
        (["replay.replay_ratio=-1"], "replay.replay_ratio"),
        (["agent.unroll_steps=0"], "agent.unroll_steps"),
        (["agent.consistency_coef=-1"], "agent.consistency_coef"),
        (["agent.consistency_steps=6"], "agent.consistency_steps"),
        (["agent.latent_channels=8"], "agent.latent_channels"),  # a spatial latent on the mlp torso
        (["agent.value_bootstrap=fresh"], "agent.value_bootstrap"),
        (["search.policy=alphazero"], "search.policy"),
        (["search.temperature_decay=[0.75, 0.5]"], "search.temperature_decay"),
        (["replay.min_size=100000", "replay.capacity=5000"], "replay.min_size"),
    ],
)
def test_bad_search_configs_are_rejected_before_compiling(overrides, message, compile_counter):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        config_lib.load("anakin_muzero_cartpole", overrides)
    assert compile_counter == []


def test_more_considered_actions_than_actions_is_rejected_before_compiling(compile_counter):
    from podray.anakin import AnakinProgram
    from podray.envs.jax_envs import JaxEnv

    config = config_lib.load("anakin_muzero_cartpole", ["search.policy=gumbel", "search.max_num_considered_actions=3"])
    devices = tuple(jax.local_devices()[:1])
    mesh = HostContext(0, 1, devices, devices).mesh()
    JaxEnv("CartPole-v1")  # gymnax's spaces build small arrays once per process (not the program's compiles)
    compile_counter.clear()
    with pytest.raises(ConfigError, match=r"search\.max_num_considered_actions: 3 is more than the 2 actions"):
        AnakinProgram(config, mesh)
    assert compile_counter == []


def test_replay_capacity_must_split_over_devices():
    with pytest.raises(ConfigError, match=r"replay\.batch_size"):
        _agent(4, ReplayConfig(capacity=256, batch_size=18))


def test_build_agent_passes_the_sections():
    config = config_lib.load("anakin_muzero_cartpole")
    agent = build_agent(config, EnvSpec("CartPole-v1", (4,), "float32", 2), 10, num_devices=2)
    assert isinstance(agent, MuZero) and agent.search_config == config.search
    assert agent.capacity == config.replay.capacity // 2 and agent.batch_size == config.replay.batch_size // 2
    assert dataclasses.asdict(agent.replay_config) == dataclasses.asdict(config.replay)
