"""Checkpoints with orbax: program state (params, optimizer, PRNG, environments) plus counters and
config, written atomically, the newest `keep` kept.

orbax writes each save to a temporary directory and renames it when complete, so a run killed while
saving still has its previous checkpoint; in a multi-host run every process calls save and orbax
writes each array shard once. The directory may be an object-store URI (podray.storage): there orbax
writes each step under its final name and commits it with a marker file written last (an object
store has no atomic rename), and only committed steps are listed.

What goes wrong with checkpoints, and what this module does about it:
  - A damaged checkpoint (truncated or missing files): `restore_latest` tries the newest first, says
    which step is damaged and why, and falls back to the newest one that reads. The damaged ones are
    moved (not deleted) to checkpoints_damaged/ beside the checkpoints, so that the resumed run can
    save those steps again. With none readable it raises CheckpointError and moves nothing.
  - A checkpoint written by another config: `check_config` compares the config stored with the
    checkpoint to the run's, on the fields that decide the state's shapes, and names the first that
    differs, before anything compiles.
  - A save that fails (full disk, lost permissions): CheckpointError with the reason; the previous
    checkpoint is untouched (the save never reached its rename).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time
import uuid
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from podray import config as config_lib
from podray import storage


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or written; the message names the step, the path and the reason."""


# Fields that decide the shapes and structure of the saved state: the environment (its state and
# observations), the network, the agent and its optimizer (their parameters and optimizer state), and
# Anakin's replica axis. Hyperparameters (learning rate, coefficients) may differ: PBT restores one
# trial's checkpoint into another with mutated ones, and `--resume --set` guards the rest.
_SHAPE_FIELDS = ("architecture", "env.", "network.", "agent.name", "agent.optimizer", "anakin.replicas")


def config_mismatch(saved: dict, config: config_lib.Config) -> tuple[str, Any, Any] | None:
    """The first field (dotted path, saved value, run's value) whose difference changes the shapes of
    the saved state, or None when the checkpoint fits `config`."""
    a, b = config_lib.flatten(saved), config_lib.flatten(config.to_dict())
    for key in sorted(set(a) | set(b)):
        if not key.startswith(_SHAPE_FIELDS) or key not in a or key not in b:
            continue  # a field of a newer podray is absent from an older checkpoint: not a mismatch
        va, vb = a[key], b[key]
        if isinstance(va, (list, tuple)) and isinstance(vb, (list, tuple)):
            va, vb = list(va), list(vb)
        if va != vb:
            return key, a[key], b[key]
    return None


def probe_writable(directory: str | pathlib.Path, what: str = "run directory") -> None:
    """Creates `directory` and writes, syncs and removes a small file in it; raises ConfigError naming
    the path and the reason (read-only, full, a parent that is a file) before anything compiles. An
    object-store URI is left to podray.storage.check_run_dir (its bucket is asked directly)."""
    if storage.is_uri(directory):
        return
    path = pathlib.Path(directory)
    probe = path / f".podray-write-probe-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)  # a page: a full file system fails here or at fsync
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        raise config_lib.ConfigError(
            f"{what} {path} is not writable ({reason}: {e.filename or path}); give run.run_dir / --run-dir "
            "a directory on a disk with free space that this user can write"
        ) from None


def on_mesh(shapes: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """`shapes` (ShapeDtypeStructs, as jax.eval_shape gives them: without shardings) with each leaf
    placed by its part's PartitionSpec on `mesh`; `specs` is a prefix of `shapes` whose leaves are
    PartitionSpecs. Restoring into this puts every array on the resuming program's mesh, whatever
    processes or devices saved it (without a sharding orbax reuses the saving program's)."""

    def place(spec: jax.sharding.PartitionSpec, part: Any) -> Any:
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), part)

    return jax.tree.map(place, specs, shapes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


class Checkpointer:
    """Saves and restores (state pytree, metadata dict) pairs under `directory`, by step.

    Args:
      directory: where the step directories go (run_dir/checkpoints).
      keep: how many of the newest checkpoints to keep.
      is_leader: whether this process moves damaged checkpoints aside (process 0 of the program).
      say: where warnings go (default stderr).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 2,
        is_leader: bool = True,
        say: Callable[[str], None] | None = None,
    ):
        self.directory = storage.run_path(directory)
        self.is_leader = is_leader
        self.say = say or (lambda s: print(s, file=sys.stderr, flush=True))
        self.on_restored: Callable[[int], None] | None = None
        """Called with the step restore_latest restored (the run cuts its metrics log there)."""
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
        """Writes the state and JSON metadata for `step` (all processes must call this); raises
        CheckpointError with the reason when it fails, the previous checkpoint kept."""
        try:
            self._manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            )
            self._manager.wait_until_finished()
        except Exception as e:
            previous = [s for s in self.all_steps() if s != step]
            kept = f"update {previous[-1]}" if previous else "none yet"
            raise CheckpointError(
                f"saving the checkpoint of update {step} to {self.directory} failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else e!r}); the previous checkpoint is kept ({kept})"
            ) from e

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

    def restore_latest(self, target: Any) -> tuple[Any, dict]:
        """Restores the newest checkpoint that reads, newest first; says which ones are damaged and why,
        and moves those aside (to checkpoints_damaged/). Raises CheckpointError, moving nothing, when
        none reads."""
        damaged: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            try:
                state, meta = self.restore(target, step)
            except Exception as e:  # orbax and tensorstore raise many kinds for a broken file
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
                if "Topology mismatch" in reason or "not compatible with the stored shape" in reason:
                    # Intact, but its arrays do not fit this program's (another total device count).
                    raise CheckpointError(
                        f"the checkpoint of update {step} in {self.directory} holds arrays of other shapes "
                        f"than this program's ({reason[:200]}): it was saved with another total number of "
                        "devices; resume on as many devices in all (run.hosts x devices per host) as it was "
                        "saved with"
                    ) from e
                damaged.append((step, reason[:300]))
                self.say(f"podray: checkpoint of update {step} in {self.directory} is damaged ({reason[:300]})")
                continue
            if damaged:
                self.say(
                    f"podray: resuming from update {step}, the newest checkpoint that reads; the damaged ones "
                    f"({', '.join(str(s) for s, _ in damaged)}) move to {self.damaged_dir}"
                )
                self._move_aside([s for s, _ in damaged])
            if self.on_restored is not None:
                self.on_restored(step)
            return state, meta
        listing = "; ".join(f"update {s}: {r}" for s, r in damaged)
        raise CheckpointError(
            f"no readable checkpoint in {self.directory} ({listing}); nothing was deleted. Resume from a copy "
            "of an intact checkpoint, or start a new run"
        )

    @property
    def damaged_dir(self):
        return self.directory.parent / "checkpoints_damaged"

    def _move_aside(self, steps: list[int]) -> None:
        if self.is_leader:
            self.damaged_dir.mkdir(exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for step in steps:
                source = self.directory / str(step)
                if source.exists():
                    source.rename(self.damaged_dir / f"{step}-{stamp}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("podray_checkpoints_moved_aside")
        self._manager.reload()

    def read_meta(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def check_config(self, config: config_lib.Config) -> None:
        """Raises ConfigError naming the first field where `config` differs from the config saved with
        the newest checkpoint whose metadata reads (a damaged one is left to restore_latest)."""
        for step in reversed(self.all_steps()):
            try:
                saved = self.read_meta(step).get("config")
            except Exception:
                continue
            if not saved:
                return
            mismatch = config_mismatch(saved, config)
            if mismatch:
                key, was, now = mismatch
                raise config_lib.ConfigError(
                    f"{key}: the checkpoint of update {step} in {self.directory} was made with {key}={was!r}, "
                    f"this run has {now!r}; resume with the config the checkpoint was made with, or start a "
                    "new run directory"
                )
            return

    def close(self) -> None:
        self._manager.close()
