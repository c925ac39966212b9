"""Graceful stop: SIGTERM or SIGINT asks a run to save a checkpoint at the next update boundary and end.

What happens on a signal (a preempted TPU VM or spot instance, Ray stopping a node, Ctrl-C):
  1. The first SIGTERM/SIGINT only sets a flag (`StopRequest`); nothing is interrupted.
  2. The architecture looks at the flag at every call boundary (Anakin) or learner step (Sebulba). In a
     multi-host program every host must stop at the same boundary, because a checkpoint save is a
     collective: `StopAgreement` reduces the hosts' flags with a max over the global mesh, dispatched
     after each call and read one call later, so every host reads the same value at the same call.
  3. The program saves a checkpoint there, writes the stop to run_log.jsonl and raises `Preempted`;
     the command prints one line (where the checkpoint is, how to resume) and exits 143 (SIGTERM) or
     130 (SIGINT).
  4. A second signal (more than SAME_STOP_S after the first) stops at once (`StopNow`), keeping the
     checkpoints already written.

Why not jax.experimental.multihost_utils.reached_preemption_sync_point: it works on CPU with
jax.distributed on loopback (both hosts agreed on a step in our check), but it hears only SIGTERM,
through a native handler that jax.distributed.initialize installs, so SIGINT and a second signal
would take other paths and the command could not say what happened. One small reduction per call
boundary gives the same agreement for both signals (its cost: docs/operations.md).

Python runs signal handlers in the main thread between bytecodes, so a signal arriving during a
compilation is acted on when it ends. Handlers are installed only from the main thread (a Ray Tune
function trial runs in another thread and is stopped by Tune itself).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import threading
import time
from typing import Any, Iterator

EXIT_STATUS = {signal.SIGTERM: 143, signal.SIGINT: 130}
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped at an update boundary after a signal, with a checkpoint saved there.

    Attributes:
      signal_name: "SIGTERM" or "SIGINT".
      updates: the update count of the checkpoint (None if the run had no checkpointer).
      env_steps: env steps done at that update.
      checkpoint_dir: the directory holding the checkpoint.
      run_dir: the run directory (what --resume takes).
      signal_time: when the signal arrived (time.time(); default: STOP's record of it).
    """

    def __init__(
        self,
        signal_name: str,
        updates: int | None,
        env_steps: int,
        checkpoint_dir: str = "",
        run_dir: str = "",
        signal_time: float | None = None,
    ):
        self.signal_name = signal_name
        self.updates = updates
        self.env_steps = env_steps
        self.checkpoint_dir = checkpoint_dir
        self.run_dir = run_dir
        self.signal_time = STOP.time if signal_time is None else signal_time
        super().__init__(signal_name, updates, env_steps, checkpoint_dir, run_dir, self.signal_time)

    @property
    def exit_status(self) -> int:
        return 130 if self.signal_name == "SIGINT" else 143

    def __str__(self) -> str:
        if self.updates is None:
            return f"stopped by {self.signal_name} at {self.env_steps:,d} env steps, before any checkpoint was saved"
        return (
            f"stopped by {self.signal_name} at update {self.updates} ({self.env_steps:,d} env steps); checkpoint "
            f"saved in {self.checkpoint_dir}; continue with: podray train --resume {self.run_dir}"
        )


class StopNow(BaseException):
    """A second signal: stop at once (the checkpoints already written are kept). A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way out swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signum)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signum, 128 + self.signum)

    def __str__(self) -> str:
        return f"stopped at once by a second {self.signal_name}; the checkpoints already written are kept"


class StopRequest:
    """The process-wide stop flag that the signal handlers set (and tests may set directly)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.signum: int | None = None
        self.time: float | None = None

    def request(self, signum: int) -> None:
        with self._lock:
            if self.signum is None:
                self.signum, self.time = signum, time.time()

    def clear(self) -> None:
        with self._lock:
            self.signum, self.time = None, None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


STOP = StopRequest()
_installed = 0  # nesting depth of handle_signals() in this process
_install_lock = threading.Lock()


SAME_STOP_S = 1.0
"""A signal this soon after the first is the same stop delivered twice (Ctrl-C reaches every process of
the terminal's group, host workers included, and the driver passes it on too), not a second one."""


def _handler(signum: int, frame: Any) -> None:
    if STOP.requested:
        if time.time() - (STOP.time or 0.0) < SAME_STOP_S:
            return
        raise StopNow(signum)
    STOP.request(signum)


@contextlib.contextmanager
def handle_signals() -> Iterator[StopRequest]:
    """Within the block, SIGTERM and SIGINT set STOP (a second one raises StopNow); the previous
    handlers come back at the end. Nested blocks share the outer one's handlers. Outside the main
    thread it installs nothing and yields STOP, which then only a caller sets."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        yield STOP
        return
    with _install_lock:
        outer = _installed == 0
        _installed += 1
    previous = {}
    if outer:
        STOP.clear()
        # Replaces whatever handled these signals before (Ray's absl failure-signal handler, which
        # prints a native stack dump on SIGTERM; the SIGTERM notifier of jax.distributed).
        previous = {s: signal.signal(s, _handler) for s in _SIGNALS}
    try:
        yield STOP
    finally:
        with _install_lock:
            _installed -= 1
        if outer:
            for s, h in previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            STOP.clear()  # a later run in this process (tests, notebooks) starts without a stop


class StopAgreement:
    """Whether to stop after the current call, the same answer on every host of the program.

    With one process the local flag is the answer. With several, each host posts its flag after every
    call as a [local devices] array; a jitted max over the whole mesh combines them and is read one
    call later (when the host reads that call's metrics anyway), so it adds a tiny collective per call
    and no wait. Every host posts and reads at the same calls, so all stop at the same one.

    Args:
      mesh: the program's mesh (it may span hosts).
      stop: the flag to read (default: the process's STOP).
    """

    def __init__(self, mesh, stop: StopRequest | None = None):
        import jax

        self.stop = stop or STOP
        self.multi_host = len({d.process_index for d in mesh.devices.flat}) > 1
        self._pending = None
        if self.multi_host:
            import jax.numpy as jnp
            import numpy as np
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            self._np = np
            flat = jax.sharding.Mesh(np.asarray(list(mesh.devices.flat), dtype=object), ("podray_stop",))
            self._sharding = NamedSharding(flat, P("podray_stop"))
            self._local = len([d for d in mesh.devices.flat if d.process_index == jax.process_index()])
            self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(flat, P()))

    def should_stop(self) -> bool:
        """Call once after dispatching each call; True: every host stops after this call."""
        if not self.multi_host:
            return self.stop.requested
        import jax

        agreed = False
        if self._pending is not None:
            agreed = bool(self._np.asarray(self._pending.addressable_shards[0].data))
        flags = self._np.full((self._local,), self.stop.requested, dtype=self._np.int32)
        self._pending = self._reduce(jax.make_array_from_process_local_data(self._sharding, flags))
        return agreed


def log_event(run_dir: str | pathlib.Path, event: dict) -> None:
    """Appends one event to run_dir/run_log.jsonl (the run's own log of starts, stops and restarts)."""
    with (pathlib.Path(run_dir) / "run_log.jsonl").open("a") as f:
        f.write(json.dumps({"time": time.time(), **event}) + "\n")
