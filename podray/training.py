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
        data = config_lib.yaml_load(text)
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

    from podray import preemption
    from podray.checkpoint import Checkpointer, CheckpointError, probe_writable

    # Before anything compiles: a run directory this process cannot write (read-only, full, under a
    # file) is a one-line error now rather than a failed save an hour in.
    probe_writable(run_dir)
    probe_writable(run_dir / "checkpoints", "checkpoint directory")
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=config.run.keep_checkpoints, is_leader=host.is_leader)
    if resume:
        checkpointer.check_config(config)  # a checkpoint of another config: the field, before compute
    sinks: list[Sink] = []
    if host.is_leader:
        storage.write_text(run_dir / "config.yaml", config_lib.dump_yaml(config))
        if resume:
            # Rows past the checkpoint are replayed; with no checkpoint yet the run starts over. The
            # checkpoint restored may be older than the latest when that one is damaged: cut again then.
            metrics_path = run_dir / "metrics.jsonl"
            truncate_jsonl(metrics_path, checkpointer.latest_step() or 0)
            checkpointer.on_restored = lambda step: truncate_jsonl(metrics_path, step)
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

        with preemption.handle_signals():
            summary = program_module(config.architecture).run(
                config, host, fanout, checkpointer=checkpointer, resume=resume, run_dir=str(run_dir)
            )
    except preemption.Preempted as stopped:
        stopped.run_dir = str(run_dir)
        if host.is_leader:
            event = {"event": "stopped", "signal": stopped.signal_name, "updates": stopped.updates}
            event.update(env_steps=stopped.env_steps, signal_time=stopped.signal_time)
            preemption.log_event(run_dir, event)
        raise
    except CheckpointError as failed:
        if host.is_leader:
            preemption.log_event(run_dir, {"event": "failed", "error": str(failed)})
        raise
    finally:
        fanout.close()
        checkpointer.close()
    if host.is_leader:
        _write_json(run_dir / "summary.json", summary.to_dict())
    return summary
