"""Running a study on Ray Tune: the Tuner, its scheduler and resources, and restoring a study.

    run_study(spec)           -> StudyResult   (a new study directory <storage>/<name>-<time>)
    resume_study(study_dir)   -> StudyResult   (Tuner.restore of an interrupted study)

The study directory is Tune's experiment directory; podray adds study.yaml (the resolved study, which
--resume reads back), runs/<trial id>/ (each trial's podray run directory) and the outputs of
podray.tuning.report. The spec was validated before this module is called; here we check only what
needs the Ray cluster (that some node can hold a trial), still before any trial starts.

The storage may be an object-store URI (gs://bucket/tune_runs, s3://...): Tune keeps its experiment
state and trial checkpoints there through pyarrow.fs, and the trials' run directories and the study's
outputs go there through podray.storage.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Sequence

import yaml

from podray import config as config_lib
from podray import storage as storage_lib
from podray.config import ConfigError
from podray.tuning import parse
from podray.tuning import report as report_lib
from podray.tuning import spec as spec_lib
from podray.tuning.trainable import TrialContext, run_trial

STUDY_FILE = "study.yaml"


@dataclass
class StudyResult:
    """What a study produced.

    Attributes:
      study_dir: the study directory.
      outputs: the table, rows and files written by podray.tuning.report.
      unfinished: trials neither terminated nor errored (the study was interrupted).
      wall_s: seconds of this fit (a resumed study counts only its own).
    """

    study_dir: storage_lib.Path
    outputs: report_lib.Outputs
    unfinished: int
    wall_s: float

    @property
    def best(self) -> dict | None:
        return self.outputs.rows[0] if self.outputs.rows else None


class ClipToRanges:
    """PBT's custom_explore_fn: PBT perturbs a float by x0.8 or x1.2 without bounds; clip each mutated
    field back into its range, so an exploited trial's config stays valid (e.g. a discount <= 1)."""

    def __init__(self, mutations: Sequence[spec_lib.Dimension]):
        self.bounds = {d.field: (min(d.values), max(d.values)) for d in mutations}

    def __call__(self, config: dict) -> dict:
        for name, (low, high) in self.bounds.items():
            if name in config and isinstance(config[name], (int, float)):
                config[name] = min(max(config[name], low), high)
        return config


def _domain(dimension: spec_lib.Dimension):
    from ray import tune

    low_high = dimension.values
    return {
        "grid": lambda: tune.grid_search(list(dimension.values)),
        "choice": lambda: tune.choice(list(dimension.values)),
        "uniform": lambda: tune.uniform(*low_high),
        "loguniform": lambda: tune.loguniform(*low_high),
        "randint": lambda: tune.randint(*low_high),
    }[dimension.kind]()


def param_space(spec: spec_lib.StudySpec) -> dict[str, Any]:
    """Tune's param_space: dotted config field -> domain (a PBT-mutated field not searched is sampled
    from its mutation range)."""
    space = {d.field: _domain(d) for d in spec.search}
    for d in spec.scheduler.mutations:
        space.setdefault(d.field, _domain(d))
    return space


def make_scheduler(spec: spec_lib.StudySpec):
    """The Tune scheduler; its time is env steps, so trials of any batch size compare at equal steps."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    s = spec.scheduler
    if s.name == "asha":
        max_t = spec_lib.max_env_steps(spec)
        grace = s.grace_period or max(1, max_t // 10)
        return ASHAScheduler(
            time_attr="env_steps", max_t=max_t, grace_period=grace, reduction_factor=s.reduction_factor
        )
    if s.name == "pbt":
        mutations = {d.field: (list(d.values) if d.kind == "choice" else _domain(d)) for d in s.mutations}
        return PopulationBasedTraining(
            time_attr="env_steps",
            perturbation_interval=s.perturbation_interval,
            hyperparam_mutations=mutations,
            quantile_fraction=s.quantile_fraction,
            resample_probability=s.resample_probability,
            synch=s.synch,
            custom_explore_fn=ClipToRanges(s.mutations),
        )
    return FIFOScheduler()


def connect(address: str | None = None) -> bool:
    """Connects to Ray at `address` (or $RAY_ADDRESS); else starts a local Ray. Returns whether this
    call started it (then the caller shuts it down). Prints which Ray it is, with its dashboard."""
    import ray

    from podray.cluster import driver

    if ray.is_initialized():
        return False
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False)
    started = not (address or os.environ.get("RAY_ADDRESS"))
    print(driver.where_line(driver.RayConnection(started, driver._dashboard_url(ray))), flush=True)
    return True


def check_cluster(spec: spec_lib.StudySpec) -> None:
    import ray

    spec_lib.check_cluster(spec, [n for n in ray.nodes() if n.get("Alive")])


def _trainable(spec: spec_lib.StudySpec, study_dir: storage_lib.Path):
    from ray import tune

    remote = storage_lib.is_uri(study_dir)
    context = TrialContext(
        base_config=spec.base_config,
        resources=spec.resources,
        checkpoint_every=spec.checkpoint_every,
        runs_dir=str(study_dir / "runs"),
        # A study on an object store: a cache on each node's local disk (programs are keyed by their
        # hash, so studies can share it), so that a trial resumed on the same node skips compiling.
        compilation_cache=os.path.join(tempfile.gettempdir(), "podray_jax_cache")
        if remote
        else str(study_dir / "jax_cache"),
        storage_env=storage_lib.storage_env() if remote else {},
    )
    return tune.with_resources(tune.with_parameters(run_trial, context=context), resource_request(spec.resources))


def resource_request(resources: spec_lib.Resources):
    """The trial's tune.PlacementGroupFactory: its own bundle, one per host worker, and (TPU slice) the
    label selectors and topology strategy that keep the hosts on one slice (Resources.placement_options)."""
    from ray import tune

    return tune.PlacementGroupFactory(resources.ray_bundles(), **resources.placement_options())


def trial_dirname(trial) -> str:
    """A trial's directory in the study is named by its trial id (what podray.tuning.report reads)."""
    return trial.trial_id


def storage_options(storage: storage_lib.Path) -> dict:
    """Tune's RunConfig storage arguments for a storage directory: storage_path, and for s3:// on an
    S3-compatible store (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL set) a pyarrow S3FileSystem with that
    endpoint and the AWS_* credentials of this process, which Tune pickles to the trials."""
    text = str(storage)
    if storage_lib.scheme(text) != "s3":
        return {"storage_path": text}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return {"storage_path": text}
    from pyarrow import fs

    scheme, _, host = endpoint.partition("://")
    filesystem = fs.S3FileSystem(
        endpoint_override=host or scheme,
        scheme=scheme if host else "https",
        access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        session_token=os.environ.get("AWS_SESSION_TOKEN"),
        region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
    )
    return {"storage_path": text.split("://", 1)[1], "storage_filesystem": filesystem}


def _unfinished(outputs: report_lib.Outputs) -> int:
    return sum(row["status"] == "UNFINISHED" for row in outputs.rows)


def run_study(
    spec: spec_lib.StudySpec,
    storage: str | os.PathLike = "tune_runs",
    name: str | None = None,
    address: str | None = None,
    callbacks: Sequence[Any] = (),
    verbose: int = 1,
) -> StudyResult:
    """Runs a validated study on Ray Tune and writes its outputs.

    Args:
      spec: from podray.tuning.load_study (validated).
      storage: the directory holding study directories: a path or an object-store URI.
      name: the study directory's name; default <spec.name>-<time>.
      address: the Ray cluster; None: $RAY_ADDRESS, else a local Ray started here.
      callbacks: extra ray.tune.Callback objects.
      verbose: Tune's verbosity (0 silent, 1 status tables).
    """
    from ray import tune

    from podray import run_dirs

    storage_lib.check_run_dir(storage, "--storage")
    storage = storage_lib.run_path(storage)
    name = name or f"{spec.name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    study_dir = storage / name
    if (study_dir / STUDY_FILE).exists() or (not storage_lib.is_uri(study_dir) and study_dir.exists()):
        raise ConfigError(f"--name: study directory {study_dir} exists; choose another name or --resume it")
    if not storage_lib.is_uri(study_dir):
        fix = "give --storage an absolute path on durable storage"
        run_dirs.refuse_ray_cache(study_dir, "--storage", "study directory", fix)  # a Ray job's working directory
    print(f"podray: study dir {study_dir}", flush=True)
    started = connect(address)
    try:
        check_cluster(spec)  # raises before the study directory or any trial exists
        study_dir.mkdir(parents=True, exist_ok=True)
        storage_lib.write_text(study_dir / STUDY_FILE, yaml.safe_dump(spec.to_dict(), sort_keys=False))
        # Tune snapshots the experiment state each time a trial's checkpoints rotate through num_to_keep
        # (so the state never names a deleted one); with a checkpoint per report, keep a few.
        keep = 8
        tuner = tune.Tuner(
            _trainable(spec, study_dir),
            param_space=param_space(spec),
            tune_config=tune.TuneConfig(
                metric=spec.metric,
                mode=spec.mode,
                scheduler=make_scheduler(spec),
                num_samples=spec.samples,
                max_concurrent_trials=spec.concurrency or None,
                reuse_actors=False,  # a fresh process per trial: JAX fixes its device count per process
                trial_dirname_creator=trial_dirname,  # the report reads trial ids from the public Result.path
            ),
            run_config=tune.RunConfig(
                name=name,
                **storage_options(storage),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=keep),
                callbacks=list(callbacks),
                verbose=verbose,
            ),
        )
        return _fit_and_report(tuner, study_dir, spec)
    finally:
        if started:
            import ray

            ray.shutdown()


def _fit_and_report(tuner, study_dir: storage_lib.Path, spec: spec_lib.StudySpec) -> StudyResult:
    """Runs the study and writes its table, CSV/JSON and plots."""
    start = time.perf_counter()
    grid = tuner.fit()
    wall = time.perf_counter() - start
    outputs = report_lib.write_outputs(study_dir, spec, grid, wall)
    return StudyResult(study_dir, outputs, _unfinished(outputs), wall)


def load_study_dir(study_dir: str | os.PathLike) -> spec_lib.StudySpec:
    """The study a study directory (local or an object-store URI) was started with (validated again)."""
    storage_lib.check_run_dir(study_dir, "--resume")
    path = storage_lib.run_path(study_dir) / STUDY_FILE
    text = storage_lib.read_text(path)
    if text is None:
        raise ConfigError(f"--resume {study_dir}: no {STUDY_FILE} there; give the directory of a podray tune study")
    return parse.from_dict(config_lib.yaml_load(text), source=str(path))


def resume_study(study_dir: str | os.PathLike, address: str | None = None) -> StudyResult:
    """Resumes an interrupted study (Tuner.restore): unfinished trials continue from their latest
    checkpoints, errored ones are retried from theirs, finished ones are kept."""
    from ray import tune

    spec = load_study_dir(study_dir)
    study_dir = storage_lib.run_path(study_dir)
    options = storage_options(study_dir)
    if not tune.Tuner.can_restore(options["storage_path"], storage_filesystem=options.get("storage_filesystem")):
        raise ConfigError(f"--resume {study_dir}: Tune saved no experiment state there; the study never started")
    started = connect(address)
    try:
        check_cluster(spec)
        tuner = tune.Tuner.restore(
            options["storage_path"],
            trainable=_trainable(spec, study_dir),
            resume_unfinished=True,
            resume_errored=True,
            storage_filesystem=options.get("storage_filesystem"),
        )
        return _fit_and_report(tuner, study_dir, spec)
    finally:
        if started:
            import ray

            ray.shutdown()
