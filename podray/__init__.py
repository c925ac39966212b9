"""podray: Podracer architectures (Anakin, Sebulba) for scalable RL, on JAX and Ray.

The public surface fits on one screen:
  podray.config           typed configs: load(preset, overrides), Config, ConfigError
  podray.validate(config) the whole check before compute: fields, environment, device counts
  podray.train(config)    run a config in this process; returns a Summary
  podray.make_agent(...)  the agents (PPO, IMPALA), the same under every architecture
  podray.tuning           Ray Tune studies: load_study(yaml), run_study(spec), resume_study(dir)
"""

from podray import config, validation
from podray.config import Config, ConfigError
from podray.validation import validate


def train(config, run_dir=None, resume=False, **kwargs):
    """Trains `config` (see podray.training.train); imports JAX only when called."""
    from podray.training import train as _train

    return _train(config, run_dir=run_dir, resume=resume, **kwargs)


def make_agent(*args, **kwargs):
    """Builds an agent (see podray.agents.make_agent)."""
    from podray.agents import make_agent as _make_agent

    return _make_agent(*args, **kwargs)


__all__ = ["Config", "ConfigError", "config", "make_agent", "train", "validate", "validation"]
