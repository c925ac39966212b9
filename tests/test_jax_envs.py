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
