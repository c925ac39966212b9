"""The `podray` command: train, bench.

  podray train [PRESET_OR_YAML] [--set section.field=value ...] [--run-dir DIR] [--resume RUN_DIR]
  podray bench anakin|sebulba [--out FILE] [--quick]

Bad input (preset, YAML, --set, environment name, device split) is reported as one line naming the
field and the fix, with exit status 2, before anything compiles.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from podray import config as config_lib


def _train(args: argparse.Namespace) -> int:
    from podray.training import load_run_config

    if args.resume:
        if args.preset or args.set:
            raise config_lib.ConfigError("--resume continues a run with its own config; drop the preset and --set")
        config = load_run_config(args.resume)
        run_dir = args.resume
    else:
        config = config_lib.load(args.preset, args.set)
        run_dir = args.run_dir
    # JAX starts only now, after the whole config has been checked.
    from podray.training import train

    summary = train(config, run_dir=run_dir, resume=bool(args.resume))
    ret = summary.final_mean_return
    print(
        f"done: final mean return {ret if not math.isnan(ret) else float('nan'):.2f} | "
        f"env steps {summary.env_steps:,d} | wall {summary.wall_s:.1f} s "
        f"(compile {summary.compile_s:.1f} s) | {summary.steps_per_s:,.0f} steps/s "
        f"({summary.steady_steps_per_s:,.0f} steady) | run dir {summary.run_dir}"
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.target == "anakin":
        from podray.bench import anakin_bench

        anakin_bench.main(out=args.out, quick=args.quick)
        return 0
    if args.target == "sebulba":
        from podray import host

        host.configure_cpu_devices(4)  # on CPU: fake devices for the actor/learner splits
        from podray.bench import sebulba_bench

        sebulba_bench.main(out=args.out, quick=args.quick, min_seconds=args.seconds)
        return 0
    raise config_lib.ConfigError(f"bench: unknown target '{args.target}'; choose anakin or sebulba")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="podray", description="Podracer architectures on JAX and Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an agent (default: Anakin PPO on CartPole-v1)")
    t.add_argument(
        "preset", nargs="?", default=None, help=f"preset name ({', '.join(config_lib.preset_names())}) or a YAML file"
    )
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field, e.g. --set agent.learning_rate=3e-4 (repeatable)",
    )
    t.add_argument("--run-dir", default=None, help="run directory (default runs/<name>-<time>)")
    t.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    t.set_defaults(func=_train)
    b = sub.add_parser("bench", help="throughput benchmarks")
    b.add_argument("target", choices=["anakin", "sebulba"], help="what to benchmark")
    b.add_argument("--out", default=None, help="write the rows as JSON to this file")
    b.add_argument("--quick", action="store_true", help="a shorter sweep (for smoke tests)")
    b.add_argument("--seconds", type=float, default=20.0, help="sebulba: seconds of steady state per setting")
    b.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except config_lib.ConfigError as e:
        print(f"podray: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("podray: interrupted; the latest checkpoint is kept (resume with --resume RUN_DIR)", file=sys.stderr)
        return 130
    if args.command == "train":
        print(f"total command time {time.perf_counter() - start:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
