"""Versioned parameters, published by the learner to every actor device."""

from __future__ import annotations

import threading
from typing import Any, Sequence

import jax


def _ready(tree: Any) -> bool:
    return all(leaf.is_ready() for leaf in jax.tree.leaves(tree))


def local_copy(tree: Any) -> Any:
    """This process's copy of replicated arrays: each leaf's first addressable shard (a full copy on
    one of this host's devices). A learner mesh that spans hosts makes arrays that no device_put to an
    actor device can take whole; their local copy it can, without waiting for them."""
    return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(x, jax.Array) else x, tree)


class ParamsStore:
    """The newest parameters on each actor device, with the learner version that made them.

    The learner calls `publish` right after dispatching an update: the copy to each actor device is
    enqueued behind the update and nothing waits. `latest` hands an actor the newest version whose
    arrays are already computed, so an actor never stalls on the learner; it acts with the previous
    version meanwhile (policy lag, corrected by V-trace and measured by the learner).

    Args:
      devices: the actor devices.
    """

    def __init__(self, devices: Sequence[jax.Device]):
        self.devices = list(devices)
        self._lock = threading.Lock()
        self._current: dict[jax.Device, tuple[int, Any]] = {}
        self._pending: dict[jax.Device, list[tuple[int, Any]]] = {d: [] for d in self.devices}

    def publish(self, params: Any, version: int, wait: bool = False) -> None:
        """Copies `params` (on the learner devices) to every actor device as `version`.

        Args:
          params: the parameters, replicated over the learner devices (of one host or of many).
          version: the learner's update count that produced them.
          wait: make them current at once (the first publication, before actors start).
        """
        params = local_copy(params)
        copies = {d: jax.device_put(params, d) for d in self.devices}
        with self._lock:
            for d, p in copies.items():
                if wait or d not in self._current:
                    jax.block_until_ready(p)
                    self._current[d] = (version, p)
                    self._pending[d].clear()
                else:
                    # Keep at most a few pending versions: older ones are superseded anyway.
                    self._pending[d] = (self._pending[d] + [(version, p)])[-4:]

    def latest(self, device: jax.Device) -> tuple[int, Any]:
        """(version, params): the newest computed version on `device`."""
        with self._lock:
            pending = self._pending[device]
            for i in range(len(pending) - 1, -1, -1):
                if _ready(pending[i][1]):
                    self._current[device] = pending[i]
                    del pending[: i + 1]
                    break
            return self._current[device]
