"""The host worker: one Ray actor per host, one JAX process of the (possibly multi-host) program.

A host worker imports JAX only inside its own process (a TPU host can be opened by one process, so the
driver never touches a JAX backend). It joins the program with `jax.distributed.initialize` (the
coordinator runs on host 0), builds its HostContext, and calls the same entry as an in-process run,
`podray.training.train(config, run_dir, resume, host, extra_sinks)`: the architectures do not know Ray
started them (shared/DESIGN.md).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable


def _strip_device_count_flag() -> None:
    """Drops --xla_force_host_platform_device_count inherited from the driver's environment, so that
    run.cpu_devices alone decides how many CPU devices this host fakes."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(kept)


class HostWorker:
    """One host of a run (wrapped with ray.remote by podray.cluster.driver).

    Args:
      process_id: this host's JAX process index, 0 .. num_processes - 1.
      num_processes: hosts in the program.
      cpu_devices: on CPU, fake this many devices (0 leaves JAX alone).
    """

    def __init__(self, process_id: int, num_processes: int, cpu_devices: int = 0):
        self.process_id = process_id
        self.num_processes = num_processes
        self.cpu_devices = cpu_devices
        if cpu_devices:
            _strip_device_count_flag()

    def node_info(self) -> dict[str, Any]:
        """Where this worker runs: node id and IP, process id, TPU worker id (when on a TPU host)."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "tpu_worker_id": os.environ.get("TPU_WORKER_ID"),
            "tpu_name": os.environ.get("TPU_NAME"),
            "cpu_s": time.process_time(),  # CPU this process spent so far (start-up: imports, Ray)
        }

    def coordinator_address(self, loopback: bool) -> str:
        """A free port on this node for jax.distributed's coordinator (called on host 0 only)."""
        import ray

        ip = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("" if not loopback else ip, 0))
            port = s.getsockname()[1]
        return f"{ip}:{port}"

    def initialize(self, coordinator: str | None) -> dict[str, int]:
        """Starts JAX in this process and joins the multi-host program; returns device counts."""
        import jax

        if self.cpu_devices:
            jax.config.update("jax_num_cpu_devices", self.cpu_devices)
        if self.num_processes > 1:
            # gloo: collectives across processes on CPU (TPU and GPU use their own interconnect).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(
                coordinator_address=coordinator,
                num_processes=self.num_processes,
                process_id=self.process_id,
                initialization_timeout=120,
            )
        return {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "local_devices": jax.local_device_count(),
            "global_devices": jax.device_count(),
            "cpu_s": time.process_time(),
        }

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn(*args) in this host's process and returns its result (`podray bench scale` times the
        program's first collective and its per-report traffic with it)."""
        return fn(*args)

    def train(
        self, config_dict: dict, run_dir: str, resume: bool, metric_tags: dict[str, str], return_params: bool = False
    ) -> dict[str, Any]:
        """Runs this host's part of the program through podray.training.train; returns the Summary as a
        dict (plus this host's copy of the parameters when `return_params`, for tests)."""
        import jax
        import numpy as np

        from podray import config as config_lib
        from podray import host as host_lib
        from podray.cluster.metrics import RayMetricsSink
        from podray.training import train

        config = config_lib.from_dict(config_dict)
        host = host_lib.local_context(config.run.devices)
        tags = dict(metric_tags, host=str(host.process_index))
        summary = train(
            config, run_dir=run_dir, resume=resume, host=host, host_sinks=[RayMetricsSink(tags)], launcher="ray"
        )
        out = summary.to_dict()
        out["process_index"] = host.process_index
        out["global_devices"] = len(host.devices)
        if return_params:
            # The parameters are replicated: every host holds a full copy on each of its devices.
            state = summary.final_state
            params = getattr(getattr(state, "train", state), "params", state)
            out["params"] = [np.asarray(leaf.addressable_shards[0].data) for leaf in jax.tree.leaves(params)]
            if summary.actor_params is not None:  # Sebulba: each actor device's copy, as the actors use it
                out["actor_params"] = [[np.asarray(leaf) for leaf in jax.tree.leaves(p)] for p in summary.actor_params]
        return out
