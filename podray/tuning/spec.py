"""A study: its typed values (read from a tune YAML by podray.tuning.parse), and the checks of every
trial it can produce, made before Ray starts a trial.

    name: anakin_cartpole_batch_depth
    base: anakin_cartpole              # a preset of configs/ or the path of a config YAML
    overrides: {total_env_steps: 200000}   # fixed changes to the base, like --set
    search:                            # config field -> one distribution
      env.envs_per_device: {grid: [4, 16]}
      network.depth: {grid: [1, 2]}
      agent.learning_rate: {loguniform: [1.0e-4, 1.0e-3]}
    metric: mean_return
    mode: max
    scheduler: {name: asha, grace_period: 50000}
    samples: 1
    concurrency: 2
    resources: {cpus: 1, accelerator: cpu, devices: 1, hosts: 1}

A trial can span several hosts (podray.tuning.trainable.launch runs it through the Ray layer):

    resources: {accelerator: cpu, devices: 2, hosts: 2}                # 2 CPU host workers of 2 fake devices
    resources: {accelerator: tpu, tpu_topology: 2x2x2, tpu_version: v4}  # one whole v4-16 slice per trial

A TPU slice sets `hosts` and `devices` (its hosts, chips per host; given values must agree). The trial's
placement group holds its own CPU bundle plus one bundle per host of the slice, the first with the
slice's TPU-<pod type>-head resource (so Tune runs at most as many trials as the cluster has slices),
all kept on one slice by Ray's topology-aware scheduling (podray.cluster.tpu). The slice is set through
`resources` only: a base config with other run.tpu_topology / run.tpu_version is rejected. `hosts > 1`
without a slice is for CPU hosts only (not GPU).

Every trial a study can produce is checked by building its Config with podray.config and validating
it (and its device split): every grid and choice value, and both ends of every range. A bad field,
distribution, value or resource is a ConfigError naming it, raised before Ray is touched.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import random
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator

from podray import config as config_lib
from podray import validation
from podray.config import ConfigError

DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform", "randint")
SCHEDULERS = ("fifo", "asha", "pbt")
MODES = ("max", "min")
ACCELERATORS = ("cpu", "gpu", "tpu")
METRICS = (
    "mean_return",
    "env_steps",
    "frames_per_s",
    "steps_per_s",
    "episodes",
    "updates",
    "loss",
    "policy_loss",
    "value_loss",
    "entropy",
)
"""What every trial reports (each architecture's sink rows, plus frames_per_s)."""

SHAPE_FREE_FIELDS = (
    "agent.learning_rate",
    "agent.entropy_coef",
    "agent.value_coef",
    "agent.discount",
    "agent.gae_lambda",
    "agent.clip_epsilon",
    "agent.vtrace_lambda",
    "agent.clip_rho_threshold",
    "agent.clip_pg_rho_threshold",
    "agent.adam_eps",
)
"""Fields PBT may mutate: they change no array shape and no pytree structure of the program state, so
one trial's checkpoint restores into another trial's program (which recompiles with the new values)."""

TUNE_OWNED_FIELDS = (
    "run.run_dir",
    "run.devices",
    "run.cpu_devices",
    "run.hosts",
    "run.tpu_topology",
    "run.tpu_version",
    "run.checkpoint_every",
    "run.progress",
)
"""Set by podray tune for each trial (run directory; devices, hosts and TPU slice from `resources`; a
checkpoint per report)."""

BATCH_FIELDS = (
    "env.envs_per_device",
    "env.num_envs",
    "sebulba.actor_batch_size",
    "sebulba.learner_batch_size",
)
"""Fields plotted as 'batch size' (those the study searches; else the architecture's first)."""

MAX_CHECKED_TRIALS = 10_000
"""Above this many combinations, each dimension is checked alone and a seeded sample of combinations."""


# --------------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class Dimension:
    """One searched (or mutated) config field.

    Attributes:
      field: dotted config field, e.g. 'network.depth'.
      kind: one of DISTRIBUTIONS.
      values: the grid or choice values, or [low, high] of a range (randint's high is excluded).
    """

    field: str
    kind: str
    values: tuple

    def representatives(self) -> list:
        """Values that stand for the whole distribution when checking trials (ranges: both ends)."""
        if self.kind in ("grid", "choice"):
            return list(self.values)
        low, high = self.values
        return [low, high - 1] if self.kind == "randint" else [low, high]

    def to_yaml(self) -> dict:
        return {self.kind: list(self.values)}


@dataclass(frozen=True)
class Scheduler:
    """How trials are stopped or exploited. Times are in env steps (the `env_steps` metric).

    Attributes:
      name: 'fifo' (run every trial to the end), 'asha' or 'pbt'.
      grace_period: asha: env steps before a trial may be stopped.
      reduction_factor: asha: 1/reduction_factor of the trials go on at each rung.
      perturbation_interval: pbt: env steps between exploit/explore decisions of a trial.
      quantile_fraction: pbt: the bottom fraction exploits the top fraction.
      resample_probability: pbt: chance to resample a mutated field instead of perturbing it.
      synch: pbt: perturb only when every trial reached the interval (trials pause and resume from
        their checkpoints to wait); deterministic, but every trial restarts at every perturbation.
      mutations: pbt: the shape-free fields it mutates (SHAPE_FREE_FIELDS).
    """

    name: str = "fifo"
    grace_period: int = 0
    reduction_factor: float = 2.0
    perturbation_interval: int = 0
    quantile_fraction: float = 0.25
    resample_probability: float = 0.25
    synch: bool = False
    mutations: tuple[Dimension, ...] = ()


@dataclass(frozen=True)
class Resources:
    """What each trial reserves.

    Attributes:
      cpus: CPU cores Ray reserves per trial (for the trial's own process).
      accelerator: 'cpu' (the trial fakes `devices` CPU devices), 'gpu' or 'tpu'.
      devices: devices per host a trial uses: GPUs, TPU chips, or fake CPU devices.
      hosts: hosts per trial; more than 1 runs the trial through the Ray layer (podray.cluster): one
        host worker per host, joined into one multi-host JAX program. CPU hosts: each worker in a
        bundle of 1 CPU of the trial's placement group. TPU: the hosts of one slice (below).
      tpu_topology, tpu_version: a trial takes one whole TPU slice of this topology and generation
        (e.g. 2x2x2, v4); `hosts` and `devices` are then the slice's hosts and chips per host.
    """

    cpus: float = 1.0
    accelerator: str = "cpu"
    devices: int = 1
    hosts: int = 1
    tpu_topology: str = ""
    tpu_version: str = ""

    def tpu_slice(self):
        """The trial's TPU slice (a podray.cluster.tpu.SliceShape), or None."""
        if not self.tpu_topology:
            return None
        from podray.cluster import tpu

        return tpu.slice_shape(self.tpu_topology, self.tpu_version, where="resources")

    def ray_bundle(self) -> dict[str, float]:
        """The trial's own bundle (for a multi-host trial: the process that drives its host workers)."""
        bundle = {"CPU": float(self.cpus)}
        if self.accelerator == "gpu":
            bundle["GPU"] = float(self.devices)
        elif self.accelerator == "tpu" and not self.tpu_topology:
            bundle["TPU"] = float(self.devices)
        return bundle

    def ray_bundles(self) -> list[dict[str, float]]:
        """Every bundle of a trial's placement group: its own, then one per host worker (hosts > 1, or a
        TPU slice: each host's chips, the slice's head resource on host 0's, see podray.cluster.tpu)."""
        shape = self.tpu_slice()
        if shape is not None:
            from podray.cluster import tpu

            return [self.ray_bundle()] + tpu.host_bundles(shape)
        if self.hosts == 1:
            return [self.ray_bundle()]
        return [self.ray_bundle()] + [{"CPU": 1.0}] * self.hosts

    def placement_options(self) -> dict[str, Any]:
        """The rest of the trial's placement-group request (tune.PlacementGroupFactory's keywords).

        A TPU slice trial: every bundle on one slice (topology_strategy, Ray's alpha topology-aware
        scheduling; it replaces `strategy`), host bundles on hosts of the slice's pod type, the first
        on worker 0. The trial's own bundle then runs on a host of its slice too. Others: PACK."""
        shape = self.tpu_slice()
        if shape is None:
            return {"strategy": "PACK"}
        from podray.cluster import tpu

        return {
            "strategy": None,
            "bundle_label_selector": [{}] + tpu.host_label_selectors(shape),
            "topology_strategy": dict(tpu.ONE_SLICE),
        }


@dataclass
class StudySpec:
    """A validated study.

    Attributes:
      name: the study's name (its directory is <storage>/<name>-<time>).
      base: the base preset name or config path, as written.
      base_config: the resolved base Config (preset + overrides + --set), as a nested dict.
      search: the searched dimensions.
      metric, mode: what ranks trials ('max' or 'min' of the metric's last report).
      scheduler: fifo, asha or pbt.
      samples: samples of the search space (every grid point is repeated this many times).
      concurrency: trials running at once (0: as many as the resources allow).
      resources: what each trial reserves.
      checkpoint_every: reports between trial checkpoints (PBT needs 1).
      batch_fields, depth_field: the axes of the best-return plot.
      source: the YAML file it was read from.
    """

    name: str
    base: str
    base_config: dict
    search: tuple[Dimension, ...] = ()
    metric: str = "mean_return"
    mode: str = "max"
    scheduler: Scheduler = field(default_factory=Scheduler)
    samples: int = 1
    concurrency: int = 0
    resources: Resources = field(default_factory=Resources)
    checkpoint_every: int = 1
    batch_fields: tuple[str, ...] = ()
    depth_field: str = "network.depth"
    source: str = ""

    @property
    def architecture(self) -> str:
        return self.base_config.get("architecture", "anakin")

    def searched_fields(self) -> list[str]:
        """Fields that differ between trials (search, then PBT mutations)."""
        out = [d.field for d in self.search]
        out += [d.field for d in self.scheduler.mutations if d.field not in out]
        return out

    def to_dict(self) -> dict:
        """The study as YAML-ready data (written to the study directory, read back by --resume)."""
        s = self.scheduler
        scheduler: dict[str, Any] = {"name": s.name}
        if s.name == "asha":
            scheduler.update(grace_period=s.grace_period, reduction_factor=s.reduction_factor)
        if s.name == "pbt":
            scheduler.update(
                perturbation_interval=s.perturbation_interval,
                quantile_fraction=s.quantile_fraction,
                resample_probability=s.resample_probability,
                synch=s.synch,
                mutations={d.field: d.to_yaml() for d in s.mutations},
            )
        return {
            "name": self.name,
            "base": self.base,
            "base_config": self.base_config,
            "search": {d.field: d.to_yaml() for d in self.search},
            "metric": self.metric,
            "mode": self.mode,
            "scheduler": scheduler,
            "samples": self.samples,
            "concurrency": self.concurrency,
            "resources": dataclasses.asdict(self.resources),
            "checkpoint_every": self.checkpoint_every,
            "plot": {"batch": list(self.batch_fields), "depth": self.depth_field},
        }


# --------------------------------------------------------------------------------------------------
# Trials: the one function that turns a sampled assignment into a Config (driver and trainable)


def trial_config(
    base_config: dict, assignment: dict[str, Any], resources: Resources, checkpoint_every: int = 1
) -> config_lib.Config:
    """The Config of one trial: base + sampled values + what podray tune sets; validated, device split
    included. Raises ConfigError naming the field. The same function runs on the driver (checking) and in
    each trial (running).

    Args:
      base_config: the resolved base config as a nested dict.
      assignment: dotted field -> value of this trial.
      resources: the study's resources (device count, accelerator).
      checkpoint_every: reports between checkpoints.
    """
    data = copy.deepcopy(base_config)
    data = config_lib._merge(data, config_lib.nest(assignment))
    config = config_lib.from_dict(data)
    config.run.run_dir = ""
    config.run.devices = []
    config.run.progress = False
    config.run.cpu_devices = resources.devices if resources.accelerator == "cpu" else 0
    if resources.tpu_topology:
        # The Ray layer places one host worker per host of the slice; run.hosts stays 1 (podray.config).
        config.run.tpu_topology = resources.tpu_topology
        config.run.tpu_version = resources.tpu_version
        config.run.hosts = 1
    else:
        config.run.hosts = resources.hosts
    config.run.checkpoint_every = report_every_updates(config) * checkpoint_every
    validation.validate(config, num_devices=resources.devices * resources.hosts)
    return config


def report_every_updates(config: config_lib.Config) -> int:
    """Updates between two metric reports of the architecture (a checkpoint can follow each)."""
    if config.architecture == "anakin":
        return config.anakin.updates_per_call
    section = getattr(config, config.architecture, None)
    return int(getattr(section, "log_every", 1) or 1)


def total_env_steps(config: config_lib.Config, num_devices: int) -> int:
    """Env steps a trial on `num_devices` devices runs in all (Anakin rounds up to whole calls)."""
    if config.architecture == "anakin":
        per_update = config_lib.num_envs(config, num_devices) * config.anakin.rollout_length
        calls = math.ceil(math.ceil(config.total_env_steps / per_update) / config.anakin.updates_per_call)
        return calls * config.anakin.updates_per_call * per_update * config.anakin.replicas
    return config.total_env_steps


def field_type(where: str, dotted: str) -> Any:
    """The annotated type of a config leaf field; ConfigError naming it if there is none."""
    node: Any = config_lib.Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(node)]
        prefix = ".".join(parts[:i]) or "the config"
        if part not in names:
            raise ConfigError(f"{where}.{dotted}: unknown field; {prefix} has fields {', '.join(names)}")
        tp = typing.get_type_hints(node)[part]
        if dataclasses.is_dataclass(tp):
            if i == len(parts) - 1:
                sub = ", ".join(f"{dotted}.{f.name}" for f in dataclasses.fields(tp))
                raise ConfigError(f"{where}.{dotted}: is a section, not a field; search one of {sub}")
            node = tp
        elif i < len(parts) - 1:
            raise ConfigError(f"{where}.{dotted}: {'.'.join(parts[: i + 1])} is a field, not a section")
        else:
            return tp
    raise AssertionError(dotted)


# --------------------------------------------------------------------------------------------------
# Checking every trial the study can produce


def _dimensions_to_check(spec: StudySpec) -> list[Dimension]:
    dims = list(spec.search)
    searched = {d.field for d in dims}
    # PBT perturbs by x0.8 / x1.2 and then clips to the mutation's range, so its ends are what it reaches.
    dims += [d for d in spec.scheduler.mutations if d.field not in searched]
    return dims


def assignments_to_check(spec: StudySpec) -> Iterator[dict[str, Any]]:
    """Every combination of representative values, or (if too many) each dimension alone plus a
    seeded random sample of combinations."""
    dims = _dimensions_to_check(spec)
    values = [d.representatives() for d in dims]
    total = math.prod(len(v) for v in values)
    if total <= MAX_CHECKED_TRIALS:
        for combo in itertools.product(*values):
            yield {d.field: v for d, v in zip(dims, combo)}
        return
    for d, vs in zip(dims, values):
        for v in vs:
            yield {d.field: v}
    rng = random.Random(0)
    for _ in range(MAX_CHECKED_TRIALS):
        yield {d.field: rng.choice(vs) for d, vs in zip(dims, values)}


def check_trials(spec: StudySpec) -> int:
    """Builds and validates the Config of every trial the study can produce; returns how many were
    checked. Raises ConfigError naming the field and the trial."""
    checked = 0
    longest = 0
    for assignment in assignments_to_check(spec):
        try:
            config = trial_config(spec.base_config, assignment, spec.resources, spec.checkpoint_every)
        except ConfigError as e:
            where = ", ".join(f"{k}={v!r}" for k, v in assignment.items())
            raise ConfigError(f"{e} (in the trial with {where or 'the base config'})") from None
        longest = max(longest, total_env_steps(config, spec.resources.devices * spec.resources.hosts))
        checked += 1
    s = spec.scheduler
    if s.name == "asha" and s.grace_period >= longest:
        raise ConfigError(
            f"scheduler.grace_period: {s.grace_period} env steps is not less than a trial's length "
            f"({longest} env steps); ASHA could never stop a trial early"
        )
    if s.name == "pbt" and s.perturbation_interval >= longest:
        raise ConfigError(
            f"scheduler.perturbation_interval: {s.perturbation_interval} env steps is not less than a trial's "
            f"length ({longest} env steps); PBT would never exploit"
        )
    return checked


def max_env_steps(spec: StudySpec) -> int:
    """The longest trial, in env steps (ASHA's max_t)."""
    devices = spec.resources.devices * spec.resources.hosts
    return max(
        total_env_steps(trial_config(spec.base_config, a, spec.resources, spec.checkpoint_every), devices)
        for a in assignments_to_check(spec)
    )


def check_cluster(spec: StudySpec, nodes: typing.Sequence[dict[str, Any]]) -> None:
    """Rejects resources that the Ray cluster cannot give a trial ('impossible resources'), naming the
    field and the fix.

    Args:
      nodes: the alive nodes, as ray.nodes() lists them ("Resources"; "Labels" for TPU slices).
    """
    r = spec.resources
    shape = r.tpu_slice()
    if shape is not None:
        _check_slices(r, shape, nodes)
        return
    resources = [node.get("Resources") or {} for node in nodes]
    bundle = r.ray_bundle()
    if r.hosts > 1:
        need = sum(b["CPU"] for b in r.ray_bundles())
        have = sum(node.get("CPU", 0.0) for node in resources)
        if need > have:
            raise ConfigError(
                f"resources.hosts: a trial of {r.hosts} hosts needs {need:g} CPUs "
                f"({r.cpus:g} for the trial, 1 per host worker), but the Ray cluster has {have:g}; "
                "lower resources.hosts or resources.cpus, or add nodes"
            )
    if any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in resources):
        return
    for name, need in bundle.items():
        have = max((node.get(name, 0.0) for node in resources), default=0.0)
        if need > have:
            key = "cpus" if name == "CPU" else "devices"
            raise ConfigError(
                f"resources.{key}: a trial needs {need:g} {name} on one node, but the largest node of the Ray "
                f"cluster has {have:g}; lower resources.{key} or add a larger node"
            )
    raise ConfigError(f"resources: no node of the Ray cluster has all of {bundle} at once")


def _check_slices(r: Resources, shape, nodes: typing.Sequence[dict[str, Any]]) -> None:
    """A TPU trial needs a complete slice of its pod type, with a host that can also run the trial."""
    from podray.cluster import tpu

    slices = tpu.complete_slices(nodes, shape)
    if not slices:
        alive = [n for n in nodes if n.get("Alive", True)]
        seen = sorted({(n.get("Labels") or {}).get(tpu.POD_TYPE_LABEL) for n in alive} - {None})
        raise ConfigError(
            f"resources.tpu_topology: a trial takes a {shape.describe()}, but the Ray cluster has no complete "
            f"slice of that kind (every host alive, labelled {tpu.POD_TYPE_LABEL}={shape.pod_type} with its "
            f"chips, worker 0 holding {shape.head_resource}); pod types of its TPU hosts: {', '.join(seen) or 'none'}; "
            "start such a slice in the cluster, or set resources.tpu_topology and resources.tpu_version to a "
            "slice it has"
        )
    most = max((n.get("Resources") or {}).get("CPU", 0.0) for hosts in slices.values() for n in hosts)
    if most < r.cpus:
        raise ConfigError(
            f"resources.cpus: a TPU trial's own process runs on a host of its slice (its placement group "
            f"keeps every bundle on one slice), but the hosts of the {shape.pod_type} slices have at most "
            f"{most:g} CPUs; lower resources.cpus to {most:g} or less"
        )
