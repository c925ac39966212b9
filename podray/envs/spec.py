"""What an agent needs to know about an environment, independent of where the environment runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvSpec:
    """Static description of an environment's observations and actions.

    Attributes:
      name: the environment id.
      obs_shape: shape of one observation, e.g. (4,) or (84, 84, 4).
      obs_dtype: numpy dtype name of observations, e.g. 'float32' or 'uint8'.
      num_actions: size of the discrete action space.
    """

    name: str
    obs_shape: tuple[int, ...]
    obs_dtype: str
    num_actions: int
