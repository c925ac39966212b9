"""Metric sinks: where the scalars of a run go (console, JSONL, TensorBoard; Ray's sinks elsewhere).

Producing a metric never blocks the learner: programs aggregate on device and pull once per log
interval, then hand a flat dict of floats to every sink.

The files live in the run directory, which may be on an object store (podray.storage). An object has
no append, so there the JSONL sink keeps its text and writes the whole object again at each row, and
the TensorBoard sink writes its event files in a local folder and copies them to the store at each
row: a run that dies loses no row it wrote, and in particular none up to its last checkpoint (a
program writes a row before it saves that step).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Mapping, Protocol, Sequence

from podray import storage


class Sink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class ConsoleProgress:
    """A live progress line: where the run runs ('local' or 'ray'), env steps, steps/s, mean episode
    return and the compile time of the run's program."""

    def __init__(self, total_steps: int, stream=None, label: str = "local"):
        self.total_steps = total_steps
        self.label = label
        self.stream = stream or sys.stdout
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        ret = metrics.get("mean_return", math.nan)
        line = (
            f"env steps {int(metrics.get('env_steps', step)):>12,d}/{self.total_steps:,d}  "
            f"steps/s {metrics.get('steps_per_s', 0.0):>11,.0f}  mean return {ret:8.2f}"
        )
        if "frames_per_s" in metrics:  # Sebulba: frames (4 per Atari step), over every host
            line += f"  frames/s {metrics['frames_per_s']:>11,.0f}"
        if metrics.get("hosts", 1) > 1:
            line += f"  ({int(metrics['hosts'])} hosts, slowest {metrics.get('slowest_host_frames_per_s', 0.0):,.0f})"
        line = f"[{self.label}] {line}"
        if "compile_s" in metrics:
            line += f"  (compiled in {metrics['compile_s']:.1f} s)"
        if self._tty:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


class JsonlSink:
    """One JSON object per write in `path` (a local file or an object-store URI), with the step and
    wall time. On an object store each write rewrites the object with the rows so far (kept here), so
    the object always holds every row written; a row is one log interval, so the rewrite costs one
    PUT of the file per interval."""

    def __init__(self, path: str | os.PathLike):
        self.path = storage.run_path(path)
        self._remote = storage.is_uri(self.path)
        if self._remote:
            self._text = storage.read_text(self.path) or ""
        else:
            self._file = open(os.fspath(self.path), "a")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": int(step), "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        line = json.dumps(row) + "\n"
        if self._remote:
            self._text += line
            self.path.write_text(self._text)
        else:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        if not self._remote:
            self._file.close()


def truncate_jsonl(path: str | os.PathLike, max_step: int) -> None:
    """Drops rows after `max_step` (used on resume, so that replayed steps are not logged twice)."""
    path = storage.run_path(path)
    text = storage.read_text(path)
    if text is None:
        return
    rows = [line for line in text.splitlines() if line.strip()]
    kept = "".join(line + "\n" for line in rows if json.loads(line).get("step", 0) <= max_step)
    if storage.is_uri(path):
        storage.write_text(path, kept)
        return
    # In place, not by rename: a JsonlSink may already hold the file open for appending (a resume that
    # falls back past a damaged checkpoint cuts again), and its next row must land in this file.
    with open(os.fspath(path), "r+") as f:
        f.write(kept)
        f.truncate()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSONL file (local or on an object store)."""
    text = storage.run_path(path).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class TensorBoardSink:
    """TensorBoard event files (tensorboardX), one scalar per metric, in `logdir` (a local folder or an
    object-store URI; there the files are written in a local folder and copied up at each write)."""

    def __init__(self, logdir: str | os.PathLike):
        from tensorboardX import SummaryWriter

        self._remote = storage.run_path(logdir) if storage.is_uri(logdir) else None
        self._staging = tempfile.mkdtemp(prefix="podray-tb-") if self._remote else None
        self._writer = SummaryWriter(self._staging or os.fspath(logdir))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()
        self._upload()

    def close(self) -> None:
        self._writer.close()
        if self._staging:
            self._upload()
            shutil.rmtree(self._staging, ignore_errors=True)

    def _upload(self) -> None:
        if self._remote is not None:
            storage.copy_tree(storage.Path(self._staging), self._remote)


class Sinks:
    """Fans one write out to many sinks."""

    def __init__(self, sinks: Sequence[Sink] = ()):
        self.sinks = list(sinks)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _plain(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
