"""`podray eval RUN_DIR`: play a trained policy, report its real score, optionally record a video.

The policy is the run's checkpoint (the latest, or `step`), acting through the agent's own
`act_with_noise` (zero noise: greedy; Gumbel noise: a sample of the policy), without training. Scores are
the environment's real, unclipped episode returns: for Atari a whole game (no episodic life, no reward
clipping), for JAX environments the episode return. Every episode is the first one of its own
environment, all played as one batch; eval.json in the run directory holds the figures.

A video records one more episode for a person to watch: Atari games through envpool's renderer, in
colour at the game's resolution (210x160) rather than the agent's 84x84 grey stack, other envpool tasks
through the same renderer, JAX (gymnax) environments through gymnax's matplotlib renderers.
Everything a command line can get wrong (no config, no checkpoint, a bad step, a bad video suffix) is
checked before anything compiles or an environment starts.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from podray import config as config_lib
from podray import storage

VIDEO_SUFFIXES = (".mp4", ".gif")


@dataclass
class EvalRequest:
    """A checked `podray eval` request.

    Attributes:
      run_dir: the run directory.
      config: the run's config (config.yaml).
      step: the checkpoint (update count) to play.
      episodes: episodes to play (each on its own environment).
      greedy: take the most probable action (True) or sample the policy (False).
      video: where to write one recorded episode (.mp4 or .gif), or None.
      seed: seed of the evaluation environments and of sampled actions.
    """

    run_dir: storage.Path
    config: config_lib.Config
    step: int
    episodes: int
    greedy: bool
    video: pathlib.Path | None
    seed: int


@dataclass
class EvalResult:
    """What eval.json holds."""

    run_dir: str
    checkpoint_step: int
    env_steps: int | None
    env: str
    policy: str
    """'greedy' or 'sample'."""
    episodes: int
    mean: float
    std: float
    min: float
    max: float
    returns: list[float]
    """The real (unclipped) return of every episode, in environment order."""
    episode_lengths: list[int]
    """Agent steps of every episode."""
    seed: int
    video: str | None
    video_frames: int
    wall_s: float


def checkpoint_steps(run_dir) -> list[int]:
    """The steps of the complete checkpoints of a run, local or on an object store (storage.step_dirs)."""
    return storage.step_dirs(storage.run_path(run_dir) / "checkpoints")


def check_request(
    run_dir: str | pathlib.Path,
    step: int | None = None,
    episodes: int = 10,
    greedy: bool = False,
    video: str | None = None,
    seed: int = 0,
) -> EvalRequest:
    """Checks a request without starting JAX's compiler or any environment; ConfigError names the fix."""
    from podray.training import load_run_config

    storage.check_run_dir(run_dir, "eval")  # an object store: its filesystem, bucket and credentials
    run_dir = storage.run_path(run_dir)
    if episodes < 1:
        raise config_lib.ConfigError(f"eval --episodes {episodes}: must be >= 1")
    video_path = None
    if video is not None:
        video_path = pathlib.Path(video)
        if video_path.suffix.lower() not in VIDEO_SUFFIXES:
            raise config_lib.ConfigError(
                f"eval --video {video}: the file must end in {' or '.join(VIDEO_SUFFIXES)} (the format follows it)"
            )
        # The writers are setup.py dependencies; an environment installed before they were lacks them.
        needed = ["imageio"] + (["imageio_ffmpeg"] if video_path.suffix.lower() == ".mp4" else [])
        import importlib.util

        missing = [m for m in needed if importlib.util.find_spec(m) is None]
        if missing:
            raise config_lib.ConfigError(
                f"eval --video {video}: {', '.join(missing)} is not installed in this Python; reinstall podray "
                "(pip install -e . in the checkout) or pip install imageio imageio-ffmpeg"
            )
    if storage.read_text(run_dir / "config.yaml") is None:
        raise config_lib.ConfigError(f"eval {run_dir}: no config.yaml there; give the directory of a podray run")
    config = load_run_config(run_dir, check=False)
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise config_lib.ConfigError(
            f"eval {run_dir}: no checkpoint in {run_dir / 'checkpoints'}; a run saves one at its end "
            "(and every run.checkpoint_every updates)"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise config_lib.ConfigError(f"eval --step {step}: no such checkpoint in {run_dir}; the steps kept are {steps}")
    return EvalRequest(run_dir, config, step, episodes, greedy, video_path, seed)


def _agent_params(agent, tree: Any) -> Any:
    """The restored parameter tree (nested dicts, as orbax reads it) in the agent's own parameter type,
    e.g. MuZero's MuZeroParams dataclass; flax's dicts stay dicts."""
    import jax
    from flax import serialization

    abstract = jax.eval_shape(agent.init, jax.random.PRNGKey(0)).params
    return serialization.from_state_dict(abstract, tree)


def restore_params(run_dir, step: int, architecture: str, device=None) -> tuple[Any, dict]:
    """The agent parameters of checkpoint `step` on one device, and the checkpoint's metadata.

    The state is restored into the shapes the checkpoint records, on `device` (default: the first local
    one), whatever devices the run trained on. Anakin states carry a replica axis; replica 0 is taken.
    """
    import jax
    import orbax.checkpoint as ocp

    device = device or jax.local_devices()[0]
    item = storage.run_path(run_dir) / "checkpoints" / str(step)  # absolute, or a URI
    if storage.scheme(item) == "s3":
        storage.enable_orbax_s3()
    checkpointer = ocp.StandardCheckpointer()
    metadata = checkpointer.metadata(item / "state")
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), tree)
    state = checkpointer.restore(item / "state", target)
    checkpointer.close()
    params = state["train"]["params"]
    if architecture == "anakin":
        params = jax.tree.map(lambda x: x[0], params)  # [R, ...] -> replica 0
    meta_file = item / "meta" / "metadata"
    text = storage.read_text(meta_file)
    meta = json.loads(text) if text is not None else {}
    return params, meta


def _policy(agent, greedy: bool, channels_first: bool = False):
    """A jitted (params, obs [B, ...], key) -> action [B]: the agent's own `act_greedy` (greedy) or
    `act_with_noise` with its own noise (a sample of the policy; for MuZero, of the search)."""
    import jax

    from podray.envs.host_envs import to_channels_last

    @jax.jit
    def act(params, obs, key):
        obs = to_channels_last(obs, channels_first)
        if greedy:
            return agent.act_greedy(params, obs, key)
        return agent.act_with_noise(params, obs, agent.action_noise(jax.random.split(key, obs.shape[0])))[0]

    return act


# ---- JAX (gymnax) environments ------------------------------------------------------------------------


def _play_jax(request: EvalRequest, params, agent, env) -> tuple[list[float], list[int]]:
    """Plays request.episodes episodes in one compiled loop; returns their returns and lengths."""
    import jax
    import jax.numpy as jnp

    n = request.episodes
    limit = int(getattr(env._params, "max_steps_in_episode", 100_000)) + 1

    @jax.jit
    def play(params, key):
        reset_key, key = jax.random.split(key)
        state, obs = env.reset(jax.random.split(reset_key, n))
        zeros = jnp.zeros(n, jnp.float32)

        def cond(carry):
            t, _, _, _, _, finished, _ = carry
            return (t < limit) & ~finished.all()

        def body(carry):
            t, key, state, obs, returns, finished, lengths = carry
            key, act_key, step_key = jax.random.split(key, 3)
            if request.greedy:
                action = agent.act_greedy(params, obs, act_key)
            else:
                action, _ = agent.act_with_noise(params, obs, agent.action_noise(jax.random.split(act_key, n)))
            state, ts = env.step(state, action, jax.random.split(step_key, n))
            first_end = ts.done & ~finished
            returns = jnp.where(first_end, ts.episode_return, returns)
            lengths = jnp.where(first_end, ts.episode_length, lengths)
            return t + 1, key, state, ts.obs, returns, finished | ts.done, lengths

        carry = (0, key, state, obs, zeros, jnp.zeros(n, bool), jnp.zeros(n, jnp.int32))
        _, _, _, _, returns, finished, lengths = jax.lax.while_loop(cond, body, carry)
        return returns, lengths, finished

    returns, lengths, finished = jax.device_get(play(params, jax.random.PRNGKey(request.seed)))
    if not finished.all():
        raise RuntimeError(f"eval: {int((~finished).sum())} episodes did not end within {limit} steps")
    return [float(r) for r in returns], [int(x) for x in lengths]


def _jax_video_frames(request: EvalRequest, params, agent, env) -> list[np.ndarray]:
    """One episode of a JAX environment, rendered frame by frame with gymnax's renderer for it."""
    import os

    import jax
    import matplotlib

    # pygame (under gymnasium's renderer) draws off-screen: no display, no sound card
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from gymnax.visualize import Visualizer, vis_gym

    act = _policy(agent, request.greedy)

    @jax.jit
    def step(state, action, key):
        return env.step(state, action, key[None])

    key = jax.random.PRNGKey(request.seed + 1)
    key, reset_key = jax.random.split(key)
    state, obs = jax.jit(env.reset)(reset_key[None])
    states, rewards, total = [], [], 0.0
    limit = int(getattr(env._params, "max_steps_in_episode", 100_000))
    for _ in range(limit):
        states.append(jax.tree.map(lambda x: np.asarray(x[0]), state.inner))
        key, act_key, step_key = jax.random.split(key, 3)
        state, ts = step(state, act(params, obs, act_key), step_key)
        obs = ts.obs
        total += float(ts.reward[0])
        rewards.append(total)
        if bool(ts.done[0]):
            break
    if env.spec.name in vis_gym.SUPPORTED_GYM_ENVS:
        # classic control: gymnasium's own renderer, drawn from each gymnax state (600x400)
        return [np.asarray(vis_gym.render_gym_frame(env.spec.name, s, env._params)) for s in states]
    vis = Visualizer(env._env, env._params, states, rewards)
    try:
        vis.init()
        frames = []
        for i in range(len(states)):
            vis.update(i)
            vis.fig.canvas.draw()
            frames.append(np.asarray(vis.fig.canvas.buffer_rgba())[..., :3].copy())
    finally:
        plt.close(vis.fig)
    return frames


# ---- envpool (host) environments -----------------------------------------------------------------------


def _eval_options(config: config_lib.Config, render: bool):
    """The run's envpool options for evaluation: whole games (no episodic life), real rewards."""
    from dataclasses import replace

    from podray.envs import host_envs

    options = host_envs.HostEnvOptions.from_config(config.env)
    options = replace(options, episodic_life=False, reward_clip=False)
    return replace(options, render_mode="rgb_array") if render else options


def _play_host(
    request: EvalRequest, params, agent, episodes: int, seed: int, record: bool
) -> tuple[list[float], list[int], list[np.ndarray]]:
    """Plays `episodes` first episodes of as many envpool environments (one batch); with `record`, the
    frames of environment 0's episode through envpool's renderer. Returns returns, lengths, frames."""
    import jax

    from podray.envs import host_envs

    env = host_envs.HostEnv(request.config.env.name, episodes, seed=seed, options=_eval_options(request.config, record))
    act = _policy(agent, request.greedy, env.channels_first)
    returns = np.zeros(episodes, np.float64)
    lengths = np.zeros(episodes, np.int64)
    finished = np.zeros(episodes, bool)
    frames: list[np.ndarray] = []
    key = jax.random.PRNGKey(seed)
    try:
        obs, _ = env.reset()
        if record:
            frames.append(env.render(0))
        while not finished.all():
            key, act_key = jax.random.split(key)
            step = env.step(np.asarray(act(params, obs, act_key)))
            obs = step.obs
            lengths[~finished] += 1
            ended = step.episode_done & ~finished
            returns[ended] = step.episode_return[ended]
            if record and not finished[0]:
                frames.append(env.render(0))
            finished |= step.episode_done
    finally:
        env.close()
    return [float(r) for r in returns], [int(x) for x in lengths], frames


# ---- video files ------------------------------------------------------------------------------------


def write_video(path: pathlib.Path, frames: list[np.ndarray], fps: float) -> None:
    """Writes RGB frames [H, W, 3] uint8 as an mp4 (H.264 through the ffmpeg that imageio-ffmpeg ships)
    or a gif (Pillow)."""
    import imageio.v2 as imageio

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".gif":
        imageio.mimsave(path, frames, duration=1000.0 / fps, loop=0)
        return
    # macro_block_size=2: keep the frame's own size (yuv420p needs even sides; ours are).
    with imageio.get_writer(path, fps=fps, codec="libx264", quality=8, macro_block_size=2) as writer:
        for frame in frames:
            writer.append_data(frame)


def _fps(atari: bool) -> float:
    """Playback speed: an Atari game's own (60 frames/s, one agent step per 4 frames: envpool's frame
    skip); 30 agent steps a second elsewhere."""
    return 60.0 / 4 if atari else 30.0


# ---- the command -----------------------------------------------------------------------------------


def evaluate(request: EvalRequest) -> EvalResult:
    """Plays the request's episodes (and its video episode), writes eval.json; returns the result."""
    start = time.perf_counter()
    config = request.config
    from podray.agents import build_agent

    atari = False
    if config.architecture == "anakin":
        from podray.envs.jax_envs import JaxEnv

        env = JaxEnv(config.env.name)
        spec = env.spec
    else:
        from podray.envs import host_envs

        spec, atari = host_envs.env_spec(config.env.name)
    params, meta = restore_params(request.run_dir, request.step, config.architecture)
    # The run's whole config: MuZero's search (policy, simulations, considered actions) is its own.
    agent = build_agent(config, spec, num_updates=1, num_devices=1)
    params = _agent_params(agent, params)
    frames: list[np.ndarray] = []
    if config.architecture == "anakin":
        returns, lengths = _play_jax(request, params, agent, env)
        if request.video is not None:
            frames = _jax_video_frames(request, params, agent, env)
    else:
        returns, lengths, _ = _play_host(request, params, agent, request.episodes, request.seed, record=False)
        if request.video is not None:
            # The recorded game is an extra one, on an environment of its own (seed past the others').
            _, _, frames = _play_host(request, params, agent, 1, request.seed + request.episodes, record=True)
    if request.video is not None:
        write_video(request.video, frames, _fps(atari))
    result = EvalResult(
        run_dir=str(request.run_dir),
        checkpoint_step=request.step,
        env_steps=meta.get("env_steps"),
        env=config.env.name,
        policy="greedy" if request.greedy else "sample",
        episodes=len(returns),
        mean=statistics.fmean(returns),
        std=statistics.pstdev(returns),
        min=min(returns),
        max=max(returns),
        returns=returns,
        episode_lengths=lengths,
        seed=request.seed,
        video=str(request.video) if request.video is not None else None,
        video_frames=len(frames),
        wall_s=time.perf_counter() - start,
    )
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(result).items()}
    storage.write_text(request.run_dir / "eval.json", json.dumps(clean, indent=2) + "\n")
    return result
