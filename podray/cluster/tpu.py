"""TPU slices for the Ray layer: a slice's shape (from Ray's own TPU helpers), the placement-group
bundles that reserve one whole slice, and the complete slices a Ray cluster holds.

    shape = slice_shape("2x2x2", "v4")   # pod type v4-16: 2 hosts of 4 chips, TPU-v4-16-head on worker 0
    host_bundles(shape), host_label_selectors(shape), ONE_SLICE   # one bundle per host, all on one slice
    complete_slices(nodes, shape)        # {slice name: its nodes}, every host alive with its chips

`podray train` reserves a slice with ray.util.tpu.slice_placement_group, which first claims a slice's
`TPU-<pod type>-head` resource in a placement group of its own, reads the slice's name from there, and
then asks for one bundle per host with the label selector `ray.io/tpu-slice-name=<that name>`. A Tune
trial cannot do that two-step dance: Tune creates the trial's placement group from a fixed request
before the trial runs. The one-group equivalent is this module's request: the head resource on the
first host bundle, the pod type as a label selector on every host bundle (worker 0 on the first), and
`topology_strategy={"ray.io/tpu-slice-name": "STRICT_PACK"}` (Ray's alpha topology-aware scheduling),
which keeps every bundle of the group on nodes with one value of the slice-name label. Label selectors
alone do not: with two slices of a pod type, Ray can put host 0 on one slice and host 1 on the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from podray.config import ConfigError

SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"

ONE_SLICE = {SLICE_NAME_LABEL: "STRICT_PACK"}
"""The `topology_strategy` of a placement group whose bundles must all land on one TPU slice (every
bundle: the slice's hosts and any CPU-only bundle of the same group, which then runs on a host of it)."""


@dataclass(frozen=True)
class SliceShape:
    """One TPU slice, as Ray schedules it.

    Attributes:
      topology: chips per dimension, e.g. '2x2x2' (lower case).
      version: Ray's name of the generation, e.g. 'v4', 'v5litepod', 'v6e'.
      pod_type: the slice's pod type label, e.g. 'v4-16' (Ray counts v2-v4 and v5p in cores).
      hosts: TPU hosts (VMs, one Ray node each) of the slice.
      chips_per_host: the `TPU` resource of one host (chips, times RAY_TPU_RESOURCE_PER_CHIP).
    """

    topology: str
    version: str
    pod_type: str
    hosts: int
    chips_per_host: int

    @property
    def head_resource(self) -> str:
        """The resource only worker 0 of each slice of this pod type has (one unit)."""
        return f"TPU-{self.pod_type}-head"

    def describe(self) -> str:
        """E.g. 'TPU v4 2x2x2 slice (v4-16: 2 hosts of 4 chips)'."""
        hosts = f"{self.hosts} host{'s' if self.hosts > 1 else ''} of {self.chips_per_host} chips"
        return f"TPU {self.version} {self.topology} slice ({self.pod_type}: {hosts})"


def slice_shape(topology: str, version: str, where: str = "run") -> SliceShape:
    """The shape of a slice, computed the way ray.util.tpu.SlicePlacementGroup computes it.

    Args:
      topology: e.g. '2x2x2'.
      version: e.g. 'v4', 'v5p', 'v5litepod', 'v6e' (or 'TPU-V4').
      where: the config section named in errors (`<where>.tpu_topology`, `<where>.tpu_version`).
    Raises:
      ConfigError naming the field when Ray does not know the version or the topology.
    """
    from ray._private.accelerators.tpu import TPUAcceleratorManager, infer_tpu_pod_type_from_topology
    from ray.util.tpu import get_tpu_version_from_type, get_tpu_worker_resources

    try:
        generation = get_tpu_version_from_type(version.strip())
    except ValueError as e:
        raise ConfigError(f"{where}.tpu_version: {e}") from None
    topology = topology.strip().lower()
    if not TPUAcceleratorManager.is_valid_tpu_accelerator_topology(
        tpu_accelerator_version=generation, tpu_topology=topology
    ):
        raise ConfigError(
            f"{where}.tpu_topology: '{topology}' is not a topology of TPU {version} (e.g. 2x2x1, 2x2x2, 2x2x4 for v4)"
        )
    hosts, per_host = get_tpu_worker_resources(topology=topology, accelerator_type=generation)
    pod_type = infer_tpu_pod_type_from_topology(topology, f"TPU-{generation.upper()}")
    return SliceShape(topology, generation, pod_type, int(hosts), int(per_host["TPU"]))


def host_bundles(shape: SliceShape) -> list[dict[str, float]]:
    """One bundle per host, holding all its chips; the first also holds the slice's head resource, so a
    group of these bundles claims a whole slice (a cluster with k slices holds k such groups at most).
    No CPU: the host workers ask for none (podray.cluster.driver.HostGroup)."""
    chips = float(shape.chips_per_host)
    return [{"TPU": chips, shape.head_resource: 1.0}] + [{"TPU": chips} for _ in range(shape.hosts - 1)]


def host_label_selectors(shape: SliceShape) -> list[dict[str, str]]:
    """The label selector of each bundle of host_bundles: the pod type, and worker 0 for the first."""
    return [{POD_TYPE_LABEL: shape.pod_type, WORKER_ID_LABEL: "0"}] + [
        {POD_TYPE_LABEL: shape.pod_type} for _ in range(shape.hosts - 1)
    ]


def complete_slices(nodes: Sequence[dict[str, Any]], shape: SliceShape) -> dict[str, list[dict]]:
    """The slices of `shape`'s pod type whose hosts are all alive with their chips, worker 0 holding the
    head resource (what host_bundles needs), by slice name.

    Args:
      nodes: Ray node dicts, as ray.nodes() returns them ("Alive", "Resources", "Labels").
    """
    by_slice: dict[str, list[dict]] = {}
    for node in nodes:
        labels = node.get("Labels") or {}
        if node.get("Alive", True) and labels.get(POD_TYPE_LABEL) == shape.pod_type:
            name = labels.get(SLICE_NAME_LABEL) or node.get("NodeID", "")
            by_slice.setdefault(name, []).append(node)
    complete = {}
    for name, members in by_slice.items():
        workers = {(m.get("Labels") or {}).get(WORKER_ID_LABEL) for m in members}
        heads = [m for m in members if (m.get("Labels") or {}).get(WORKER_ID_LABEL) == "0"]
        if (
            len(members) == shape.hosts
            and workers == {str(i) for i in range(shape.hosts)}
            and all((m.get("Resources") or {}).get("TPU", 0) >= shape.chips_per_host for m in members)
            and any((h.get("Resources") or {}).get(shape.head_resource, 0) >= 1 for h in heads)
        ):
            complete[name] = members
    return complete
