"""Reading a study YAML into a StudySpec, naming the key of every mistake (see podray.tuning.spec)."""

from __future__ import annotations

import math
import pathlib
import typing
from typing import Any

import yaml

from podray import config as config_lib
from podray.config import ConfigError
from podray.tuning.spec import (
    ACCELERATORS,
    BATCH_FIELDS,
    DISTRIBUTIONS,
    METRICS,
    MODES,
    SCHEDULERS,
    SHAPE_FREE_FIELDS,
    TUNE_OWNED_FIELDS,
    Dimension,
    Resources,
    Scheduler,
    StudySpec,
    check_trials,
    field_type,
)

_TOP_KEYS = (
    "name",
    "base",
    "overrides",
    "search",
    "metric",
    "mode",
    "scheduler",
    "samples",
    "concurrency",
    "resources",
    "checkpoint_every",
    "plot",
)

# --------------------------------------------------------------------------------------------------
# Reading the YAML


def _number(where: str, value: Any, integer: bool = False) -> int | float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-4 as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    if integer:
        if float(value) != int(value):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    return value


def _mapping(where: str, value: Any, allowed: typing.Sequence[str]) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(allowed)}, got {value!r}")
    for key in value:
        if key not in allowed:
            raise ConfigError(f"{where}.{key}: unknown key; valid keys here are {', '.join(allowed)}")
    return value


def _dimension(where: str, dotted: str, spec: Any, kinds: typing.Sequence[str]) -> Dimension:
    name = f"{where}.{dotted}"
    if not isinstance(dotted, str):
        raise ConfigError(f"{where}: field names are dotted strings like network.depth, got {dotted!r}")
    tp = field_type(where, dotted)
    example = "{grid: [1, 2]}, {choice: [tanh, relu]} or {loguniform: [1.0e-4, 1.0e-3]}"
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConfigError(f"{name}: expected one distribution, e.g. {example}; got {spec!r}")
    ((kind, args),) = spec.items()
    if kind not in kinds:
        raise ConfigError(f"{name}: '{kind}' is not a valid distribution here; choose one of {', '.join(kinds)}")
    if kind in ("grid", "choice"):
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{name}: {kind} needs a non-empty list of values, got {args!r}")
        if tp in (int, float):
            args = [_number(f"{name}.{kind}[{i}]", v, integer=tp is int) for i, v in enumerate(args)]
        if len({repr(v) for v in args}) != len(args):
            raise ConfigError(f"{name}: {kind} lists a value twice: {args!r}")
        return Dimension(dotted, kind, tuple(args))
    if not isinstance(args, list) or len(args) != 2:
        raise ConfigError(f"{name}: {kind} needs [low, high], got {args!r}")
    if kind == "randint":
        if tp is not int:
            raise ConfigError(f"{name}: randint needs an integer field; {dotted} is {getattr(tp, '__name__', tp)}")
        low, high = (_number(f"{name}.randint", v, integer=True) for v in args)
        if high <= low:
            raise ConfigError(f"{name}: randint [low, high) needs high > low, got [{low}, {high}]")
    else:
        if tp is not float:
            hint = "use randint or grid" if tp is int else "use choice or grid"
            raise ConfigError(f"{name}: {kind} needs a float field; {dotted} is {getattr(tp, '__name__', tp)}: {hint}")
        low, high = (float(_number(f"{name}.{kind}", v)) for v in args)
        if not low < high:
            raise ConfigError(f"{name}: {kind} [low, high] needs low < high, got [{low}, {high}]")
        if kind == "loguniform" and low <= 0:
            raise ConfigError(f"{name}: loguniform needs low > 0, got {low}")
    return Dimension(dotted, kind, (low, high))


def _dimensions(where: str, data: Any, kinds: typing.Sequence[str]) -> tuple[Dimension, ...]:
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of config field -> distribution, got {data!r}")
    out = []
    for dotted, spec in data.items():
        for owned in TUNE_OWNED_FIELDS:
            if dotted == owned:
                raise ConfigError(f"{where}.{dotted}: is set by podray tune for each trial; use resources instead")
        out.append(_dimension(where, dotted, spec, kinds))
    return tuple(out)


def _scheduler(data: Any) -> Scheduler:
    if data is None:
        return Scheduler()
    if isinstance(data, str):
        data = {"name": data}
    name = data.get("name", "fifo") if isinstance(data, dict) else data
    if name not in SCHEDULERS:
        raise ConfigError(f"scheduler.name: '{name}' is not valid; choose one of {', '.join(SCHEDULERS)}")
    allowed = {
        "fifo": ("name",),
        "asha": ("name", "grace_period", "reduction_factor"),
        "pbt": ("name", "perturbation_interval", "quantile_fraction", "resample_probability", "synch", "mutations"),
    }[name]
    data = _mapping("scheduler", data, allowed)
    if name == "asha":
        grace = _number("scheduler.grace_period", data.get("grace_period", 0), integer=True)
        factor = float(_number("scheduler.reduction_factor", data.get("reduction_factor", 2)))
        if grace < 0:
            raise ConfigError(f"scheduler.grace_period: env steps before a trial may be stopped, >= 0; got {grace}")
        if factor <= 1:
            raise ConfigError(f"scheduler.reduction_factor: must be > 1 (2 keeps half at each rung), got {factor}")
        return Scheduler(name, grace_period=grace, reduction_factor=factor)
    if name == "pbt":
        if "perturbation_interval" not in data:
            raise ConfigError("scheduler.perturbation_interval: PBT needs the env steps between exploit decisions")
        interval = _number("scheduler.perturbation_interval", data["perturbation_interval"], integer=True)
        if interval <= 0:
            raise ConfigError(f"scheduler.perturbation_interval: must be positive env steps, got {interval}")
        quantile = float(_number("scheduler.quantile_fraction", data.get("quantile_fraction", 0.25)))
        if not 0 < quantile <= 0.5:
            raise ConfigError(f"scheduler.quantile_fraction: must be in (0, 0.5], got {quantile}")
        resample = float(_number("scheduler.resample_probability", data.get("resample_probability", 0.25)))
        if not 0 <= resample <= 1:
            raise ConfigError(f"scheduler.resample_probability: must be in [0, 1], got {resample}")
        synch = data.get("synch", False)
        if not isinstance(synch, bool):
            raise ConfigError(f"scheduler.synch: expected true or false, got {synch!r}")
        mutations = _dimensions("scheduler.mutations", data.get("mutations"), ("choice", "uniform", "loguniform"))
        if not mutations:
            raise ConfigError(
                "scheduler.mutations: PBT needs at least one field to mutate, e.g. "
                "agent.learning_rate: {loguniform: [1.0e-4, 1.0e-3]}"
            )
        for d in mutations:
            if d.field not in SHAPE_FREE_FIELDS:
                raise ConfigError(
                    f"scheduler.mutations.{d.field}: PBT may only mutate fields that keep the program's shapes "
                    f"(a checkpoint must fit the exploiting trial): {', '.join(SHAPE_FREE_FIELDS)}; search "
                    f"{d.field} with grid, choice or ASHA instead"
                )
        return Scheduler(
            name,
            perturbation_interval=interval,
            quantile_fraction=quantile,
            resample_probability=resample,
            synch=synch,
            mutations=mutations,
        )
    return Scheduler(name)


def _resources(data: Any) -> Resources:
    keys = ("cpus", "accelerator", "devices", "hosts", "tpu_topology", "tpu_version")
    data = _mapping("resources", data, keys)
    cpus = _number("resources.cpus", data.get("cpus", 1))
    topology = str(data.get("tpu_topology") or "").strip()
    version = str(data.get("tpu_version") or "").strip()
    accelerator = data.get("accelerator", "tpu" if topology or version else "cpu")
    if cpus <= 0:
        raise ConfigError(f"resources.cpus: CPU cores per trial must be positive, got {cpus}")
    if accelerator not in ACCELERATORS:
        raise ConfigError(
            f"resources.accelerator: '{accelerator}' is not valid; choose one of {', '.join(ACCELERATORS)}"
        )
    if topology or version:
        return _tpu_slice_resources(data, cpus, accelerator, topology, version)
    devices = _number("resources.devices", data.get("devices", 1), integer=True)
    hosts = _number("resources.hosts", data.get("hosts", 1), integer=True)
    if devices < 1:
        raise ConfigError(f"resources.devices: devices per trial must be >= 1, got {devices}")
    if hosts < 1:
        raise ConfigError(f"resources.hosts: hosts per trial must be >= 1, got {hosts}")
    if hosts > 1 and accelerator == "tpu":
        raise ConfigError(
            f"resources.hosts: a trial of {hosts} TPU hosts runs on one TPU slice; give the slice instead of "
            "hosts, e.g. resources: {accelerator: tpu, tpu_topology: 2x2x2, tpu_version: v4} (2 hosts of 4 chips)"
        )
    if hosts > 1 and accelerator != "cpu":
        raise ConfigError(
            f"resources.hosts: {hosts} {accelerator} hosts per trial are not wired yet (multi-host trials place "
            "CPU host workers, or the hosts of one TPU slice, through the Ray layer); use hosts: 1, or "
            "accelerator: cpu"
        )
    return Resources(cpus=cpus, accelerator=accelerator, devices=devices, hosts=hosts)


def _tpu_slice_resources(data: dict, cpus: float, accelerator: str, topology: str, version: str) -> Resources:
    """A trial on one whole TPU slice: hosts and devices follow from the slice; given ones must agree."""
    if accelerator != "tpu":
        raise ConfigError(
            f"resources.accelerator: tpu_topology and tpu_version give each trial a TPU slice; use accelerator: "
            f"tpu (or leave it out), not {accelerator}"
        )
    if not topology or not version:
        missing = "tpu_version" if topology else "tpu_topology"
        raise ConfigError(
            f"resources.{missing}: tpu_topology and tpu_version go together, e.g. "
            "{accelerator: tpu, tpu_topology: 2x2x2, tpu_version: v4}"
        )
    from podray.cluster import tpu

    shape = tpu.slice_shape(topology, version, where="resources")
    hosts = _number("resources.hosts", data.get("hosts", shape.hosts), integer=True)
    if hosts != shape.hosts:
        raise ConfigError(
            f"resources.hosts: a trial takes the whole {shape.describe()}, so {shape.hosts} hosts, not {hosts}; "
            f"leave hosts out, or choose the tpu_topology of {hosts} hosts"
        )
    devices = _number("resources.devices", data.get("devices", shape.chips_per_host), integer=True)
    if devices != shape.chips_per_host:
        raise ConfigError(
            f"resources.devices: a trial on a {shape.describe()} uses all {shape.chips_per_host} chips of each "
            f"host, not {devices}; leave devices out"
        )
    return Resources(
        cpus=cpus,
        accelerator="tpu",
        devices=shape.chips_per_host,
        hosts=shape.hosts,
        tpu_topology=shape.topology,
        tpu_version=shape.version,
    )


def load_study(path: str | pathlib.Path, overrides: typing.Sequence[str] = ()) -> StudySpec:
    """Reads and validates a study YAML; `overrides` ('section.field=value') change the base config.

    Raises ConfigError naming the field, before Ray or any trial starts.
    """
    path = pathlib.Path(path)
    if not path.exists():
        candidate = _tune_preset_dir() / f"{path.stem}.yaml"
        if path.suffix or not candidate.exists():
            names = ", ".join(sorted(p.stem for p in _tune_preset_dir().glob("*.yaml")))
            raise ConfigError(f"study file {path} does not exist; studies in tune_configs/ are {names}")
        path = candidate
    try:
        data = config_lib.yaml_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    return from_dict(data, overrides=overrides, source=str(path))


def _tune_preset_dir() -> pathlib.Path:
    here = pathlib.Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "tune_configs", here / "tune_presets"):
        if candidate.is_dir():
            return candidate
    return here.parent / "tune_configs"


def from_dict(data: Any, overrides: typing.Sequence[str] = (), source: str = "") -> StudySpec:
    """Builds and validates a StudySpec from parsed YAML (see the module docstring for the keys)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source or 'study'}: expected a mapping at the top level, got {type(data).__name__}")
    for key in data:
        if key not in _TOP_KEYS and key != "base_config":
            raise ConfigError(f"{key}: unknown key of a study; valid keys are {', '.join(_TOP_KEYS)}")
    if "base" not in data:
        raise ConfigError("base: a study needs a base config, a preset name (configs/) or a config YAML path")
    base = str(data["base"])
    if "base_config" in data:  # a study written by podray tune (resolved already)
        base_data = data["base_config"]
    else:
        try:
            base_data = config_lib.load_yaml(base)
        except ConfigError as e:
            raise ConfigError(f"base: {e}") from None
        fixed = data.get("overrides") or {}
        if not isinstance(fixed, dict):
            raise ConfigError(f"overrides: expected a mapping of config field -> value, got {fixed!r}")
        for dotted in fixed:
            field_type("overrides", dotted)
        base_data = config_lib._merge(base_data, config_lib.nest(fixed))
    for text in overrides:
        base_data = config_lib._merge(base_data, config_lib.parse_override(text))
    base_config = config_lib.from_dict(base_data)  # unknown keys of the base or --set are named here
    base_dict = base_config.to_dict()

    name = str(data.get("name") or pathlib.Path(source).stem or "study")
    metric = data.get("metric", "mean_return")
    if metric not in METRICS:
        raise ConfigError(f"metric: '{metric}' is not reported by trials; choose one of {', '.join(METRICS)}")
    mode = data.get("mode", "max")
    if mode not in MODES:
        raise ConfigError(f"mode: '{mode}' is not valid; choose max or min")
    samples = _number("samples", data.get("samples", 1), integer=True)
    if samples < 1:
        raise ConfigError(f"samples: must be >= 1, got {samples}")
    concurrency = _number("concurrency", data.get("concurrency", 0), integer=True)
    if concurrency < 0:
        raise ConfigError(
            f"concurrency: trials at once must be >= 0 (0: as many as resources allow), got {concurrency}"
        )
    checkpoint_every = _number("checkpoint_every", data.get("checkpoint_every", 1), integer=True)
    if checkpoint_every < 1:
        raise ConfigError(f"checkpoint_every: reports between checkpoints must be >= 1, got {checkpoint_every}")
    search = _dimensions("search", data.get("search"), DISTRIBUTIONS)
    scheduler = _scheduler(data.get("scheduler"))
    if scheduler.name == "pbt" and checkpoint_every != 1:
        raise ConfigError(
            "checkpoint_every: PBT exploits through the latest checkpoint; use 1 (a checkpoint per report)"
        )
    resources = _resources(data.get("resources"))
    _check_base_slice(base_config, resources)
    plot = _mapping("plot", data.get("plot"), ("batch", "depth"))
    batch_fields = plot.get("batch")
    if isinstance(batch_fields, str):
        batch_fields = [batch_fields]
    if batch_fields is None:
        searched = [d.field for d in search]
        batch_fields = [f for f in BATCH_FIELDS if f in searched] or [_default_batch_field(base_config)]
    for dotted in batch_fields:
        field_type("plot.batch", dotted)
    depth_field = plot.get("depth", "network.depth")
    field_type("plot.depth", depth_field)

    spec = StudySpec(
        name=name,
        base=base,
        base_config=base_dict,
        search=search,
        metric=metric,
        mode=mode,
        scheduler=scheduler,
        samples=samples,
        concurrency=concurrency,
        resources=resources,
        checkpoint_every=checkpoint_every,
        batch_fields=tuple(batch_fields),
        depth_field=depth_field,
        source=source,
    )
    check_trials(spec)
    return spec


def _check_base_slice(config: config_lib.Config, resources: Resources) -> None:
    """A study sets each trial's TPU slice through `resources`; a base config asking for another slice
    (run.tpu_topology/run.tpu_version of the preset, overrides or --set) would be silently replaced."""
    r = config.run
    if not (r.tpu_topology or r.tpu_version):
        return
    if r.tpu_topology and r.tpu_version and resources.tpu_topology:
        from podray.cluster import tpu

        base = tpu.slice_shape(r.tpu_topology, r.tpu_version, where="run")
        if (base.topology, base.version) == (resources.tpu_topology, resources.tpu_version):
            return  # the same slice, said twice
    raise ConfigError(
        f"run.tpu_topology: the base config asks for a TPU slice ({r.tpu_topology or '-'}, "
        f"{r.tpu_version or '-'}); a study gives each trial its slice through resources: set "
        f"resources: {{accelerator: tpu, tpu_topology: {r.tpu_topology or '...'}, tpu_version: "
        f"{r.tpu_version or '...'}}} and drop run.tpu_topology / run.tpu_version from the base, overrides and --set"
    )


def _default_batch_field(config: config_lib.Config) -> str:
    if config.architecture == "anakin":
        return "env.num_envs" if config.env.num_envs else "env.envs_per_device"
    return f"{config.architecture}.actor_batch_size"
