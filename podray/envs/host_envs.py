"""Batched host environments from envpool, for Sebulba: Atari, classic control, any envpool task.

envpool steps a whole batch in C++ threads with the GIL released, so an actor thread that waits on it
leaves Python free for the other threads. Atari gets the standard preprocessing of the IMPALA and
Sebulba papers, done inside envpool: 84x84 grayscale, a stack of 4 frames, frame skip 4 with
max-pooling over the last two frames, up to 30 no-op starts, and for training episodic life and reward
clipping; sticky actions (repeat_action_probability) are an option.

Two details of envpool that this wrapper hides from the actors:
- Auto-reset takes one extra step: after a step that ends an episode, the next step of that
  environment ignores its action and returns the first observation of the next episode, with reward 0.
  That step is flagged (`HostStep.first`) and reported with reward 0 and discount 0. It is no
  transition of the game: the actors record none for it (podray/actors/actor.py), so a trajectory goes
  from the step that ended an episode (discount 0) straight to the first observation of the next, as
  under Anakin's JAX environments.
- A time limit (envpool's `max_episode_steps`: 27,000 agent steps = 108,000 frames on Atari, 500 on
  CartPole-v1) truncates an episode; it does not end it. A truncated step keeps discount 1 and is
  flagged (`HostStep.truncated`), so that its value is bootstrapped from the last observation instead
  of being taken as 0 (the actors fold that bootstrap into the reward, see podray/actors/actor.py).
- With episodic life and reward clipping, the reward and the episode end used for training are not the
  game's. The returns reported to users are the real, unclipped game score over whole games
  (envpool's info["reward"] and info["terminated"]).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from podray.envs.spec import EnvSpec


@dataclass(frozen=True)
class HostEnvOptions:
    """How to build a host environment batch (from EnvConfig; the Atari fields apply to Atari only).

    Attributes:
      episodic_life: a lost life ends the training episode (Atari).
      reward_clip: clip training rewards to their sign (Atari).
      noop_max: up to this many no-op actions at the start of a game (Atari).
      repeat_action_probability: sticky actions; 0 disables (Atari).
      frame_skip: frames per agent step, max-pooled over the last two (Atari).
      stack_num: frames stacked in one observation (Atari).
      max_episode_steps: time limit in agent steps; 0 keeps envpool's default.
      num_threads: envpool worker threads; 0 lets envpool choose.
      render_mode: envpool's render mode: 'rgb_array' makes HostEnv.render return frames (Atari: the
        game's colour screen at 210x160); empty renders nothing.
    """

    episodic_life: bool = True
    reward_clip: bool = True
    noop_max: int = 30
    repeat_action_probability: float = 0.0
    frame_skip: int = 4
    stack_num: int = 4
    max_episode_steps: int = 0
    num_threads: int = 0
    render_mode: str = ""

    @classmethod
    def from_config(cls, env) -> HostEnvOptions:
        """The options an EnvConfig (`config.env`) asks for."""
        return cls(
            episodic_life=env.episodic_life,
            reward_clip=env.reward_clip,
            noop_max=env.noop_max,
            repeat_action_probability=env.sticky_actions,
            max_episode_steps=env.max_episode_steps,
            num_threads=env.envpool_threads,
        )


@dataclass
class HostStep:
    """One step of a batch of B environments (numpy arrays, on the host).

    Attributes:
      obs: [B, *obs_shape] observation after the step (envpool's layout, see HostEnv.channels_first).
      reward: [B] float32 training reward (clipped for Atari when reward_clip is set).
      discount: [B] float32, 0 where the training episode terminated on this step or this step was
        envpool's reset step, else 1 (also 1 where the time limit truncated it: see `truncated`).
      truncated: [B] bool, the time limit cut the episode on this step (and it did not terminate): the
        next step of this environment is a reset step, and obs is the episode's last observation.
      first: [B] bool, this step was envpool's reset step: its action was ignored and obs is the first
        observation of a new episode (no transition happened).
      env_id: [B] int32 ids of the environments in this batch (all of them, in order, when sync).
      episode_return: [B] float32 unclipped game score of games that ended on this step (0 elsewhere).
      episode_done: [B] bool, a whole game ended on this step.
    """

    obs: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    truncated: np.ndarray
    first: np.ndarray
    env_id: np.ndarray
    episode_return: np.ndarray
    episode_done: np.ndarray


@functools.lru_cache(maxsize=1)
def registered_tasks() -> tuple[str, ...]:
    import envpool

    return tuple(envpool.list_all_envs())


def is_atari(name: str) -> bool:
    """Whether `name` is one of envpool's Atari tasks (they all take the Atari options)."""
    import envpool

    try:
        spec = envpool.make_spec(name)
    except Exception:
        return False
    return "noop_max" in spec.config._fields and "episodic_life" in spec.config._fields


def check_name(name: str) -> None:
    """Raises ConfigError unless `name` is a discrete-action envpool task, with a hint for JAX envs."""
    from podray.config import ConfigError

    if name in registered_tasks():
        import envpool

        space = envpool.make_spec(name).action_space
        if not hasattr(space, "n"):
            raise ConfigError(
                f"env.name: '{name}' has continuous actions; podray's agents need a discrete action space"
            )
        return
    hint = ""
    try:
        import gymnax

        if name in gymnax.registered_envs:
            hint = f"; '{name}' is a JAX (gymnax) environment: use architecture=anakin"
    except ImportError:
        pass
    close = [t for t in registered_tasks() if t.lower().startswith(name.split("-")[0].lower()[:4])][:8]
    raise ConfigError(
        f"env.name: '{name}' is not an envpool task{hint or ''}"
        + (f"; similar envpool tasks: {', '.join(close)}" if close and not hint else "")
        + ("; e.g. Pong-v5, Breakout-v5, CartPole-v1, Acrobot-v1" if not hint else "")
    )


def check_config(name: str, torso: str) -> None:
    """Raises ConfigError unless `name` is a discrete-action envpool task whose observations suit the
    network torso (pixel torsos need image observations); reads envpool's registry, compiles nothing."""
    from podray.config import ConfigError

    check_name(name)  # with a hint for gymnax names
    shape = observation_shape(name)
    if torso != "mlp" and len(shape) != 3:
        raise ConfigError(
            f"network.torso: '{torso}' needs image observations; {name} has shape {shape}; use network.torso=mlp"
        )


@functools.lru_cache(maxsize=None)
def observation_shape(name: str) -> tuple[int, ...]:
    """The observation shape the agent sees (channels last for Atari), from envpool's spec alone."""
    import envpool

    shape = tuple(envpool.make_spec(name).observation_space.shape)
    return (*shape[1:], shape[0]) if is_atari(name) else shape


class HostEnv:
    """A batch of envpool environments on the host.

    Args:
      name: an envpool task id (Pong-v5, Breakout-v5, CartPole-v1, Acrobot-v1, ...).
      num_envs: environments in the pool.
      batch_size: environments returned per step; less than num_envs is envpool's async mode (each
        recv returns the first batch_size environments ready). 0 means num_envs (sync).
      seed: envpool's seed (each environment gets seed + its index).
      options: Atari and pool options.
    """

    def __init__(self, name: str, num_envs: int, batch_size: int = 0, seed: int = 0, options: HostEnvOptions = None):
        import envpool

        check_name(name)
        options = options or HostEnvOptions()
        self.name = name
        self.num_envs = num_envs
        self.batch_size = batch_size or num_envs
        self.atari = is_atari(name)
        kwargs = dict(num_envs=num_envs, batch_size=self.batch_size, seed=seed, num_threads=options.num_threads)
        if options.max_episode_steps:
            kwargs["max_episode_steps"] = options.max_episode_steps
        if options.render_mode:
            kwargs["render_mode"] = options.render_mode
        if self.atari:
            if options.noop_max < 1:
                raise ValueError("noop_max must be >= 1: envpool 1.2 crashes (segfault) on reset with noop_max=0")
            kwargs.update(
                episodic_life=options.episodic_life,
                reward_clip=options.reward_clip,
                noop_max=options.noop_max,
                repeat_action_probability=options.repeat_action_probability,
                frame_skip=options.frame_skip,
                stack_num=options.stack_num,
            )
        self._env = envpool.make(name, env_type="gymnasium", **kwargs)
        obs_space, act_space = self._env.observation_space, self._env.action_space
        shape = tuple(obs_space.shape)
        # envpool's Atari frames are [stack, 84, 84]; the networks want channels last. The move happens
        # on the device, inside the compiled act and update (see to_channels_last), never on the host.
        self.channels_first = self.atari
        self.raw_obs_shape = shape
        """Observation shape as envpool returns it ([stack, 84, 84] for Atari)."""
        agent_shape = (*shape[1:], shape[0]) if self.channels_first else shape
        self.spec = EnvSpec(
            name=name, obs_shape=agent_shape, obs_dtype=str(np.dtype(obs_space.dtype)), num_actions=int(act_space.n)
        )
        self._returns = np.zeros(num_envs, np.float32)
        self._needs_reset = np.zeros(num_envs, bool)
        self._closed = False

    def reset(self) -> tuple[np.ndarray, np.ndarray]:
        """Resets every environment; returns (obs [B, ...], env_id [B]) of the first batch.

        In async mode the other environments' first observations arrive through recv().
        """
        self._returns[:] = 0.0
        self._needs_reset[:] = False
        if self.batch_size == self.num_envs:
            obs, info = self._env.reset()
            return obs, info["env_id"]
        self._env.async_reset()
        step = self.recv()
        return step.obs, step.env_id

    def step(self, action: np.ndarray) -> HostStep:
        """Steps every environment once (sync mode); action [num_envs] int."""
        self.send(action)
        return self.recv()

    def send(self, action: np.ndarray, env_id: np.ndarray | None = None) -> None:
        """Starts a step of the environments `env_id` (all when None) with `action` [len(env_id)]."""
        self._env.send(np.asarray(action, np.int32), env_id)

    def recv(self) -> HostStep:
        """Waits for the next batch of stepped environments (the GIL is released meanwhile)."""
        obs, reward, terminated, truncated, info = self._env.recv()
        env_id = info["env_id"]
        was_reset = self._needs_reset[env_id]
        done = np.logical_or(terminated, truncated)
        score = info.get("reward", reward)  # Atari: the unclipped game reward
        game_over = np.logical_or(info.get("terminated", terminated), truncated).astype(bool) & done
        returns = self._returns[env_id] + np.where(was_reset, 0.0, score).astype(np.float32)
        self._returns[env_id] = np.where(game_over, 0.0, returns)
        self._needs_reset[env_id] = done
        return HostStep(
            obs=obs,
            reward=np.where(was_reset, 0.0, reward).astype(np.float32),
            discount=np.where(was_reset | terminated, 0.0, 1.0).astype(np.float32),
            truncated=np.logical_and(truncated, ~np.asarray(terminated, bool)),
            first=was_reset,
            env_id=env_id,
            episode_return=np.where(game_over, returns, 0.0).astype(np.float32),
            episode_done=game_over,
        )

    def render(self, env_id: int = 0) -> np.ndarray:
        """The current screen of environment `env_id`, [H, W, 3] uint8 RGB (needs render_mode='rgb_array')."""
        return self._env.render(env_ids=[env_id])[0]

    def close(self) -> None:
        """Stops envpool's worker threads (idempotent)."""
        if not self._closed:
            self._closed = True
            close = getattr(self._env, "close", None)
            if close is not None:
                close()
            del self._env


def to_channels_last(obs, channels_first: bool):
    """[..., C, H, W] -> [..., H, W, C] inside a compiled function (a no-op for other layouts)."""
    if not channels_first:
        return obs
    import jax.numpy as jnp

    return jnp.moveaxis(obs, -3, -1)


def env_spec(name: str) -> tuple[EnvSpec, bool]:
    """(the agent's EnvSpec, whether envpool's observations are channels first), without making an env."""
    import envpool

    check_name(name)
    spec = envpool.make_spec(name)
    dtype = str(np.dtype(spec.observation_space.dtype))
    return (
        EnvSpec(name=name, obs_shape=observation_shape(name), obs_dtype=dtype, num_actions=int(spec.action_space.n)),
        is_atari(name),
    )
