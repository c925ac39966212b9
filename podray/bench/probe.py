"""What an agent's network does with random-play frames: `podray bench probe RUN_DIR`.

For a run directory (its config.yaml and latest checkpoint), and for the same network freshly
initialised, it reports on frames from random play of the run's host environment:
  - the torso's features: mean |feature|, the fraction never active (a ReLU feature that is 0 on every
    frame gets no gradient), and their spread over states (mean std of a feature across frames);
  - the policy: the logits' std across frames per action, and the mean action probabilities;
  - each layer of the torso (convolutions and dense layers, after their ReLU): the fraction of its
    channels never active on any frame and position, and their spread over states. A dead layer cuts
    every gradient to the layers below it, so this says where a torso died;
  - the value: mean and std across frames.
A policy can only depend on the state through features that vary with it; docs/benchmarks.md (the
Pong runs) shows how these figures tell a dying or state-blind torso from one that is learning.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from podray import config as config_lib
from podray.agents import make_agent
from podray.agents.networks import ImpalaResNet, MLPTorso, NatureCNN
from podray.checkpoint import Checkpointer
from podray.envs import host_envs


def random_play_frames(config: config_lib.Config, frames: int, seed: int = 3, envs: int = 8) -> np.ndarray:
    """About `frames` observations (envpool's layout) of uniformly random play, every other step."""
    options = host_envs.HostEnvOptions.from_config(config.env)
    env = host_envs.HostEnv(config.env.name, envs, envs, seed=seed, options=options)
    try:
        obs, _ = env.reset()
        rng = np.random.default_rng(seed)
        kept = []
        for t in range(2 * -(-frames // envs)):
            obs = env.step(rng.integers(0, env.spec.num_actions, envs)).obs
            if t % 2:
                kept.append(obs)
        return np.concatenate(kept)[:frames]
    finally:
        env.close()


_TORSOS = (NatureCNN, ImpalaResNet, MLPTorso)


def forward(agent, channels_first: bool):
    """A jitted (params, obs [N, ...] in envpool's layout) -> (network output, policy-torso features
    [N, F], {torso layer path: pre-activations [N, ..., C]}), from one pass of the network."""
    prefixes = tuple(t.__name__ for t in _TORSOS)
    keep = (*_TORSOS, nn.Conv, nn.Dense)

    @jax.jit
    def run(params, obs):
        obs = host_envs.to_channels_last(obs, channels_first)
        out, state = agent.network.apply(
            params, obs, capture_intermediates=lambda m, name: name == "__call__" and isinstance(m, keep)
        )
        # The first torso is the policy's (the only one when shared); chunked calls are concatenated.
        features = jnp.concatenate(next(iter(state["intermediates"].values()))["__call__"])
        layers = {}
        leaves = jax.tree_util.tree_flatten_with_path(state["intermediates"], is_leaf=lambda x: isinstance(x, tuple))
        for path, calls in leaves[0]:
            names = [str(getattr(k, "key", k)) for k in path if str(getattr(k, "key", k)) != "__call__"]
            # a torso's own output is its features, above; the heads are left out
            if len(names) > 1 and names[0].startswith(prefixes):
                layers["/".join(names)] = jnp.concatenate(calls)
        return out, features, layers

    return run


def layer_health(layers: dict[str, Any], activation: str = "relu") -> dict[str, dict[str, float]]:
    """Per torso layer (pre-activations from forward()), after its activation: dead (ReLU: fraction of
    channels zero on every frame and position; tanh: fraction that do not vary over frames) and spread
    (std over frames, averaged over channels and positions)."""
    out = {}
    for name, z in layers.items():
        z = np.asarray(z, np.float64)
        a = np.tanh(z) if activation == "tanh" else np.maximum(z, 0.0)
        per_channel = a.reshape(a.shape[0], -1, a.shape[-1])  # [N, positions, C]
        std = per_channel.std(axis=0)  # [positions, C]
        dead = std.max(axis=0) <= 1e-6 if activation == "tanh" else per_channel.max(axis=(0, 1)) <= 0
        out[name] = {"dead": float(dead.mean()), "spread": float(std.mean())}
    return out


def probe(run, params: Any, frames: np.ndarray, activation: str = "relu") -> dict[str, Any]:
    """The figures of the module docstring for `params` on `frames` [N, ...], with `run` from forward()."""
    out, features, layers = run(params, jnp.asarray(frames))
    features, logits, value = (np.asarray(x, np.float64) for x in (features, out.logits, out.value))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return {
        "features": features.shape[-1],
        "mean_abs_feature": float(np.abs(features).mean()),
        "dead_fraction": float((features.max(0) <= 0).mean()),
        "feature_spread": float(features.std(0).mean()),
        "logit_spread": [round(float(s), 4) for s in logits.std(0)],
        "mean_probs": [round(float(p), 4) for p in probs.mean(0)],
        "value_mean": float(value.mean()),
        "value_std": float(value.std()),
        "layers": layer_health(layers, activation),
    }


def probe_run(
    run_dir: str | pathlib.Path, frames: int = 2400, seed: int = 3, step: int | None = None
) -> dict[str, Any]:
    """Probes a Sebulba run's checkpoint (`step`, default the latest) and the same network at init."""
    from podray import storage
    from podray.learners.learner import LearnerState
    from podray.training import load_run_config

    run_dir = storage.run_path(run_dir)  # a local run or one on an object store
    config = load_run_config(run_dir)
    if config.architecture != "sebulba":
        raise config_lib.ConfigError(f"bench probe: {run_dir} is a {config.architecture} run; it probes sebulba runs")
    checkpoints = Checkpointer(run_dir / "checkpoints")
    steps = checkpoints.all_steps()
    if not steps:
        raise FileNotFoundError(f"bench probe: no checkpoint in {run_dir / 'checkpoints'}; probe a run that saved one")
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise config_lib.ConfigError(
            f"bench probe --step: no checkpoint {step} in {run_dir}; there are {sorted(steps)}"
        )
    spec, channels_first = host_envs.env_spec(config.env.name)
    agent = make_agent(config.agent, config.network, spec, num_updates=1)
    init = LearnerState(train=agent.init(jax.random.PRNGKey(config.seed)), key=jax.random.PRNGKey(0))
    state, meta = checkpoints.restore(init, step)
    checkpoints.close()
    obs = random_play_frames(config, frames, seed)
    run = forward(agent, channels_first)
    activation = config.network.activation if config.network.torso == "mlp" else "relu"
    return {
        "run_dir": str(run_dir),
        "checkpoint_step": int(step),
        "env_steps": meta.get("env_steps"),
        "frames": int(len(obs)),
        "init": probe(run, init.train.params, obs, activation),
        "trained": probe(run, state.train.params, obs, activation),
    }


def main(run_dir: str, out: str | None = None, frames: int = 2400, step: int | None = None) -> dict[str, Any]:
    result = probe_run(run_dir, frames, step=step)
    where = f"{result['run_dir']} @ update {result['checkpoint_step']} ({result['env_steps']} env steps)"
    print(f"{where}, {result['frames']} frames")
    for name in ("init", "trained"):
        r = result[name]
        print(
            f"  {name:>7}: |f| {r['mean_abs_feature']:.4f}  dead {r['dead_fraction']:.2f}"
            f"  spread {r['feature_spread']:.4f}"
            f"  value {r['value_mean']:+.2f} +- {r['value_std']:.2f}  logit spread {r['logit_spread']}"
            f"  mean probs {r['mean_probs']}"
        )
        print(
            "           layers (dead, spread): "
            + "  ".join(
                f"{'/'.join(k.split('/')[-2:])} {v['dead']:.2f} {v['spread']:.4f}" for k, v in r["layers"].items()
            )
        )
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
