"""The `podray` command: train, eval, plot, bench, tune.

  podray train [PRESET_OR_YAML] [--set section.field=value ...] [--run-dir DIR|URI] [--resume RUN_DIR]
               [--address RAY_ADDRESS] [--dashboard] [--ray | --in-process]
  podray bench anakin|sebulba|ray [--out FILE] [--quick]
  podray bench sebulba-hosts|scale [--repeats R] [--out FILE] [--quick]
  podray bench sebulba [--agent impala|muzero] [--simulations 8,16,50] [--torso T,..] [--batch B,..] [--threads N,..]
                       [--split S,..] [--repeats R] [--seconds S] [--out FILE] [--quick]
  podray bench preempt [--trials 10] [--max-delay 10] [--out FILE]
  podray bench soak [--minutes 60] [--interval 60] [--out FILE] [--plot PNG] [--runs NAMES] [--keep DIR]
                    [--set KEY=VALUE ...]
  podray bench probe RUN_DIR [--step UPDATE] [--out FILE]
  podray bench purejaxrl [--peer PATH] [--repeats R] [--only throughput|wall] [--envs 4,64] [--out FILE]
  podray eval RUN_DIR [--step N] [--episodes N] [--greedy|--sample] [--video FILE.mp4|.gif] [--seed S]
  podray plot RUN_DIR [RUN_DIR ...] --out FILE.png [--names A,B,..] [--title TEXT]
  podray tune STUDY_YAML [--set section.field=value ...] [--storage DIR] [--name NAME] [--address ADDR]
  podray tune --resume STUDY_DIR

Bad input (preset, YAML, --set, environment name, device split) is reported as one line naming the
field and the fix, with exit status 2, before anything compiles.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from podray import config as config_lib
from podray import run_dirs
from podray.preemption import Preempted, StopNow


def _train(args: argparse.Namespace) -> int:
    from podray.training import load_run_config

    if args.resume:
        if args.preset:
            raise config_lib.ConfigError("--resume continues a run with its own config; drop the preset")
        run_dir = run_dirs.existing(args.resume)  # a relative one: under $PODRAY_RUNS_ROOT when set
        config = load_run_config(run_dir, check=False)
        config = config_lib.resume_overrides(config, args.set)  # e.g. a larger total_env_steps
    else:
        config = config_lib.load(args.preset, args.set, check=False)
        run_dir = args.run_dir
    r = config.run
    # A run goes through the Ray layer only when it needs Ray (or --ray asks for it); otherwise the same
    # train() a host worker calls runs here, without the ~7 s of starting and stopping a local Ray.
    needs_ray = {
        "--address": args.address,
        "RAY_ADDRESS": not args.in_process and not args.address and os.environ.get("RAY_ADDRESS"),
        "--dashboard": args.dashboard,
        "run.hosts": r.hosts > 1,
        "run.seeds": r.seeds,
        "run.tpu_topology": r.tpu_topology,
    }
    reasons = [name for name, value in needs_ray.items() if value]
    if args.in_process and (reasons or args.ray):
        used = ", ".join(reasons + (["--ray"] if args.ray else []))
        raise config_lib.ConfigError(f"--in-process runs one host without Ray; drop {used} or drop --in-process")
    use_ray = args.ray or bool(reasons)
    if use_ray:
        from podray.cluster.driver import pin_driver_jax_to_cpu

        pin_driver_jax_to_cpu()
    from podray import validation

    # Absolute, under the runs root; a directory in Ray's job cache is refused here, before any compile.
    run_dir = run_dirs.resolve(config, run_dir)
    if not args.resume:  # (load_run_config checked a resumed one)
        from podray import storage

        storage.check_run_dir(run_dir, "--run-dir")  # an object store: its filesystem, bucket, credentials
    validation.validate(config)
    print(f"podray: run dir {run_dir}", flush=True)
    if not use_ray:
        # JAX starts only now, after the config is checked.
        from podray.training import train

        print(
            "podray: running in this process (local; Ray is started only for --ray, --address, "
            "--dashboard, run.hosts > 1, run.seeds or run.tpu_topology)",
            flush=True,
        )
        _print_summary(train(config, run_dir=run_dir, resume=bool(args.resume)).to_dict(), "local")
        return 0
    # The Ray layer: host workers start JAX on the devices; this process only a CPU JAX (validation).
    from podray.cluster import train_on_ray

    print(f"podray: running on Ray ({', '.join(reasons) if reasons else '--ray'})", flush=True)
    results = train_on_ray(
        config,
        run_dir=run_dir,
        resume=bool(args.resume),
        address=args.address,
        dashboard=args.dashboard,
        keep_dashboard=_wait_for_interrupt if args.dashboard else None,
    )
    for result in results:
        _print_summary(result, "ray")
    return 0


def _print_summary(summary: dict, launcher: str) -> None:
    ret = summary["final_mean_return"]
    ret = float("nan") if ret is None else ret
    print(
        f"done ({launcher}): final mean return {ret:.2f} | "
        f"env steps {summary['env_steps']:,d} | wall {summary['wall_s']:.1f} s "
        f"(compile {summary['compile_s']:.1f} s) | {summary['steps_per_s']:,.0f} steps/s "
        f"({summary['steady_steps_per_s']:,.0f} steady) | run dir {summary['run_dir']}",
        flush=True,
    )


def _wait_for_interrupt(url: str) -> None:
    """Keeps a local Ray (and its dashboard) up after the run until Ctrl-C, on an interactive terminal."""
    if not sys.stdin.isatty():
        return
    print(f"the run is done; the dashboard stays up at {url}; press Ctrl-C to stop Ray", flush=True)
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass


def _comma_list(flag: str, text: str | None, kind=str, target: str = "sebulba") -> list | None:
    if text is None:
        return None
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        message = f"bench {target}: {flag} {text!r} is not a comma-separated list of integers"
        raise config_lib.ConfigError(message) from None


def _bench(args: argparse.Namespace) -> int:
    sebulba_only = (args.agent, args.simulations, args.torso, args.batch, args.threads, args.split)
    if args.target != "sebulba" and any(v is not None for v in sebulba_only):
        raise config_lib.ConfigError(
            f"bench {args.target}: --agent/--simulations/--torso/--batch/--threads/--split belong to "
            "'podray bench sebulba'"
        )
    if args.target not in ("sebulba", "sebulba-hosts", "scale", "purejaxrl") and args.repeats is not None:
        raise config_lib.ConfigError(
            f"bench {args.target}: --repeats belongs to 'podray bench sebulba', 'sebulba-hosts', 'scale', 'purejaxrl'"
        )
    if args.target != "purejaxrl" and (args.peer is not None or args.only is not None or args.envs is not None):
        raise config_lib.ConfigError(
            f"bench {args.target}: --peer, --only and --envs belong to 'podray bench purejaxrl'"
        )
    if args.target != "soak" and (args.runs is not None or args.keep is not None or args.set):
        raise config_lib.ConfigError(f"bench {args.target}: --runs, --keep and --set belong to 'podray bench soak'")
    if args.repeats is None:
        args.repeats = 3 if args.target in ("sebulba-hosts", "purejaxrl") else 1
    if args.repeats < 1:
        raise config_lib.ConfigError(f"bench {args.target}: --repeats {args.repeats} must be >= 1")
    if args.target == "purejaxrl":
        from podray.bench import purejaxrl_compare

        envs = tuple(_comma_list("--envs", args.envs, int, "purejaxrl") or (4, 64))
        which = args.only or "all"
        purejaxrl_compare.main(peer=args.peer, repeats=args.repeats, out=args.out, which=which, envs=envs)
        return 0
    if args.target == "anakin":
        from podray.bench import anakin_bench

        anakin_bench.main(out=args.out, quick=args.quick)
        return 0
    if args.target == "ray":
        from podray.bench import ray_bench

        ray_bench.main(out=args.out, quick=args.quick)
        return 0
    if args.target == "sebulba-hosts":
        from podray.bench import hosts_bench

        hosts_bench.main(out=args.out, quick=args.quick, repeats=args.repeats)
        return 0
    if args.target == "scale":
        from podray.bench import scale_bench

        scale_bench.main(out=args.out, quick=args.quick, repeats=args.repeats)
        return 0
    if args.target == "sebulba":
        from podray import host
        from podray.bench import sebulba_bench

        args.repeats = 1 if args.repeats is None else args.repeats
        if args.repeats < 1:
            raise config_lib.ConfigError(f"bench sebulba: --repeats {args.repeats} must be >= 1")
        if args.seconds <= 0:
            raise config_lib.ConfigError(f"bench sebulba: --seconds {args.seconds} must be > 0")
        sweep = sebulba_bench.select(
            agent=args.agent,
            quick=args.quick,
            simulations=_comma_list("--simulations", args.simulations, int),
            torso=_comma_list("--torso", args.torso),
            actor_batch_size=_comma_list("--batch", args.batch, int),
            threads_per_actor_device=_comma_list("--threads", args.threads, int),
            split=_comma_list("--split", args.split),
        )
        host.configure_cpu_devices(4)  # on CPU: fake devices for the actor/learner splits
        sebulba_bench.main(out=args.out, min_seconds=args.seconds, sweep=sweep, repeats=args.repeats)
        return 0
    if args.target == "preempt":
        if args.trials < 1 or args.max_delay < 0:
            raise config_lib.ConfigError(f"bench preempt: --trials {args.trials} must be >= 1, --max-delay >= 0")
        from podray.bench import preempt_bench

        preempt_bench.main(trials=args.trials, max_delay_s=args.max_delay, out=args.out)
        return 0
    if args.target == "soak":
        if args.minutes <= 0 or args.interval <= 0:
            raise config_lib.ConfigError(
                f"bench soak: --minutes {args.minutes} and --interval {args.interval} must be > 0"
            )
        from podray import validation
        from podray.bench import soak_bench

        runs = (
            tuple(name.strip() for name in args.runs.split(",") if name.strip())
            if args.runs
            else tuple(soak_bench.RUNS)
        )
        unknown = [name for name in runs if name not in soak_bench.RUNS]
        if unknown or not runs:
            raise config_lib.ConfigError(
                f"bench soak: --runs {args.runs!r} names {', '.join(unknown) or 'nothing'}; "
                f"choose from {','.join(soak_bench.RUNS)}"
            )
        for name in runs:  # every override is checked against every run's preset before anything starts
            preset, *own = soak_bench.RUNS[name]
            validation.validate(config_lib.load(preset, [*soak_bench.COMMON, *own, *args.set]))
        soak_bench.main(
            minutes=args.minutes,
            interval_s=args.interval,
            out=args.out,
            plot_path=args.plot,
            runs=runs,
            keep=args.keep,
            overrides=tuple(args.set),
        )
        return 0
    if args.target == "probe":
        if not args.run_dir:
            raise config_lib.ConfigError("bench probe: give a run directory: podray bench probe RUN_DIR")
        if args.frames < 1:
            raise config_lib.ConfigError(f"bench probe: --frames {args.frames} must be >= 1 (default 2400)")
        from podray.bench import probe

        probe.main(args.run_dir, out=args.out, frames=args.frames, step=args.step)
        return 0
    raise config_lib.ConfigError(
        f"bench: unknown target '{args.target}'; choose anakin, sebulba, sebulba-hosts, scale, ray, soak, preempt, "
        "probe or purejaxrl"
    )


def _eval(args: argparse.Namespace) -> int:
    from podray import evaluation

    # Everything the command line can get wrong is checked before JAX compiles or an environment starts.
    run_dir = args.run_dir
    if not run_dirs.is_uri(run_dir) and not os.path.isdir(run_dir):
        run_dir = run_dirs.existing(run_dir)  # a relative one: under $PODRAY_RUNS_ROOT when set
    request = evaluation.check_request(
        run_dir, step=args.step, episodes=args.episodes, greedy=args.greedy, video=args.video, seed=args.seed
    )
    print(
        f"podray: evaluating {request.run_dir} at checkpoint {request.step}: {request.episodes} episodes, "
        f"{'greedy' if request.greedy else 'sampled'} actions",
        flush=True,
    )
    r = evaluation.evaluate(request)
    steps = f" ({r.env_steps:,d} env steps)" if r.env_steps is not None else ""
    print(
        f"eval: {r.env} checkpoint {r.checkpoint_step}{steps}, {r.episodes} episodes, {r.policy}: "
        f"mean {r.mean:.2f} std {r.std:.2f} min {r.min:.2f} max {r.max:.2f} | wall {r.wall_s:.1f} s"
    )
    print(f"wrote {request.run_dir / 'eval.json'}" + (f" and {r.video} ({r.video_frames} frames)" if r.video else ""))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from podray import plotting

    plotting.check_out(args.out)
    runs = plotting.load_runs(args.run_dirs, names=args.names)  # checked before matplotlib starts
    plotting.plot_runs(runs, args.out, title=args.title)
    print(f"wrote {args.out} ({len(runs)} runs: {', '.join(r.name for r in runs)})")
    return 0


def _tune(args: argparse.Namespace) -> int:
    import jax

    from podray import tuning

    # This process only validates (gymnax starts a JAX backend): keep it off the accelerators, which the
    # trials on this host need (a TPU host can be opened by one process only). Not an environment
    # variable, so that a Ray started here does not pass it on to the trials.
    jax.config.update("jax_platforms", "cpu")

    if args.resume:
        if args.study or args.set:
            raise config_lib.ConfigError("--resume continues a study with its own spec; drop the YAML and --set")
        result = tuning.resume_study(args.resume, address=args.address)
    else:
        if not args.study:
            raise config_lib.ConfigError("tune: give a study YAML (e.g. tune_configs/anakin_cartpole_batch_depth.yaml)")
        spec = tuning.load_study(args.study, args.set)  # every trial validated; Ray not started yet
        result = tuning.run_study(spec, storage=args.storage, name=args.name, address=args.address)
    print(result.outputs.table)
    best = result.best
    if best is not None:
        shown = {k: v for k, v in best.items() if k not in ("trial", "status", "run_dir", "error")}
        print(f"best trial {best['trial']}: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    print(f"study dir {result.study_dir} (trials.csv, trials.json, *.png) | wall {result.wall_s:.1f} s")
    if result.unfinished:
        print(
            f"podray: {result.unfinished} trials unfinished (interrupted); resume with "
            f"podray tune --resume {result.study_dir}",
            file=sys.stderr,
        )
        return 130
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="podray", description="Podracer architectures on JAX and Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an agent (default: Anakin PPO on CartPole-v1)")
    t.add_argument(
        "preset", nargs="?", default=None, help=f"preset name ({', '.join(config_lib.preset_names())}) or a YAML file"
    )
    t.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="override config fields, e.g. --set agent.learning_rate=3e-4 env.num_envs=64 (repeatable)",
    )
    t.add_argument(
        "--run-dir",
        default=None,
        help="run directory: a path or an object-store URI (gs://BUCKET/PATH, s3://BUCKET/PATH); a relative "
        "path goes under run.runs_root / $PODRAY_RUNS_ROOT when set (default <runs root>/<name>-<time>, else "
        "runs/<name>-<time>)",
    )
    t.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue a run (a path or a gs:// / s3:// URI) from its latest checkpoint; --set may then change only "
        "total_env_steps (to extend it) and the run's logging and checkpoint fields",
    )
    t.add_argument(
        "--address",
        default=None,
        help="Ray cluster to run on ('auto' on a cluster node, host:6379, ray://host:10001); default "
        "$RAY_ADDRESS, else an embedded local Ray started and stopped by this command",
    )
    t.add_argument(
        "--dashboard",
        action="store_true",
        help="start the Ray dashboard (127.0.0.1) with the local Ray, print its URL, keep it up after the run",
    )
    t.add_argument(
        "--ray",
        action="store_true",
        help="run through the Ray layer (an embedded local Ray unless --address) even when the run does "
        "not need it; without it Ray starts only for --address/RAY_ADDRESS, --dashboard, run.hosts > 1, "
        "run.seeds or run.tpu_topology",
    )
    t.add_argument(
        "--in-process",
        action="store_true",
        help="insist on this process: refuse the options that need Ray (the default already runs here "
        "when the run needs no Ray); also ignores RAY_ADDRESS",
    )
    t.set_defaults(func=_train)
    b = sub.add_parser("bench", help="throughput benchmarks; 'probe RUN_DIR' looks inside a run's network")
    b.add_argument(
        "target",
        choices=["anakin", "sebulba", "sebulba-hosts", "scale", "ray", "soak", "preempt", "probe", "purejaxrl"],
        help="what to benchmark",
    )
    b.add_argument("run_dir", nargs="?", default=None, help="probe: the run directory (its latest checkpoint)")
    b.add_argument("--frames", type=int, default=2400, help="probe: random-play frames to look at")
    b.add_argument(
        "--step", type=int, default=None, help="probe: the checkpoint (update) to look at; default the latest"
    )
    b.add_argument("--out", default=None, help="write the rows as JSON to this file")
    b.add_argument(
        "--minutes", type=float, default=60.0, help="soak: minutes of each run (Sebulba Pong, Anakin MinAtar)"
    )
    b.add_argument("--interval", type=float, default=60.0, help="soak: seconds between samples")
    b.add_argument("--plot", default=None, help="soak: write the plot (PNG) to this file")
    b.add_argument("--runs", default=None, help="soak: which runs, comma-separated (sebulba_pong,anakin_minatar)")
    b.add_argument("--keep", default=None, metavar="DIR", help="soak: keep the run directories under DIR")
    b.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="soak: config overrides for every run, after the soak's own (e.g. total_env_steps=2500000)",
    )
    b.add_argument("--trials", type=int, default=10, help="preempt: SIGTERM trials (modes in turn)")
    b.add_argument("--max-delay", type=float, default=10.0, help="preempt: most seconds after the first row")
    b.add_argument("--quick", action="store_true", help="a shorter sweep (for smoke tests)")
    b.add_argument("--seconds", type=float, default=20.0, help="sebulba: seconds of steady state per setting")
    b.add_argument(
        "--agent",
        default=None,
        help="sebulba: impala (default) or muzero (the sebulba_muzero_pong preset, Gumbel search)",
    )
    b.add_argument(
        "--simulations",
        default=None,
        help="sebulba --agent muzero: search simulations to sweep (default 8,16,50; --quick 16)",
    )
    b.add_argument("--torso", default=None, help="sebulba: torsos to sweep, e.g. nature_cnn,impala_resnet")
    b.add_argument("--batch", default=None, help="sebulba: actor batch sizes to sweep, e.g. 32,64,128")
    b.add_argument("--threads", default=None, help="sebulba: threads per actor device to sweep, e.g. 1,2,4")
    b.add_argument("--split", default=None, help="sebulba: actor+learner device splits to sweep: 1+1, 1+2, 2+2")
    b.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="sebulba, sebulba-hosts, scale: runs of every setting, interleaved (default 1; sebulba-hosts 3); "
        "purejaxrl: alternated rounds (default 3)",
    )
    b.add_argument(
        "--peer",
        default=None,
        metavar="PATH",
        help="purejaxrl: a PureJaxRL checkout or git directory (default: cloned at run time into the cache)",
    )
    b.add_argument("--only", choices=["throughput", "wall"], default=None, help="purejaxrl: one of the two comparisons")
    b.add_argument("--envs", default=None, help="purejaxrl: environments on the one device to compare at (4,64)")
    b.set_defaults(func=_bench)
    e = sub.add_parser("eval", help="play a run's trained policy: real scores (eval.json) and a video")
    e.add_argument("run_dir", help="the run directory (its config.yaml and checkpoints)")
    e.add_argument("--step", type=int, default=None, help="the checkpoint (update count) to play; default the latest")
    e.add_argument("--episodes", type=int, default=10, help="episodes to play, each on its own environment (10)")
    policy = e.add_mutually_exclusive_group()
    policy.add_argument("--greedy", action="store_true", help="take the most probable action")
    policy.add_argument(
        "--sample", dest="greedy", action="store_false", help="sample the policy's actions (the default)"
    )
    e.add_argument("--video", default=None, metavar="FILE", help="record one more episode to FILE.mp4 or FILE.gif")
    e.add_argument("--seed", type=int, default=0, help="seed of the evaluation environments and sampled actions")
    e.set_defaults(func=_eval)
    pl = sub.add_parser("plot", help="learning curves and throughput of one or more runs, overlaid, as a PNG")
    pl.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (their metrics.jsonl) or metrics .jsonl files"
    )
    pl.add_argument("--out", required=True, help="the PNG to write")
    pl.add_argument("--names", default=None, help="comma-separated legend names (default the directories' names)")
    pl.add_argument("--title", default=None, help="a title above the panels")
    pl.set_defaults(func=_plot)
    u = sub.add_parser("tune", help="run a Ray Tune study from tune_configs/ (docs/operations.md, Tuning)")
    u.add_argument("study", nargs="?", default=None, help="study YAML (tune_configs/NAME.yaml or a name there)")
    u.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="override fields of the base config for every trial (several after one --set; repeatable)",
    )
    u.add_argument(
        "--storage",
        default="tune_runs",
        help="directory of study directories, a path or a gs:// / s3:// URI (default tune_runs)",
    )
    u.add_argument("--name", default=None, help="study directory name (default <study name>-<time>)")
    u.add_argument("--address", default=None, help="Ray cluster address (default $RAY_ADDRESS, else a local Ray)")
    u.add_argument("--resume", default=None, metavar="STUDY_DIR", help="resume an interrupted study (Tuner.restore)")
    u.set_defaults(func=_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except config_lib.ConfigError as e:
        print(f"podray: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from podray.checkpoint import CheckpointError
        from podray.cluster.driver import ClusterError

        if not isinstance(e, (ClusterError, CheckpointError)):
            raise
        print(f"podray: error: {e}", file=sys.stderr)
        return 1
    except (Preempted, StopNow) as stopped:  # SIGTERM / SIGINT: podray.preemption
        print(f"podray: {stopped}", file=sys.stderr, flush=True)
        return stopped.exit_status
    except KeyboardInterrupt:
        print("podray: interrupted; the latest checkpoint is kept (resume with --resume RUN_DIR)", file=sys.stderr)
        return 130
    if args.command in ("train", "tune"):
        print(f"total command time {time.perf_counter() - start:.1f} s")
    return code


def entry() -> int:
    """The console script: `main` after re-executing once with malloc on huge pages (podray.hugepages).
    Only the command does this; `main` called from Python (tests, notebooks) runs as it is."""
    from podray import hugepages

    hugepages.reexecute()
    return main()


if __name__ == "__main__":
    sys.exit(entry())
