"""The whole check of a run's config before anything compiles (shared/DESIGN.md, principle 6).

Each check lives with the code that owns what it checks: the fields in podray.config (a leaf module),
environment names and observation shapes in podray.envs, device counts in podray.host. This module
runs them in order; every error is a podray.config.ConfigError naming the field.
"""

from __future__ import annotations

from podray import config as config_lib


def validate(config: config_lib.Config, num_devices: int | None = None) -> None:
    """Checks `config` as a whole: fields, environment registry, device counts. Compiles nothing.

    Args:
      config: the run's config.
      num_devices: the run's device count when the caller knows it (a Tune trial's resources), checked
        beside the count that run.devices or run.cpu_devices x run.hosts fix, where they do.
    """
    config_lib.validate(config)
    from podray import host

    r = config.run
    if config.architecture == "sebulba" and r.tpu_topology:
        from podray.cluster import tpu

        config_lib.check_sebulba_batches(config, tpu.slice_shape(r.tpu_topology, r.tpu_version).hosts)
    if config.architecture == "anakin":
        # gymnax builds arrays when imported, which starts JAX: fake the CPU devices first.
        host.configure_cpu_devices_if_not_started(r.cpu_devices)
    from podray import envs

    envs.check_config(config.architecture, config.env.name, config.network.torso)
    # Sebulba's device split indexes each host's own devices; Anakin's mesh spans every host's.
    hosts = 1 if config.architecture == "sebulba" else r.hosts
    for count in sorted({len(r.devices) or r.cpu_devices * hosts, num_devices or 0} - {0}):
        host.check_devices(config, count)
