"""`podray bench sebulba`: frames/s of Sebulba IMPALA or MuZero on Pong-v5 against what its parts allow.

For each setting (agent, search simulations, torso, actor batch size, threads per actor device,
actor/learner device split) it measures, in the same process:
  - env:       raw envpool throughput of one actor batch with random actions (env steps/s);
  - inference: the jitted policy at the actor batch on an actor device, host copies in and out
               included (env steps/s); for MuZero the policy is the search, so this is the search's
               own ceiling;
  - learner:   the compiled learner step on a synthetic learner batch (env steps/s); for MuZero the
               update (add to the replay, then its gradient steps on samples), with the replay filled
               past replay.min_size first, so that every measured update takes its gradient steps;
  - measured:  the whole Sebulba pipeline, env steps the learner consumed per second, after warm-up.
Where all three share the same CPU cores, the best rate a pipeline can reach is the sequential bound
1 / (1/env + 1/inference + 1/learner) (every env step costs all three, on the same cores); with an
accelerator it is the slowest of the three. Efficiency = measured / bound. Frames = 4 x env steps
(Atari frame skip).

IMPALA: the learner batch is fixed (LEARNER_BATCH trajectories; an actor trajectory larger than that
is cut into pieces) while the actor batch is swept, so that every setting does the same learner work
per sample; the rollout length is 20 (IMPALA's). MuZero: every setting is the sebulba_muzero_pong
preset (Gumbel search, its batches, rollout and replay) at a number of search simulations.

With `repeats` > 1 every setting is measured that many times, in rounds that go over all settings
(alternate rounds in reverse order, so that a drift in the machine's speed touches every setting
alike); a row then holds the medians of its runs and each run's frames/s.
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import time
from dataclasses import asdict, dataclass, field, replace

import jax
import numpy as np

# The learner batch stays at LEARNER_BATCH trajectories while the actor batch is swept: batch sizes are
# decoupled (an actor trajectory larger than the learner batch is cut into pieces), so the sweep shows
# what the actor batch changes, with the learner in the same regime at every setting.
LEARNER_BATCH = 32

# Each agent's preset, and the learner batch and rollout length of every setting (None: the preset's).
AGENTS = {"impala": ("sebulba_pong", LEARNER_BATCH, 20), "muzero": ("sebulba_muzero_pong", None, None)}
SIMULATIONS = [8, 16, 50]
"""MuZero's search simulations swept by default (--quick: 16, the preset's)."""

# A sweep: the values of every axis; its settings are their product, in this order.
AXES = ("agent", "simulations", "torso", "actor_batch_size", "threads_per_actor_device", "split")
FULL_SWEEP = {
    "agent": ["impala"],
    "simulations": [0],  # no search
    "torso": ["nature_cnn", "impala_resnet"],
    "actor_batch_size": [32, 64, 128],
    "threads_per_actor_device": [1, 2, 4],
    "split": ["1+1", "1+2"],
}
QUICK_SWEEP = {
    "agent": ["impala"],
    "simulations": [0],
    "torso": ["nature_cnn"],
    "actor_batch_size": [32, 64, 128],
    "threads_per_actor_device": [2],
    "split": ["1+1"],
}
SPLITS = {"1+1": ([0], [1]), "1+2": ([0], [1, 2]), "2+2": ([0, 1], [2, 3])}


def sweep_for(agent: str, quick: bool = False) -> dict:
    """The default sweep of an agent: IMPALA's FULL_SWEEP or QUICK_SWEEP; MuZero's preset setting at
    SIMULATIONS (quick: the preset's own count)."""
    if agent == "impala":
        return QUICK_SWEEP if quick else FULL_SWEEP
    from podray import config as config_lib

    config = config_lib.load(AGENTS[agent][0])
    s = config.sebulba
    split = next(name for name, devices in SPLITS.items() if devices == (s.actor_devices, s.learner_devices))
    return {
        "agent": [agent],
        "simulations": [config.search.num_simulations] if quick else list(SIMULATIONS),
        "torso": [config.network.torso],
        "actor_batch_size": [s.actor_batch_size],
        "threads_per_actor_device": [s.threads_per_actor_device],
        "split": [split],
    }


def settings(sweep: dict) -> list[tuple]:
    """Every setting of a sweep, as tuples in the order of AXES."""
    return list(itertools.product(*(sweep[axis] for axis in AXES)))


@dataclass
class Row:
    """One setting's measurements (rates in env steps/s unless named frames)."""

    setting: str
    agent: str
    simulations: int  # search simulations per action (0: no search)
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
    gradient_steps: float  # per learner update: the fewest of the learner ceiling's timed updates
    measure_s: float
    load_avg_1m: float
    repeats: int = 1
    frames_per_s_runs: list[float] = field(default_factory=list)


def _config(
    agent: str,
    simulations: int,
    torso: str,
    batch: int,
    threads: int,
    split: str,
    env: str = "Pong-v5",
    rollout_length: int | None = None,
    learner_batch: int | None = None,
    overrides: tuple[str, ...] = (),
):
    """The setting's config: the agent's preset with the setting, then `overrides`; validated (a
    ConfigError names the field)."""
    from podray import config as config_lib

    preset, fixed_learner_batch, fixed_rollout_length = AGENTS[agent]
    learner_batch = learner_batch or fixed_learner_batch
    rollout_length = rollout_length or fixed_rollout_length
    actors, learners = SPLITS[split]
    overrides = [
        f"env.name={env}",
        f"network.torso={torso}",
        f"sebulba.actor_devices={actors}",
        f"sebulba.learner_devices={learners}",
        f"sebulba.threads_per_actor_device={threads}",
        f"sebulba.actor_batch_size={batch}",
        *([f"sebulba.learner_batch_size={learner_batch}"] if learner_batch else []),
        *([f"sebulba.rollout_length={rollout_length}"] if rollout_length else []),
        *([f"search.num_simulations={simulations}"] if agent == "muzero" else []),
        "sebulba.queue_size=2",
        "agent.epochs=1",
        "agent.num_minibatches=1",  # one step per learner batch, as in the sweeps recorded in docs/benchmarks.md
        "sebulba.max_policy_lag=1000",
        "sebulba.timeout_s=600",
        "run.cpu_devices=0",
        *(["network.depth=2", "network.width=256"] if torso == "impala_resnet" else []),
        *overrides,
    ]
    return config_lib.load(preset, overrides)


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
    """(env steps/s of the learner step, its gradient steps per update, the state after it)."""
    from podray import config as config_lib
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
    holder = [state, None]
    timed: list = []  # the metrics of the timed updates

    def run():
        holder[0], holder[1] = program.learner_step(holder[0], rollouts)
        jax.block_until_ready(holder[1])

    def gradient_steps(metrics) -> float:
        # An agent that replays says how many gradient steps its update took (none before its replay
        # holds replay.min_size transitions); the others take epochs x minibatches.
        if "gradient_steps" in metrics:
            return float(jax.device_get(metrics["gradient_steps"]))
        epochs, minibatches = config_lib.sgd_schedule(program.config.agent)
        return float(epochs * minibatches)

    def timed_run():
        run()
        timed.append(holder[1])

    run()  # warm-up
    # Fill a replay past replay.min_size first (with the same synthetic batches), so that every timed
    # update takes its gradient steps.
    for _ in range(math.ceil(program.config.replay.min_size / program.steps_per_update)):
        if gradient_steps(holder[1]) > 0:
            break
        run()
    rate = _median_rate(timed_run, program.steps_per_update, repeats)
    steps = min(gradient_steps(metrics) for metrics in timed)
    if not steps > 0:
        raise RuntimeError(f"bench sebulba: a timed learner update took {steps} gradient steps (replay not filled?)")
    return rate, steps, holder[0]


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
    rollout_length: int | None = None,
    min_seconds: float = 20.0,
    learner_batch: int | None = None,
    agent: str = "impala",
    simulations: int = 0,
    overrides: tuple[str, ...] = (),
) -> Row:
    """Measures one setting (see the module docstring).

    The learner batch and rollout length are the agent's (AGENTS) unless given; `simulations` is
    MuZero's search.num_simulations; `overrides` (section.field=value) apply last.
    """
    import os

    from podray.host import local_context
    from podray.sebulba import SebulbaProgram

    config = _config(agent, simulations, torso, batch, threads, split, env, rollout_length, learner_batch, overrides)
    learner_batch = config.sebulba.learner_batch_size
    program = SebulbaProgram(config, local_context())
    state = program.learner.initial_state(0)
    program.compile(state)
    env_rate = _env_ceiling(program, batch)
    inference_rate = _inference_ceiling(program, state, batch)
    learner_rate, gradient_steps, state = _learner_ceiling(program, state, repeats=3)
    measured, lag, updates, elapsed = _pipeline(program, state, 2, 3, min_seconds)
    search = f"{agent} sims={simulations} " if agent != "impala" else ""
    return Row(
        setting=f"{search}{torso} B={batch} L={learner_batch} threads={threads} split={split}",
        agent=agent,
        simulations=simulations if agent != "impala" else 0,
        torso=torso,
        actor_batch_size=batch,
        learner_batch_size=learner_batch,
        threads_per_actor_device=threads,
        split=split,
        **_rates(env_rate, inference_rate, learner_rate, measured, program.frame_skip),
        policy_lag=lag,
        learner_updates=updates,
        gradient_steps=gradient_steps,
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
    width = max([50, *(len(r.setting) for r in rows)])
    head = (
        f"{'setting':<{width}} {'frames/s':>9} {'bound':>9} {'eff':>5} {'env f/s':>9} {'infer f/s':>10} "
        f"{'learn f/s':>10} {'lag':>5} {'load':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.setting:<{width}} {r.frames_per_s:>9,.0f} {r.ceiling_frames_per_s:>9,.0f} {r.efficiency:>5.0%} "
            f"{r.env_frames_per_s:>9,.0f} {r.inference_frames_per_s:>10,.0f} {r.learner_frames_per_s:>10,.0f} "
            f"{r.policy_lag:>5.1f} {r.load_avg_1m:>5.1f}"
        )
    return "\n".join(lines)


def _x_and_line(row: Row) -> tuple[int, tuple]:
    """Where a row sits in the plot and in rise(): its x (the search simulations for an agent that
    searches, else the actor batch size) and the line it belongs to (the other axes)."""
    if row.simulations:
        line = (row.agent, row.torso, row.actor_batch_size, row.threads_per_actor_device, row.split)
        return row.simulations, line
    return row.actor_batch_size, (row.agent, row.torso, 0, row.threads_per_actor_device, row.split)


def _line_name(line: tuple) -> str:
    agent, torso, batch, threads, split = line
    return f"{agent} {torso}" + (f" B={batch}" if batch else "") + f" threads={threads} split={split}"


def plot(rows: list[Row], path: str | pathlib.Path) -> None:
    """frames/s (solid; dots: the runs of a repeated setting) and the sequential bound (dashed, x): one
    panel per agent and torso, against actor batch size (IMPALA; one line per threads and split) or
    against search simulations (MuZero; one line per actor batch, threads and split)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.agent, r.torso) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (agent, torso) in zip(axes[0], panels):
        groups: dict[tuple, list[Row]] = {}
        for r in rows:
            if (r.agent, r.torso) == (agent, torso):
                groups.setdefault(_x_and_line(r)[1], []).append(r)
        searches, xs = False, set()
        for line_key, group in sorted(groups.items()):
            group.sort(key=lambda r: _x_and_line(r)[0])
            x = [_x_and_line(r)[0] for r in group]
            searches, xs = bool(group[0].simulations), xs | set(x)
            label = _line_name(line_key).removeprefix(f"{agent} {torso} ")
            (line,) = ax.plot(x, [r.frames_per_s for r in group], "o-", label=label)
            for xi, r in zip(x, group):  # each run of a repeated setting, around its median
                ax.plot([xi] * len(r.frames_per_s_runs), r.frames_per_s_runs, ".", color=line.get_color(), alpha=0.4)
            ax.plot(x, [r.ceiling_frames_per_s for r in group], "x--", color=line.get_color(), alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(xs), [str(x) for x in sorted(xs)])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("search simulations per action" if searches else "actor batch size (envs per actor thread)")
        ax.set_ylabel("frames/s (Pong-v5, frame skip 4)")
        ax.set_title(f"{agent} {torso}: measured (solid) vs sequential bound (dashed)", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def select(
    sweep: dict | None = None,
    torso: list[str] | None = None,
    actor_batch_size: list[int] | None = None,
    threads_per_actor_device: list[int] | None = None,
    split: list[str] | None = None,
    agent: str | None = None,
    simulations: list[int] | None = None,
    quick: bool = False,
) -> dict:
    """The sweep to run: `sweep` (default: the agent's, see sweep_for) with the given axes replaced.

    Checked before anything compiles: a bad flag, and every setting's config, raise ConfigError (a
    flag's error names the flag).
    """
    from podray import config as config_lib

    if agent is not None and agent not in AGENTS:
        raise config_lib.ConfigError(f"bench sebulba: --agent {agent} is not one of {', '.join(AGENTS)}")
    agent = agent or (sweep["agent"][0] if sweep else "impala")
    if simulations is not None and agent != "muzero":
        raise config_lib.ConfigError(
            f"bench sebulba: --simulations belongs to --agent muzero (the {agent} agent does not search)"
        )
    chosen = dict(sweep or sweep_for(agent, quick))
    for name, flag, values, valid in (
        ("torso", "--torso", torso, ("nature_cnn", "impala_resnet")),
        ("split", "--split", split, tuple(SPLITS)),
    ):
        if values is not None:
            bad = [v for v in values if v not in valid]
            if bad or not values:
                raise config_lib.ConfigError(f"bench sebulba: {flag} {','.join(bad)} is not one of {', '.join(valid)}")
            chosen[name] = list(values)
    for name, flag, values, example in (
        ("actor_batch_size", "--batch", actor_batch_size, "32,64,128"),
        ("threads_per_actor_device", "--threads", threads_per_actor_device, "1,2,4"),
        ("simulations", "--simulations", simulations, ",".join(map(str, SIMULATIONS))),
    ):
        if values is not None:
            if not values or any(v < 1 for v in values):
                raise config_lib.ConfigError(f"bench sebulba: {flag} takes positive integers, e.g. {flag} {example}")
            chosen[name] = list(values)
    for setting in settings(chosen):
        _config(*setting)  # validates the setting's whole config
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
        gradient_steps=med("gradient_steps"),
        measure_s=float(sum(r.measure_s for r in runs)),
        load_avg_1m=max(r.load_avg_1m for r in runs),
        repeats=len(runs),
        frames_per_s_runs=[r.frames_per_s for r in runs],
    )


def rise(rows: list[Row]) -> list[tuple[str, float]]:
    """For each line of the sweep (IMPALA: torso, threads, split; MuZero: also the actor batch):
    frames/s at its largest x (IMPALA: actor batch; MuZero: search simulations) over frames/s at its
    smallest."""
    lines: dict[tuple, list[Row]] = {}
    for r in rows:
        lines.setdefault(_x_and_line(r)[1], []).append(r)
    out = []
    for line, group in sorted(lines.items()):
        group.sort(key=lambda r: _x_and_line(r)[0])
        if len(group) > 1:
            axis = "sims" if group[0].simulations else "B"
            first, last = _x_and_line(group[0])[0], _x_and_line(group[-1])[0]
            name = _line_name(line).removeprefix("impala ") + f" {axis}={first}->{last}"
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
    (with actor batch; MuZero: with simulations), writes JSON rows to `out` and a PNG plot beside it."""
    sweep = sweep or sweep_for("impala", quick)
    all_settings = settings(sweep)
    runs: dict[tuple, list[Row]] = {s: [] for s in all_settings}
    for round_ in range(repeats):
        for setting in all_settings if round_ % 2 == 0 else all_settings[::-1]:
            agent, simulations, torso, batch, threads, split = setting
            row = measure(torso, batch, threads, split, min_seconds=min_seconds, agent=agent, simulations=simulations)
            runs[setting].append(row)
            print(_table(runs[setting][-1:]).splitlines()[-1], flush=True)
    rows = [_median_row(runs[s]) for s in all_settings]
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
