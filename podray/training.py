"""The training entry point: config in, run directory and Summary out.

`train(config)` is what `podray train` calls in-process (and what each host worker of the Ray layer
calls): it validates the config, chooses the devices, prepares the run directory (resolved config,
metrics.jsonl, TensorBoard events, checkpoints, summary.json) and runs the architecture. The run
directory is a local path or an object-store URI (gs://, s3://; podray.storage): process 0 writes the
logs, every process takes part in the checkpoints, and no host needs another's disk.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Sequence

import yaml

from podray import config as config_lib
from podray import run_dirs, storage, validation
from podray.metrics import ConsoleProgress, JsonlSink, Sink, Sinks, TensorBoardSink, truncate_jsonl


def load_run_config(run_dir: str | os.PathLike, check: bool = True) -> config_lib.Config:
    """The config a run directory (local or an object-store URI) was started with (for --resume);
    validated unless `check` is False."""
    storage.check_run_dir(run_dir, "--resume")
    text = storage.read_text(storage.run_path(run_dir) / "config.yaml")
    if text is None:
        raise config_lib.ConfigError(
            f"--resume {run_dir}: no config.yaml there; give the directory of an earlier podray run"
        )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise config_lib.ConfigError(f"--resume {run_dir}: config.yaml is not valid YAML: {e}") from e
    config = config_lib.from_dict(data)
    if check:
        validation.validate(config)
    return config


def _write_json(path: storage.Path, data: dict) -> None:
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in data.items()}
    storage.write_text(path, json.dumps(clean, indent=2) + "\n")


def read_summary(run_dir: str | os.PathLike) -> dict:
    """The summary.json of a finished run (local or on an object store)."""
    return json.loads((storage.run_path(run_dir) / "summary.json").read_text())


def train(
    config: config_lib.Config,
    run_dir: str | pathlib.Path | None = None,
    resume: bool = False,
    host=None,
    extra_sinks: Sequence[Sink] = (),
    host_sinks: Sequence[Sink] = (),
    launcher: str = "local",
):
    """Trains with `config`, writing to `run_dir`; returns the architecture's Summary.

    Args:
      config: a Config (validated here again, before anything compiles).
      run_dir: the run directory, a path or an object-store URI (gs://, s3://); None takes
        config.run.run_dir, else <runs root>/<name>-<time> (podray.run_dirs.resolve, which refuses a
        directory inside Ray's job cache).
      resume: continue from the latest checkpoint in run_dir.
      host: a podray.host.HostContext; None means this process and config.run.devices.
      extra_sinks: more metric sinks (Ray Tune), fed on process 0 only.
      host_sinks: sinks fed on every process (each tags its own host: Ray's dashboard metrics).
      launcher: how this process was started, shown on the progress line: 'local' (this process) or
        'ray' (a host worker of the Ray layer).
    """
    run_dir = storage.run_path(run_dirs.resolve(config, run_dir))
    storage.check_run_dir(run_dir, "run_dir")
    validation.validate(config)
    from podray import host as host_lib

    host_lib.configure_compile_cache(config.run.compile_cache)  # before this run compiles anything

    if host is None:
        host_lib.configure_cpu_devices(config.run.cpu_devices)
        host = host_lib.local_context(config.run.devices)
    # Sebulba's split indexes this host's devices; Anakin's environments divide over every host's.
    host_lib.check_devices(config, len(host.local_devices if config.architecture == "sebulba" else host.devices))

    run_dir.mkdir(parents=True, exist_ok=True)
    from podray.checkpoint import Checkpointer

    checkpointer = Checkpointer(run_dir / "checkpoints", keep=config.run.keep_checkpoints)
    sinks: list[Sink] = []
    if host.is_leader:
        storage.write_text(run_dir / "config.yaml", config_lib.dump_yaml(config))
        if resume:
            # Rows past the checkpoint are replayed; with no checkpoint yet the run starts over.
            truncate_jsonl(run_dir / "metrics.jsonl", checkpointer.latest_step() or 0)
        sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if config.run.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if config.run.progress:
            sinks.append(ConsoleProgress(config.total_env_steps * config.anakin.replicas, label=launcher))
        sinks.extend(extra_sinks)
    sinks.extend(host_sinks)
    fanout = Sinks(sinks)
    try:
        from podray.program import program_module

        summary = program_module(config.architecture).run(
            config, host, fanout, checkpointer=checkpointer, resume=resume, run_dir=str(run_dir)
        )
    finally:
        fanout.close()
        checkpointer.close()
    if host.is_leader:
        _write_json(run_dir / "summary.json", summary.to_dict())
    return summary
