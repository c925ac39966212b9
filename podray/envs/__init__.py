"""Environments: JAX environments for Anakin (gymnax), host environments for Sebulba (envpool)."""

from __future__ import annotations

from podray.envs.spec import EnvSpec


def check_config(architecture: str, name: str, torso: str) -> None:
    """Checks an environment name against the registry of `architecture` (gymnax for Anakin, envpool
    for Sebulba) and its observations against the network torso; raises podray.config.ConfigError.
    Reads registries and traces shapes; compiles nothing."""
    if architecture == "sebulba":
        from podray.envs import host_envs

        host_envs.check_config(name, torso)
    else:
        from podray.envs import jax_envs

        jax_envs.check_config(name, torso)


__all__ = ["EnvSpec", "check_config"]
