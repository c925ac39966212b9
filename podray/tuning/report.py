"""A study's outputs: a table with the best trial first, every trial as CSV and JSON, and two plots.

Files in the study directory:
  trials.csv, trials.json             one row per trial (searched fields, last and best metric, ...)
  return_vs_env_steps.png             the metric against env steps, one line per trial
  best_return_vs_batch_depth.png      the best metric against batch size, one line per depth
"""

from __future__ import annotations

import csv
import io
import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

from podray import storage
from podray.tuning import spec as spec_lib


@dataclass
class Outputs:
    """Attributes: table (text, best first), rows (one dict per trial, best first), files written."""

    table: str
    rows: list[dict]
    files: list[storage.Path] = field(default_factory=list)


def _dotted_get(data: dict, dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _best(values: list[float], mode: str) -> float:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return math.nan
    return max(finite) if mode == "max" else min(finite)


def rank_key(value: float, mode: str) -> tuple:
    """Sort key: best first, NaN last."""
    return (math.isnan(value), -value if mode == "max" and not math.isnan(value) else value)


def collect(spec: spec_lib.StudySpec, grid, study_dir: pathlib.Path) -> tuple[list[dict], dict[str, Any]]:
    """Rows (best first) and each trial's history (a DataFrame or None) from a Tune ResultGrid."""
    metric = spec.metric
    fields = spec.searched_fields()
    fields += [f for f in (*spec.batch_fields, spec.depth_field) if f not in fields]
    rows, histories = [], {}
    for result in grid:
        # podray names each trial's directory by its trial id (study.trial_dirname).
        trial_id = pathlib.Path(result.path).name
        config = result.config or {}
        last = result.metrics or {}
        history = result.metrics_dataframe
        histories[trial_id] = history
        series = [_float(v) for v in history[metric]] if history is not None and metric in history else []
        # After an interruption Tune marks live trials TERMINATED in memory (RUNNING in its saved state);
        # only a trial that completed (or was stopped by the scheduler) has done=True in its last result.
        status = "ERROR" if result.error else "TERMINATED" if last.get("done") else "UNFINISHED"
        row: dict[str, Any] = {"trial": trial_id, "status": status}
        for name in fields:
            row[name] = config[name] if name in config else _dotted_get(spec.base_config, name)
        row[metric] = _float(last.get(metric))
        row[f"best_{metric}"] = _best(series, spec.mode)
        row["env_steps"] = int(last.get("env_steps", 0) or 0)
        row["frames_per_s"] = _float(last.get("frames_per_s"))
        row["iterations"] = int(last.get("training_iteration", 0) or 0)
        row["restores"] = int(last.get("restores", 0) or 0)
        row["run_dir"] = str(study_dir / "runs" / trial_id)
        row["error"] = str(result.error).strip().splitlines()[-1][:300] if result.error else ""
        rows.append(row)
    rows.sort(key=lambda r: rank_key(r[metric], spec.mode))
    return rows, histories


def _format(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e6):
            return f"{value:.3g}"
        return f"{value:,.2f}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,d}"
    return str(value)


def table(spec: spec_lib.StudySpec, rows: list[dict]) -> str:
    """A plain-text table of the trials, best first."""
    metric = spec.metric
    fields = [
        k
        for k in (rows[0] if rows else {})
        if k in spec.searched_fields() or k in spec.batch_fields or k == spec.depth_field
    ]
    columns = ["rank", "trial", *fields, metric, f"best_{metric}", "env_steps", "frames_per_s", "restores", "status"]
    cells = [[_format(i + 1) if c == "rank" else _format(r.get(c)) for c in columns] for i, r in enumerate(rows)]
    widths = [max(len(c), *(len(row[j]) for row in cells)) if cells else len(c) for j, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _save(fig, path: storage.Path) -> None:
    """Writes a figure as PNG to `path` (local or on an object store)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    path.write_bytes(buffer.getvalue())


def _plot_histories(path: storage.Path, spec: spec_lib.StudySpec, rows: list[dict], histories: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # 20 distinct colours before any repeats
    for row in rows:
        h = histories.get(row["trial"])
        if h is None or "env_steps" not in h or spec.metric not in h:
            continue
        label = row["trial"] + " " + " ".join(f"{k.split('.')[-1]}={_format(row[k])}" for k in spec.searched_fields())
        ax.plot(h["env_steps"], h[spec.metric], marker=".", label=label)
    ax.set_xlabel("env steps")
    ax.set_ylabel(spec.metric)
    ax.set_title(f"{spec.name}: {spec.metric} per trial")
    if 0 < len(rows) <= 20:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _plot_batch_depth(path: storage.Path, spec: spec_lib.StudySpec, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fields = list(spec.batch_fields)
    fig, axes = plt.subplots(1, len(fields), figsize=(6 * len(fields), 4.5), squeeze=False)
    metric = spec.metric
    for ax, batch_field in zip(axes[0], fields):
        best: dict[Any, dict[Any, float]] = {}  # depth -> batch -> best metric
        for row in rows:
            value = row[metric]
            if math.isnan(value):
                continue
            per_depth = best.setdefault(row[spec.depth_field], {})
            batch = row[batch_field]
            old = per_depth.get(batch, math.nan)
            per_depth[batch] = _best([old, value], spec.mode)
        for depth in sorted(best, key=str):
            xs = sorted(best[depth])
            ax.plot(xs, [best[depth][x] for x in xs], marker="o", label=f"{spec.depth_field}={depth}")
        batches = {b for d in best.values() for b in d}
        if len(batches) > 1 and all(isinstance(b, (int, float)) and b > 0 for b in batches):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(batches))
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(batch_field)
        ax.set_ylabel(f"best {metric} (last report)")
        ax.set_title(f"{spec.name}\nbest {metric} vs batch size and depth", fontsize=10)
        if best:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _plain(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def write_outputs(study_dir: storage.PathLike, spec: spec_lib.StudySpec, grid, wall_s: float) -> Outputs:
    """Writes trials.csv, trials.json and the two plots into `study_dir` (a local directory or an
    object-store URI); returns the table and rows."""
    study_dir = storage.run_path(study_dir)
    rows, histories = collect(spec, grid, study_dir)
    files = [
        study_dir / n
        for n in ("trials.csv", "trials.json", "return_vs_env_steps.png", "best_return_vs_batch_depth.png")
    ]
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if _plain(v) is None else v) for k, v in row.items()})
    storage.write_text(files[0], text.getvalue())
    summary = {
        "study": spec.name,
        "study_dir": str(study_dir),
        "metric": spec.metric,
        "mode": spec.mode,
        "scheduler": spec.scheduler.name,
        "wall_s": wall_s,
        "best": {k: _plain(v) for k, v in rows[0].items()} if rows else None,
        "trials": [{k: _plain(v) for k, v in row.items()} for row in rows],
    }
    storage.write_text(files[1], json.dumps(summary, indent=2) + "\n")
    _plot_histories(files[2], spec, rows, histories)
    _plot_batch_depth(files[3], spec, rows)
    return Outputs(table=table(spec, rows), rows=rows, files=files)
