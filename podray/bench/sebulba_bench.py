"""`podray bench sebulba`: frames/s of Sebulba IMPALA on Pong-v5 against what its parts allow.

For each setting (torso, actor batch size, threads per actor device, actor/learner device split) it
measures, in the same process:
  - env:       raw envpool throughput of one actor batch with random actions (env steps/s);
  - inference: the jitted policy at the actor batch on an actor device, host copies in and out
               included (env steps/s);
  - learner:   the compiled learner step on a synthetic learner batch (env steps/s);
  - measured:  the whole Sebulba pipeline, env steps the learner consumed per second, after warm-up.
Where all three share the same CPU cores, the best rate a pipeline can reach is the sequential bound
1 / (1/env + 1/inference + 1/learner) (every env step costs all three, on the same cores); with an
accelerator it is the slowest of the three. Efficiency = measured / bound. Frames = 4 x env steps
(Atari frame skip).

The learner batch is fixed (LEARNER_BATCH trajectories; an actor trajectory larger than that is cut
into pieces) while the actor batch is swept, so that every setting does the same learner work per
sample; the rollout length is 20 (IMPALA's).

With `repeats` > 1 every setting is measured that many times, in rounds that go over all settings
(alternate rounds in reverse order, so that a drift in the machine's speed touches every setting
alike); a row then holds the medians of its runs and each run's frames/s.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import time
from dataclasses import asdict, dataclass, field, replace

import jax
import numpy as np

# The learner batch stays at LEARNER_BATCH trajectories while the actor batch is swept: batch sizes are
# decoupled (an actor trajectory larger than the learner batch is cut into pieces), so the sweep shows
# what the actor batch changes, with the learner in the same regime at every setting.
LEARNER_BATCH = 32

FULL_SWEEP = {
    "torso": ["nature_cnn", "impala_resnet"],
    "actor_batch_size": [32, 64, 128],
    "threads_per_actor_device": [1, 2, 4],
    "split": ["1+1", "1+2"],
}
QUICK_SWEEP = {
    "torso": ["nature_cnn"],
    "actor_batch_size": [32, 64, 128],
    "threads_per_actor_device": [2],
    "split": ["1+1"],
}
SPLITS = {"1+1": ([0], [1]), "1+2": ([0], [1, 2]), "2+2": ([0, 1], [2, 3])}


@dataclass
class Row:
    """One setting's measurements (rates in env steps/s unless named frames)."""

    setting: str
    torso: str
    actor_batch_size: int
    learner_batch_size: int
    threads_per_actor_device: int
    split: str
    env_steps_per_s: float
    inference_steps_per_s: float
    learner_steps_per_s: float
    ceiling_steps_per_s: float
    measured_steps_per_s: float
    frames_per_s: float
    ceiling_frames_per_s: float
    env_frames_per_s: float
    inference_frames_per_s: float
    learner_frames_per_s: float
    efficiency: float
    policy_lag: float
    learner_updates: int
    measure_s: float
    load_avg_1m: float
    repeats: int = 1
    frames_per_s_runs: list[float] = field(default_factory=list)


def _config(torso: str, batch: int, threads: int, split: str, env: str, rollout_length: int, learner_batch: int):
    from podray import config as config_lib

    actors, learners = SPLITS[split]
    overrides = [
        f"env.name={env}",
        f"network.torso={torso}",
        f"sebulba.actor_devices={actors}",
        f"sebulba.learner_devices={learners}",
        f"sebulba.threads_per_actor_device={threads}",
        f"sebulba.actor_batch_size={batch}",
        f"sebulba.learner_batch_size={learner_batch}",
        f"sebulba.rollout_length={rollout_length}",
        "sebulba.queue_size=2",
        "agent.epochs=1",
        "agent.num_minibatches=1",  # one step per learner batch, as in the sweeps recorded in docs/benchmarks.md
        "sebulba.max_policy_lag=1000",
        "sebulba.timeout_s=600",
        "run.cpu_devices=0",
    ]
    if torso == "impala_resnet":
        overrides += ["network.depth=2", "network.width=256"]
    return config_lib.load("sebulba_pong", overrides)


def _median_rate(fn, work: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return work / float(np.median(times))


def _env_ceiling(program, batch: int, steps: int = 100) -> float:
    env = program._make_env(0)
    try:
        env.reset()
        rng = np.random.default_rng(0)
        n = env.spec.num_actions
        ids = np.arange(batch, dtype=np.int32)

        def run():
            for _ in range(steps):
                env.send(rng.integers(0, n, batch), ids)
                env.recv()

        run()  # warm-up
        return _median_rate(run, steps * batch, 3)
    finally:
        env.close()


def _inference_ceiling(program, state, batch: int, calls: int = 10) -> float:
    device = program.actor_devices[0]
    params = jax.device_put(state.train.params, device)
    key = jax.device_put(jax.random.PRNGKey(0), device)
    obs = np.zeros((batch, *program._raw_obs_shape()), np.uint8)

    def run():
        for _ in range(calls):
            jax.device_get(program.policy(params, jax.device_put(obs, device), key)[1:])

    return _median_rate(run, calls * batch, 3)


def _learner_ceiling(program, state, repeats: int):
    from podray.actors import Rollout

    s = program.config.sebulba
    abstract = program.learner.abstract_trajectory(
        s.rollout_length, program.piece, program._raw_obs_shape(), program.spec.obs_dtype
    )
    rng = np.random.default_rng(0)

    def fake(a):
        if a.dtype == np.uint8:
            x = rng.integers(0, 255, a.shape, dtype=np.uint8)
        elif a.dtype == np.int32:
            x = rng.integers(0, program.spec.num_actions, a.shape).astype(np.int32)
        else:
            x = rng.random(a.shape, dtype=np.float32)
        return jax.device_put(x, a.sharding)

    rollouts = [Rollout(jax.tree.map(fake, abstract), 0, 0) for _ in range(program.learner.k)]
    holder = [state]

    def run():
        holder[0], metrics = program.learner_step(holder[0], rollouts)
        jax.block_until_ready(metrics)

    run()  # warm-up
    return _median_rate(run, program.steps_per_update, repeats), holder[0]


def _pipeline(program, state, warmup_updates: int, min_updates: int, min_seconds: float):
    """Runs actors and learner; returns (env steps/s consumed by the learner, mean lag, updates)."""
    program.start(state.train.params, 0)
    try:
        version = 0
        for _ in range(warmup_updates):
            state, _ = program.learner_step(state, program.gather(version))
            version += 1
            program.params.publish(state.train.params, version)
        jax.block_until_ready(state)
        program.lags.clear()
        start, updates = time.perf_counter(), 0
        while updates < min_updates or time.perf_counter() - start < min_seconds:
            state, metrics = program.learner_step(state, program.gather(version))
            version += 1
            updates += 1
            program.params.publish(state.train.params, version)
        jax.block_until_ready(metrics)
        elapsed = time.perf_counter() - start
    finally:
        program.stop()
    lag = float(np.mean(program.lags)) if program.lags else float("nan")
    return updates * program.steps_per_update / elapsed, lag, updates, elapsed


def measure(
    torso: str,
    batch: int,
    threads: int,
    split: str,
    env: str = "Pong-v5",
    rollout_length: int = 20,
    min_seconds: float = 20.0,
    learner_batch: int | None = None,
) -> Row:
    """Measures one setting (see the module docstring); the learner batch is LEARNER_BATCH unless given."""
    import os

    from podray.host import local_context
    from podray.sebulba import SebulbaProgram

    learner_batch = learner_batch or LEARNER_BATCH
    config = _config(torso, batch, threads, split, env, rollout_length, learner_batch)
    program = SebulbaProgram(config, local_context())
    state = program.learner.initial_state(0)
    program.compile(state)
    env_rate = _env_ceiling(program, batch)
    inference_rate = _inference_ceiling(program, state, batch)
    learner_rate, state = _learner_ceiling(program, state, repeats=3)
    measured, lag, updates, elapsed = _pipeline(program, state, 2, 3, min_seconds)
    return Row(
        setting=f"{torso} B={batch} L={learner_batch} threads={threads} split={split}",
        torso=torso,
        actor_batch_size=batch,
        learner_batch_size=learner_batch,
        threads_per_actor_device=threads,
        split=split,
        **_rates(env_rate, inference_rate, learner_rate, measured, program.frame_skip),
        policy_lag=lag,
        learner_updates=updates,
        measure_s=elapsed,
        load_avg_1m=os.getloadavg()[0],
    )


def _rates(env: float, inference: float, learner: float, measured: float, frame_skip: int) -> dict:
    """Row's rate fields from the three ceilings and the measured rate (env steps/s): the sequential
    bound, the efficiency and every rate in frames."""
    bound = 1.0 / (1.0 / env + 1.0 / inference + 1.0 / learner)
    return dict(
        env_steps_per_s=env,
        inference_steps_per_s=inference,
        learner_steps_per_s=learner,
        ceiling_steps_per_s=bound,
        measured_steps_per_s=measured,
        frames_per_s=measured * frame_skip,
        ceiling_frames_per_s=bound * frame_skip,
        env_frames_per_s=env * frame_skip,
        inference_frames_per_s=inference * frame_skip,
        learner_frames_per_s=learner * frame_skip,
        efficiency=measured / bound,
    )


def _table(rows: list[Row]) -> str:
    head = (
        f"{'setting':<50} {'frames/s':>9} {'bound':>9} {'eff':>5} {'env f/s':>9} {'infer f/s':>10} "
        f"{'learn f/s':>10} {'lag':>5} {'load':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.setting:<50} {r.frames_per_s:>9,.0f} {r.ceiling_frames_per_s:>9,.0f} {r.efficiency:>5.0%} "
            f"{r.env_frames_per_s:>9,.0f} {r.inference_frames_per_s:>10,.0f} {r.learner_frames_per_s:>10,.0f} "
            f"{r.policy_lag:>5.1f} {r.load_avg_1m:>5.1f}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str | pathlib.Path) -> None:
    """frames/s (solid; dots: the runs of a repeated setting) and the sequential bound (dashed) against
    actor batch size: one panel per torso, one line per (threads, split)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torsos = sorted({r.torso for r in rows})
    fig, axes = plt.subplots(1, len(torsos), figsize=(6 * len(torsos), 4.5), squeeze=False)
    for ax, torso in zip(axes[0], torsos):
        groups: dict[tuple, list[Row]] = {}
        for r in rows:
            if r.torso == torso:
                groups.setdefault((r.threads_per_actor_device, r.split), []).append(r)
        for (threads, split), group in sorted(groups.items()):
            group.sort(key=lambda r: r.actor_batch_size)
            x = [r.actor_batch_size for r in group]
            (line,) = ax.plot(x, [r.frames_per_s for r in group], "o-", label=f"{threads} thr, {split}")
            for r in group:  # each run of a repeated setting, around its median
                ax.plot(
                    [r.actor_batch_size] * len(r.frames_per_s_runs),
                    r.frames_per_s_runs,
                    ".",
                    color=line.get_color(),
                    alpha=0.4,
                )
            ax.plot(x, [r.ceiling_frames_per_s for r in group], "--", color=line.get_color(), alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("actor batch size (envs per actor thread)")
        ax.set_ylabel("frames/s (Pong-v5, frame skip 4)")
        ax.set_title(f"{torso}: measured (solid) vs sequential bound (dashed)", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def select(
    sweep: dict,
    torso: list[str] | None = None,
    actor_batch_size: list[int] | None = None,
    threads_per_actor_device: list[int] | None = None,
    split: list[str] | None = None,
) -> dict:
    """`sweep` with the given axes replaced; checked before anything compiles (ConfigError names the flag)."""
    from podray import config as config_lib

    chosen = dict(sweep)
    for name, flag, values, valid in (
        ("torso", "--torso", torso, ("nature_cnn", "impala_resnet")),
        ("split", "--split", split, tuple(SPLITS)),
    ):
        if values is not None:
            bad = [v for v in values if v not in valid]
            if bad or not values:
                raise config_lib.ConfigError(f"bench sebulba: {flag} {','.join(bad)} is not one of {', '.join(valid)}")
            chosen[name] = list(values)
    for name, flag, values in (
        ("actor_batch_size", "--batch", actor_batch_size),
        ("threads_per_actor_device", "--threads", threads_per_actor_device),
    ):
        if values is not None:
            if not values or any(v < 1 for v in values):
                raise config_lib.ConfigError(f"bench sebulba: {flag} takes positive integers, e.g. {flag} 32,64,128")
            chosen[name] = list(values)
    return chosen


def _median_row(runs: list[Row]) -> Row:
    """One row from repeated runs of a setting: the median of each rate, the bound and efficiency
    recomputed from the medians."""
    med = lambda name: float(np.median([getattr(r, name) for r in runs]))  # noqa: E731
    names = ("env_steps_per_s", "inference_steps_per_s", "learner_steps_per_s", "measured_steps_per_s")
    frame_skip = round(runs[0].frames_per_s / runs[0].measured_steps_per_s)
    return replace(
        runs[0],
        **_rates(*(med(n) for n in names), frame_skip),
        policy_lag=med("policy_lag"),
        learner_updates=int(sum(r.learner_updates for r in runs)),
        measure_s=float(sum(r.measure_s for r in runs)),
        load_avg_1m=max(r.load_avg_1m for r in runs),
        repeats=len(runs),
        frames_per_s_runs=[r.frames_per_s for r in runs],
    )


def rise(rows: list[Row]) -> list[tuple[str, float]]:
    """For each line of the sweep (torso, threads, split): frames/s at its largest actor batch over
    frames/s at its smallest."""
    lines: dict[tuple, list[Row]] = {}
    for r in rows:
        lines.setdefault((r.torso, r.threads_per_actor_device, r.split), []).append(r)
    out = []
    for (torso, threads, split), group in sorted(lines.items()):
        group.sort(key=lambda r: r.actor_batch_size)
        if len(group) > 1:
            batches = f"B={group[0].actor_batch_size}->{group[-1].actor_batch_size}"
            name = f"{torso} threads={threads} split={split} {batches}"
            out.append((name, group[-1].frames_per_s / group[0].frames_per_s))
    return out


def main(
    out: str | None = None,
    quick: bool = False,
    min_seconds: float = 20.0,
    sweep: dict | None = None,
    repeats: int = 1,
) -> list[Row]:
    """Runs the sweep `repeats` times (see the module docstring), prints a table and each line's rise
    with actor batch, writes JSON rows to `out` and a PNG plot beside it."""
    sweep = sweep or (QUICK_SWEEP if quick else FULL_SWEEP)
    settings = list(
        itertools.product(sweep["torso"], sweep["actor_batch_size"], sweep["threads_per_actor_device"], sweep["split"])
    )
    runs: dict[tuple, list[Row]] = {s: [] for s in settings}
    for round_ in range(repeats):
        for setting in settings if round_ % 2 == 0 else settings[::-1]:
            torso, batch, threads, split = setting
            runs[setting].append(measure(torso, batch, threads, split, min_seconds=min_seconds))
            print(_table(runs[setting][-1:]).splitlines()[-1], flush=True)
    rows = [_median_row(runs[s]) for s in settings]
    print(_table(rows) + (f"\n(medians of {repeats} runs per setting)" if repeats > 1 else ""))
    for name, ratio in rise(rows):
        print(f"{name}: frames/s x{ratio:.2f}")
    if out:
        path = pathlib.Path(out)
        path.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        plot(rows, path.with_suffix(".png"))
    return rows


def plot_learning_curve(
    metrics_jsonl: str | pathlib.Path, path: str | pathlib.Path, title: str | None = None, smooth: int = 10
) -> None:
    """Mean unclipped game score against frames, from a Sebulba run's metrics.jsonl.

    Each report's score (dots) and its mean over the last `smooth` reports (line). The title defaults
    to the agent and environment of the run's config.yaml, when it sits beside the metrics.

    python -c "from podray.bench import sebulba_bench as b; b.plot_learning_curve('RUN/metrics.jsonl', 'curve.png')"
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from podray.metrics import read_jsonl

    if title is None:
        title = "Sebulba on Atari"
        config_file = pathlib.Path(metrics_jsonl).with_name("config.yaml")
        if config_file.exists():
            from podray.config import load_yaml

            config = load_yaml(str(config_file))
            title = f"Sebulba {config['agent']['name'].upper()} on {config['env']['name']}"
    rows = [r for r in read_jsonl(metrics_jsonl) if r.get("mean_return") is not None]
    frame_skip = 4
    frames = [r["env_steps"] * frame_skip / 1e6 for r in rows]
    scores = np.asarray([r["mean_return"] for r in rows], np.float64)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(frames, scores, "o", ms=2, alpha=0.4, label="report")
    if len(scores) >= smooth:
        mean = np.convolve(scores, np.ones(smooth) / smooth, mode="valid")
        ax.plot(frames[smooth - 1 :], mean, "-", label=f"mean of last {smooth} reports")
    ax.set_xlabel("frames (millions)")
    ax.set_ylabel("mean episode return (unclipped)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
