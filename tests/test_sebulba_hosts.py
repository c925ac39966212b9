"""Sebulba across hosts through the Ray layer: 2 host workers x 2 fake devices (1 actor + 1 learner
each) form one learner mesh of 2 devices, learn CartPole, hold bitwise identical parameters on every
actor device of both hosts, survive a killed host, and bad multi-host configs stop before any worker."""

import os
import signal
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest

from podray import config as config_lib
from podray import validation
from podray.cluster import HostGroup, train_on_ray
from podray.metrics import read_jsonl

TWO_HOSTS = ["run.hosts=2", "run.cpu_devices=2", "sebulba.actor_devices=[0]", "sebulba.learner_devices=[1]"]


def _config(*overrides: str) -> config_lib.Config:
    quiet = ["run.tensorboard=false", "run.progress=false"]
    return config_lib.load("sebulba_cartpole", TWO_HOSTS + quiet + list(overrides))


@pytest.mark.slow
def test_two_hosts_learn_cartpole_with_one_learner_mesh_and_identical_actor_parameters(ray_cluster, tmp_path):
    # PPO's settings of tests/test_sebulba.py (400 within 300k steps on one host); the global learner
    # batch of 32 is 16 environments from each host.
    config = _config(
        "agent.name=ppo",
        "agent.optimizer=adam",
        "agent.learning_rate=2.5e-3",
        "agent.epochs=4",
        "agent.num_minibatches=4",
        "total_env_steps=300000",
    )
    # Each host's own gauges reach Ray's metrics export, tagged with its host index.
    name = f"hosts_{uuid.uuid4().hex[:8]}"
    config.name = name
    port = ray_cluster.head_node.metrics_export_port
    seen: set[str] = set()
    stop = threading.Event()

    def scrape_loop():
        while not stop.is_set() and len(seen) < 2:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                text = ""
            for line in text.splitlines():
                if line.startswith("ray_podray_host_frames_per_s{") and f'run="{name}"' in line:
                    seen.update(h for h in ("0", "1") if f'host="{h}"' in line)
            time.sleep(0.3)

    poller = threading.Thread(target=scrape_loop, daemon=True)
    poller.start()
    try:
        (result,) = train_on_ray(config, run_dir=tmp_path, return_params=True)
        poller.join(timeout=15)
    finally:
        stop.set()
    assert seen == {"0", "1"}, f"per-host gauges not exported on http://127.0.0.1:{port}/metrics"
    hosts = result["hosts"]
    assert [h["process_index"] for h in hosts] == [0, 1]
    assert result["final_mean_return"] >= 400, result
    assert result["env_steps"] == hosts[1]["env_steps"] >= config.total_env_steps
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert {r["learner_devices"] for r in rows} == {2.0} and {r["hosts"] for r in rows} == {2.0}
    # Totals over hosts: the run's frames/s sum both hosts' (each row also carries host 0's own).
    last = rows[-1]
    assert last["frames_per_s"] >= last["host_frames_per_s"] > 0
    assert last["frames_per_s"] >= 2 * last["slowest_host_frames_per_s"] * 0.999
    # Every actor device of every host acts with the same parameters, bit for bit, and they are the
    # learner's.
    (actor_0,), (actor_1,) = hosts[0]["actor_params"], hosts[1]["actor_params"]
    assert len(actor_0) == len(hosts[0]["params"]) > 0
    for a, b, learner in zip(actor_0, actor_1, hosts[0]["params"]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, learner)


def test_killed_host_of_a_two_host_sebulba_run_is_restored_from_checkpoint(ray_cluster, tmp_path, host_killer):
    every = 5
    config = _config(
        f"sebulba.log_every={every}",
        f"run.checkpoint_every={every}",
        f"total_env_steps={32 * 32 * every * 6}",  # 6 reports of 5 updates of 32 x 32 steps
    )
    killer = host_killer(tmp_path, at_update=2 * every)
    (result,) = train_on_ray(config, run_dir=tmp_path, on_group=killer)
    assert result["env_steps"] == config.total_env_steps  # the full budget
    killer.restart(lost_updates_at_most=every)
    # Continuous step counts: one row per report, no gap, no repeat.
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["updates"] for r in rows] == [every * (i + 1) for i in range(6)]
    assert [r["env_steps"] for r in rows] == [32 * 32 * every * (i + 1) for i in range(6)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sebulba.learner_batch_size=48"], "sebulba.learner_batch_size: 48 / 2 hosts = 24 must be a multiple"),
        (
            ["sebulba.learner_batch_size=33"],
            "sebulba.learner_batch_size: 33 is the global learner batch and must divide over 2 host(s) x 1",
        ),
        (
            ["sebulba.learner_devices=[1, 2]", "sebulba.actor_batch_size=16", "sebulba.learner_batch_size=34"],
            "over 2 host(s) x 2 learner device(s) per host; use a multiple of 4",
        ),
        (["sebulba.learner_devices=[2]"], "sebulba.learner_devices: index 2 is out of range; each host of this run"),
        (["sebulba.actor_devices=[0, 3]"], "sebulba.actor_devices: index 3 is out of range; each host of this run"),
    ],
)
def test_bad_multi_host_sebulba_config_is_rejected_before_any_worker_starts(overrides, message, monkeypatch, tmp_path):
    placed = []
    monkeypatch.setattr(HostGroup, "place", classmethod(lambda cls, *a, **k: placed.append(a)))
    config = config_lib.load("sebulba_cartpole", TWO_HOSTS + overrides, check=False)
    with pytest.raises(config_lib.ConfigError, match=_escape(message)):
        validation.validate(config)
    with pytest.raises(config_lib.ConfigError, match=_escape(message)):
        train_on_ray(config, run_dir=tmp_path, address="none-should-be-reached:1")
    assert placed == []


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_dead_or_stalled_host_is_reported_within_seconds_while_the_others_are_blocked(ray_cluster):
    """HostGroup.wait: a host killed while the others wait in a collective is lost at once; a host whose
    actors stalled (TimeoutError) is lost after the grace for the others, never after their sleep."""
    import ray

    from podray.cluster.driver import HostLost

    class StandIn:  # a host worker that sleeps (as if blocked in a collective) or stalls
        def pid(self) -> int:
            return os.getpid()

        def sleep(self, seconds: float) -> None:
            time.sleep(seconds)

        def stall(self) -> None:
            raise TimeoutError("sebulba: no trajectory from the actors for 1 s")

    Host = ray.remote(num_cpus=0, max_restarts=0)(StandIn)
    hosts = [Host.remote() for _ in range(2)]
    group = HostGroup(workers=hosts, nodes=[])
    survivor = Host.remote()
    try:
        pid = ray.get(hosts[1].pid.remote())
        refs = [hosts[0].sleep.remote(120), hosts[1].sleep.remote(120)]
        time.sleep(0.5)
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(HostLost):
            group.wait(refs)
        assert time.monotonic() - start < 10
        start = time.monotonic()
        with pytest.raises(HostLost, match="a host stalled: sebulba: no trajectory"):
            group.wait([hosts[0].sleep.remote(120), survivor.stall.remote()], grace_s=1.0)
        assert time.monotonic() - start < 10
    finally:
        for h in [*hosts, survivor]:
            ray.kill(h)
