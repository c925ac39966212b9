"""The Ray driver: connects to (or starts) Ray, places one host worker per host, restarts after failures.

    train_on_ray(config)  ->  summary dict of host 0

The driver never imports a JAX backend: workers do (podray.cluster.worker). A run is a *group* of
host workers that together form one JAX program. On CPU the group is `run.hosts` actors in a placement
group (fake hosts on one machine, or CPU nodes of a cluster); on a TPU slice it is one actor per TPU
host of a slice reserved with ray.util.tpu.slice_placement_group. When a host worker dies the driver
stops the whole group (a JAX program cannot lose a process), starts a new one and resumes from the
latest checkpoint, up to run.max_restarts times, writing each restart to the run log
(run_dir/run_log.jsonl). The run directory may be an object-store URI (podray.storage), which every
host and this driver open directly; the driver then passes its object-store credentials and endpoint
variables (storage.STORAGE_ENV) to the host workers.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from podray import config as config_lib
from podray import storage, validation
from podray.cluster import tpu


class ClusterError(RuntimeError):
    """A run the Ray layer could not finish (its checkpoints are kept; the message says where)."""


class HostLost(Exception):
    """A host worker of the group died (preemption, OOM, killed)."""


# --------------------------------------------------------------------------------------------------
# Connecting


def pin_driver_jax_to_cpu() -> None:
    """Keeps the driver's JAX (which validating a config starts: gymnax builds arrays on import) on
    the CPU, so that it never opens a TPU or GPU the host workers need. Workers are not affected: this
    is a setting of this process, not of the environment they inherit."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


@dataclass
class RayConnection:
    """Where the driver is connected, and whether it started that Ray itself (then it stops it)."""

    started_here: bool
    dashboard_url: str | None


def connect(address: str | None = None, dashboard: bool = False, num_cpus: int | None = None) -> RayConnection:
    """Connects to the Ray cluster at `address` (or $RAY_ADDRESS), else starts an embedded local Ray.

    Args:
      address: a Ray address ("auto", "ray://host:10001", "host:6379"); None reads RAY_ADDRESS.
      dashboard: start the dashboard (bound to 127.0.0.1) when starting a local Ray.
      num_cpus: logical CPUs of a local Ray (enough for every fake host worker).
    """
    import ray

    if ray.is_initialized():
        return RayConnection(False, _dashboard_url(ray))
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        # A cluster's workers do not inherit this process's environment: pass malloc's tunables on
        # (huge pages, 2 arenas: podray.hugepages). A local Ray's workers inherit them.
        tunables = os.environ.get("GLIBC_TUNABLES")
        job_env = {"runtime_env": {"env_vars": {"GLIBC_TUNABLES": tunables}}} if tunables else {}
        ray.init(address=address, logging_level="WARNING", **job_env)
        return RayConnection(False, _dashboard_url(ray))
    # Ray starts its processes with fork+exec, which JAX's fork warning (the driver's CPU JAX is up
    # after validation) does not concern.
    import warnings

    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
    # address="local": always a new Ray of our own, never one that another user started on this machine.
    context = ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=dashboard,
        dashboard_host="127.0.0.1",
        logging_level="WARNING",
    )
    url = context.dashboard_url if dashboard else None
    return RayConnection(True, f"http://{url}" if url and not url.startswith("http") else url)


def where_line(connection: RayConnection) -> str:
    """One line saying which Ray this run is on, its dashboard and, in a submitted job, the job's page."""
    import ray

    from podray import run_dirs

    if connection.started_here:
        where = "podray: on a local Ray started by this command"
    else:
        try:
            address = ray.get_runtime_context().gcs_address
        except Exception:  # a Ray Client connection (ray://) has no GCS address of its own
            address = os.environ.get("RAY_ADDRESS") or "(Ray Client)"
        where = f"podray: on the Ray cluster at {address}"
    url = connection.dashboard_url
    if url is None:
        return where + " (no dashboard)"
    job = run_dirs.ray_job_id()
    return where + f" | dashboard {url}" + (f" | job {job}: {url}/#/jobs/{job}" if job else "")


def _dashboard_url(ray) -> str | None:
    """The dashboard URL of the cluster we joined (None when it runs none)."""
    try:
        url = ray._private.worker.get_dashboard_url()
    except Exception:
        return None
    return f"http://{url}" if url and not url.startswith("http") else (url or None)


# --------------------------------------------------------------------------------------------------
# A group of host workers


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


_send_signal_fn = None


def _send_signal():
    """ray.remote(_kill), made once on first use (importing this module does not import Ray)."""
    global _send_signal_fn
    if _send_signal_fn is None:
        import ray

        _send_signal_fn = ray.remote(_kill)
    return _send_signal_fn


def _preempted(error: BaseException):
    """The podray.preemption.Preempted a host worker raised (through Ray's RayTaskError), or None."""
    from podray.preemption import Preempted

    cause = getattr(error, "cause", None)
    if isinstance(cause, Preempted):
        return cause
    return error if type(error) is Preempted else None


def _remote_worker():
    import ray

    from podray.cluster.worker import HostWorker

    # max_restarts=0: the driver restarts whole groups, never one host alone.
    return ray.remote(max_restarts=0)(HostWorker)


@dataclass
class HostGroup:
    """The host workers of one attempt of a run, ordered by JAX process index."""

    workers: list
    nodes: list[dict]
    placement: Any = None
    tpu_slice: Any = None
    devices: dict = field(default_factory=dict)
    borrowed: bool = False

    @classmethod
    def place(
        cls,
        config: config_lib.Config,
        timeout_s: float = 120.0,
        placement: tuple | None = None,
        env: dict | None = None,
    ) -> "HostGroup":
        """Places one host worker per host (without starting JAX in them): `run.hosts` workers of 1 CPU
        each on CPU; on a TPU slice (run.tpu_topology) one worker per TPU host holding that host's
        chips, JAX process i on TPU worker i.

        Args:
          placement: (placement group, first bundle index): bundles the caller reserved, one per host
            from that index, kept on stop(). A multi-host Tune trial reserves them with its own bundle;
            on TPU they must be the hosts of one slice (podray.cluster.tpu says how to ask for them).
            None: the group reserves its own (a slice with ray.util.tpu.slice_placement_group) and
            releases it on stop().
          env: environment variables of the workers (added to the Ray job's), e.g. object-store
            credentials.
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        Worker = _remote_worker()
        r = config.run
        borrowed = placement is not None
        tpu_slice = None
        if r.tpu_topology:
            shape = tpu.slice_shape(r.tpu_topology, r.tpu_version)
            n, cpu_devices, options = shape.hosts, 0, {"num_cpus": 0, "resources": {"TPU": shape.chips_per_host}}
        else:
            n, cpu_devices, options = r.hosts, r.cpu_devices, {"num_cpus": 1}
        if env:
            options["runtime_env"] = {"env_vars": dict(env)}
        if not borrowed:
            if r.tpu_topology:
                from ray.util.tpu import slice_placement_group

                # Ray reserves the slice through its TPU-<pod>-head resource and gang-schedules one
                # bundle per TPU host of that slice (the ray.io/tpu-slice-name label).
                what = f"a TPU slice {r.tpu_version} {r.tpu_topology}"
                fix = (
                    f"free or add a {r.tpu_version} slice of topology {r.tpu_topology}, or set run.tpu_topology "
                    "to a slice the cluster has"
                )
                try:
                    tpu_slice = slice_placement_group(
                        topology=r.tpu_topology, accelerator_version=r.tpu_version, head_reservation_timeout_s=timeout_s
                    )
                except TimeoutError:  # no free TPU-<pod>-head: every slice of this type is taken or absent
                    raise _placement_error(what, timeout_s, fix) from None
                _wait_placement(tpu_slice.placement_group, timeout_s, what, release=tpu_slice.shutdown, fix=fix)
                placement = (tpu_slice.placement_group, 0)
            elif n == 1:
                # One host: no placement group to wait for (the single-host default stays fast).
                workers = [Worker.options(**options).remote(0, 1, cpu_devices)]
                return cls(workers, ray.get([workers[0].node_info.remote()]))
            else:
                from ray.util.placement_group import placement_group

                # PACK: fake hosts share one machine; on a CPU cluster Ray still spills onto more nodes.
                pg = placement_group([{"CPU": 1}] * n, strategy="PACK")
                _wait_placement(pg, timeout_s, f"{n} host workers of 1 CPU each")
                placement = (pg, 0)
        pg, first = placement

        def start(bundles: list[int]) -> list:
            return [
                Worker.options(
                    **options, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
                ).remote(i, n, cpu_devices)
                for i, b in enumerate(bundles)
            ]

        bundles = list(range(first, first + n))
        workers = start(bundles)
        nodes = ray.get([w.node_info.remote() for w in workers])
        if r.tpu_topology:
            # JAX process i is TPU worker i, so that the global mesh follows the slice's topology.
            order = sorted(range(n), key=lambda i: int(nodes[i]["tpu_worker_id"] or i))
            if order != list(range(n)):
                for w in workers:
                    ray.kill(w)
                workers = start([bundles[i] for i in order])
                nodes = ray.get([w.node_info.remote() for w in workers])
        return cls(workers, nodes, placement=pg, tpu_slice=tpu_slice, borrowed=borrowed)

    def initialize(self) -> dict:
        """Starts JAX in every worker and joins them into one program (coordinator on host 0)."""
        import ray

        coordinator = None
        if len(self.workers) > 1:
            # Loopback when every host is on one node (fake CPU hosts); the node IP otherwise.
            loopback = len({n["node_id"] for n in self.nodes}) == 1
            coordinator = ray.get(self.workers[0].coordinator_address.remote(loopback))
        counts = ray.get([w.initialize.remote(coordinator) for w in self.workers])
        self.devices = counts[0]
        return self.devices

    def train(self, config: config_lib.Config, run_dir: str, resume: bool, tags: dict, return_params=False) -> list:
        """Runs train() on every host; returns their results, or raises HostLost / the host's error."""
        config_dict = config.to_dict()
        return self.wait([w.train.remote(config_dict, run_dir, resume, tags, return_params) for w in self.workers])

    def wait(self, refs: list, grace_s: float = 5.0) -> list:
        """The results of one call on every host (`refs`, in host order), or HostLost when a host died
        or stalled, or the first host's error.

        A dead host raises HostLost at once: the others may be blocked in a collective with it and are
        not waited for (stop() kills them). A host that raised an error gets `grace_s` for the others
        to fail too, since an error raised because a peer died (a collective lost it) is a lost host,
        not a bug in the program.
        """
        import ray
        from ray.exceptions import RayActorError

        from podray import preemption

        pending = list(refs)
        forwarded = False
        while pending:
            # Short waits: a signal to the driver (podray.preemption.STOP) is passed on to every host
            # worker, which then stops at the same update boundary with a checkpoint (a preempted host
            # worker takes the same path by itself).
            done, pending = ray.wait(pending, num_returns=1, timeout=0.25)
            if preemption.STOP.requested and not forwarded:
                self.signal_workers(preemption.STOP.signum)
                forwarded = True
            if not done:
                continue
            try:
                ray.get(done[0])
            except RayActorError as dead:
                raise HostLost(str(dead).splitlines()[0]) from dead
            except Exception as error:
                if _preempted(error) is not None:
                    # Every host stops at the same boundary: collect them all (their save is collective).
                    ray.wait(pending, num_returns=len(pending), timeout=60.0) if pending else None
                    raise _preempted(error) from None
                # The other hosts fail soon after (their collectives lose a peer): look a few seconds
                # for a dead actor, which says "host lost" rather than "bug in the program".
                errors = [error]
                ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
                for ref in ready:
                    try:
                        ray.get(ref)
                    except Exception as other:
                        errors.append(other)
                dead = [e for e in errors if isinstance(e, RayActorError)]
                if dead:
                    raise HostLost(str(dead[0]).splitlines()[0]) from dead[0]
                # A host that timed out waiting on its own work (Sebulba: its actors stalled) is lost
                # like a dead one; the other hosts wait for it inside a collective until stop() kills them.
                stalled = [e for e in errors if isinstance(getattr(e, "cause", None), TimeoutError)]
                if stalled:
                    raise HostLost(f"a host stalled: {stalled[0].cause}") from stalled[0]
                raise
        return ray.get(refs)

    def signal_workers(self, signum: int) -> None:
        """Sends `signum` to every host worker's process: directly on this node, through a zero-CPU
        task pinned to the worker's node elsewhere (what a preempted TPU host receives from its VM)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        remote = []
        for node in self.nodes:
            if node["node_id"] == here:
                try:
                    os.kill(node["pid"], signum)
                except ProcessLookupError:
                    pass
            else:
                strategy = NodeAffinitySchedulingStrategy(node["node_id"], soft=False)
                send = _send_signal().options(num_cpus=0, scheduling_strategy=strategy)
                remote.append(send.remote(node["pid"], signum))
        if remote:
            ray.get(remote, timeout=30)

    def stop(self) -> None:
        """Kills every worker and releases the placement (within seconds; no orphan process)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        # Host 0 goes last: it runs jax.distributed's coordination service, and a host whose coordination
        # client outlives the service aborts (a native stack dump in the driver's log) instead of dying
        # quietly. The others are killed first and waited for, a few seconds at most.
        others, first = self.workers[1:], self.workers[:1]
        for w in others:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        if others and first:
            try:  # a call to a killed actor fails once it is dead
                ray.wait([w.node_info.remote() for w in others], num_returns=len(others), timeout=5.0)
            except Exception:
                pass
        for w in first:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        if self.tpu_slice is not None:
            self.tpu_slice.shutdown()
        elif self.placement is not None and not self.borrowed:
            remove_placement_group(self.placement)


def _wait_placement(
    pg,
    timeout_s: float,
    what: str,
    release: Callable[[], None] | None = None,
    fix: str = "lower run.hosts, or add nodes",
) -> None:
    """Waits for `pg`; on timeout releases it (`release`, or removing the group) and raises ClusterError
    whose message ends with `fix`."""
    import ray

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        (release or (lambda: remove_placement_group(pg)))()
        raise _placement_error(what, timeout_s, fix) from None


def _placement_error(what: str, timeout_s: float, fix: str) -> ClusterError:
    import ray

    return ClusterError(
        f"Ray could not place {what} within {timeout_s:.0f} s; cluster resources: {ray.cluster_resources()} ({fix})"
    )


# --------------------------------------------------------------------------------------------------
# Runs, restarts, replicas


def _latest_checkpoint(run_dir: storage.Path) -> int | None:
    """The latest complete orbax step (storage.step_dirs)."""
    steps = storage.step_dirs(run_dir / "checkpoints")
    return max(steps) if steps else None


def _last_logged(run_dir: storage.Path) -> dict:
    text = storage.read_text(run_dir / "metrics.jsonl") or ""
    lines = [line for line in text.splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else {}


def _log_event(run_dir: storage.Path, event: dict) -> None:
    """Appends an event to run_log.jsonl (written by the driver alone: no other writer to race)."""
    storage.append_lines(run_dir / "run_log.jsonl", [json.dumps({"time": time.time(), **event})])


def _run_group(
    config: config_lib.Config,
    run_dir: storage.Path,
    resume: bool,
    tags: dict,
    return_params: bool,
    on_group: Callable[[HostGroup], None] | None,
    say: Callable[[str], None],
    placement: tuple | None = None,
) -> list[dict]:
    """Runs `config` to its end on a group of host workers, restarting after a lost host.

    `placement` (placement group, first bundle index) places the workers in bundles the caller holds."""
    from ray.exceptions import RayActorError

    from podray.preemption import STOP, Preempted

    restarts = 0
    run_dir = storage.run_path(run_dir)
    env = storage.storage_env() if storage.is_uri(run_dir) else None
    _log_event(run_dir, {"event": "start", "resume": resume, "hosts": config.run.hosts, **tags})
    while True:
        group = HostGroup.place(config, placement=placement, env=env)
        try:
            group.initialize()
            if on_group is not None:
                on_group(group)
            try:
                results = group.train(config, str(run_dir), resume, tags, return_params)
            except Preempted as stopped:
                if STOP.requested or restarts >= config.run.max_restarts:
                    raise  # the driver was signalled (host 0 logged the stop): the run ends here
                # A host worker was preempted by itself: it saved at the boundary every host agreed on,
                # so the restart loses nothing.
                restarts += 1
                _log_event(
                    run_dir,
                    {
                        "event": "restart",
                        "restart": restarts,
                        "error": str(stopped).split(";")[0],
                        "reached_updates": stopped.updates,
                        "resumed_from_updates": stopped.updates,
                        "lost_updates": 0,
                        "lost_env_steps": 0,
                    },
                )
                say(
                    f"podray: a host worker {str(stopped).split(';')[0]}; restart {restarts}/"
                    f"{config.run.max_restarts} from its checkpoint (nothing lost)"
                )
                resume = True
                group.stop()
                group = None
                continue
            _log_event(run_dir, {"event": "finish", "restarts": restarts, "env_steps": results[0]["env_steps"]})
            return results
        except (HostLost, RayActorError) as lost:  # also a host lost while joining the program
            reason = str(lost).splitlines()[0]
            group.stop()
            group = None
            checkpoint = _latest_checkpoint(run_dir)
            if STOP.requested:  # signalled before the workers could stop gracefully (start-up): no restart
                last = _last_logged(run_dir)
                _log_event(run_dir, {"event": "stopped", "signal": STOP.signal_name, "updates": checkpoint})
                raise Preempted(
                    STOP.signal_name,
                    checkpoint,
                    int(last.get("env_steps", 0)),
                    str(run_dir / "checkpoints"),
                    str(run_dir),
                ) from None
            last = _last_logged(run_dir)
            reached = int(last.get("updates", last.get("step", 0)))
            resumed_from = checkpoint or 0
            event = {
                "event": "restart" if restarts < config.run.max_restarts else "failed",
                "restart": restarts + 1,
                "error": reason,
                "reached_updates": reached,
                "resumed_from_updates": resumed_from,
                "lost_updates": max(0, reached - resumed_from),
                "reached_env_steps": int(last.get("env_steps", 0)),
            }
            per_update = event["reached_env_steps"] / reached if reached else 0
            event["lost_env_steps"] = int(event["lost_updates"] * per_update)
            _log_event(run_dir, event)
            if restarts >= config.run.max_restarts:
                raise ClusterError(
                    f"a host worker died ({reason}) and run.max_restarts={config.run.max_restarts} restarts "
                    f"are spent; the checkpoints are intact in {run_dir / 'checkpoints'} (latest: update "
                    f"{checkpoint}); continue with: podray train --resume {run_dir}"
                ) from lost
            restarts += 1
            say(
                f"podray: host worker lost ({reason}); restart {restarts}/{config.run.max_restarts} from "
                f"update {resumed_from} (lost {event['lost_updates']} updates since the last checkpoint)"
            )
            resume = True
        finally:
            if group is not None:
                group.stop()


def train_on_ray(
    config: config_lib.Config,
    run_dir: str | pathlib.Path | None = None,
    resume: bool = False,
    address: str | None = None,
    dashboard: bool = False,
    keep_dashboard: Callable[[str], None] | None = None,
    return_params: bool = False,
    on_group: Callable[[HostGroup], None] | None = None,
    say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> list[dict]:
    """Trains `config` on Ray: one group of host workers per replica (run.seeds), restarted on failure.

    Args:
      config: a validated Config.
      run_dir: the run directory (replicas get run_dir/seed-N); None takes run.run_dir, else a new one
        under the runs root (podray.run_dirs.resolve). On a multi-node cluster it must be storage every
        host sees: an object-store URI (gs://, s3://) or a shared disk.
      resume: continue from the latest checkpoint in run_dir.
      address: Ray address, or None for $RAY_ADDRESS, or else an embedded local Ray (stopped at the end).
      dashboard: start the dashboard with a local Ray and print its URL.
      keep_dashboard: called with the URL after the run, before a local Ray stops (e.g. wait for Ctrl-C).
      return_params: also return each host's copy of the final parameters (tests).
      on_group: called with each HostGroup once it is placed and initialized (tests inject failures).
    Returns:
      One dict per replica: host 0's summary, plus "hosts" (every host's summary).
    """
    from podray import run_dirs

    base = storage.run_path(run_dirs.resolve(config, run_dir))
    pin_driver_jax_to_cpu()
    validation.validate(config)
    storage.check_run_dir(base, "--run-dir")
    from podray.checkpoint import probe_writable

    probe_writable(base)  # a local directory, before Ray starts and anything compiles (each host worker probes too)
    seeds = config.run.seeds
    replicas = []
    for seed in seeds or [config.seed]:
        c = copy.deepcopy(config)
        c.seed, c.run.seeds = seed, []
        replicas.append((c, base / f"seed-{seed}" if seeds else base, {"run": config.name, "replica": str(seed)}))
    if seeds:  # `podray train --resume BASE` then resumes every replica
        base.mkdir(parents=True, exist_ok=True)
        storage.write_text(base / "config.yaml", config_lib.dump_yaml(config))
    hosts_needed = len(replicas) * (1 if config.run.tpu_topology else config.run.hosts)
    from podray import preemption

    connection = connect(address, dashboard=dashboard, num_cpus=max(os.cpu_count() or 1, hosts_needed))
    # After ray.init: our handlers replace Ray's absl failure-signal handler for SIGTERM/SIGINT (its
    # native stack dump), and a signal becomes a graceful stop of every host worker.
    signals = preemption.handle_signals()
    signals.__enter__()
    try:
        say(where_line(connection))
        results: list[Any] = [None] * len(replicas)

        def run_replica(i: int) -> None:
            c, d, tags = replicas[i]
            d.mkdir(parents=True, exist_ok=True)
            try:
                hosts = _run_group(c, d, resume, tags, return_params, on_group, say)
                results[i] = {**hosts[0], "hosts": hosts}
            except BaseException as e:  # reported by the caller's thread
                results[i] = e

        if len(replicas) == 1:
            run_replica(0)
        else:
            threads = [threading.Thread(target=run_replica, args=(i,)) for i in range(len(replicas))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if keep_dashboard is not None and connection.dashboard_url:
            keep_dashboard(connection.dashboard_url)
        return results
    finally:
        try:
            if connection.started_here:
                import ray

                ray.shutdown()
        finally:
            signals.__exit__(None, None, None)
