"""Sebulba's learner: the agent's update replicated over the learner devices."""

from podray.learners.learner import LEARNER_AXIS, Learner, LearnerState

__all__ = ["LEARNER_AXIS", "Learner", "LearnerState"]
