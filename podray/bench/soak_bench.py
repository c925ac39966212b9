"""`podray bench soak`: nothing grows in a long run.

Runs Sebulba Pong (configs/sebulba_pong.yaml) and Anakin MinAtar Breakout
(configs/anakin_minatar_breakout.yaml), one after the other, each in its own fresh process for
`minutes`, and samples every `interval_s` seconds:
  - rss_mb: resident memory of the training process (/proc/PID/status VmRSS);
  - threads: its threads (/proc/PID/status Threads);
  - fds: its open file descriptors (/proc/PID/fd);
  - queue_occupancy / queue_max (Sebulba): mean and largest actor-to-learner queue length seen in the
    latest report interval, against the bound sebulba.queue_size;
  - env_steps: progress (from the run's metrics.jsonl).
Each run ends the way a preempted one does: SIGTERM at the deadline, a checkpoint at the next update
boundary and exit status 143 (podray.preemption), which the benchmark checks too.

It reports, per architecture, the least-squares slope of each series over the samples after the warm-up
(the first 5 minutes, or the first quarter of a shorter run): RSS in % of its mean per hour, threads and
file descriptors per hour, and the largest queue length against its bound. Writes the samples and
slopes as JSON (--out) and a plot (--plot).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

RUNS = {
    "sebulba_pong": ["sebulba_pong", "total_env_steps=1000000000", "sebulba.log_every=20"],
    "anakin_minatar": ["anakin_minatar_breakout", "total_env_steps=100000000000", "anakin.updates_per_call=10"],
}
COMMON = ["run.tensorboard=false", "run.progress=false", "run.checkpoint_every=0"]


def _status(pid: int) -> dict[str, float]:
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            fields[key] = float(value.split()[0])
    return {"rss_mb": fields["VmRSS"] / 1024, "threads": fields["Threads"], "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _last_row(path: pathlib.Path) -> dict:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}


def slope_per_hour(times_s: list[float], values: list[float]) -> float:
    """Least-squares slope of values over time, per hour (0 with fewer than 2 samples)."""
    n = len(times_s)
    if n < 2:
        return 0.0
    mt, mv = sum(times_s) / n, sum(values) / n
    var = sum((t - mt) ** 2 for t in times_s)
    if var == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in zip(times_s, values)) / var * 3600.0


def soak(name: str, minutes: float, interval_s: float, workdir: str, extra: tuple[str, ...] = ()) -> dict:
    """Runs one configuration for `minutes` in a fresh `podray train --in-process`, sampling it.

    `extra` overrides come last, so they win over the soak's own (a finite total_env_steps makes the
    run end by itself, and the soak then covers the run's whole length).
    """
    preset, *overrides = RUNS[name]
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"soak-{name}-", dir=workdir))
    cmd = [sys.executable, "-m", "podray.cli", "train", preset, "--in-process", "--run-dir", str(run_dir)]
    cmd += ["--set", *COMMON, *overrides, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[dict] = []
    start = time.monotonic()
    deadline = start + minutes * 60
    try:
        # The clock starts at the first metrics row (after start-up, compilation and the first report).
        while proc.poll() is None and not _last_row(run_dir / "metrics.jsonl"):
            time.sleep(0.5)
        start = time.monotonic()
        deadline = start + minutes * 60
        while proc.poll() is None and time.monotonic() < deadline:
            row = _last_row(run_dir / "metrics.jsonl")
            sample = {"t_s": time.monotonic() - start, **_status(proc.pid), "env_steps": row.get("env_steps", 0)}
            if "queue_occupancy" in row:
                sample["queue_occupancy"] = row["queue_occupancy"]
                sample["queue_max"] = row.get("queue_occupancy_max", row["queue_occupancy"])
            samples.append(sample)
            time.sleep(interval_s)
        stop_s = None
        if proc.poll() is None:
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=900)
            stop_s = time.monotonic() - sent
        else:
            _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    warmup = min(300.0, minutes * 60 / 4)
    steady = [s for s in samples if s["t_s"] >= warmup]
    t = [s["t_s"] for s in steady]
    rss = [s["rss_mb"] for s in steady]
    mean_rss = sum(rss) / len(rss) if rss else 0.0
    result = {
        "name": name,
        "run_dir": str(run_dir),
        "overrides": [*COMMON, *overrides, *extra],
        "minutes": minutes,
        "interval_s": interval_s,
        "warmup_s": warmup,
        "samples": samples,
        "exit_status": proc.returncode,
        "stop_s": stop_s,
        "stopped_line": (err or "").strip().splitlines()[-1][-300:] if err and err.strip() else "",
        "rss_mb_mean": mean_rss,
        "rss_pct_per_hour": 100.0 * slope_per_hour(t, rss) / mean_rss if mean_rss else 0.0,
        "threads_per_hour": slope_per_hour(t, [s["threads"] for s in steady]),
        "fds_per_hour": slope_per_hour(t, [s["fds"] for s in steady]),
        "threads_range": [
            min((s["threads"] for s in steady), default=0),
            max((s["threads"] for s in steady), default=0),
        ],
        "fds_range": [min((s["fds"] for s in steady), default=0), max((s["fds"] for s in steady), default=0)],
        "env_steps": samples[-1]["env_steps"] if samples else 0,
    }
    if any("queue_occupancy" in s for s in samples):
        from podray import config as config_lib

        result["queue_bound"] = config_lib.load(preset).sebulba.queue_size
        result["queue_max_seen"] = max(s.get("queue_max", 0) for s in samples)
    return result


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for r in results:
        t = [s["t_s"] / 60 for s in r["samples"]]
        for ax, key in zip(axes, ("rss_mb", "threads", "fds")):
            ax.plot(t, [s[key] for s in r["samples"]], label=r["name"])
            ax.set_xlabel("minutes")
            ax.set_ylabel(key)
    axes[0].legend()
    fig.suptitle("podray bench soak: resident memory, threads, open files of the training process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(
    minutes: float = 60.0,
    interval_s: float = 60.0,
    out: str | None = None,
    plot_path: str | None = None,
    runs: tuple[str, ...] = tuple(RUNS),
    keep: str | None = None,
    overrides: tuple[str, ...] = (),
) -> list:
    """`keep`: a directory to hold the run directories afterwards (default: a temporary one, deleted)."""
    unknown = [name for name in runs if name not in RUNS]
    if unknown:
        raise ValueError(f"bench soak: --runs {','.join(unknown)} unknown; choose from {', '.join(RUNS)}")
    results = []
    if keep:
        pathlib.Path(keep).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="podray-soak-") as tmp:
        workdir = keep or tmp
        for name in runs:
            r = soak(name, minutes, interval_s, workdir, tuple(overrides))
            results.append(r)
            queue = f" | queue max {r['queue_max_seen']:.0f} of {r['queue_bound']}" if "queue_bound" in r else ""
            print(
                f"{name}: {r['minutes']:.0f} min, {len(r['samples'])} samples, {r['env_steps']:,} env steps | "
                f"RSS {r['rss_mb_mean']:.0f} MB, {r['rss_pct_per_hour']:+.2f} %/h | threads "
                f"{r['threads_per_hour']:+.2f}/h {r['threads_range']} | fds {r['fds_per_hour']:+.2f}/h "
                f"{r['fds_range']}{queue} | exit {r['exit_status']} after {r['stop_s'] or 0:.0f} s: "
                f"{r['stopped_line']}" + (f" | run dir {r['run_dir']}" if keep else ""),
                flush=True,
            )
    if out:
        pathlib.Path(out).write_text(json.dumps(results, indent=1) + "\n")
    if plot_path:
        plot(results, plot_path)
    return results
