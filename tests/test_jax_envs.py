"""Batched gymnax environments: auto-reset and returns of completed episodes only."""

import jax
import jax.numpy as jnp
import numpy as np

from podray.envs.jax_envs import JaxEnv


def test_cartpole_episode_returns_only_on_completion():
    env = JaxEnv("CartPole-v1")
    assert env.spec.obs_shape == (4,) and env.spec.num_actions == 2
    B = 8
    state, obs = env.reset(jax.random.split(jax.random.PRNGKey(0), B))
    step = jax.jit(env.step)
    finished, lengths = [], []
    running = np.zeros(B)
    for t in range(200):
        action = jnp.zeros(B, jnp.int32)  # always push left: episodes end fast
        state, ts = step(state, action, jax.random.split(jax.random.PRNGKey(t + 1), B))
        running += np.asarray(ts.reward)
        done = np.asarray(ts.done)
        np.testing.assert_array_equal(np.asarray(ts.episode_return)[~done], 0.0)
        np.testing.assert_allclose(np.asarray(ts.episode_return)[done], running[done])
        np.testing.assert_array_equal(np.asarray(ts.discount), 1.0 - done)
        finished.extend(np.asarray(ts.episode_return)[done])
        lengths.extend(np.asarray(ts.episode_length)[done])
        running[done] = 0.0
    assert len(finished) > B  # auto-reset keeps episodes coming
    np.testing.assert_allclose(finished, lengths)  # CartPole pays 1 per step


def test_image_env_spec():
    env = JaxEnv("Breakout-MinAtar")
    assert env.spec.obs_shape == (10, 10, 4)
    assert env.spec.num_actions == 3


def test_prepared_step_equals_gymnax_auto_reset_step():
    """Anakin draws a rollout's resets before its loop; the outcome must be gymnax's own step."""
    import gymnax

    for name in ("CartPole-v1", "Breakout-MinAtar"):
        env = JaxEnv(name)
        inner_env, params = gymnax.make(name)
        B, T = 6, 60
        state, obs = env.reset(jax.random.split(jax.random.PRNGKey(0), B))
        keys = jax.random.split(jax.random.PRNGKey(1), T * B).reshape(T, B, 2)
        step_keys, resets = jax.jit(env.prepare)(keys)  # the whole rollout at once
        step = jax.jit(env.step_prepared)
        gym_step = jax.jit(jax.vmap(inner_env.step, in_axes=(0, 0, 0, None)))
        close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)  # noqa: E731
        dones = 0
        for t in range(T):
            action = jax.random.randint(jax.random.PRNGKey(100 + t), (B,), 0, env.spec.num_actions)
            # gymnax's step from the same state and key (XLA may fuse the two programs differently: ulps)
            gym_obs, gym_state, reward, terminated, truncated, _ = gym_step(keys[t], state.inner, action, params)
            state, ts = step(state, action, step_keys[t], jax.tree.map(lambda x, t=t: x[t], resets))
            close(ts.obs, np.asarray(gym_obs).astype(env.spec.obs_dtype))
            close(ts.reward, np.asarray(reward, np.float32))
            np.testing.assert_array_equal(np.asarray(ts.done), np.asarray(terminated | truncated))
            jax.tree.map(close, state.inner, gym_state)
            dones += int(ts.done.sum())
        assert dones > 0, name  # resets were exercised
