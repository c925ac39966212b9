"""Environments: JAX environments for Anakin (gymnax), host environments for Sebulba (envpool)."""

from podray.envs.spec import EnvSpec

__all__ = ["EnvSpec"]
