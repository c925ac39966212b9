"""Where a run's outputs go: the runs root, the run directory, and Ray's cache that must not hold it.

    resolve(config, run_dir)  ->  the absolute run directory (checked, not created)

A run directory given as an absolute path is used as it is. A relative one, and the default
`<name>-<time>`, go under the *runs root*: `run.runs_root`, else `$PODRAY_RUNS_ROOT`, else the working
directory (where the default is `runs/<name>-<time>`). The root exists for Ray jobs: `ray job submit
--working-dir .` runs the entry script in a copy of the working directory inside Ray's
runtime-resources cache (`<ray temp>/session_*/runtime_resources/working_dir_files/...`), which Ray
deletes when the cache grows past its size limit and no job uses the copy, and which belongs to one
Ray session, so a run directory there would lose the run's checkpoints, metrics and summary.
`resolve` refuses such a directory, naming the field to set, before anything compiles.

The run directory and the runs root may be object-store URIs (gs://, s3://; podray.storage): a
relative run directory joins a URI root with '/' (`join`), and a URI is used as it is (Ray's cache is
a local directory, so a URI is never in it).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib

from podray import config as config_lib

RUNS_ROOT_ENV = "PODRAY_RUNS_ROOT"
"""Environment variable for the runs root when `run.runs_root` is empty."""

_RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor in a submitted job's entry process (runtime_env and metadata as JSON)."""


def runs_root(config: config_lib.Config) -> tuple[str, str]:
    """(root, where it came from): `run.runs_root`, else $PODRAY_RUNS_ROOT, else ('', '') for the
    working directory."""
    if config.run.runs_root:
        return config.run.runs_root, "run.runs_root"
    if os.environ.get(RUNS_ROOT_ENV):
        return os.environ[RUNS_ROOT_ENV], RUNS_ROOT_ENV
    return "", ""


def is_uri(path: str) -> bool:
    """Whether `path` names object storage (gs://bucket/..., s3://...) rather than a local path."""
    return "://" in path


def join(root: str, name: str) -> str:
    """`root`/`name`: the one place a run directory is placed under its root (a URI joins with '/')."""
    if is_uri(root):
        return root.rstrip("/") + "/" + name
    return os.path.join(os.path.expanduser(root), name)


def default_name(config: config_lib.Config) -> str:
    """`<name>-<date>-<time>-<microseconds>`: the run directory's name when none is given."""
    return f"{config.name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S-%f')}"


def ray_cache_dir(path: str | os.PathLike) -> str | None:
    """The Ray runtime-resources cache (`.../session_*/runtime_resources`) that holds `path`, or None.

    Symlinks are followed (Ray's `session_latest` is one), so a path reached through any of them is
    recognised."""
    resolved = pathlib.Path(os.path.realpath(os.path.expanduser(str(path))))
    for directory in (resolved, *resolved.parents):
        if directory.name == "runtime_resources" and directory.parent.name.startswith("session_"):
            return str(directory)
    return None


def ray_job_id() -> str | None:
    """The submission id of the Ray job this process is the entry script of (`ray job submit`), else None."""
    text = os.environ.get(_RAY_JOB_ENV)
    if not text:
        return None
    try:
        return json.loads(text).get("metadata", {}).get("job_submission_id") or None
    except (ValueError, AttributeError):
        return None


def existing(run_dir: str | os.PathLike) -> str:
    """The absolute path of an existing run directory named on the command line (`--resume`): a
    relative one is under $PODRAY_RUNS_ROOT when that is set (where `--run-dir` put it), else here."""
    path = str(run_dir)
    root = os.environ.get(RUNS_ROOT_ENV, "")
    if root and not (is_uri(path) or os.path.isabs(os.path.expanduser(path))):
        path = join(root, path)
    return path if is_uri(path) else os.path.abspath(os.path.expanduser(path))


def resolve(config: config_lib.Config, run_dir: str | os.PathLike | None = None) -> str:
    """The absolute run directory (or object-store URI) of a run: `run_dir`, else `run.run_dir`, else the
    default name, placed under the runs root when relative (module docstring). Creates nothing.

    Raises:
      ConfigError: the directory would be inside Ray's runtime-resources cache (a Ray job's copy of its
        working directory, deleted after the job).
    """
    given = str(run_dir or config.run.run_dir or "")
    root, source = runs_root(config)
    if given and (is_uri(given) or os.path.isabs(os.path.expanduser(given))):
        path, field = given, "run.run_dir (--run-dir)"
    elif given:
        path, field = (join(root, given), source) if root else (given, "run.runs_root")
    else:
        path, field = join(root or "runs", default_name(config)), source or "run.runs_root"
    if is_uri(path):
        return path.rstrip("/")  # reached through podray.storage by every host
    path = os.path.abspath(os.path.expanduser(path))
    refuse_ray_cache(
        path,
        field,
        "run directory",
        f"set run.runs_root (--set run.runs_root=/durable/path) or {RUNS_ROOT_ENV} to durable storage, or give "
        "--run-dir an absolute path outside the cache",
    )
    return path


def refuse_ray_cache(path: str | os.PathLike, field: str, what: str, fix: str) -> None:
    """Raises ConfigError naming `field` (and ending with `fix`) when `path` is inside Ray's
    runtime-resources cache."""
    cache = ray_cache_dir(path)
    if cache is None:
        return
    job = ray_job_id()
    raise config_lib.ConfigError(
        f"{field}: the {what} {path} is inside Ray's runtime-resources cache ({cache}), the copy of the "
        f"working directory Ray gives a job{f' ({job})' if job else ''}, which Ray may delete once no job uses "
        f"it, so the run's checkpoints, metrics and summary would be lost; {fix}"
    )
