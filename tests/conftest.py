"""Test session setup: 4 fake CPU devices, set before JAX starts its backend."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Runs of the suite (and the commands it starts) compile afresh; tests of the cache give their own.
os.environ.setdefault("PODRAY_COMPILE_CACHE", "off")

import pytest  # noqa: E402


@pytest.fixture
def compile_counter():
    """Counts XLA compilations made while the test runs (for 'rejected before compiling')."""
    import gymnax  # noqa: F401 - its import runs jnp ops at module level (compiles); not the test's
    import jax

    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)


# Fake TPU hosts of one v4 slice (topology 2x2x2: 8 chips, 4 per host, 2 hosts) for placement tests.
FAKE_TPU_SLICE = {"name": "fake-v4-16", "pod_type": "v4-16", "topology": "2x2x2", "version": "v4", "hosts": 2}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (ray.init takes ~5 s here): a head node with CPUs
    for fake CPU hosts, plus the hosts of a fake TPU slice (TPU resources, ray.io/tpu-* labels and
    the TPU_* environment Ray reads on a TPU VM). Yields the ray.cluster_utils.Cluster."""
    import ray
    from ray.cluster_utils import Cluster

    s = FAKE_TPU_SLICE
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "include_dashboard": False,
            "_system_config": {"metrics_report_interval_ms": 500},
        },
    )
    saved = {k: os.environ.get(k) for k in ("TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE")}
    try:
        for worker_id in range(s["hosts"]):
            os.environ.update(TPU_NAME=s["name"], TPU_WORKER_ID=str(worker_id), TPU_ACCELERATOR_TYPE=s["pod_type"])
            resources = {"TPU": 4}
            if worker_id == 0:
                resources[f"TPU-{s['pod_type']}-head"] = 1
            cluster.add_node(
                num_cpus=1,  # a TPU VM's slice bundle also asks for one CPU
                resources=resources,
                labels={
                    "ray.io/tpu-slice-name": s["name"],
                    "ray.io/tpu-worker-id": str(worker_id),
                    "ray.io/tpu-pod-type": s["pod_type"],
                    "ray.io/tpu-topology": s["topology"],
                    "ray.io/accelerator-type": "TPU-V4",
                },
            )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ray.init(address=cluster.address, logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


class HostKiller:
    """An `on_group` callback for `train_on_ray`: on the first host group only, SIGKILLs host 1's
    worker once a checkpoint of at least `at_update` updates is in `run_dir`; the group the driver
    restarts runs to the end. `restart()` then checks the run log: one restart, from that checkpoint
    or a later one, losing at most `lost_updates_at_most` updates, and a finish."""

    def __init__(self, run_dir, at_update: int):
        self.run_dir, self.at_update, self.killed = run_dir, at_update, []

    def __call__(self, group) -> None:
        import signal
        import threading
        import time

        if self.killed:
            return
        checkpoints = self.run_dir / "checkpoints"

        def kill():
            while not any(p.name.isdigit() and int(p.name) >= self.at_update for p in checkpoints.glob("*")):
                time.sleep(0.05)
            os.kill(group.nodes[1]["pid"], signal.SIGKILL)

        self.killed.append(group.nodes[1]["pid"])
        threading.Thread(target=kill, daemon=True).start()

    def restart(self, lost_updates_at_most: int) -> dict:
        from podray.metrics import read_jsonl

        assert self.killed
        log = read_jsonl(self.run_dir / "run_log.jsonl")
        restarts = [e for e in log if e["event"] == "restart"]
        assert len(restarts) == 1 and log[-1]["event"] == "finish"
        assert restarts[0]["resumed_from_updates"] >= self.at_update
        assert restarts[0]["lost_updates"] <= lost_updates_at_most  # at most one checkpoint interval
        return restarts[0]


@pytest.fixture
def host_killer():
    """The HostKiller class: `killer = host_killer(run_dir, at_update)`, `on_group=killer`."""
    return HostKiller
