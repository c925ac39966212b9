"""Typed run configuration: dataclasses, YAML presets, `--set` overrides and validation.

A `Config` is a tree of dataclasses. Every field has a default and a one-line docstring below it.
Presets in `configs/*.yaml` override some fields; `--set section.field=value` overrides more. The
whole config is validated before anything is compiled, and every error names the field and says what
would be valid (shared/DESIGN.md, principle 6).

This module is a leaf: it imports nothing from podray, and every other layer imports it. `validate`
here checks the fields and how they fit together; the checks that need an environment registry or a
device count live with the code that owns those (podray.envs.check_config, podray.host.check_devices),
and podray.validation.validate runs all of them.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem, with the offending field named in the message."""


# --------------------------------------------------------------------------------------------------
# The config tree


@dataclass
class EnvConfig:
    name: str = "CartPole-v1"
    """Environment id: a gymnax id for Anakin (e.g. CartPole-v1, Catch-bsuite, Breakout-MinAtar)."""
    num_envs: int = 0
    """Environments per replica, summed over all devices (must divide over them); 0 means
    envs_per_device on every device."""
    envs_per_device: int = 4
    """Environments per device and replica, used when num_envs is 0."""
    episodic_life: bool = True
    """Sebulba, Atari: a lost life ends the training episode (reported returns are whole games)."""
    reward_clip: bool = True
    """Sebulba, Atari: clip training rewards to their sign (reported returns are the real score)."""
    noop_max: int = 30
    """Sebulba, Atari: up to this many no-op actions at the start of each game (>= 1: envpool 1.2 crashes on 0)."""
    sticky_actions: float = 0.0
    """Sebulba, Atari: probability of repeating the previous action (0.25 in Machado et al.; 0 off)."""
    envpool_threads: int = 0
    """Sebulba: envpool worker threads per actor thread's pool; 0 lets envpool choose."""
    max_episode_steps: int = 0
    """Sebulba: time limit of an episode in agent steps; 0 keeps envpool's (Atari 27,000 = 108,000
    frames, CartPole-v1 500). An episode cut by it is truncated, not ended: its value is bootstrapped."""


@dataclass
class NetworkConfig:
    torso: str = "mlp"
    """Torso: 'mlp' for vector observations, 'nature_cnn' or 'impala_resnet' for pixels."""
    depth: int = 2
    """Depth: hidden layers (mlp), dense layers after the convolutions (nature_cnn), residual blocks
    per stage (impala_resnet)."""
    width: int = 64
    """Hidden units per dense layer (mlp) or of the dense layers after the torso (cnn, resnet)."""
    activation: str = "tanh"
    """Activation of the dense layers: 'tanh' or 'relu'."""
    shared_torso: bool = False
    """One torso for policy and value (True) or one each (False)."""
    value_head_scale: float = 1.0
    """Gain of the value head's orthogonal init. 0 starts the value at 0 in every state, so the first,
    state-independent value errors (Pong's returns are about -2) train the head's bias instead of
    pushing a shared torso's features to zero."""
    layer_norm: bool = False
    """LayerNorm on the pre-activations of the torso's dense layers. With Pong's nearly constant value
    targets and 16 gradient steps per batch, plain IMPALA's dense features died (96% zero in every state
    after 1,600-3,200 updates); normalised, every state keeps about half active, though on Pong the
    convolutions below then died instead."""
    chunk_rows: int = -1
    """Rows of a batch that a pixel torso (nature_cnn, impala_resnet) takes at a time; the result is
    the same, only the order of the float sums changes. -1 chooses by backend: on CPU 32 rows for
    nature_cnn and 16 for impala_resnet, where a conv's activations for a whole learner batch spill out
    of the caches (Nature-CNN's gradient at 672 rows runs about 3x faster in chunks;
    docs/benchmarks.md), else the whole batch. 0 means the whole batch."""


@dataclass
class AgentConfig:
    name: str = "ppo"
    """Agent: 'ppo' (clipped surrogate, GAE), 'impala' (V-trace actor-critic) or 'muzero' (a learned
    model searched with mctx, trained from a replay; sections search: and replay:)."""
    learning_rate: float = 2.5e-4
    """Optimizer learning rate (peak value when anneal_lr is set)."""
    anneal_lr: bool = True
    """Anneal the learning rate linearly to zero over the run."""
    optimizer: str = "adam"
    """Optimizer: 'adam', 'rmsprop' (optax's: eps inside the square root), or 'rmsprop_torch'
    (PyTorch's, as in torchbeast and Cleanba: eps after the square root, no momentum, decay 0.99).
    Their IMPALA sums the loss over a batch of N samples; podray's losses are means, so their eps of
    0.01 and gradient clip of 40 are 0.01 / N and 40 / N here."""
    adam_eps: float = 1e-5
    """Epsilon of Adam / RMSProp (optax; RMSProp adds it inside the square root). podray's losses are
    means over the batch, so keep it small: RMSProp's 0.01 of torchbeast assumes losses summed over the
    batch and here freezes learning."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip (0 disables)."""
    discount: float = 0.99
    """Discount factor gamma."""
    gae_lambda: float = 0.95
    """GAE lambda (ppo)."""
    clip_epsilon: float = 0.2
    """Clipping of the probability ratio (ppo)."""
    value_coef: float = 0.5
    """Weight of the value loss."""
    entropy_coef: float = 0.01
    """Weight of the entropy bonus."""
    epochs: int = 0
    """Passes over each batch of experience; 0 means the agent's default (ppo 4, impala 1)."""
    num_minibatches: int = 0
    """Minibatches per epoch; 0 means the agent's default (ppo 4, impala 1). PPO splits the per-device
    batch of samples (rollout_length x envs per device), IMPALA the per-device environments (V-trace
    needs whole sequences); the count must divide it."""
    normalize_advantages: bool = False
    """Normalise the policy-gradient advantages over the batch (impala; ppo always does). With a
    shared torso, IMPALA's raw advantages (about 0.1 on Atari with clipped rewards) make the policy
    gradient small beside the value loss's, which then shapes the torso alone."""
    vtrace_lambda: float = 1.0
    """Lambda of the V-trace targets (impala)."""
    clip_rho_threshold: float = 1.0
    """Importance-weight clip of the V-trace value targets (impala)."""
    clip_pg_rho_threshold: float = 1.0
    """Importance-weight clip of the V-trace policy-gradient advantages (impala)."""
    surrogate_clip: float = 0.0
    """IMPALA with a trust region (what RLlib calls APPO): above 0, the policy loss is PPO's clipped
    surrogate -min(rho A, clip(rho, 1 - eps, 1 + eps) A) with rho = pi / mu against the behaviour
    policy, A the V-trace advantage q_s - V(x_s) and eps this value; clip_pg_rho_threshold is then
    unused. 0 keeps IMPALA's policy gradient min(rho, clip_pg_rho_threshold) A log pi."""
    unroll_steps: int = 5
    """K, the steps the learned model is unrolled from each sampled state in the loss (muzero)."""
    td_steps: int = 10
    """n of the n-step value targets (muzero); value_bootstrap says which value they bootstrap from."""
    value_bootstrap: str = "search"
    """The value the n-step targets bootstrap from (muzero): 'search', the search's root value when the
    step was acted on, stored with the item; or 'reanalyse', the value head's value of the stored
    observation n steps on, computed at sampling time with the parameters the update started from
    (MuZero Reanalyse's fresh value targets: the search's value ages as the item waits in the replay,
    and early in a run it comes from a model that knew little). Reanalysing costs a forward pass of
    unroll_steps + 1 observations per sampled item; the observation after a trajectory's last step is
    not stored, so targets that bootstrap from it keep the learner's value of it at the time it came."""
    support_size: int = 10
    """Value and reward heads are categorical over the 2 * support_size + 1 integers of
    [-support_size, support_size] in h(x) space (h the invertible transform of Pohlen et al.; muzero)."""
    dynamics_blocks: int = 1
    """Residual blocks of the latent dynamics (muzero); the representation uses network.depth/width."""
    latent_channels: int = 0
    """The latent state of the model (muzero): 0 for a vector of network.width features with dense
    dynamics; above 0, a feature map of this many channels on the pixel torso's last one (7x7 for the
    Nature CNN at 84x84 frames) with convolutional dynamics, as MuZero and EfficientZero on Atari.
    Pixel torsos only."""
    reward_coef: float = 1.0
    """Weight of the reward loss (muzero); value_coef weights the value loss, the policy loss has 1."""
    consistency_coef: float = 0.0
    """Weight of the self-supervised consistency loss (muzero; EfficientZero, Ye et al., 2021): the
    latents the dynamics predicts at unroll steps 1..consistency_steps are trained, through a
    projection and a prediction head, towards the (gradient-stopped) projection of the representation
    of the observations actually reached, by negative cosine similarity. It gives the dynamics a dense
    signal about what each action does, where the reward and value targets alone carry little (sparse
    rewards, few gradient steps). 0 turns it off (MuZero)."""
    consistency_steps: int = 0
    """Unroll steps trained by the consistency loss, 1..unroll_steps; 0 means all of them. Each replay
    item stores this many more observations, so the replay's memory grows by that factor + 1."""


@dataclass
class SearchConfig:
    policy: str = "gumbel"
    """Search policy (MuZero agents): 'muzero' (PUCT, Dirichlet noise at the root, actions sampled
    from the visit counts with a temperature) or 'gumbel' (Gumbel MuZero: sequential halving at the
    root, which improves the policy even with few simulations)."""
    num_simulations: int = 16
    """Simulations per search (one network step each)."""
    max_depth: int = 0
    """Deepest a simulation may go below the root; 0 means no limit but num_simulations."""
    dirichlet_alpha: float = 0.25
    """Concentration of the Dirichlet noise added to the root prior (muzero policy)."""
    dirichlet_fraction: float = 0.25
    """Weight of that noise in the root prior, in [0, 1] (muzero policy)."""
    temperature: float = 1.0
    """Temperature of acting on the root's visit counts (muzero policy); 0 is greedy."""
    temperature_decay: list[float] = field(default_factory=list)
    """Fractions of the run's updates at which the temperature halves, increasing, in (0, 1)
    (MuZero's Atari schedule is [0.5, 0.75]: 1, 0.5, 0.25); empty keeps it constant."""
    gumbel_scale: float = 1.0
    """Scale of the Gumbel noise at the root (gumbel policy); 0 searches deterministically."""
    max_num_considered_actions: int = 16
    """Actions sequential halving starts from at the root (gumbel policy); at most the action count."""
    pb_c_init: float = 1.25
    """c1 of the PUCT rule (muzero policy)."""
    pb_c_base: float = 19652.0
    """c2 of the PUCT rule (muzero policy)."""
    value_normalization: str = "tree"
    """How Q-values are scaled to [0, 1] in PUCT (muzero policy): 'tree' (min-max over every visited
    edge of the tree, MuZero's MinMaxStats) or 'siblings' (over the node's value and its children's,
    mctx's default). The gumbel policy always rescales its completed Q-values by their min-max."""
    min_value_range: float = 0.0
    """The smallest range the min-max normalisation of Q-values divides by (both policies), in the
    value's own units: Q-values that differ by less than this are not stretched to span [0, 1]. 0
    stretches any difference (MuZero and mctx). While the model cannot yet tell actions apart, its
    Q-values differ only by noise, and stretching that noise to the full scale makes the search
    policy (and so the policy target) peak on arbitrary actions; a floor near the size of a
    meaningful value difference (a reward of 1 on clipped Atari rewards) keeps the search near the
    prior until the Q-values really differ. EfficientZero floors the range at 0.01."""


@dataclass
class ReplayConfig:
    capacity: int = 100_000
    """Transitions the replay holds, summed over learner devices (each device holds its share)."""
    min_size: int = 1_000
    """Transitions in the replay (summed over devices) before gradient steps begin."""
    batch_size: int = 256
    """Transitions per gradient step, summed over learner devices."""
    replay_ratio: float = 1.0
    """Sampled transitions per new transition: an update with N new transitions takes
    round(replay_ratio * N / batch_size) gradient steps (at least 1)."""
    sampling: str = "uniform"
    """'uniform' or 'prioritized' (priorities |value prediction - n-step target|, Schaul et al.)."""
    priority_exponent: float = 0.6
    """alpha of prioritised sampling: P(i) is proportional to priority_i ** alpha."""
    importance_exponent: float = 0.4
    """beta of the importance weights (N P(i)) ** -beta of prioritised sampling."""


@dataclass
class AnakinConfig:
    rollout_length: int = 128
    """Environment steps per update, per environment (T of the time-major trajectory)."""
    updates_per_call: int = 50
    """Updates fused into one compiled call; metrics are pulled once per call."""
    replicas: int = 1
    """Independent replicas (seeds) sharing each device through vmap."""


@dataclass
class SebulbaConfig:
    actor_devices: list[int] = field(default_factory=lambda: [0])
    """Indices (among the local devices) of the devices that run the actors' policy."""
    learner_devices: list[int] = field(default_factory=lambda: [1])
    """Indices of the devices that run the learner (disjoint from actor_devices)."""
    threads_per_actor_device: int = 2
    """Actor threads per actor device, each with its own envpool batch."""
    actor_batch_size: int = 32
    """Environments per actor thread (the batch of one inference call)."""
    envs_per_actor_thread: int = 0
    """envpool environments per actor thread; 0 means actor_batch_size (sync); a multiple k >= 2 of
    actor_batch_size is envpool's async mode (each step returns the first actor_batch_size ready)."""
    learner_batch_size: int = 32
    """Trajectories per learner step, summed over every learner device of every host (each of
    run.hosts hosts contributes learner_batch_size / hosts); that share is a multiple or a divisor of
    actor_batch_size."""
    rollout_length: int = 32
    """Environment steps per trajectory (T of the time-major trajectory)."""
    queue_size: int = 4
    """Trajectories (one per actor rollout) the actor-to-learner queue holds at most."""
    max_policy_lag: int = 8
    """Most learner updates between the parameters that acted and those that learn from it; staler
    trajectories are dropped (and counted)."""
    log_every: int = 10
    """Learner updates between metric reports."""
    timeout_s: float = 60.0
    """Longest wait on any queue or thread before the run fails with an error."""


@dataclass
class RunConfig:
    run_dir: str = ""
    """Run directory; empty means <runs root>/<name>-<timestamp>; a relative one goes under the runs root."""
    runs_root: str = ""
    """Directory that holds relative and defaulted run directories; empty takes $PODRAY_RUNS_ROOT, else
    the working directory (runs/<name>-<timestamp>). Ray jobs need it (or --run-dir) on durable storage:
    their working directory is a copy in Ray's cache, which Ray may delete (podray/run_dirs.py)."""
    devices: list[int] = field(default_factory=list)
    """Local device indices to use; empty means all local devices."""
    cpu_devices: int = 0
    """On CPU, fake this many host devices (XLA host platform device count); 0 leaves JAX alone."""
    checkpoint_every: int = 0
    """Checkpoint every this many updates (a multiple of updates_per_call); 0 means only at the end."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    tensorboard: bool = True
    """Also write TensorBoard event files to the run directory."""
    progress: bool = True
    """Print a live progress line to the console."""
    hosts: int = 1
    """Host workers (Ray actors, one JAX process each) forming one multi-host program; on CPU each
    fakes run.cpu_devices devices. Ignored on TPU slices, where the slice decides (run.tpu_topology)."""
    max_restarts: int = 2
    """Ray layer: how many times a group whose host worker died is restarted from the latest checkpoint."""
    seeds: list[int] = field(default_factory=list)
    """Ray layer: independent replicas of the run, one per seed, each with its own run directory
    (run_dir/seed-N) and metrics; empty means one run with `seed`."""
    tpu_topology: str = ""
    """Ray layer: reserve a TPU slice of this topology (e.g. 2x2x1 for v4-8, 2x2x4 for v4-32) through
    ray.util.tpu and place one host worker per TPU host; empty means CPU/GPU host workers."""
    tpu_version: str = ""
    """TPU generation of run.tpu_topology (e.g. v4, v5e, v5p, v6e)."""
    compile_cache: str = "auto"
    """JAX's persistent compilation cache, so that a second run of the same program loads its compiled
    executables instead of compiling them: 'auto' is $PODRAY_COMPILE_CACHE when set, else
    $XDG_CACHE_HOME/podray/jax (~/.cache/podray/jax); 'off' disables it; anything else is the directory.
    An entry's key covers the program, the jaxlib version, the backend and its version, the devices
    and the XLA flags, so an entry from another version or device set is never read."""


@dataclass
class Config:
    name: str = "anakin_cartpole"
    """Name of the run, used for the run directory."""
    architecture: str = "anakin"
    """Podracer architecture: 'anakin' (JAX environments) or 'sebulba' (envpool host environments)."""
    seed: int = 0
    """Seed of every PRNG key in the run."""
    total_env_steps: int = 512_000
    """Environment steps per replica; rounded up to a whole number of compiled calls."""
    env: EnvConfig = field(default_factory=EnvConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    anakin: AnakinConfig = field(default_factory=AnakinConfig)
    sebulba: SebulbaConfig = field(default_factory=SebulbaConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ARCHITECTURES = ("anakin", "sebulba")
AGENTS = ("ppo", "impala", "muzero")
TORSOS = ("mlp", "nature_cnn", "impala_resnet")
ACTIVATIONS = ("tanh", "relu")
OPTIMIZERS = ("adam", "rmsprop", "rmsprop_torch")
SGD_DEFAULTS = {"ppo": (4, 4), "impala": (1, 1), "muzero": (1, 1)}
"""(epochs, num_minibatches) of each agent where the config leaves them at 0."""


def sgd_schedule(agent: AgentConfig) -> tuple[int, int]:
    """(epochs, num_minibatches) of one update: the config's, or the agent's defaults for 0."""
    epochs, minibatches = SGD_DEFAULTS[agent.name]
    return agent.epochs or epochs, agent.num_minibatches or minibatches


# --------------------------------------------------------------------------------------------------
# Building a config from dicts, YAML presets and overrides


def _preset_dir() -> pathlib.Path:
    # configs/ beside the package in a checkout (editable install); podray/presets in a wheel.
    here = pathlib.Path(__file__).resolve().parent
    for candidate in (here.parent / "configs", here / "presets"):
        if candidate.is_dir():
            return candidate
    return here.parent / "configs"


PRESET_DIR = _preset_dir()


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true and false are booleans, so a bare on,
    off, yes or no stays a string (`run.compile_cache: off`, `--set run.compile_cache=off`)."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def yaml_load(text: str) -> Any:
    """Parses YAML text (configs, presets, --set values, Tune spaces) with YAML 1.2's booleans."""
    return yaml.load(text, Loader=_YamlLoader)


def _coerce(path: str, tp: Any, value: Any) -> Any:
    """Checks `value` against the annotated type `tp`; returns it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list of {_type_name(item_tp)}, got {value!r}")
        return [_coerce(f"{path}[{i}]", item_tp, v) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(path, arg, value)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: {value!r} is not one of {args}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{path}: must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _apply(obj: Any, updates: dict[str, Any], prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in names:
            shown = path if path.isprintable() else repr(path)
            raise ConfigError(f"{shown}: unknown key; valid keys here are {', '.join(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{path}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(current))}"
                )
            _apply(current, value, prefix=f"{path}.")
        else:
            setattr(obj, key, _coerce(path, hints[key], value))


def from_dict(data: dict[str, Any] | None, base: Config | None = None) -> Config:
    """Builds a Config from a nested dict over `base` (defaults if None); rejects unknown keys."""
    config = dataclasses.replace(base) if base is not None else Config()
    config = _deepcopy(config)
    if data:
        if not isinstance(data, dict):
            raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
        _apply(config, data)
    return config


def _deepcopy(config: Config) -> Config:
    import copy

    return copy.deepcopy(config)


def load_yaml(path_or_name: str) -> dict[str, Any]:
    """Reads a preset by name (configs/NAME.yaml) or a YAML file by path."""
    path = pathlib.Path(path_or_name)
    if not path.suffix and not path.exists():
        path = PRESET_DIR / f"{path_or_name}.yaml"
        if not path.exists():
            raise ConfigError(
                f"preset '{path_or_name}' does not exist; presets are {', '.join(preset_names())}, "
                "or give the path of a YAML file"
            )
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_one_line(e)}") from None
    return data or {}


def _one_line(error: BaseException) -> str:
    """A YAML parser's multi-line message (with its caret diagram) as one line."""
    return " ".join(str(error).split())


_FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def parse_override(text: str) -> dict[str, Any]:
    """Turns 'agent.learning_rate=3e-4' into {'agent': {'learning_rate': 3e-4}} (values are YAML)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.field=value, e.g. agent.learning_rate=3e-4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {text!r}: empty field name")
    if not _FIELD_PATH.fullmatch(key):
        raise ConfigError(
            f"--set {text!r}: field name {key!r} is not section.field (letters, digits and _ joined by dots), "
            "e.g. agent.learning_rate=3e-4"
        )
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {_one_line(e)}") from None
    if isinstance(value, str):
        # YAML reads '1e5' as a string; accept plain scientific notation as numbers.
        try:
            value = int(value) if value.lstrip("+-").isdigit() else float(value)
        except ValueError:
            pass
    return nest({key: value})


def nest(dotted: dict[str, Any]) -> dict[str, Any]:
    """{'network.depth': 2} -> {'network': {'depth': 2}}."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def flatten(nested: typing.Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'network': {'depth': 2}} -> {'network.depth': 2}: the inverse of `nest`."""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, typing.Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load(preset: str | None = None, overrides: typing.Sequence[str] = (), check: bool = True) -> Config:
    """Builds and validates (unless `check` is False) a Config from a preset name or YAML path plus
    `--set` overrides."""
    data = load_yaml(preset) if preset else load_yaml("anakin_cartpole")
    for text in overrides:
        data = _merge(data, parse_override(text))
    config = from_dict(data)
    if check:
        validate(config)
    return config


RESUME_FIELDS = (
    "total_env_steps",
    "run.progress",
    "run.tensorboard",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "sebulba.timeout_s",
    "run.hosts",
    "run.cpu_devices",
)
"""Fields `--set` may change on `--resume`: they leave the meaning of the checkpoint alone. A larger
total_env_steps extends the run; an annealed learning rate is then stretched over the new total (it
rises from where the old schedule had taken it to what the new one gives at this update). run.hosts
and run.cpu_devices may regroup the same total of devices (2 hosts x 1 device resume as 1 x 2): the
checkpoint restores onto the resuming program's mesh; another total is refused at restore, since the
per-device shards (environments, replay) would not fit."""


def resume_overrides(config: Config, overrides: typing.Sequence[str]) -> Config:
    """`config` (a run directory's) with the `--set` overrides of a `--resume`, which may only touch
    RESUME_FIELDS; any other field would change what the checkpoint means, so it is an error."""
    data: dict[str, Any] = {}
    for text in overrides:
        override = parse_override(text)  # a malformed override gets parse_override's own message
        key = text.split("=", 1)[0].strip()
        if key not in RESUME_FIELDS:
            raise ConfigError(
                f"{key}: cannot be changed when resuming (the checkpoint was made with the run's value); "
                f"--set on --resume takes only {', '.join(RESUME_FIELDS)}. To change it, start a new run"
            )
        data = _merge(data, override)
    return from_dict(data, base=config)


# --------------------------------------------------------------------------------------------------
# Validation of the fields (no JAX, no environment registry; see podray.validation for the whole check)


def _positive(path: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"{path}: must be positive, got {value}")


def _choice(path: str, value: str, allowed: typing.Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}: '{value}' is not valid; choose one of {', '.join(allowed)}")


def validate(config: Config) -> None:
    """Checks every field and how the fields fit together; raises ConfigError naming the field.

    Imports no environment and starts no JAX: podray.validation.validate adds the environment registry
    and device-count checks."""
    _choice("architecture", config.architecture, ARCHITECTURES)
    _positive("total_env_steps", config.total_env_steps)
    if config.env.num_envs < 0:
        raise ConfigError(f"env.num_envs: must be >= 0 (0 means envs_per_device per device), got {config.env.num_envs}")
    if config.env.num_envs == 0:
        _positive("env.envs_per_device", config.env.envs_per_device)
    n = config.network
    _choice("network.torso", n.torso, TORSOS)
    _choice("network.activation", n.activation, ACTIVATIONS)
    _positive("network.depth", n.depth)
    _positive("network.width", n.width)
    if n.value_head_scale < 0:
        raise ConfigError(f"network.value_head_scale: must be >= 0, got {n.value_head_scale}")
    if n.chunk_rows < -1:
        raise ConfigError(
            f"network.chunk_rows: must be -1 (by backend), 0 (whole batch) or a positive row count, got {n.chunk_rows}"
        )
    a = config.agent
    _choice("agent.name", a.name, AGENTS)
    _choice("agent.optimizer", a.optimizer, OPTIMIZERS)
    _positive("agent.learning_rate", a.learning_rate)
    for name in ("epochs", "num_minibatches"):
        if getattr(a, name) < 0:
            raise ConfigError(f"agent.{name}: must be >= 0 (0 means the agent's default), got {getattr(a, name)}")
    if a.max_grad_norm < 0:
        raise ConfigError(f"agent.max_grad_norm: must be >= 0 (0 disables clipping), got {a.max_grad_norm}")
    for name in ("discount", "gae_lambda", "vtrace_lambda"):
        value = getattr(a, name)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"agent.{name}: must be in [0, 1], got {value}")
    for name in ("clip_epsilon", "clip_rho_threshold", "clip_pg_rho_threshold"):
        _positive(f"agent.{name}", getattr(a, name))
    if not 0.0 <= a.surrogate_clip < 1.0:
        raise ConfigError(
            f"agent.surrogate_clip: must be in [0, 1) (0 = IMPALA's policy gradient, e.g. 0.1 for a clipped"
            f" surrogate), got {a.surrogate_clip}"
        )
    if a.surrogate_clip > 0 and a.name != "impala":
        raise ConfigError(
            f"agent.surrogate_clip: applies to agent.name=impala only (ppo clips with agent.clip_epsilon),"
            f" got agent.name={a.name}"
        )
    for name in ("value_coef", "entropy_coef"):
        if getattr(a, name) < 0:
            raise ConfigError(f"agent.{name}: must be >= 0, got {getattr(a, name)}")
    if a.name == "muzero":
        _validate_muzero(config)
    k = config.anakin
    _positive("anakin.rollout_length", k.rollout_length)
    _positive("anakin.updates_per_call", k.updates_per_call)
    _positive("anakin.replicas", k.replicas)
    r = config.run
    if config.architecture == "anakin" and (r.checkpoint_every < 0 or r.checkpoint_every % k.updates_per_call):
        raise ConfigError(
            f"run.checkpoint_every: {r.checkpoint_every} must be 0 or a positive multiple of "
            f"anakin.updates_per_call ({k.updates_per_call}), since checkpoints are taken between calls"
        )
    _positive("run.keep_checkpoints", r.keep_checkpoints)
    if r.cpu_devices < 0:
        raise ConfigError(f"run.cpu_devices: must be >= 0, got {r.cpu_devices}")
    _positive("run.hosts", r.hosts)
    if r.max_restarts < 0:
        raise ConfigError(f"run.max_restarts: must be >= 0 (0 means fail on the first lost host), got {r.max_restarts}")
    if len(set(r.seeds)) != len(r.seeds):
        raise ConfigError(f"run.seeds: seeds must be distinct, got {r.seeds}")
    if bool(r.tpu_topology) != bool(r.tpu_version):
        raise ConfigError(
            "run.tpu_topology and run.tpu_version go together (e.g. run.tpu_topology=2x2x4 "
            f"run.tpu_version=v4); got topology '{r.tpu_topology}', version '{r.tpu_version}'"
        )
    if r.tpu_topology:
        _check_tpu_slice(r.tpu_topology, r.tpu_version)
    if r.tpu_topology and r.hosts != 1:
        raise ConfigError("run.hosts: leave it at 1 with run.tpu_topology; the TPU slice sets the number of hosts")
    if any(i < 0 for i in r.devices) or len(set(r.devices)) != len(r.devices):
        raise ConfigError(f"run.devices: indices must be distinct and >= 0, got {r.devices}")
    if config.architecture == "sebulba":
        _validate_sebulba(config)
    if r.devices and r.cpu_devices and max(r.devices) >= r.cpu_devices:
        raise ConfigError(f"run.devices: index {max(r.devices)} is out of range for run.cpu_devices={r.cpu_devices}")


def _validate_muzero(config: Config) -> None:
    """The MuZero agent's fields and the search: and replay: sections (pure field checks)."""
    a, s, r = config.agent, config.search, config.replay
    if a.unroll_steps < 1:
        raise ConfigError(
            f"agent.unroll_steps: K must be >= 1 (MuZero unrolls its model K steps), got {a.unroll_steps}"
        )
    _positive("agent.td_steps", a.td_steps)
    _choice("agent.value_bootstrap", a.value_bootstrap, ("search", "reanalyse"))
    _positive("agent.support_size", a.support_size)
    if a.dynamics_blocks < 0:
        raise ConfigError(f"agent.dynamics_blocks: must be >= 0, got {a.dynamics_blocks}")
    if a.latent_channels < 0:
        raise ConfigError(f"agent.latent_channels: must be >= 0 (0: a vector latent), got {a.latent_channels}")
    if a.latent_channels and config.network.torso == "mlp":
        raise ConfigError(
            f"agent.latent_channels: {a.latent_channels} asks for a spatial latent, which needs a pixel torso "
            "(network.torso nature_cnn or impala_resnet); use 0 with the mlp torso"
        )
    if a.reward_coef < 0:
        raise ConfigError(f"agent.reward_coef: must be >= 0, got {a.reward_coef}")
    if a.consistency_coef < 0:
        raise ConfigError(f"agent.consistency_coef: must be >= 0 (0 turns the loss off), got {a.consistency_coef}")
    if not 0 <= a.consistency_steps <= a.unroll_steps:
        raise ConfigError(
            f"agent.consistency_steps: must be in [0, agent.unroll_steps={a.unroll_steps}] (0 means all), "
            f"got {a.consistency_steps}"
        )
    if a.epochs > 1 or a.num_minibatches > 1:
        raise ConfigError(
            "agent.epochs / agent.num_minibatches: muzero takes its gradient steps from the replay "
            "(replay.replay_ratio, replay.batch_size); leave them at 0"
        )
    _choice("search.policy", s.policy, ("muzero", "gumbel"))
    if s.num_simulations < 1:
        raise ConfigError(f"search.num_simulations: must be >= 1, got {s.num_simulations}")
    if s.max_depth < 0:
        raise ConfigError(f"search.max_depth: must be >= 0 (0 means no limit), got {s.max_depth}")
    _positive("search.dirichlet_alpha", s.dirichlet_alpha)
    if not 0.0 <= s.dirichlet_fraction <= 1.0:
        raise ConfigError(f"search.dirichlet_fraction: must be in [0, 1], got {s.dirichlet_fraction}")
    if s.temperature < 0:
        raise ConfigError(
            f"search.temperature: must be >= 0 (0 acts greedily on the visit counts), got {s.temperature}"
        )
    decay = s.temperature_decay
    if any(not 0.0 < b < 1.0 for b in decay) or any(x >= y for x, y in zip(decay, decay[1:])):
        raise ConfigError(
            f"search.temperature_decay: fractions of the run must increase within (0, 1), e.g. [0.5, 0.75]; got {decay}"
        )
    if s.gumbel_scale < 0:
        raise ConfigError(f"search.gumbel_scale: must be >= 0, got {s.gumbel_scale}")
    if s.max_num_considered_actions < 1:
        raise ConfigError(f"search.max_num_considered_actions: must be >= 1, got {s.max_num_considered_actions}")
    _positive("search.pb_c_init", s.pb_c_init)
    _positive("search.pb_c_base", s.pb_c_base)
    _choice("search.value_normalization", s.value_normalization, ("tree", "siblings"))
    if s.min_value_range < 0:
        raise ConfigError(f"search.min_value_range: must be >= 0 (0 normalises any range), got {s.min_value_range}")
    _positive("replay.capacity", r.capacity)
    _positive("replay.batch_size", r.batch_size)
    if r.replay_ratio <= 0:
        raise ConfigError(f"replay.replay_ratio: must be > 0 (sampled transitions per new one), got {r.replay_ratio}")
    if not 0 <= r.min_size <= r.capacity:
        raise ConfigError(f"replay.min_size: must be in [0, replay.capacity={r.capacity}], got {r.min_size}")
    _choice("replay.sampling", r.sampling, ("uniform", "prioritized"))
    if r.priority_exponent < 0:
        raise ConfigError(f"replay.priority_exponent: must be >= 0, got {r.priority_exponent}")
    if not 0.0 <= r.importance_exponent <= 1.0:
        raise ConfigError(f"replay.importance_exponent: must be in [0, 1], got {r.importance_exponent}")


def check_num_actions(config: Config, num_actions: int) -> None:
    """The search fields that need the environment's action count (still before any compilation)."""
    if config.agent.name == "muzero" and config.search.policy == "gumbel":
        m = config.search.max_num_considered_actions
        if m > num_actions:
            raise ConfigError(
                f"search.max_num_considered_actions: {m} is more than the {num_actions} actions of "
                f"{config.env.name}; use at most {num_actions}"
            )


def _check_tpu_slice(topology: str, version: str) -> None:
    """Asks Ray's own TPU helpers whether the slice exists (no compilation, no cluster needed)."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager
    from ray.util.tpu import get_tpu_version_from_type

    try:
        generation = get_tpu_version_from_type(version)
    except ValueError as e:
        raise ConfigError(f"run.tpu_version: {e}") from None
    if not TPUAcceleratorManager.is_valid_tpu_accelerator_topology(
        tpu_accelerator_version=generation, tpu_topology=topology
    ):
        raise ConfigError(
            f"run.tpu_topology: '{topology}' is not a topology of TPU {version} (e.g. 2x2x1, 2x2x4 for v4)"
        )


def _validate_sebulba(config: Config) -> None:
    """The fields of the Sebulba section and of its host environments."""
    s, e, r = config.sebulba, config.env, config.run
    for name in ("actor_devices", "learner_devices"):
        indices = getattr(s, name)
        if not indices:
            raise ConfigError(f"sebulba.{name}: needs at least one device index, e.g. [0]")
        if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
            raise ConfigError(f"sebulba.{name}: indices must be distinct and >= 0, got {indices}")
    overlap = sorted(set(s.actor_devices) & set(s.learner_devices))
    if overlap:
        raise ConfigError(
            f"sebulba.learner_devices: device(s) {overlap} are also in sebulba.actor_devices; the split must be "
            f"disjoint, e.g. actor_devices=[0], learner_devices=[1] (on CPU, run.cpu_devices fakes more devices)"
        )
    for name in (
        "threads_per_actor_device",
        "actor_batch_size",
        "learner_batch_size",
        "rollout_length",
        "queue_size",
        "log_every",
        "timeout_s",
    ):
        _positive(f"sebulba.{name}", getattr(s, name))
    if s.max_policy_lag < 0:
        raise ConfigError(f"sebulba.max_policy_lag: must be >= 0, got {s.max_policy_lag}")
    if s.envs_per_actor_thread and (
        s.envs_per_actor_thread < 2 * s.actor_batch_size or s.envs_per_actor_thread % s.actor_batch_size
    ):
        raise ConfigError(
            f"sebulba.envs_per_actor_thread: {s.envs_per_actor_thread} must be 0 (sync) or a multiple >= 2 of "
            f"sebulba.actor_batch_size ({s.actor_batch_size}) for envpool's async mode"
        )
    if not r.tpu_topology:  # a TPU slice's host count comes from Ray (podray.validation checks it then)
        check_sebulba_batches(config, r.hosts)
    if r.checkpoint_every < 0 or r.checkpoint_every % s.log_every:
        raise ConfigError(
            f"run.checkpoint_every: {r.checkpoint_every} must be 0 or a positive multiple of sebulba.log_every "
            f"({s.log_every}), since checkpoints are taken at reports"
        )
    if e.noop_max < 1:
        raise ConfigError(f"env.noop_max: must be >= 1 (envpool 1.2 crashes with 0), got {e.noop_max}")
    if e.envpool_threads < 0:
        raise ConfigError(f"env.envpool_threads: must be >= 0, got {e.envpool_threads}")
    if e.max_episode_steps < 0:
        raise ConfigError(
            f"env.max_episode_steps: must be >= 0 (0 keeps envpool's time limit), got {e.max_episode_steps}"
        )
    if not 0.0 <= e.sticky_actions <= 1.0:
        raise ConfigError(f"env.sticky_actions: must be in [0, 1], got {e.sticky_actions}")


def check_sebulba_batches(config: Config, hosts: int) -> None:
    """Sebulba's batches over `hosts` hosts: the global learner batch divides over every learner device
    of every host, each host's share is a multiple or a divisor of the actor batch, and its pieces split
    over the host's learner devices."""
    s = config.sebulba
    n_learners = len(s.learner_devices)
    if hosts > 1 and s.learner_batch_size % (hosts * n_learners):
        raise ConfigError(
            f"sebulba.learner_batch_size: {s.learner_batch_size} is the global learner batch and must divide "
            f"over {hosts} host(s) x {n_learners} learner device(s) per host; use a multiple of "
            f"{hosts * n_learners}, e.g. {hosts * n_learners * max(1, s.learner_batch_size // (hosts * n_learners))}"
        )
    host_batch = s.learner_batch_size // hosts  # what each host's actors contribute to a learner step
    share = f" / {hosts} hosts = {host_batch}" if hosts > 1 else ""
    if host_batch % s.actor_batch_size and s.actor_batch_size % host_batch:
        raise ConfigError(
            f"sebulba.learner_batch_size: {s.learner_batch_size}{share} must be a multiple or a divisor of "
            f"sebulba.actor_batch_size ({s.actor_batch_size}): a learner step gathers whole actor trajectories, "
            f"or an actor trajectory is cut into learner batches"
        )
    piece = min(s.actor_batch_size, host_batch)
    if piece % n_learners:
        field_ = "actor_batch_size" if piece == s.actor_batch_size else "learner_batch_size"
        raise ConfigError(
            f"sebulba.{field_}: {piece} does not split over {n_learners} learner devices; "
            f"use a multiple of {n_learners}"
        )
    check_minibatches(
        config.agent,
        host_batch // n_learners,
        s.rollout_length,
        "sebulba.learner_batch_size / learner devices",
        "sebulba.rollout_length",
    )


def num_envs(config: Config, num_devices: int) -> int:
    """Environments per replica over all `num_devices` devices."""
    return config.env.num_envs or config.env.envs_per_device * num_devices


def check_minibatches(agent: AgentConfig, envs: int, rollout_length: int, envs_field: str, t_field: str) -> None:
    """PPO's minibatches split the per-device samples, IMPALA's the per-device environments."""
    _, mb = sgd_schedule(agent)
    if agent.name == "impala":
        size, what = envs, f"environments per device ({envs_field})"
    else:
        size, what = rollout_length * envs, f"batch ({t_field} x {envs_field})"
    if size % mb:
        raise ConfigError(
            f"agent.num_minibatches: {mb} does not divide the per-device {what} of {size}; choose a divisor of {size}"
        )


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
