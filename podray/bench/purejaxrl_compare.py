"""`podray bench purejaxrl`: podray beside PureJaxRL's PPO CartPole, measured alternately.

The peer is PureJaxRL itself (github.com/luchris429/purejaxrl), never a copy in this repository: it is
read from `--peer PATH` (a checkout, or a git directory such as a bare mirror, read at HEAD) or cloned
at run time into the user's cache directory. Its two files are written to a temporary directory with
the edits today's libraries need, made at run time:
  - gymnax >= 1.0 returns (obs, state, reward, terminated, truncated, info) from step; the peer's
    FlattenObservationWrapper unpacks five values: it now unpacks six and ends the episode on either;
  - wrappers.py imports brax and navix at module level for wrappers CartPole does not use: those imports
    are made optional, so neither needs installing.
Nothing else of the peer changes (its network, PPO, hyperparameters and seed stay as written).

Two comparisons, each in fresh processes, podray and the peer alternated (podray, peer, podray, peer,
...) so that a machine busy with other work slows both alike; medians of `repeats` rounds:
  - throughput: env steps/s of the compiled training program at 1 device x 4 and x 64 environments,
    compile excluded, the median of 3 calls of 131,072 env steps after one warm-up call: podray's
    Anakin program as `podray bench anakin` times it (PPO CartPole, the default job's agent) and the
    peer's make_train at NUM_ENVS 4 or 64 (DEBUG off, its other settings as in its script);
  - wall: the README's `podray train` (the default job, 512k steps) against the peer's script as
    written (`python ppo.py`, 500k steps, its per-episode prints included), each from process start to
    exit; podray's first run with an empty compile cache ('cold'), then with the cache it filled
    ('warm'). Each run's final mean return is reported beside its time.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

PEER_URL = "https://github.com/luchris429/purejaxrl"
PEER_FILES = ("purejaxrl/ppo.py", "purejaxrl/wrappers.py")

_STEP_5 = (
    "        obs, state, reward, done, info = self._env.step(key, state, action, params)\n"
    "        obs = jnp.reshape(obs, (-1,))\n"
)
_STEP_6 = (
    "        obs, state, reward, terminated, truncated, info = self._env.step(key, state, action, params)\n"
    "        done = jnp.logical_or(terminated, truncated)\n"
    "        obs = jnp.reshape(obs, (-1,))\n"
)
_OPTIONAL_IMPORTS = {
    "from brax import envs\n": "try:\n    from brax import envs\nexcept ImportError:\n    envs = None\n",
    "from brax.envs.wrappers.training import EpisodeWrapper, AutoResetWrapper\n": (
        "try:\n    from brax.envs.wrappers.training import EpisodeWrapper, AutoResetWrapper\n"
        "except ImportError:\n    EpisodeWrapper = AutoResetWrapper = object\n"
    ),
    "import navix as nx\n": "try:\n    import navix as nx\nexcept ImportError:\n    nx = None\n",
}


def _read_peer_file(peer: pathlib.Path, name: str) -> str:
    if (peer / name).is_file():
        return (peer / name).read_text()
    git_dir = peer / ".git" if (peer / ".git").exists() else peer
    proc = subprocess.run(
        ["git", "--git-dir", str(git_dir), "show", f"HEAD:{name}"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench purejaxrl: --peer {peer}: no {name} there (a PureJaxRL checkout or git directory)")
    return proc.stdout


def prepare_peer(peer: str | None) -> pathlib.Path:
    """A temporary directory with the peer's ppo.py and wrappers.py, edited as the module docstring says."""
    if peer is None:
        cache = (
            pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "podray" / "purejaxrl"
        )
        if not cache.exists():
            print(f"cloning {PEER_URL} into {cache}", flush=True)
            subprocess.run(["git", "clone", "--depth", "1", PEER_URL, str(cache)], check=True)
        peer = str(cache)
    source = pathlib.Path(peer)
    ppo, wrappers = (_read_peer_file(source, name) for name in PEER_FILES)
    if wrappers.count(_STEP_5) != 1:
        raise SystemExit("bench purejaxrl: the peer's FlattenObservationWrapper.step is not the one this script edits")
    wrappers = wrappers.replace(_STEP_5, _STEP_6)
    for old, new in _OPTIONAL_IMPORTS.items():
        wrappers = wrappers.replace(old, new)
    out = pathlib.Path(tempfile.mkdtemp(prefix="purejaxrl-"))
    (out / "ppo.py").write_text(ppo)
    (out / "wrappers.py").write_text(wrappers)
    return out


# ---- throughput ------------------------------------------------------------------------------------

_PEER_THROUGHPUT = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
num_envs, steps, calls = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import jax
import ppo
config = {"LR": 2.5e-4, "NUM_ENVS": num_envs, "NUM_STEPS": 128, "TOTAL_TIMESTEPS": steps, "UPDATE_EPOCHS": 4,
          "NUM_MINIBATCHES": 4, "GAMMA": 0.99, "GAE_LAMBDA": 0.95, "CLIP_EPS": 0.2, "ENT_COEF": 0.01,
          "VF_COEF": 0.5, "MAX_GRAD_NORM": 0.5, "ACTIVATION": "tanh", "ENV_NAME": "CartPole-v1",
          "ANNEAL_LR": True, "DEBUG": False}
rng = jax.random.PRNGKey(30)
train = jax.jit(ppo.make_train(config)).lower(rng).compile()
jax.block_until_ready(train(rng))
times = []
for i in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(train(jax.random.PRNGKey(i)))
    times.append(time.perf_counter() - start)
done = (steps // 128 // num_envs) * 128 * num_envs
print("ROW " + json.dumps({"steps_per_s": done / statistics.median(times)}))
"""


def _row(proc: subprocess.CompletedProcess, what: str) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    raise RuntimeError(f"bench purejaxrl: {what} failed:\n{proc.stderr[-3000:]}")


_PODRAY_THROUGHPUT = r"""
import json, statistics, sys, time
num_envs, steps, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
import jax
from podray import config as config_lib
from podray.anakin import AnakinProgram
from podray.host import local_context
updates = steps // (128 * num_envs)
config = config_lib.load("anakin_cartpole", [f"env.num_envs={num_envs}", f"anakin.updates_per_call={updates}",
                                             f"total_env_steps={steps * (calls + 2)}"])
program = AnakinProgram(config, local_context([0]).mesh())
state = program.initial_state(config.seed)
step = program.step.lower(state).compile()
state = jax.block_until_ready(step(state)[0])
times = []
for _ in range(calls):
    start = time.perf_counter()
    state = jax.block_until_ready(step(state)[0])
    times.append(time.perf_counter() - start)
print("ROW " + json.dumps({"steps_per_s": updates * 128 * num_envs / statistics.median(times)}))
"""


def _podray_throughput(envs: int, steps: int = 131072) -> float:
    """podray's Anakin program as `podray bench anakin` times it (compile excluded, the median of 3
    calls of `steps` env steps each), without that benchmark's env-only ceiling."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PODRAY_COMPILE_CACHE")}
    env["PODRAY_COMPILE_CACHE"] = "off"
    proc = subprocess.run(
        [sys.executable, "-c", _PODRAY_THROUGHPUT, str(envs), str(steps), "3"], capture_output=True, text=True, env=env
    )
    return _row(proc, f"podray at 1x{envs}")["steps_per_s"]


def _peer_throughput(peer_dir: pathlib.Path, envs: int, steps: int = 131072) -> float:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", _PEER_THROUGHPUT, str(peer_dir), str(envs), str(steps), "3"],
        capture_output=True,
        text=True,
        env=env,
    )
    return _row(proc, f"PureJaxRL at 1x{envs}")["steps_per_s"]


# ---- wall time of the default job ---------------------------------------------------------------------


def _podray_train(cache: pathlib.Path, run_dir: pathlib.Path) -> tuple[float, float]:
    """(seconds from process start to exit, final mean return) of the README's `podray train`."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
    env["PODRAY_COMPILE_CACHE"] = str(cache)
    podray = pathlib.Path(sys.executable).with_name("podray")
    command = [str(podray)] if podray.exists() else [sys.executable, "-m", "podray.cli"]
    start = time.perf_counter()
    proc = subprocess.run([*command, "train", "--run-dir", str(run_dir)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"bench purejaxrl: podray train failed:\n{proc.stderr[-3000:]}")
    return wall, json.loads((run_dir / "summary.json").read_text())["final_mean_return"]


def _peer_script(peer_dir: pathlib.Path) -> tuple[float, float]:
    """(seconds from process start to exit, mean of its last 100 printed episode returns) of ppo.py."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "ppo.py"], cwd=peer_dir, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"bench purejaxrl: the peer's ppo.py failed:\n{proc.stderr[-3000:]}")
    returns = [float(x) for x in re.findall(r"episodic return=([-\d.]+)", proc.stdout)]
    return wall, statistics.fmean(returns[-100:]) if returns else float("nan")


def main(
    peer: str | None = None, repeats: int = 3, out: str | None = None, which: str = "all", envs: tuple = (4, 64)
) -> dict:
    """Runs the comparisons (`which`: throughput, wall or all); prints and returns the figures."""
    peer_dir = prepare_peer(peer)
    print(f"PureJaxRL from {peer or 'a fresh clone'} (edited copy in {peer_dir}); {repeats} alternated rounds")
    result: dict = {"repeats": repeats, "machine": f"{os.cpu_count()} CPU cores", "load_average": os.getloadavg()}
    if which in ("throughput", "all"):
        for n in envs:
            ours, theirs = [], []
            for _ in range(repeats):
                ours.append(_podray_throughput(n))
                theirs.append(_peer_throughput(peer_dir, n))
                print(f"  1x{n}: podray {ours[-1]:,.0f}  PureJaxRL {theirs[-1]:,.0f} env steps/s", flush=True)
            a, b = statistics.median(ours), statistics.median(theirs)
            result[f"throughput_1x{n}"] = {"podray": ours, "purejaxrl": theirs, "ratio": a / b}
            print(f"1x{n}: podray {a:,.0f}  PureJaxRL {b:,.0f} env steps/s (medians)  ratio {a / b:.2f}", flush=True)
    if which in ("wall", "all"):
        cold, warm, peer_wall, returns = [], [], [], {"cold": [], "warm": [], "purejaxrl": []}
        with tempfile.TemporaryDirectory(prefix="podray-bench-") as tmp:
            for i in range(repeats):
                cache = pathlib.Path(tmp) / f"cache{i}"
                wall, ret = _podray_train(cache, pathlib.Path(tmp) / f"cold{i}")
                cold.append(wall)
                returns["cold"].append(ret)
                wall, ret = _peer_script(peer_dir)
                peer_wall.append(wall)
                returns["purejaxrl"].append(ret)
                wall, ret = _podray_train(cache, pathlib.Path(tmp) / f"warm{i}")
                warm.append(wall)
                returns["warm"].append(ret)
                print(
                    f"  podray train cold {cold[-1]:.1f} s (return {returns['cold'][-1]:.0f})  PureJaxRL "
                    f"{peer_wall[-1]:.1f} s (return {returns['purejaxrl'][-1]:.0f})  podray train warm "
                    f"{warm[-1]:.1f} s (return {returns['warm'][-1]:.0f})",
                    flush=True,
                )
        c, w, p = statistics.median(cold), statistics.median(warm), statistics.median(peer_wall)
        result["wall"] = {"cold": cold, "warm": warm, "purejaxrl": peer_wall, "returns": returns}
        result["wall"].update(cold_ratio=c / p, warm_ratio=w / p)
        print(
            f"wall (medians): podray train cold {c:.1f} s ({c / p:.2f}x), warm {w:.1f} s ({w / p:.2f}x), "
            f"PureJaxRL {p:.1f} s"
        )
    result["load_average_after"] = os.getloadavg()
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return result
