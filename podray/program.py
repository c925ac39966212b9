"""What every architecture program shares: its entry point's shape and the Summary it returns.

An architecture module (podray.anakin, podray.sebulba) exposes

    run(config, host, sinks, checkpointer=None, resume=False, run_dir="") -> Summary

with `host` a podray.host.HostContext. The same call runs a single process or one host of many; the
program does not know whether Ray started it (shared/DESIGN.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any

# architecture name -> module exposing run(...)
PROGRAMS = {"anakin": "podray.anakin", "sebulba": "podray.sebulba"}


def program_module(architecture: str):
    """The module that runs `architecture`."""
    return importlib.import_module(PROGRAMS[architecture])


@dataclass
class Summary:
    """What a run reports at its end (also written as summary.json)."""

    final_mean_return: float
    env_steps: int
    wall_s: float
    steps_per_s: float
    updates: int
    run_dir: str
    replica_returns: list[float]
    compile_s: float = 0.0
    steady_steps_per_s: float = 0.0
    final_state: Any = field(default=None, repr=False)
    """The program state at the end (device arrays); not part of summary.json."""
    actor_params: list[Any] | None = field(default=None, repr=False)
    """Sebulba: the parameters each actor device of this host holds at the end, one tree per actor
    device (device arrays); not part of summary.json."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("final_state", "actor_params")}
