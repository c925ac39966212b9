"""`podray plot RUN_DIR [RUN_DIR ...] --out FILE.png`: learning curves and throughput, runs overlaid.

Three panels from each run's metrics.jsonl: mean episode return against env steps, the same against
wall time, and env steps/s over wall time. Wall time is measured from the run's start: the first
row's time less the time its env steps took at its reported rate (the start-up and compile before
it), and a resumed run's gap while it was stopped is left out (rows more than ten report intervals
apart are joined). Rows without a finite return (no episode ended in that interval) are skipped on the
return panels.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

from podray.config import ConfigError


@dataclass
class RunCurves:
    """One run's curves, one entry per metrics row.

    Attributes:
      name: the legend name.
      env_steps: [N] env steps at each row.
      wall_s: [N] seconds since the run started.
      mean_return: [N] mean return of the episodes completed in the row's interval (NaN where none).
      steps_per_s: [N] env steps/s over the row's interval.
    """

    name: str
    env_steps: list[float]
    wall_s: list[float]
    mean_return: list[float]
    steps_per_s: list[float]


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def read_curves(run_dir: str | pathlib.Path, name: str | None = None) -> RunCurves:
    """A run's curves from a run directory (its metrics.jsonl) or a metrics file itself (a .jsonl kept
    apart from its run); ConfigError (one line) for a missing, empty or unreadable metrics file."""
    run_dir = pathlib.Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if run_dir.suffix == ".jsonl" and run_dir.is_file():
        path, name = run_dir, name or run_dir.stem
    elif not path.exists():
        where = "no such directory" if not run_dir.is_dir() else "no metrics.jsonl there"
        raise ConfigError(f"plot {run_dir}: {where}; give the directory of a podray run")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"plot {path}: line {number} is not JSON; is this a podray metrics file?") from None
        if isinstance(row, dict) and "env_steps" in row and "time" in row:
            rows.append(row)
    if not rows:
        raise ConfigError(f"plot {path}: no metrics rows (env_steps, time) yet; plot a run that has logged")
    wall, elapsed, previous = [], 0.0, None
    for row in rows:
        rate = _number(row.get("steps_per_s"))
        if previous is None:
            # the first report's interval: its env steps at its rate (plus start-up, unknown: left out)
            elapsed = row["env_steps"] / rate if rate > 0 else 0.0
        else:
            gap = row["time"] - previous["time"]
            interval = (row["env_steps"] - previous["env_steps"]) / rate if rate > 0 else gap
            elapsed += gap if gap <= 10 * max(interval, 1e-9) else interval  # a resume's gap is left out
        wall.append(elapsed)
        previous = row
    return RunCurves(
        name=name or run_dir.resolve().name,
        env_steps=[float(r["env_steps"]) for r in rows],
        wall_s=wall,
        mean_return=[_number(r.get("mean_return")) for r in rows],
        steps_per_s=[_number(r.get("steps_per_s")) for r in rows],
    )


def load_runs(run_dirs: list[str], names: str | None = None) -> list[RunCurves]:
    """Every run's curves, named by `names` (comma-separated) or by their directories."""
    labels = [n.strip() for n in names.split(",")] if names else [None] * len(run_dirs)
    if len(labels) != len(run_dirs):
        raise ConfigError(f"plot --names: {len(labels)} names for {len(run_dirs)} run directories; give one per run")
    return [read_curves(d, n) for d, n in zip(run_dirs, labels)]


def check_out(out: str | pathlib.Path) -> pathlib.Path:
    """The output path, if it names a PNG."""
    out = pathlib.Path(out)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"plot --out {out}: write a .png file")
    return out


def plot_runs(runs: list[RunCurves], out: str | pathlib.Path, title: str | None = None) -> pathlib.Path:
    """Writes the three panels for `runs` to `out` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = check_out(out)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for run in runs:
        finite = [i for i, r in enumerate(run.mean_return) if math.isfinite(r)]
        line = axes[0].plot([run.env_steps[i] for i in finite], [run.mean_return[i] for i in finite], label=run.name)
        colour = line[0].get_color()
        axes[1].plot([run.wall_s[i] for i in finite], [run.mean_return[i] for i in finite], color=colour)
        axes[2].plot(run.wall_s, run.steps_per_s, color=colour, label=run.name)
    labels = [
        ("env steps", "mean episode return", "return against env steps"),
        ("wall time (s)", "mean episode return", "return against wall time"),
        ("wall time (s)", "env steps/s", "throughput"),
    ]
    for ax, (x, y, name) in zip(axes, labels):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
