"""`podray bench preempt`: SIGTERM at a random moment, then resume; counts what held.

Each trial starts a `podray train` with a budget it will not reach, waits for its first metrics row plus
a random 0..`max_delay_s` seconds, sends SIGTERM, and checks:
  - exit: status 143 within 30 s, the last stderr line saying where the checkpoint is;
  - checkpoint age: the latest checkpoint was written after the signal and holds at least the last
    update logged before it, so nothing done before the signal is lost (the target: a checkpoint at
    most one update older than the signal). How far past the last logged row it lies is reported as
    `boundaries_past_logged` (the logged row trails the device by up to one report interval, and
    with 2 hosts the driver first passes the signal on);
  - resume: `podray train --resume` (in-process; through Ray for 2 hosts) to two more boundaries
    completes with continuous update counts in metrics.jsonl (no gap, no repeat);
  - bitwise (Anakin): the resumed run's final checkpoint equals, array for array, that of a run of the
    same budget never interrupted.
Modes, in turn: anakin and sebulba (in-process), anakin_ray and sebulba_ray (one host worker through an
embedded Ray, `--ray`), anakin_2hosts and sebulba_2hosts (two host workers of two fake devices each,
through Ray).
"""

from __future__ import annotations

import json
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

ANAKIN = [
    "env.num_envs=8",
    "anakin.rollout_length=16",
    "anakin.updates_per_call=2",
    "agent.anneal_lr=false",
    "run.tensorboard=false",
    "run.progress=false",
    "run.cpu_devices=4",
]
SEBULBA = ["run.tensorboard=false", "run.progress=false", "sebulba.log_every=4"]
# Each host of a 2-host Sebulba run: 1 actor + 1 learner device (the learner mesh spans both hosts).
SEBULBA_HOST = ["run.cpu_devices=2", "sebulba.actor_devices=[0]", "sebulba.learner_devices=[1]"]
# Modes alternate between the architectures, so 10 trials are 5 Anakin and 5 Sebulba runs.
MODES = {
    "anakin": (None, ANAKIN, ["--in-process"]),
    "sebulba": ("sebulba_cartpole", SEBULBA, ["--in-process"]),
    "anakin_ray": (None, ANAKIN, ["--ray"]),
    "sebulba_ray": ("sebulba_cartpole", SEBULBA, ["--ray"]),
    "anakin_2hosts": (None, [*ANAKIN[:-1], "run.cpu_devices=2", "run.hosts=2"], []),
    "sebulba_2hosts": ("sebulba_cartpole", [*SEBULBA, *SEBULBA_HOST, "run.hosts=2"], []),
}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "podray.cli", *args]


def _rows(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _final_arrays(run_dir: pathlib.Path):
    """The arrays of the run's newest checkpoint, gathered onto this process's first CPU device (the
    checkpoint was written by a process of several devices)."""
    import jax
    import orbax.checkpoint as ocp

    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    path = run_dir / "checkpoints" / str(steps[-1]) / "state"
    checkpointer = ocp.StandardCheckpointer()
    one = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), checkpointer.metadata(path).item_metadata
    )
    return checkpointer.restore(path, target)


def trial(mode: str, max_delay_s: float, workdir: str, rng: random.Random) -> dict:
    import jax
    import numpy as np

    preset, overrides, flags = MODES[mode]
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=workdir))
    head = ["train", *([preset] if preset else []), *flags, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        _cli(*head, "--set", *overrides, "total_env_steps=100000000000"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = {"mode": mode}
    while proc.poll() is None and not _rows(run_dir):
        time.sleep(0.1)
    delay = rng.uniform(0, max_delay_s)
    time.sleep(delay)
    logged = _rows(run_dir)[-1]["updates"] if _rows(run_dir) else 0
    sent, sent_wall = time.monotonic(), time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    exit_s = time.monotonic() - sent
    last_line = err.strip().splitlines()[-1] if err.strip() else ""
    rows = _rows(run_dir)
    directory = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []
    checkpoint = steps[-1] if steps else None
    per_boundary = 2 if mode.startswith("anakin") else 1
    out.update(
        delay_s=round(delay, 2),
        exit_status=proc.returncode,
        exit_s=round(exit_s, 2),
        one_line=last_line.startswith("podray: stopped by SIGTERM at update") and "Traceback" not in err,
        no_stack_dump="PC: @" not in err and "*** SIG" not in err,
        logged_at_signal=logged,
        checkpoint=checkpoint,
        exit_within_30s=proc.returncode == 143 and exit_s <= 30.0,
        checkpoint_age_ok=checkpoint is not None
        and checkpoint >= logged
        and (directory / str(checkpoint)).stat().st_mtime >= sent_wall,
        boundaries_past_logged=None if checkpoint is None else (checkpoint - logged) / per_boundary,
    )
    if checkpoint is None:
        out["error"] = last_line[-300:]
        return out
    # Resume (in-process, on the same global device count) to two boundaries past the checkpoint.
    per_update = rows[-1]["env_steps"] // rows[-1]["updates"]
    total = (checkpoint + 2 * per_boundary) * per_update
    where = [] if mode.endswith("2hosts") else ["--in-process"]  # a 2-host checkpoint resumes on 2 hosts
    resume = subprocess.run(
        _cli("train", *where, "--resume", str(run_dir), "--set", f"total_env_steps={total}"),
        capture_output=True,
        text=True,
    )
    updates = [r["updates"] for r in _rows(run_dir)]
    out.update(
        resume_status=resume.returncode,
        continuous=updates == sorted(set(updates)) and updates[-1] == checkpoint + 2 * per_boundary,
    )
    if mode == "anakin":
        full_dir = pathlib.Path(tempfile.mkdtemp(prefix="full-", dir=workdir))
        subprocess.run(
            _cli("train", "--in-process", "--run-dir", str(full_dir), "--set", *overrides, f"total_env_steps={total}"),
            capture_output=True,
            check=True,
        )
        a, b = jax.tree.leaves(_final_arrays(run_dir)), jax.tree.leaves(_final_arrays(full_dir))
        out["bitwise"] = len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    return out


def main(trials: int = 10, max_delay_s: float = 10.0, out: str | None = None, seed: int = 0, modes=None) -> list:
    rng = random.Random(seed)
    modes = list(modes or MODES)
    results = []
    with tempfile.TemporaryDirectory(prefix="podray-preempt-") as workdir:
        for i in range(trials):
            mode = modes[i % len(modes)]
            r = trial(mode, max_delay_s, workdir, rng)
            results.append(r)
            print(json.dumps(r), flush=True)
    keys = ("exit_status", "exit_within_30s", "one_line", "no_stack_dump", "checkpoint_age_ok", "continuous", "bitwise")
    ok = {k: sum(1 for r in results if r.get(k) in (True, 143)) for k in keys}
    counted = {k: sum(1 for r in results if k in r) for k in keys}
    print("summary: " + ", ".join(f"{k} {ok[k]}/{counted[k]}" for k in keys), flush=True)
    if out:
        pathlib.Path(out).write_text(json.dumps(results, indent=1) + "\n")
    return results
