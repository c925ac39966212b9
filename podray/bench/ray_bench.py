"""`podray bench ray`: what the Ray layer costs, and whether 2 hosts learn like 1.

Two measurements, each run a fresh `podray train` process (the default CartPole job), so every run
pays its own start-up as a user would:
  - overhead: steady-state env steps/s of one host through an embedded Ray (the default) against the same
    job in-process (`--in-process`), on the same fake CPU devices; `repeats` runs of each, alternated, medians compared.
    Steady state excludes start-up and compilation (Summary.steady_steps_per_s).
  - equivalence: final mean return of 2 host workers x 2 fake devices against 1 process x 4 devices,
    the same seed and global batch (the same 4-device mesh, split over 2 JAX processes).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass


@dataclass
class Row:
    mode: str  # "in-process" or "ray"
    hosts: int
    devices_per_host: int
    steady_steps_per_s: float
    final_mean_return: float
    run_wall_s: float
    command_s: float


def _run(mode: str, hosts: int, devices: int, extra: list[str], workdir: str) -> Row:
    run_dir = tempfile.mkdtemp(prefix="run-", dir=workdir)
    cmd = [sys.executable, "-m", "podray.cli", "train", "--run-dir", run_dir]
    cmd += ["--set", f"run.cpu_devices={devices}", "--set", f"run.hosts={hosts}"]
    cmd += ["--set", "run.tensorboard=false", "--set", "run.progress=false"] + extra
    if mode == "in-process":
        cmd.append("--in-process")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "XLA_FLAGS")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    command_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(open(os.path.join(run_dir, "summary.json")).read())
    return Row(
        mode, hosts, devices, summary["steady_steps_per_s"], summary["final_mean_return"], summary["wall_s"], command_s
    )


def main(out: str | None = None, quick: bool = False, repeats: int = 3, devices: int = 2) -> list[dict]:
    """Runs both measurements, prints a table and the verdicts, optionally writes the rows as JSON."""
    extra = ["--set", "total_env_steps=128000"] if quick else []
    repeats = 1 if quick else repeats
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="podray-bench-ray-") as workdir:
        for _ in range(repeats):
            for mode in ("in-process", "ray"):
                rows.append(_run(mode, 1, devices, extra, workdir))
                print(asdict(rows[-1]), flush=True)
        one_by_four = _run("in-process", 1, 4, extra, workdir)
        two_by_two = _run("ray", 2, 2, extra, workdir)
        for row in (one_by_four, two_by_two):
            print(asdict(row), flush=True)
    inproc = statistics.median(r.steady_steps_per_s for r in rows if r.mode == "in-process")
    ray = statistics.median(r.steady_steps_per_s for r in rows if r.mode == "ray")
    overhead = 1.0 - ray / inproc
    print(
        f"steady env steps/s on {devices} devices, median of {repeats}: in-process {inproc:,.0f}, "
        f"through Ray {ray:,.0f} -> Ray overhead {100 * overhead:+.1f}% (target <= 5%)"
    )
    print(
        f"final mean return: 1 process x 4 devices {one_by_four.final_mean_return:.2f}, "
        f"2 host workers x 2 devices {two_by_two.final_mean_return:.2f}"
    )
    result = [asdict(r) for r in rows + [one_by_four, two_by_two]]
    if out:
        with open(out, "w") as f:
            json.dump({"rows": result, "ray_overhead": overhead}, f, indent=2)
    return result
