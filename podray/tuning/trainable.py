"""The Ray Tune trainable: a trial is an ordinary podray run.

`run_trial` is a Tune function trainable. It builds the trial's Config (the same `trial_config` the
driver validated), restores the run directory from `tune.get_checkpoint()` when Tune hands it one
(resume after an interruption, a pause, or a PBT exploit), and calls podray.training.train with one
extra sink, `TuneReportSink`, which turns every metrics row into `tune.report(metrics, checkpoint)`.

A Tune checkpoint is a small directory: the orbax checkpoint of one step (podray.checkpoint), the
trial's config.yaml and checkpoint.json (trial, updates, env steps). Restoring copies the orbax step
into the run directory and calls train(resume=True), which continues from it, step count included.
The study's run directories may be on an object store (podray.storage): a Tune checkpoint is then
staged in a local temporary directory and copied into the store on restore.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from podray import config as config_lib
from podray import storage
from podray.config import ConfigError
from podray.tuning import spec as spec_lib

INFO_FILE = "checkpoint.json"
RESTORES_FILE = "restores.jsonl"


@dataclass(frozen=True)
class TrialContext:
    """What every trial of a study shares (passed with tune.with_parameters).

    Attributes:
      base_config: the study's resolved base config, a nested dict.
      resources: the study's per-trial resources.
      checkpoint_every: reports between checkpoints.
      runs_dir: where trials keep their podray run directories (<study>/runs/<trial id>).
      compilation_cache: JAX's persistent compilation cache directory shared by the trials ('' for
        none): a trial resumed with an unchanged config loads its program instead of compiling it.
      storage_env: object-store variables (storage.STORAGE_ENV) the trials set before touching a study
        on an object store (a trial's process does not inherit the driver's environment on a cluster).
    """

    base_config: dict
    resources: spec_lib.Resources
    checkpoint_every: int
    runs_dir: str
    compilation_cache: str = ""
    storage_env: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# The trainable


def run_trial(config: dict[str, Any], context: TrialContext) -> None:
    """A Ray Tune function trainable: runs one trial of a study.

    Args:
      config: the sampled values, dotted config field -> value (Tune's trial config).
      context: what the study's trials share.
    """
    import jax
    from ray import tune

    from podray import host as host_lib

    os.environ.update(context.storage_env)
    # Before validation: it imports gymnax, which starts JAX's backends (then the count is fixed).
    if context.resources.accelerator == "cpu":
        host_lib.configure_cpu_devices(context.resources.devices)
    elif context.resources.tpu_topology:
        from podray.cluster.driver import pin_driver_jax_to_cpu

        # This process runs on a host of the trial's slice, whose chips belong to the host workers: its
        # own JAX (validation) must not open the TPU.
        pin_driver_jax_to_cpu()
    if context.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", context.compilation_cache)
    trial = spec_lib.trial_config(context.base_config, config, context.resources, context.checkpoint_every)
    trial_id = tune.get_context().get_trial_id()
    run_dir = storage.run_path(context.runs_dir) / trial_id
    checkpoint = tune.get_checkpoint()
    restored = None
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            restored = restore_run_dir(directory, run_dir, trial)
    else:
        storage.rmtree(run_dir)  # a restart without a checkpoint starts over
    run_dir.mkdir(parents=True, exist_ok=True)
    sink = TuneReportSink(run_dir, trial_id, restored_row=restored and restored.get("row"))
    launch(trial, run_dir, resume=checkpoint is not None, sink=sink)
    sink.flush()


def launch(config: config_lib.Config, run_dir: storage.Path, resume: bool, sink) -> Any:
    """Runs a trial's podray run; returns host 0's summary. The seam between Tune and podray.

    One host (run.hosts == 1, no TPU slice): podray.training.train in this process (the trial's Ray
    actor) on the devices Ray gave it, with `sink` as an extra metrics sink. Several hosts, or a TPU
    slice (run.tpu_topology): the Ray layer (podray.cluster) places one host worker per host in the
    bundles after the trial's own in its placement group (on TPU: the hosts of the slice the trial
    reserved, worker i on TPU worker i), joins them into one multi-host JAX program and restarts them
    from the latest checkpoint if one is lost; host 0 writes the run directory, and this process
    forwards each new row of its metrics.jsonl to `sink` (tune.report must be called here, in the
    trial's process).
    """
    if config.run.hosts == 1 and not config.run.tpu_topology:
        from podray.training import train

        return train(config, run_dir=run_dir, resume=resume, extra_sinks=[sink])
    return _launch_hosts(config, run_dir, resume, sink)


def _launch_hosts(config: config_lib.Config, run_dir: storage.Path, resume: bool, sink, poll_s: float = 0.5) -> Any:
    import threading

    from podray.cluster import driver

    placement = host_placement()
    steps = orbax_steps(run_dir / "checkpoints")
    forwarded = steps[-1] if resume and steps else 0  # rows up to the restored step were reported before
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            tags = {"run": config.name, "replica": run_dir.name}
            outcome["results"] = driver._run_group(
                config, run_dir, resume, tags, False, None, lambda s: print(s, flush=True), placement=placement
            )
        except BaseException as e:  # re-raised in the trial's thread below
            outcome["error"] = e

    def forward_new_rows() -> None:
        nonlocal forwarded
        text = storage.read_text(run_dir / "metrics.jsonl")
        if text is None:
            return
        for line in text.splitlines():
            if not line.strip() or not line.endswith("}"):
                continue  # a row being written
            row = json.loads(line)
            step = int(row.pop("step", 0))
            row.pop("time", None)
            if step > forwarded:
                sink.write(step, row)
                forwarded = step

    thread = threading.Thread(target=run, name="podray-trial-hosts", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(poll_s)
        forward_new_rows()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results"][0]


def host_placement() -> tuple:
    """(placement group, first bundle index) of the host workers' bundles, in the placement group of the
    trial calling it: bundle 0 is the trial's own (this process), one bundle per host follows
    (podray.tuning.spec.Resources.ray_bundles)."""
    from ray.util import get_current_placement_group

    placement = get_current_placement_group()
    if placement is None:
        raise RuntimeError("a multi-host trial runs inside a Tune trial's placement group (podray tune places it)")
    return placement, 1


# --------------------------------------------------------------------------------------------------
# Checkpoints: staging one orbax step for Tune, restoring it into a run directory


def orbax_steps(directory: storage.PathLike) -> list[int]:
    """Steps of the finished orbax checkpoints under `directory` (unfinished saves excluded)."""
    return storage.step_dirs(directory)


def _link_tree(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Copies a directory tree, hard-linking files where the filesystem allows (orbax never rewrites
    a finished checkpoint's files)."""

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link_or_copy)


def stage_checkpoint(run_dir: storage.PathLike, step: int, info: dict, into: pathlib.Path) -> pathlib.Path:
    """Builds the Tune checkpoint directory of `step` in the local directory `into`: checkpoints/<step>,
    config.yaml, checkpoint.json (hard links from a local run directory, copies from an object store)."""
    run_dir = storage.run_path(run_dir)
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    source, target = run_dir / "checkpoints" / str(step), into / "checkpoints" / str(step)
    if storage.is_uri(run_dir):
        storage.copy_tree(source, storage.Path(target))
    else:
        _link_tree(pathlib.Path(source), target)
    (into / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    (into / INFO_FILE).write_text(json.dumps(info) + "\n")
    return into


def config_changes(old: config_lib.Config, new: config_lib.Config) -> dict[str, list]:
    """Dotted field -> [old, new] for every field that differs, run.* excluded."""
    a, b = config_lib.flatten(old.to_dict()), config_lib.flatten(new.to_dict())
    return {
        k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith("run.")
    }


def restore_run_dir(checkpoint_dir: str | pathlib.Path, run_dir: storage.PathLike, config: config_lib.Config) -> dict:
    """Makes `run_dir` continue from a Tune checkpoint (this trial's, or another's after a PBT exploit).

    The checkpoint's config may differ from `config` only in shape-free fields
    (spec.SHAPE_FREE_FIELDS), so that its state (parameters, optimizer state) fits the program that
    `config` compiles; anything else is a ConfigError naming the fields. Appends the restore to
    run_dir/restores.jsonl and returns that record, with "row": the metrics row reported with the checkpoint.
    """
    checkpoint_dir = pathlib.Path(checkpoint_dir)
    info = json.loads((checkpoint_dir / INFO_FILE).read_text())
    old = config_lib.from_dict(config_lib.yaml_load((checkpoint_dir / "config.yaml").read_text()))
    changes = config_changes(old, config)
    misfits = [k for k in changes if k not in spec_lib.SHAPE_FREE_FIELDS]
    if misfits:
        detail = ", ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in misfits)
        raise ConfigError(
            f"{misfits[0]}: the checkpoint of trial {info.get('trial_id')} does not fit this trial ({detail}); "
            f"a restored state must keep its shapes, so only {', '.join(spec_lib.SHAPE_FREE_FIELDS)} may change"
        )
    steps = orbax_steps(checkpoint_dir / "checkpoints")
    if not steps:
        raise FileNotFoundError(f"Tune checkpoint {checkpoint_dir} holds no orbax checkpoint")
    run_dir = storage.run_path(run_dir)
    target = run_dir / "checkpoints"
    storage.rmtree(target)
    run_dir.mkdir(parents=True, exist_ok=True)
    if storage.is_uri(run_dir):
        storage.copy_tree(storage.Path(checkpoint_dir / "checkpoints"), target)
    else:
        _link_tree(checkpoint_dir / "checkpoints", pathlib.Path(target))
    record = {
        "time": time.time(),
        "from_trial": info.get("trial_id"),
        "updates": steps[-1],
        "env_steps": info.get("env_steps"),
        "changes": changes,
    }
    storage.append_lines(run_dir / RESTORES_FILE, [json.dumps(record)])
    return {**record, "row": info.get("row")}


def read_restores(run_dir: storage.PathLike) -> list[dict]:
    """The restores of a trial's run directory, oldest first."""
    text = storage.read_text(storage.run_path(run_dir) / RESTORES_FILE) or ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# --------------------------------------------------------------------------------------------------
# The sink


class TuneReportSink:
    """A podray Sink that reports each metrics row to Ray Tune, with the checkpoint of the same step.

    Programs write a row and then save that step's checkpoint, so a row is held back until the next
    write (or `flush()`, after the run returns), when its checkpoint exists; reports therefore trail
    the run by one interval. `close()` reports nothing: a failed run must not report a last row.

    Every report carries: mean_return (of the episodes completed in the interval; the previous value
    where none completed), env_steps, frames_per_s (env frames per second), steps_per_s, the program's
    other scalars, restores (how often this trial was restored) and restored_env_steps (the env steps
    of the last restored checkpoint, 0 if none).

    A trial restored from a checkpoint taken at the end of its budget (Tune can pause a short trial
    after it reported its last checkpoint but before it returned, or PBT can clone a trial's final
    checkpoint) has nothing left to run; it reports the restored checkpoint's row again, so that its
    last result is that of the state it holds, not the stale one from before the restore.

    Args:
      run_dir: the trial's podray run directory.
      trial_id: the Tune trial id (recorded in checkpoints, so an exploiting trial knows its source).
      report: the reporting function, tune.report by default.
      restored_row: the metrics row stored with the checkpoint this run was restored from, if any.
    """

    def __init__(
        self,
        run_dir: str | pathlib.Path,
        trial_id: str,
        report: Callable | None = None,
        restored_row: Mapping[str, Any] | None = None,
    ):
        self.run_dir = storage.run_path(run_dir)
        self.trial_id = trial_id
        self._report = report
        self._restored_row = dict(restored_row) if restored_row else None
        self._sent = 0
        self._pending: tuple[int, dict] | None = None
        self._last_return = math.nan
        restores = read_restores(self.run_dir)
        self._restores = len(restores)
        self._restored_env_steps = int(restores[-1]["env_steps"] or 0) if restores else 0

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._pending is not None:
            self._send(*self._pending)
        self._pending = (int(step), dict(metrics))

    def flush(self) -> None:
        """Reports the held-back row (call after the run returned); a run that was restored and had
        nothing left to run reports its restored checkpoint's row."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._send(*pending)
        elif self._sent == 0 and self._restored_row is not None:
            self._send(int(self._restored_row.get("updates", 0)), self._restored_row)

    def close(self) -> None:
        pass

    def _send(self, step: int, metrics: dict) -> None:
        row = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        ret = row.get("mean_return", math.nan)
        if isinstance(ret, float) and not math.isnan(ret):
            self._last_return = ret
        row["mean_return"] = self._last_return
        row["env_steps"] = int(row.get("env_steps", 0))
        row["updates"] = int(row.get("updates", step))
        row.setdefault("frames_per_s", row.get("steps_per_s", 0.0))
        row["restores"] = self._restores
        row["restored_env_steps"] = self._restored_env_steps
        report = self._report
        if report is None:
            from ray import tune

            report = tune.report
        stage = None
        try:
            if step in orbax_steps(self.run_dir / "checkpoints"):
                info = {"trial_id": self.trial_id, "updates": step, "env_steps": row["env_steps"], "row": row}
                # Staged on a local disk: in the run directory (hard links), or a temporary directory
                # when the run directory is on an object store.
                remote = storage.is_uri(self.run_dir)
                into = pathlib.Path(tempfile.mkdtemp(prefix="podray-tune-")) if remote else self.run_dir / "tune_stage"
                stage = stage_checkpoint(self.run_dir, step, info, pathlib.Path(into))
                from ray import tune

                report(row, checkpoint=tune.Checkpoint.from_directory(str(stage)))
            else:
                report(row)
            self._sent += 1
        finally:
            if stage is not None:  # Tune has copied it to the study's storage by now
                shutil.rmtree(stage, ignore_errors=True)
