"""Which process this is, which devices it drives, and the global mesh over every host's devices.

The architectures take a HostContext and never ask JAX for "the" device: the same program runs on one
process with 4 fake CPU devices or on 4 hosts of 8 TPU cores each (shared/DESIGN.md, principle 1).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from podray import config as config_lib
from podray.config import ConfigError

DEVICE_AXIS = "device"


@dataclass(frozen=True)
class HostContext:
    """One process of a (possibly multi-host) JAX program.

    Attributes:
      process_index: this process, 0 .. process_count - 1.
      process_count: processes (hosts) in the program.
      local_devices: the devices this process drives, in order.
      devices: every device of the program, host by host (the mesh's order).
    """

    process_index: int
    process_count: int
    local_devices: tuple
    devices: tuple

    @property
    def is_leader(self) -> bool:
        """Process 0 writes logs, summaries and checkpoint metadata."""
        return self.process_index == 0

    def devices_by_host(self) -> list[tuple]:
        """`devices` split by process, host by host: entry p holds host p's devices in its local order
        (the same positions as `local_devices` on that host)."""
        hosts: dict[int, list] = {}
        for d in self.devices:
            hosts.setdefault(d.process_index, []).append(d)
        return [tuple(hosts[p]) for p in sorted(hosts)]

    def mesh(self, axis_name: str = DEVICE_AXIS) -> Mesh:
        """A 1-D mesh over all devices of all hosts, named `axis_name`."""
        return Mesh(np.asarray(self.devices, dtype=object), (axis_name,))


def select_local_devices(indices: Sequence[int] = ()) -> list:
    """This process's devices, or those at `indices` among them; errors name run.devices."""
    local = jax.local_devices()
    if not indices:
        return list(local)
    bad = [i for i in indices if i >= len(local)]
    if bad:
        raise ConfigError(
            f"run.devices: index {bad[0]} is out of range; this host has {len(local)} devices "
            f"(0..{len(local) - 1}); on CPU set run.cpu_devices to fake more"
        )
    return [local[i] for i in indices]


def local_context(device_indices: Sequence[int] = ()) -> HostContext:
    """The context of a single-process run (also the one each host of a multi-host run derives from)."""
    local = select_local_devices(device_indices)
    if jax.process_count() == 1:
        return HostContext(0, 1, tuple(local), tuple(local))
    # Multi-host: every process selects the same local indices; the mesh lists hosts in order.
    positions = [jax.local_devices().index(d) for d in local]
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    devices = []
    for p in sorted(by_process):
        host_devices = sorted(by_process[p], key=lambda d: d.id)
        devices.extend(host_devices[i] for i in positions)
    return HostContext(jax.process_index(), jax.process_count(), tuple(local), tuple(devices))


def check_devices(config: config_lib.Config, num_devices: int) -> None:
    """The checks of `config` that need the device count (still before any compilation): Sebulba's
    device split must index existing devices of each host (`num_devices`: one host's), Anakin's
    environments must divide over the run's devices (`num_devices`: every host's)."""
    if config.architecture == "sebulba":
        s = config.sebulba
        for name in ("actor_devices", "learner_devices"):
            bad = [i for i in getattr(s, name) if i >= num_devices]
            if bad:
                raise ConfigError(
                    f"sebulba.{name}: index {bad[0]} is out of range; each host of this run has {num_devices} "
                    f"devices (0..{num_devices - 1}); on CPU set run.cpu_devices to fake more"
                )
        return
    total = config_lib.num_envs(config, num_devices)
    if total % num_devices:
        raise ConfigError(
            f"env.num_envs: {total} environments do not divide over {num_devices} devices; use a "
            f"multiple of {num_devices}, e.g. {num_devices * max(1, total // num_devices)}"
        )
    config_lib.check_minibatches(
        config.agent,
        total // num_devices,
        config.anakin.rollout_length,
        "env.num_envs / devices",
        "anakin.rollout_length",
    )


def configure_cpu_devices(count: int) -> None:
    """Fakes `count` CPU devices; must run before JAX initialises its backends."""
    if count > 0:
        jax.config.update("jax_num_cpu_devices", count)


def configure_cpu_devices_if_not_started(count: int) -> None:
    """configure_cpu_devices, unless JAX has already started (then the count stays as it is)."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        configure_cpu_devices(count)


# XLA:CPU hands convolutions, dots and reductions to YNNPACK by default. Its convolutions run slower
# than XLA's own (Eigen) for our pixel torsos: on the 2-core CI machine the Nature-CNN policy at 32
# Atari frames ran 1.8x faster with Eigen's, the IMPALA-ResNet learner ~6% faster, and every weight
# gradient we timed (3x3 layers of 4-32 channels) was faster (docs/benchmarks.md). Dots and
# reductions stay with YNNPACK.
CPU_COMPILER_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE",
}


@functools.cache
def _cpu_options_supported() -> bool:
    """Whether this jaxlib knows CPU_COMPILER_OPTIONS (checked once, on a one-element program)."""
    try:
        cpu = jax.devices("cpu")[0]
        jax.jit(lambda x: x + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(
            jax.ShapeDtypeStruct((1,), np.float32, sharding=jax.sharding.SingleDeviceSharding(cpu))
        ).compile()
        return True
    except Exception as e:  # an unknown option is an INVALID_ARGUMENT at compile time
        warnings.warn(
            f"XLA:CPU options {CPU_COMPILER_OPTIONS} not accepted by this jaxlib ({e}); using its defaults",
            stacklevel=2,
        )
        return False


def compiler_options(devices: Sequence) -> dict[str, str] | None:
    """XLA options for a program that runs on `devices`: CPU_COMPILER_OPTIONS when they are all CPU
    devices (and this jaxlib accepts them), otherwise None (the backend's defaults)."""
    devices = list(devices)
    if devices and all(d.platform == "cpu" for d in devices) and _cpu_options_supported():
        return dict(CPU_COMPILER_OPTIONS)
    return None


COMPILE_CACHE_ENV = "PODRAY_COMPILE_CACHE"
"""Environment variable naming the compile cache directory ('off' disables it) where run.compile_cache
is 'auto'."""


def compile_cache_dir(setting: str) -> str | None:
    """The directory run.compile_cache names ('auto', 'off' or a path); None when the cache is off."""
    import os
    import pathlib

    if setting == "auto":
        setting = os.environ.get(COMPILE_CACHE_ENV, "")
        if not setting:
            base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            setting = os.path.join(base, "podray", "jax")
    if setting == "off":
        return None
    return str(pathlib.Path(setting).expanduser().resolve())


def configure_compile_cache(setting: str) -> str | None:
    """Points JAX's persistent compilation cache at compile_cache_dir(setting) (or turns it off) for
    the compilations that follow in this process; returns the directory or None.

    Every executable is cached whatever its compile time or size (JAX's defaults skip those compiled
    in under 1 s, which are most of a small run's programs). JAX decides once per process whether the
    cache is in use, at its first compilation (importing gymnax already compiles), so a change resets
    that decision. JAX keys an entry by the program's HLO, the jaxlib version, the backend platform and
    its version, the devices' kinds and topology, the compile options and the XLA flags: an executable
    from another jaxlib, backend or device set is never loaded."""
    from jax.experimental.compilation_cache import compilation_cache

    path = compile_cache_dir(setting)
    current = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    if path is not None:
        import pathlib

        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if path != current:
        jax.config.update("jax_enable_compilation_cache", path is not None)
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()
    return path
