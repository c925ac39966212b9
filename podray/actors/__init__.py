"""Sebulba's actors: Python threads that step envpool batches and run the policy on actor devices."""

from podray.actors.actor import ActorStats, ActorThread, Rollout
from podray.actors.params import ParamsStore

__all__ = ["ActorStats", "ActorThread", "ParamsStore", "Rollout"]
