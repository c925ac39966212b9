"""Agents: pure init / act / loss / update functions, the same under Anakin and Sebulba."""

from __future__ import annotations

from podray.agents.base import ActorOut, Agent, TrainState, Trajectory
from podray.agents.impala import IMPALA
from podray.agents.ppo import PPO
from podray.config import AgentConfig, NetworkConfig
from podray.envs.spec import EnvSpec

AGENTS = {"ppo": PPO, "impala": IMPALA}


def make_agent(config: AgentConfig, network: NetworkConfig, spec: EnvSpec, num_updates: int) -> Agent:
    """Builds the agent named by `config.name` for an environment spec."""
    return AGENTS[config.name](config, network, spec, num_updates)


__all__ = ["ActorOut", "Agent", "IMPALA", "PPO", "TrainState", "Trajectory", "make_agent"]
