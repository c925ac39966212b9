"""Metric sinks: where the scalars of a run go (console, JSONL, TensorBoard; Ray's sinks elsewhere).

Producing a metric never blocks the learner: programs aggregate on device and pull once per log
interval, then hand a flat dict of floats to every sink.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from typing import Mapping, Protocol, Sequence


class Sink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class ConsoleProgress:
    """A live progress line: env steps, steps/s and mean episode return."""

    def __init__(self, total_steps: int, stream=None):
        self.total_steps = total_steps
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
    """One JSON object per write in `path`, with the step and wall time."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self._file = self.path.open("a")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": int(step), "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_jsonl(path: str | pathlib.Path, max_step: int) -> None:
    """Drops rows after `max_step` (used on resume, so that replayed steps are not logged twice)."""
    path = pathlib.Path(path)
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= max_step]
    path.write_text("".join(line + "\n" for line in kept))


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


class TensorBoardSink:
    """TensorBoard event files (tensorboardX), one scalar per metric."""

    def __init__(self, logdir: str | pathlib.Path):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(logdir))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


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
