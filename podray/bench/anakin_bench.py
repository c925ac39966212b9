"""`podray bench anakin`: env steps/s of the fused Anakin loop, beside the raw environment ceiling.

For every (environment, devices x envs per device) setting, the same run measures
  - steps_per_s: PPO under Anakin (act + env step + learn), compile excluded, the median of 5 timed
    calls of the compiled program;
  - ceiling_steps_per_s: the jitted environment step alone with random actions, at the same batch and
    devices, the same way (shard_map over the mesh, scan over the same number of steps).
MuZero rows (agent muzero-<simulations>) run the anakin_muzero_cartpole preset (its search, rollout
length and replay settings) at 8, 16 and 50 simulations per search on CartPole-v1, one device with 32
environments.
Fake CPU devices are created for settings with more than one device (on CPU only).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass

FULL_SETTINGS = [(1, 4), (1, 64), (1, 1024), (4, 256)]
QUICK_SETTINGS = [(1, 4), (2, 8)]
ENVS = ["CartPole-v1", "Catch-bsuite"]
MUZERO_SIMULATIONS = [8, 16, 50]
MUZERO_SETTING = (1, 32)


@dataclass
class Row:
    env: str
    agent: str
    setting: str
    devices: int
    envs_per_device: int
    steps_per_s: float
    ceiling_steps_per_s: float
    ratio: float
    steps_per_call: int
    timed_calls: int
    compile_s: float


def _time_calls(fn, state, calls: int) -> tuple[list[float], object]:
    import jax

    state = fn(state)  # warm-up (first execution after compile)
    jax.block_until_ready(state)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        state = fn(state)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return times, state


def _ceiling(program, steps_per_device_call: int, calls: int) -> float:
    """Env steps/s of the environment alone with random actions, same mesh and batch as `program`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from podray.host import DEVICE_AXIS

    env, n_local = program.env, program.envs_per_device
    num_actions = env.spec.num_actions

    def local(key):
        key = jax.random.fold_in(key[0], jax.lax.axis_index(DEVICE_AXIS))
        state, obs = env.reset(jax.random.split(key, n_local))

        def step(carry, k):
            state, total = carry
            action_key, env_key = jax.random.split(k)
            action = jax.random.randint(action_key, (n_local,), 0, num_actions)
            state, ts = env.step(state, action, jax.random.split(env_key, n_local))
            return (state, total + ts.reward.sum()), None

        (state, total), _ = jax.lax.scan(step, (state, 0.0), jax.random.split(key, steps_per_device_call))
        return jax.lax.psum(total, DEVICE_AXIS)[None]

    fn = jax.jit(jax.shard_map(local, mesh=program.mesh, in_specs=P(), out_specs=P(), check_vma=False))
    keys = jnp.zeros((1, 2), jnp.uint32)
    jax.block_until_ready(fn(keys))
    times = []
    for i in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(keys + i))
        times.append(time.perf_counter() - start)
    return steps_per_device_call * n_local * program.num_devices / statistics.median(times)


def measure(
    env_name: str,
    devices: int,
    envs_per_device: int,
    calls: int = 3,
    target_steps: int = 131072,
    simulations: int = 0,
) -> Row:
    """One row: PPO, or with `simulations` > 0 MuZero searching that many simulations per step."""
    import jax

    from podray import config as config_lib
    from podray.anakin import AnakinProgram
    from podray.host import local_context

    num_envs = devices * envs_per_device
    preset = "anakin_muzero_cartpole" if simulations else "anakin_cartpole"
    rollout = config_lib.load(preset).anakin.rollout_length
    steps_per_update = num_envs * rollout
    updates_per_call = max(1, math.ceil(target_steps / steps_per_update))
    overrides = [
        f"env.name={env_name}",
        f"env.num_envs={num_envs}",
        f"anakin.rollout_length={rollout}",
        f"anakin.updates_per_call={updates_per_call}",
        f"total_env_steps={steps_per_update * updates_per_call * (calls + 2)}",
    ]
    if simulations:
        # the replay starts learning at once, so every timed call searches, adds, samples and learns
        overrides += [f"search.num_simulations={simulations}", "replay.min_size=0"]
    config = config_lib.load(preset, overrides)
    host = local_context(list(range(devices)))
    program = AnakinProgram(config, host.mesh())
    state = program.initial_state(config.seed)
    start = time.perf_counter()
    step = program.step.lower(state).compile()
    compile_s = time.perf_counter() - start
    times, _ = _time_calls(lambda s: step(s)[0], state, calls)
    steps_per_call = steps_per_update * updates_per_call
    steps_per_s = steps_per_call / statistics.median(times)
    ceiling = _ceiling(program, rollout * updates_per_call, calls)
    del jax
    return Row(
        env=env_name,
        agent=f"muzero-{simulations}" if simulations else "ppo",
        setting=f"{devices}x{envs_per_device}",
        devices=devices,
        envs_per_device=envs_per_device,
        steps_per_s=steps_per_s,
        ceiling_steps_per_s=ceiling,
        ratio=steps_per_s / ceiling,
        steps_per_call=steps_per_call,
        timed_calls=calls,
        compile_s=compile_s,
    )


def _print_row(row: Row) -> None:
    print(
        f"{row.env:<14}{row.agent:>11}{row.setting:>9}{row.steps_per_s:>14,.0f}{row.ceiling_steps_per_s:>14,.0f}"
        f"{row.ratio:>8.2f}{row.compile_s:>11.1f}",
        flush=True,
    )


def _measure_group(
    devices: int, per_device: list[int], envs: list[str], target_steps: int, simulations: list[int] = ()
) -> None:
    """Child-process entry: measures the settings of one device count, one JSON row per line."""
    from podray.host import configure_cpu_devices

    configure_cpu_devices(devices)  # only affects the CPU backend
    for env_name in envs:
        for n in per_device:
            row = measure(env_name, devices, n, calls=5, target_steps=target_steps)
            print(ROW_PREFIX + json.dumps(asdict(row)), flush=True)
    for count in simulations:
        # MuZero rows: PPO's target of env steps per call would be minutes of search per call on CPU
        row = measure("CartPole-v1", devices, MUZERO_SETTING[1], calls=3, target_steps=2048, simulations=count)
        print(ROW_PREFIX + json.dumps(asdict(row)), flush=True)


ROW_PREFIX = "ROW "


def main(out: str | None = None, quick: bool = False) -> list[Row]:
    """Runs the sweep. Each device count runs in a fresh process holding exactly that many (fake CPU)
    devices, as a user's run would: a 1-device program in a process that also holds 3 idle fake devices
    runs up to 20% slower here (XLA:CPU shares its thread pools among the devices)."""
    import subprocess
    import sys

    settings = QUICK_SETTINGS if quick else FULL_SETTINGS
    envs = ENVS[:1] if quick else ENVS
    target_steps = 8192 if quick else 131072
    groups: dict[int, list[int]] = {}
    for devices, per_device in settings:
        groups.setdefault(devices, []).append(per_device)
    muzero = [] if quick else MUZERO_SIMULATIONS
    if MUZERO_SETTING[0] not in groups and muzero:
        groups[MUZERO_SETTING[0]] = []
    header = f"{'env':<14}{'agent':>11}{'setting':>9}{'steps/s':>14}{'ceiling':>14}{'ratio':>8}{'compile s':>11}"
    print(
        "PPO (anakin_cartpole) and MuZero (anakin_muzero_cartpole at 8/16/50 simulations), each at its "
        "preset's rollout length; each device count in its own process"
    )
    print(header, flush=True)
    rows = []
    for devices, per_device in groups.items():
        args = [devices, per_device, envs, target_steps, muzero if devices == MUZERO_SETTING[0] else []]
        code = (
            "import json, sys; from podray.bench.anakin_bench import _measure_group; "
            "_measure_group(*json.loads(sys.argv[1]))"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for line in proc.stdout:
            if line.startswith(ROW_PREFIX):
                row = Row(**json.loads(line[len(ROW_PREFIX) :]))
                rows.append(row)
                _print_row(row)
        stderr = proc.stderr.read()
        if proc.wait() != 0:
            raise RuntimeError(f"bench anakin: the {devices}-device process failed:\n{stderr[-3000:]}")
    ppo_rows = [r for r in rows if r.agent == "ppo"]
    ppo_rows.sort(key=lambda r: (envs.index(r.env), settings.index((r.devices, r.envs_per_device))))
    rows = ppo_rows + [r for r in rows if r.agent != "ppo"]
    if out:
        with open(out, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
        print(f"wrote {out}")
    return rows
