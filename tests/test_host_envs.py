"""Host environments (envpool): specs, the reset step, real game scores, and time-consistent
trajectories from actor threads in sync and async mode."""

import jax
import numpy as np
import pytest

from podray import config as config_lib
from podray.envs import host_envs
from podray.host import HostContext
from podray.sebulba import SebulbaProgram


def test_specs_of_atari_and_classic_control():
    pong, channels_first = host_envs.env_spec("Pong-v5")
    assert channels_first and pong.obs_shape == (84, 84, 4) and pong.obs_dtype == "uint8" and pong.num_actions == 6
    cartpole, channels_first = host_envs.env_spec("CartPole-v1")
    assert not channels_first and cartpole.obs_shape == (4,) and cartpole.num_actions == 2
    assert host_envs.env_spec("Acrobot-v1")[0].num_actions == 3


def test_unknown_and_continuous_tasks_are_rejected():
    with pytest.raises(config_lib.ConfigError, match="not an envpool task"):
        host_envs.check_name("Pong-v99")
    with pytest.raises(config_lib.ConfigError, match="continuous actions"):
        host_envs.check_name("Pendulum-v1")


def test_breakout_reports_whole_games_with_the_real_score():
    """Episodic life: 5 training episodes (one per life) but one game, scored unclipped."""
    env = host_envs.HostEnv("Breakout-v5", 1, seed=3, options=host_envs.HostEnvOptions(noop_max=1))
    try:
        obs, _ = env.reset()
        assert obs.shape == (1, 4, 84, 84)
        rng = np.random.default_rng(0)
        life_ends, clipped, steps = 0, 0.0, []
        for _ in range(5000):
            step = env.step(rng.integers(0, 4, 1))
            steps.append(step)
            clipped += float(step.reward[0])
            if step.episode_done[0]:
                break
        assert step.episode_done[0], "a random Breakout game should end within 5000 steps"
        for prev, cur in zip(steps, steps[1:]):
            if prev.discount[0] == 0.0 and not prev.episode_done[0]:
                life_ends += 1 if cur.reward[0] == 0.0 and cur.discount[0] == 0.0 and cur.first[0] else 0
        assert life_ends == 4  # the 4 lives lost before the last, each followed by envpool's reset step
        assert sum(int(s.first[0]) for s in steps) == 4  # and no other step is flagged as one
        assert np.all(np.abs([s.reward[0] for s in steps]) <= 1.0)  # training rewards are clipped
        assert step.episode_return[0] >= clipped  # the real score (bricks are worth 1 to 7 points)
        assert sum(int(s.episode_done[0]) for s in steps) == 1
    finally:
        env.close()


def _host():
    devices = tuple(jax.local_devices()[:4])
    return HostContext(0, 1, devices, devices)


@pytest.mark.parametrize("envs_per_actor_thread", [0, 32])  # sync, async (32 envs, batches of 16)
def test_actor_rows_are_consistent_in_time(envs_per_actor_thread):
    """CartPole's Euler step x' = x + 0.02 x_dot holds along every row of a trajectory where no episode
    boundary intervenes: each row is one environment, in time order."""
    config = config_lib.load(
        "sebulba_cartpole",
        [
            "run.cpu_devices=0",
            f"sebulba.envs_per_actor_thread={envs_per_actor_thread}",
            "sebulba.threads_per_actor_device=1",
            "sebulba.learner_devices=[1, 2]",
        ],
    )
    program = SebulbaProgram(config, _host())
    state = program.learner.initial_state(0)
    program.start(state.train.params, 0)
    try:
        rollouts = [r for _ in range(3) for r in program.gather(0)]
    finally:
        program.stop()
    for rollout in rollouts:
        traj = jax.device_get(rollout.trajectory)
        T = config.sebulba.rollout_length
        assert traj.obs.shape == (T + 1, 16, 4) and traj.action.shape == (T, 16)
        x, x_dot = traj.obs[:-1, :, 0], traj.obs[:-1, :, 1]
        within = traj.discount == 1.0
        assert within.mean() > 0.8
        np.testing.assert_allclose(traj.obs[1:, :, 0][within], (x + 0.02 * x_dot)[within], atol=1e-5)
        # envpool's reset step is no transition: every recorded step is a real one (CartPole pays 1
        # each; the reset step would pay 0), and after an episode's last step comes a first
        # observation (gym's reset draws every component in [-0.05, 0.05]). An episode that ends on
        # the rollout's last step leaves its last observation as the bootstrap, which discount 0 voids.
        np.testing.assert_array_equal(traj.reward, 1.0)
        ended = traj.discount[:-1] == 0.0
        assert ended.any(), "some CartPole episode should end within 3 rollouts"
        assert np.all(np.abs(traj.obs[1:-1][ended]) <= 0.05)
        # and the behaviour outputs belong to the action taken
        assert np.all((traj.action >= 0) & (traj.action < 2))
        assert np.isfinite(traj.actor_out.logits).all()


def _cartpole_step(obs: np.ndarray, action: np.ndarray) -> np.ndarray:
    """gym's CartPole-v1 dynamics (Euler, tau 0.02): the observation after `action` [N] in `obs` [N, 4]."""
    x, x_dot, theta, theta_dot = obs.T.astype(np.float64)
    force = np.where(action == 1, 10.0, -10.0)
    cos, sin = np.cos(theta), np.sin(theta)
    temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
    theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
    x_acc = temp - 0.05 * theta_acc * cos / 1.1
    return np.stack(
        [x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc], axis=-1
    ).astype(np.float32)


@pytest.mark.parametrize("envs_per_actor_thread", [0, 32])  # sync, async
def test_time_limit_truncates_and_bootstraps(envs_per_actor_thread):
    """An episode cut by the time limit is not ended: its last step's target bootstraps from the value of
    the episode's last observation. With a limit of 5 steps every CartPole episode is cut (the pole
    cannot fall in 5 steps). Where the cut falls inside a row, the reward is 1 + gamma * V(last
    observation) with discount 0; where it falls on a row's last step, the discount is 1 and the
    bootstrap observation is the episode's last one."""
    config = config_lib.load(
        "sebulba_cartpole",
        [
            "run.cpu_devices=0",
            "env.max_episode_steps=5",
            f"sebulba.envs_per_actor_thread={envs_per_actor_thread}",
            "sebulba.threads_per_actor_device=1",
            "sebulba.rollout_length=12",
        ],
    )
    gamma = config.agent.discount
    program = SebulbaProgram(config, _host())
    state = program.learner.initial_state(0)
    params = state.train.params  # no update runs: every action is chosen with these
    program.start(params, 0)
    try:
        rollouts = [r for _ in range(4) for r in program.gather(0)]
    finally:
        program.stop()
    value = jax.jit(lambda obs: program.agent.apply(params, obs).value)
    cuts = at_row_end = 0
    for rollout in rollouts:
        traj = jax.device_get(rollout.trajectory)
        T = config.sebulba.rollout_length
        cut = traj.discount == 0.0  # every episode end is a cut here
        assert cut.any()
        last_obs = _cartpole_step(traj.obs[:-1][cut], traj.action[cut])
        expected = 1.0 + gamma * np.asarray(value(last_obs))
        np.testing.assert_allclose(traj.reward[cut], expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(traj.reward[~cut], 1.0)
        # a row that ends on the cut step bootstraps (discount 1) from the episode's last observation
        np.testing.assert_allclose(traj.obs[T], _cartpole_step(traj.obs[T - 1], traj.action[T - 1]), atol=1e-4)
        # episodes are 5 steps long: no two cuts in one row are closer than 5 steps
        for row in range(cut.shape[1]):
            steps = np.flatnonzero(cut[:, row])
            assert np.all(np.diff(steps) == 5), steps
        cuts += int(cut.sum())
        at_row_end += int((traj.discount[-1] == 1.0).sum())
    assert cuts > 0 and at_row_end > 0
