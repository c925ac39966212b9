"""Run directories on a local disk or an object store (gs://, s3://) behind one path API.

    run_path("runs/x")              -> epath.Path of the absolute local directory
    run_path("gs://bucket/runs/x")  -> epath.Path of the object-store prefix
    check_run_dir(path, "--run-dir")   one ConfigError line if it cannot be reached (before compiling)

Paths are etils.epath.Path, the path type orbax itself uses: on a URI it goes through fsspec (gcsfs
for gs://, s3fs for s3://), and orbax writes the checkpoint arrays with tensorstore, which reads the
same store directly. Nothing here assumes a shared local disk: every process of a multi-host run
opens the same URI.

Object stores have no append and no rename. Whole-object writes are atomic (a reader sees the old or
the new object), so `write_text` writes a local file through a temporary file and an object with one
PUT, and `append_lines` rewrites the object with the new lines added (podray.metrics.JsonlSink keeps
the text in memory instead of reading it back). A checkpoint is orbax's own business: it commits a
step on an object store by writing its commit marker last.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from typing import Iterable, Union

from etils import epath

from podray.config import ConfigError

Path = epath.Path
PathLike = Union[str, os.PathLike]

# URI scheme -> (fsspec package that serves it, podray extra that installs it).
SCHEMES = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}

# Environment variables object-store clients read (botocore, s3fs, tensorstore, pyarrow for s3://;
# google-auth for gs://). The Ray layer passes those set in the driver to the host workers, whose
# processes do not inherit the driver's environment on a cluster.
STORAGE_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
)


def _fresh_listings() -> None:
    """Turns off fsspec's directory-listing cache for the object stores: several processes (the hosts,
    the driver) write the same run directory, so a cached listing would be stale (e.g. list a
    checkpoint that orbax has since deleted). Set before any filesystem instance is made."""
    import fsspec.config

    for protocol in ("s3", "gs", "gcs"):
        fsspec.config.conf.setdefault(protocol, {})["use_listings_cache"] = False


_fresh_listings()


def scheme(path: PathLike) -> str:
    """The URI scheme of `path` ("gs", "s3"), or "" for a local path."""
    text = os.fspath(path)
    head, sep, _ = text.partition("://")
    return head.lower() if sep else ""


def is_uri(path: PathLike) -> bool:
    """Whether `path` names an object store (gs://, s3://) rather than a local directory."""
    return bool(scheme(path))


def run_path(path: PathLike) -> Path:
    """The epath.Path of a run directory: an object-store URI as given (no trailing slash), a local
    path made absolute (every process and the report name the same directory)."""
    text = os.fspath(path)
    if is_uri(text):
        return epath.Path(text.rstrip("/"))
    return epath.Path(pathlib.Path(text).resolve())


def storage_env() -> dict[str, str]:
    """The object-store client variables (STORAGE_ENV) set in this process."""
    return {k: os.environ[k] for k in STORAGE_ENV if os.environ.get(k)}


def check_run_dir(path: PathLike, what: str = "--run-dir") -> None:
    """Raises ConfigError (one line: the flag, the problem, the fix) when the object store of `path`
    cannot be used: an unknown scheme, its fsspec package missing, or its bucket absent or refused.
    A local path passes (its directory is created later). Call it before anything compiles."""
    text = os.fspath(path)
    kind = scheme(text)
    if not kind:
        return
    if kind not in SCHEMES:
        raise ConfigError(f"{what} {text}: unknown storage scheme '{kind}://'; use a local path, gs:// or s3://")
    package, extra = SCHEMES[kind]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"{what} {text}: {kind}:// needs the {package} package, which is not installed; "
            f"pip install 'podray[{extra}]'"
        )
    bucket = text.split("://", 1)[1].split("/", 1)[0]
    if not bucket:
        raise ConfigError(f"{what} {text}: no bucket in the URI; write {kind}://BUCKET/PATH")
    try:
        _probe_filesystem(kind).ls(bucket, detail=False)
    except FileNotFoundError:
        raise ConfigError(f"{what} {text}: bucket {bucket} does not exist; create it or give another") from None
    except PermissionError as error:
        raise ConfigError(
            f"{what} {text}: the store refused these credentials for bucket {bucket} ({_one_line(error)}); "
            "check them (docs/operations.md, Run directories)"
        ) from None
    except Exception as error:  # endpoint unreachable, no credentials found, ...
        raise ConfigError(
            f"{what} {text}: cannot reach bucket {bucket} ({type(error).__name__}: {_one_line(error)}); "
            "check the credentials and endpoint (docs/operations.md, Run directories)"
        ) from None


def _probe_filesystem(kind: str):
    """A filesystem for one quick question (does the bucket answer?): few retries, short timeouts, so
    that an unreachable endpoint is reported in seconds rather than after the clients' backoff."""
    import fsspec

    if kind == "s3":
        fs = fsspec.filesystem(
            "s3",
            skip_instance_cache=True,
            config_kwargs={"retries": {"max_attempts": 2}, "connect_timeout": 10, "read_timeout": 20},
        )
        fs.retries = 1  # s3fs's own retry loop around botocore's
        return fs
    return fsspec.filesystem(kind, skip_instance_cache=True)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:200] or type(error).__name__


def write_text(path: Path, text: str) -> None:
    """Writes `path` whole and atomically: readers see the old or the new text, never a part."""
    if is_uri(path):
        path.write_text(text)  # one PUT: an object appears whole
        return
    local = pathlib.Path(os.fspath(path))
    tmp = local.with_name(local.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(local)


def read_text(path: Path) -> str | None:
    """The text of `path`, or None when it does not exist."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def append_lines(path: Path, lines: Iterable[str]) -> None:
    """Appends lines to `path` (a local append; on an object store, a rewrite with them added, which
    suits small logs written by one process)."""
    text = "".join(line + "\n" for line in lines)
    if not is_uri(path):
        with open(os.fspath(path), "a") as f:
            f.write(text)
        return
    path.write_text((read_text(path) or "") + text)


def copy_tree(src: PathLike, dst: PathLike) -> None:
    """Copies the files under `src` to `dst` (either may be local or on an object store). Walks with
    iterdir: epath's walk does not run on s3fs."""
    src, dst = epath.Path(src), epath.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.is_dir():
            copy_tree(entry, dst / entry.name)
        else:
            entry.copy(dst / entry.name, overwrite=True)


def rmtree(path: Path) -> None:
    """Removes `path` and everything under it, if it exists."""
    path = epath.Path(path)
    if path.exists():
        path.rmtree()


COMMIT_FILE = "commit_success.txt"  # orbax's commit marker on object stores (atomicity.COMMIT_SUCCESS_FILE)


def step_dirs(directory: PathLike) -> list[int]:
    """The steps of the finished orbax checkpoints under `directory`: directories named by an integer
    (on a disk orbax renames a finished save to that name; on an object store it writes the step
    under its name and commits it with COMMIT_FILE, written last)."""
    directory = run_path(directory)
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = [p for p in entries if p.name.isdigit()]
    if is_uri(directory):
        return sorted(int(p.name) for p in steps if (p / COMMIT_FILE).exists())
    return sorted(int(p.name) for p in steps if p.is_dir())


# --------------------------------------------------------------------------------------------------
# orbax on s3://
#
# orbax writes a checkpoint's arrays with tensorstore, and builds tensorstore's key-value store spec
# from the checkpoint path: gs:// gets tensorstore's gcs driver, anything else its file driver (so
# orbax 0.12 cannot write arrays to s3://, although tensorstore has an s3 driver and etils.epath, which
# orbax uses for everything else, reads and writes s3:// through s3fs). `enable_orbax_s3` routes
# s3:// paths to tensorstore's s3 driver in the three functions of orbax's tensorstore_utils that make
# that choice; gs:// and local paths are left exactly as orbax builds them. Checkpoints on s3:// use
# orbax's commit-file protocol (as on gs://): an object store has no atomic rename.


def s3_kvstore(path: str) -> dict:
    """tensorstore's s3 kvstore spec for `path` (s3://bucket/key...), with the endpoint and region of
    this process's AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL and AWS_REGION / AWS_DEFAULT_REGION when
    set (an S3-compatible store); tensorstore reads the credentials from the AWS_* variables or the
    AWS profile itself."""
    bucket, _, key = path.split("://", 1)[1].partition("/")
    spec: dict = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        spec["aws_credentials"] = {"type": "environment"}  # not the profile files, which may not exist
    return spec


_ORBAX_S3 = False


def enable_orbax_s3() -> None:
    """Lets orbax write and read checkpoint arrays under s3:// (idempotent; see the comment above)."""
    global _ORBAX_S3
    if _ORBAX_S3:
        return
    try:
        from orbax.checkpoint._src.path import gcs_utils
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

        normalize, use_gcs = ts_utils._normalize_path, ts_utils._use_gcs_driver
        gcs_kvstore = gcs_utils.get_kvstore_for_gcs
    except (ImportError, AttributeError) as error:
        import orbax.checkpoint as ocp

        raise RuntimeError(
            f"s3:// checkpoints: orbax-checkpoint {ocp.__version__} no longer has {error.name or error}, which "
            "podray.storage.enable_orbax_s3 adapts; use orbax-checkpoint 0.12, or a gs:// or local run directory"
        ) from error

    def normalize_path(path: str) -> str:
        text = os.fspath(path)
        if text.startswith("s3://"):  # os.path.normpath would turn s3:// into s3:/
            return "s3://" + os.path.normpath(text[len("s3://") :])
        return normalize(path)

    def use_remote_driver(directory: str) -> bool:
        return os.fspath(directory).startswith("s3://") or use_gcs(directory)

    def kvstore(path: str) -> dict:
        text = os.fspath(path)
        return s3_kvstore(text) if text.startswith("s3://") else gcs_kvstore(path)

    ts_utils._normalize_path = normalize_path
    ts_utils._use_gcs_driver = use_remote_driver
    gcs_utils.get_kvstore_for_gcs = kvstore  # the module tensorstore_utils calls it from
    _ORBAX_S3 = True
