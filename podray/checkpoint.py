"""Checkpoints with orbax: program state (params, optimizer, PRNG, environments) plus counters and
config, written atomically, the newest `keep` kept.

orbax writes each save to a temporary directory and renames it when complete, so a run killed while
saving still has its previous checkpoint; in a multi-host run every process calls save and orbax
writes each array shard once. The directory may be an object-store URI (podray.storage): there orbax
writes each step under its final name and commits it with a marker file written last (an object
store has no atomic rename), and only committed steps are listed.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from podray import storage


class Checkpointer:
    """Saves and restores (state pytree, metadata dict) pairs under `directory`, by step."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.directory = storage.run_path(directory)
        remote = {}
        if storage.is_uri(self.directory):
            if storage.scheme(self.directory) == "s3":
                storage.enable_orbax_s3()
            remote["atomicity_options"] = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False, **remote
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Writes the state and JSON metadata for `step` (all processes must call this)."""
        self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        )
        self._manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of the checkpoints kept, oldest first."""
        return sorted(self._manager.all_steps())

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores into the structure, shapes and shardings of `target` (arrays or ShapeDtypeStructs)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return restored["state"], restored["meta"]

    def read_meta(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def close(self) -> None:
        self._manager.close()
