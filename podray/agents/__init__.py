"""Agents: pure init / act / loss / update functions, the same under Anakin and Sebulba."""

from __future__ import annotations

from podray.agents.base import ActorOut, Agent, TrainState, Trajectory
from podray.agents.impala import IMPALA
from podray.agents.muzero import MuZero
from podray.agents.ppo import PPO
from podray.config import AgentConfig, Config, NetworkConfig
from podray.envs.spec import EnvSpec

AGENTS = {"ppo": PPO, "impala": IMPALA, "muzero": MuZero}


def make_agent(config: AgentConfig, network: NetworkConfig, spec: EnvSpec, num_updates: int) -> Agent:
    """Builds the agent named by `config.name` for an environment spec."""
    return AGENTS[config.name](config, network, spec, num_updates)


def build_agent(config: Config, spec: EnvSpec, num_updates: int, num_devices: int) -> Agent:
    """The agent of a whole run config: make_agent, plus the sections and the count of devices that
    share each update, which an agent with a search and a replay (MuZero) needs."""
    if config.agent.name == "muzero":
        return MuZero(config.agent, config.network, spec, num_updates, config.search, config.replay, num_devices)
    return make_agent(config.agent, config.network, spec, num_updates)


__all__ = ["ActorOut", "Agent", "IMPALA", "MuZero", "PPO", "TrainState", "Trajectory", "build_agent", "make_agent"]
