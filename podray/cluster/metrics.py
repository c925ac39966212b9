"""Run metrics on the Ray dashboard and Prometheus, through ray.util.metrics.

Ray aggregates each process's metrics in its node's metrics agent, which the dashboard reads and
Prometheus scrapes (docs/operations.md); we only set gauges, so writing never blocks the learner.

Every host writes its own gauges, tagged host=<process index>. The run-wide gauges (frames/s, env
steps, return) carry the run's totals on every host; the podray_host_* gauges carry that host's own
rate, policy lag, queue occupancy and learner wait (Sebulba reports them as host_<key>), so a slow host
stands out beside the others on the dashboard.
"""

from __future__ import annotations

import math
import time
from typing import Mapping

# metric name on the dashboard -> (key in the program's metrics, description)
GAUGES = {
    "podray_env_steps_per_s": ("steps_per_s", "Environment steps per second (all devices of all hosts of the run)"),
    "podray_frames_per_s": (
        "frames_per_s",
        "Frames per second, all hosts (Atari: env steps x frame skip; JAX environments: env steps)",
    ),
    "podray_learner_steps_per_s": ("learner_steps_per_s", "Learner updates per second"),
    "podray_episode_return": ("mean_return", "Mean return of the episodes completed in the last interval"),
    "podray_policy_lag": ("policy_lag", "Parameter versions between acting and learning (0 for Anakin)"),
    "podray_queue_occupancy": (
        "queue_occupancy",
        "Mean length of the actor-to-learner queue over the last report, in trajectories; its bound is "
        "sebulba.queue_size (Sebulba)",
    ),
    "podray_env_steps": ("env_steps", "Environment steps so far"),
    "podray_host_frames_per_s": ("host_frames_per_s", "Frames per second of this host's actors (Sebulba)"),
    "podray_host_policy_lag": ("host_policy_lag", "Mean policy lag of the trajectories this host's learner took"),
    "podray_host_queue_occupancy": (
        "host_queue_occupancy",
        "Mean length of this host's actor-to-learner queue, in trajectories",
    ),
    "podray_host_learner_wait": (
        "host_learner_wait_fraction",
        "Fraction of time this host's learner waited for trajectories (its actors, or a slower host)",
    ),
}
TAG_KEYS = ("run", "replica", "host")


class RayMetricsSink:
    """A Sink that sets one ray.util.metrics Gauge per metric, tagged with run, replica and host.

    Args:
      tags: values of TAG_KEYS for this host (missing ones are set to "").
    """

    def __init__(self, tags: Mapping[str, str]):
        from ray.util.metrics import Gauge

        self.tags = {k: str(tags.get(k, "")) for k in TAG_KEYS}
        self._gauges = {name: Gauge(name, description=desc, tag_keys=TAG_KEYS) for name, (_, desc) in GAUGES.items()}
        self._last: tuple[float, float] | None = None  # (time, updates) of the previous write

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = dict(metrics)
        now, updates = time.perf_counter(), float(metrics.get("updates", step))
        if self._last is not None and now > self._last[0]:
            values["learner_steps_per_s"] = (updates - self._last[1]) / (now - self._last[0])
        self._last = (now, updates)
        if "policy_lag" not in values and "queue_occupancy" not in values:
            values["policy_lag"] = 0.0  # Anakin acts and learns on the same parameters
        values.setdefault("frames_per_s", values.get("steps_per_s"))  # one frame per step: JAX environments
        for name, (key, _) in GAUGES.items():
            value = values.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._gauges[name].set(float(value), tags=self.tags)

    def close(self) -> None:
        pass
