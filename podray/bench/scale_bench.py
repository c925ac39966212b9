"""`podray bench scale`: how the Ray layer's own costs grow with the number of host workers.

For 1, 2, 4, 8 and 16 host workers of 1 fake CPU device each (one JAX process each, as on a pod), on
this machine, through the driver's own code (podray.cluster.driver.HostGroup):
  - place: reserve the placement group and start the workers (HostGroup.place);
  - initialize: jax.distributed.initialize in every worker, joining one program (HostGroup.initialize);
  - first collective: compile and run a sum over every host's device (an all-reduce over gloo), and
    the same collective again (the steady cost of a cross-host reduction);
  - report: one report's traffic per host: Sebulba's gather of 8 counters over every host
    (multihost_utils.process_allgather) and one write of the Ray metrics sink (its gauges);
  - restart: SIGKILL one host while every host runs collectives, then the driver's path: notice the
    lost host (HostGroup.wait), stop the group, place a new one, initialize it, run the first collective.
Each cost is fitted against hosts (least squares, cost = a + b * hosts) and projected to 256 hosts
(2048 TPU v3 cores: 256 hosts of 8 cores; docs/scaling.md).

Every worker of this machine shares its 2 cores (and, on a busy machine, every other job's), so the
wall-clock times here serialise what a pod does in parallel: each host's own start-up CPU (importing
Ray and JAX, starting a backend, compiling) runs on that host's own CPUs there. So every phase also
records CPU seconds: each host worker's own (a pod waits for the slowest: `host_cpu` is the largest),
and the head's: the driver process and, with a Ray this command started, the GCS server (`head_cpu`;
what runs once for the whole group, on the head node of a pod). The `pod` model of a phase is
host_cpu + head_cpu (network latency aside: loopback here), fitted against hosts and projected like
the wall-clock times; docs/scaling.md says which part of Ray or JAX sets each.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

SIZES = (1, 2, 4, 8, 16)
PROJECT_TO = 256
REPORTS = 20  # reports timed per host
# (row field, phase) of the start-up phases, whose CPU is recorded
PHASES = (("place_s", "place"), ("initialize_s", "initialize"), ("first_collective_s", "first_collective"))


# ---- run inside each host worker (HostWorker.call) ----------------------------------------------------


def _sum_over_hosts():
    """The jitted sum of one value per device over every device of every host, and its input."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from podray.host import local_context

    mesh = local_context().mesh("hosts")
    ones = np.ones((mesh.devices.size,), np.float32)
    x = jax.make_array_from_callback(ones.shape, NamedSharding(mesh, P("hosts")), lambda index: ones[index])
    return jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P())), x


def first_collective() -> dict:
    """Seconds (and this process's CPU seconds) of the first all-reduce over every host (compile
    included) and of the second."""
    cpu, start = time.process_time(), time.perf_counter()
    total, x = _sum_over_hosts()
    assert float(total(x)) == x.shape[0]
    first = time.perf_counter() - start
    start = time.perf_counter()
    total(x).block_until_ready()
    return {"first_s": first, "first_cpu_s": time.process_time() - cpu, "again_s": time.perf_counter() - start}


def collectives_for(seconds: float) -> int:
    """All-reduces over every host, one after another, for `seconds` (hosts in lockstep, like a run)."""
    total, x = _sum_over_hosts()
    n, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        total(x).block_until_ready()
        n += 1
    return n


def report_traffic(reports: int, tags: dict) -> dict:
    """Seconds per report of Sebulba's cross-host gather of 8 counters and of a Ray metrics sink write."""
    from jax.experimental import multihost_utils

    from podray.cluster.metrics import GAUGES, RayMetricsSink

    sink = RayMetricsSink(tags)
    row = {key: 1.0 for key, _ in GAUGES.values()}
    multihost_utils.process_allgather(np.zeros(8, np.float32))  # compiled once per run
    start = time.perf_counter()
    for i in range(reports):
        multihost_utils.process_allgather(np.full(8, i, np.float32))
    gather = (time.perf_counter() - start) / reports
    start = time.perf_counter()
    for i in range(reports):
        sink.write(i, {**row, "updates": float(i)})
    return {"gather_s": gather, "gauges_s": (time.perf_counter() - start) / reports}


# ---- the driver side ---------------------------------------------------------------------------------


def _head_pids() -> list[int]:
    """The GCS server of a Ray this process started (empty for a Ray it joined)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    try:
        return [p.process.pid for p in node.all_processes.get("gcs_server", [])]
    except AttributeError:
        return []


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far, from /proc (0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class _HeadCpu:
    """CPU seconds of the driver (this process) and the GCS server between two reads."""

    def __init__(self):
        self.pids = _head_pids()
        self.last = self._now()

    def _now(self) -> float:
        return time.process_time() + sum(_cpu_of(p) for p in self.pids)

    def lap(self) -> float:
        now = self._now()
        spent, self.last = now - self.last, now
        return spent


@dataclass
class Row:
    hosts: int
    place_s: float
    initialize_s: float
    first_collective_s: float
    collective_s: float
    report_gather_s: float
    report_gauges_s: float
    stop_s: float
    restart_s: float
    restart_detect_s: float
    # CPU seconds spent in each phase: (sum over the hosts, the largest host, the head: driver + GCS)
    cpu: dict = field(default_factory=dict)
    restart_pod_s: float = 0.0  # detect + stop + the pod model of place, initialize, first collective


def _config(hosts: int):
    from podray import config as config_lib

    return config_lib.load(None, [f"run.hosts={hosts}", "run.cpu_devices=1"], check=False)


def _placed(hosts: int):
    """A placed and initialized group, with the seconds and worker CPU of each phase."""
    import ray

    from podray.cluster.driver import HostGroup

    config = _config(hosts)
    head = _HeadCpu()
    start = time.perf_counter()
    group = HostGroup.place(config, timeout_s=300)
    place_s, place_head = time.perf_counter() - start, head.lap()
    start = time.perf_counter()
    group.initialize()
    initialize_s, init_head = time.perf_counter() - start, head.lap()
    infos = ray.get([w.node_info.remote() for w in group.workers])
    place_cpu = [n["cpu_s"] for n in group.nodes]
    init_cpu = [i["cpu_s"] - p for i, p in zip(infos, place_cpu)]
    head.lap()
    start = time.perf_counter()
    firsts = ray.get([w.call.remote(first_collective) for w in group.workers])
    first_s, first_head = time.perf_counter() - start, head.lap()
    return group, {
        "place_s": place_s,
        "initialize_s": initialize_s,
        "first_collective_s": first_s,
        "collective_s": max(f["again_s"] for f in firsts),
        # phase -> (sum over hosts, largest host, head) CPU seconds
        "cpu": {
            "place": (sum(place_cpu), max(place_cpu), place_head),
            "initialize": (sum(init_cpu), max(init_cpu), init_head),
            "first_collective": (
                sum(f["first_cpu_s"] for f in firsts),
                max(f["first_cpu_s"] for f in firsts),
                first_head,
            ),
        },
    }


def measure(hosts: int) -> Row:
    """Every cost for one group size (a fresh group; one restart)."""
    import ray

    from podray.cluster.driver import HostLost

    group, m = _placed(hosts)
    try:
        traffic = ray.get(
            [w.call.remote(report_traffic, REPORTS, {"host": str(i)}) for i, w in enumerate(group.workers)]
        )
        # The restart: every host in collectives (a running program); one host is killed.
        running = [w.call.remote(collectives_for, 120.0) for w in group.workers]
        time.sleep(2.0)
        killed = time.perf_counter()
        os.kill(group.nodes[-1]["pid"], signal.SIGKILL)
        try:
            group.wait(running)
            raise RuntimeError("bench scale: the group ran on after a host was killed")
        except HostLost:
            detect_s = time.perf_counter() - killed
        start = time.perf_counter()
        group.stop()
        stop_s = time.perf_counter() - start
        group, again = _placed(hosts)
        restart_s = time.perf_counter() - killed
        restart_pod_s = detect_s + stop_s + sum(pod_estimate(c) for c in again["cpu"].values())
    finally:
        group.stop()
    return Row(
        hosts=hosts,
        place_s=m["place_s"],
        initialize_s=m["initialize_s"],
        first_collective_s=m["first_collective_s"],
        collective_s=m["collective_s"],
        report_gather_s=max(t["gather_s"] for t in traffic),
        report_gauges_s=max(t["gauges_s"] for t in traffic),
        stop_s=stop_s,
        restart_s=restart_s,
        restart_detect_s=detect_s,
        cpu=m["cpu"],
        restart_pod_s=restart_pod_s,
    )


def pod_estimate(cpu: tuple[float, float, float]) -> float:
    """A phase on a pod: the slowest host's own CPU (every host works in parallel on its own CPUs)
    plus the head's (driver and GCS: once for the group). Network latency is not in it."""
    _, largest, head = cpu
    return largest + head


def fit(hosts: list[int], seconds: list[float]) -> tuple[float, float]:
    """(a, b) of seconds = a + b * hosts, least squares (b = 0 from a single point, or when the fit
    falls with hosts: no cost here shrinks with more hosts, a falling fit is noise)."""
    if len(set(hosts)) < 2:
        return float(np.mean(seconds)), 0.0
    b, a = np.polyfit(np.asarray(hosts, float), np.asarray(seconds, float), 1)
    if b < 0:
        return float(np.mean(seconds)), 0.0
    return float(a), float(b)


def main(out: str | None = None, quick: bool = False, repeats: int = 1, sizes=SIZES, budget_s: float = 1500.0) -> dict:
    """Measures every size (`repeats` rounds, sizes interleaved; rows hold medians) within `budget_s`
    seconds (a size that would not fit is skipped, and said), fits and projects to 256 hosts."""
    from podray.cluster.driver import connect, pin_driver_jax_to_cpu

    if quick:
        sizes, repeats = (1, 2), 1
    pin_driver_jax_to_cpu()
    cores = os.cpu_count() or 1
    connection = connect(num_cpus=max(sizes) + 1)
    from podray.cluster.driver import HostGroup

    HostGroup.place(_config(1)).stop()  # the driver's one-time imports, outside every measurement
    runs: dict[int, list[Row]] = {h: [] for h in sizes}
    took: dict[int, float] = {}  # seconds one measurement of a size took
    started = time.perf_counter()
    skipped = []
    try:
        for _ in range(repeats):
            for h in sizes:
                below = [s for s in took if s <= h]
                # Costs grow at most in proportion to hosts here (2 cores shared by every host).
                guess = took[max(below)] * h / max(below) if below else 0.0
                if time.perf_counter() - started + guess > budget_s:
                    if h not in skipped:
                        skipped.append(h)
                    print(
                        f"bench scale: {h} hosts skipped (~{guess:.0f} s more would pass the {budget_s:.0f} s budget)"
                    )
                    continue
                start = time.perf_counter()
                runs[h].append(measure(h))
                took[h] = time.perf_counter() - start
                print(json.dumps(asdict(runs[h][-1])), flush=True)
    finally:
        if connection.started_here:
            import ray

            ray.shutdown()
    keys = [k for k in asdict(Row(0, *[0.0] * 10)) if k not in ("hosts", "cpu")]
    medians = {}
    for h, rows in runs.items():
        if rows:
            medians[h] = {k: statistics.median(getattr(r, k) for r in rows) for k in keys}
            medians[h]["cpu"] = rows[len(rows) // 2].cpu
    measured = sorted(medians)
    projection = {}
    for k in keys:
        a, b = fit(measured, [medians[h][k] for h in measured])
        projection[k] = {"a": a, "b": b, f"at_{PROJECT_TO}": a + b * PROJECT_TO}
    for k, phase in PHASES:
        for part, index in (("host_cpu", 1), ("head_cpu", 2)):
            a, b = fit(measured, [medians[h]["cpu"][phase][index] for h in measured])
            projection[f"{part}_{k}"] = {"a": a, "b": b, f"at_{PROJECT_TO}": a + b * PROJECT_TO}
        pod = [pod_estimate(medians[h]["cpu"][phase]) for h in measured]
        a, b = fit(measured, pod)
        projection[f"pod_{k}"] = {"a": a, "b": b, f"at_{PROJECT_TO}": a + b * PROJECT_TO}
    _print(measured, medians, projection, repeats, cores)
    result = {"sizes": measured, "skipped": skipped, "medians": medians, "projection": projection, "cores": cores}
    if out:
        with open(out, "w") as f:
            json.dump({**result, "runs": {h: [asdict(r) for r in rows] for h, rows in runs.items()}}, f, indent=2)
    return result


def _print(measured, medians, projection, repeats, cores) -> None:
    names = ["place_s", "initialize_s", "first_collective_s", "collective_s", "report_gather_s", "report_gauges_s"]
    names += ["stop_s", "restart_detect_s", "restart_s"]
    print(f"\nseconds per phase, median of {repeats} (this machine: {cores} cores shared by every host worker)")
    print(f"{'phase':<28}" + "".join(f"{h:>9}" for h in measured) + f"{'a':>9}{'b/host':>9}{'@' + str(PROJECT_TO):>10}")
    cpu_rows = {
        f"{part}_{k}": (phase, index)
        for k, phase in (
            ("place_s", "place"),
            ("initialize_s", "initialize"),
            ("first_collective_s", "first_collective"),
        )
        for part, index in (("host_cpu", 1), ("head_cpu", 2))
    }
    for k in names + ["restart_pod_s"] + list(cpu_rows) + ["pod_place_s", "pod_initialize_s", "pod_first_collective_s"]:
        p = projection[k]
        if k in cpu_rows:
            phase, index = cpu_rows[k]
            values = "".join(f"{medians[h]['cpu'][phase][index]:>9.3f}" for h in measured)
        elif k in medians[measured[0]]:
            values = "".join(f"{medians[h][k]:>9.3f}" for h in measured)
        else:
            values = "".join(f"{pod_estimate(medians[h]['cpu'][k[4:-2]]):>9.3f}" for h in measured)
        print(f"{k:<28}{values}{p['a']:>9.3f}{p['b']:>9.4f}{p[f'at_{PROJECT_TO}']:>10.2f}")
    up = sum(projection[k][f"at_{PROJECT_TO}"] for k in ("place_s", "initialize_s", "first_collective_s"))
    pod = sum(projection[f"pod_{k}"][f"at_{PROJECT_TO}"] for k in ("place_s", "initialize_s", "first_collective_s"))
    print(
        f"place + initialize + first collective at {PROJECT_TO} hosts: {up:.1f} s fitted here, {pod:.1f} s with each "
        f"host's CPU its own (target < 60 s); restart {projection['restart_s'][f'at_{PROJECT_TO}']:.1f} s fitted here, "
        f"{projection['restart_pod_s'][f'at_{PROJECT_TO}']:.1f} s with each host's CPU its own (target < 120 s)"
    )
