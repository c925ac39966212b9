"""`podray bench sebulba-hosts`: what crossing hosts costs Sebulba.

Sebulba on Pong-v5 (the sebulba_pong preset, Nature CNN) in two layouts of the same 4 fake devices and
the same global batches (4 actor threads of `actor_batch_size` environments, a global learner batch
over 2 learner devices):
  - one host: 1 host worker with 2 actor + 2 learner devices;
  - two hosts: 2 host workers with 1 actor + 1 learner device each (one JAX program over gloo).
Both run as a user runs them, one fresh `podray train` process each (through an embedded Ray), so both
pay the same start-up; the figure is the steady frames/s (Summary.steady_steps_per_s x frame skip,
start-up and compilation excluded). Both layouts share this machine's cores, so the ratio is what
crossing hosts costs: the gradient all-reduce over gloo, each host publishing its own parameters, and
the lockstep of the hosts' learner steps. The layouts alternate (one host, two hosts, one host, ...)
so that the load of anything else on the machine falls on both alike; the verdict compares medians.
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

FRAME_SKIP = 4  # Atari: frames per agent step

# layout -> overrides (the same global batches: 4 actor threads, learner batch over 2 learner devices)
LAYOUTS = {
    "1 host x (2 actor + 2 learner)": [
        "run.hosts=1",
        "run.cpu_devices=4",
        "sebulba.actor_devices=[0,1]",
        "sebulba.learner_devices=[2,3]",
    ],
    "2 hosts x (1 actor + 1 learner)": [
        "run.hosts=2",
        "run.cpu_devices=2",
        "sebulba.actor_devices=[0]",
        "sebulba.learner_devices=[1]",
    ],
}


@dataclass
class Row:
    layout: str
    steady_frames_per_s: float
    run_wall_s: float
    command_s: float
    updates: int


def _run(layout: str, common: list[str], workdir: str) -> Row:
    run_dir = tempfile.mkdtemp(prefix="run-", dir=workdir)
    # --ray for both: one host runs in a host worker too (without it the CLI would run it in this
    # process), so both layouts pay the same Ray driver, daemons and worker, and the ratio is what
    # crossing hosts costs.
    cmd = [sys.executable, "-m", "podray.cli", "train", "sebulba_pong", "--ray", "--run-dir", run_dir]
    for override in LAYOUTS[layout] + common:
        cmd += ["--set", override]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "XLA_FLAGS")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    command_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return Row(
        layout, summary["steady_steps_per_s"] * FRAME_SKIP, summary["wall_s"], command_s, int(summary["updates"])
    )


def main(
    out: str | None = None, quick: bool = False, repeats: int = 3, updates: int = 8, rollout_length: int = 128
) -> list[dict]:
    """Runs both layouts `repeats` times, alternated; prints each run, the medians and the ratio.

    Args:
      out: write the rows and the verdict as JSON here.
      quick: one round of 4 updates each (a smoke test of the command, not a measurement).
      repeats: rounds (one run of each layout per round).
      updates: learner updates per run (steady state is measured from the first report, every 2 updates).
      rollout_length: T of every trajectory (the preset's 128; shorter keeps a run short on a busy
        machine, with the same 4 x 4 gradient steps, so the same all-reduces, per update).
    """
    if quick:
        repeats, updates = 1, 4
    actor_batch, learner_batch, rollout = 8, 16, rollout_length
    common = [
        "sebulba.threads_per_actor_device=2",
        f"sebulba.actor_batch_size={actor_batch}",
        f"sebulba.learner_batch_size={learner_batch}",
        f"sebulba.rollout_length={rollout}",
        "sebulba.log_every=2",
        "run.checkpoint_every=0",
        "run.tensorboard=false",
        "run.progress=false",
        f"total_env_steps={updates * learner_batch * rollout}",
    ]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="podray-bench-hosts-") as workdir:
        for _ in range(repeats):
            for layout in LAYOUTS:
                rows.append(_run(layout, common, workdir))
                print(asdict(rows[-1]), flush=True)
    one, two = LAYOUTS
    medians = {
        layout: statistics.median(r.steady_frames_per_s for r in rows if r.layout == layout) for layout in LAYOUTS
    }
    ratio = medians[two] / medians[one]
    print(
        f"Pong-v5 steady frames/s, median of {repeats} alternated runs (global learner batch {learner_batch} x "
        f"{rollout} steps, 4 actor threads of {actor_batch} envs): {one} {medians[one]:,.0f}, {two} "
        f"{medians[two]:,.0f} -> 2 hosts reach {100 * ratio:.0f}% of 1 host (target >= 85%)"
    )
    result = [asdict(r) for r in rows]
    if out:
        with open(out, "w") as f:
            json.dump({"rows": result, "medians": medians, "ratio": ratio}, f, indent=2)
    return result
