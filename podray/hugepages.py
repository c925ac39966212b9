"""glibc's malloc tunables for the `podray` command (huge pages, few arenas), set before the process starts.

XLA:CPU allocates a program's temporary buffers at every execution and frees them after it. The
IMPALA-ResNet learner step's ~330 MB came back from the kernel as ~82,000 freshly zeroed 4 KiB pages
each step: ~150 ms of system time in a ~390 ms step on 2 cores. With malloc's large blocks on
transparent huge pages (the tunable glibc.malloc.hugetlb=1, glibc >= 2.35; the kernel's THP mode
'madvise' or 'always') the same step takes ~2,000 faults and ~25% less time (docs/benchmarks.md).

The same re-execution caps malloc's arenas at 2 (glibc.malloc.arena_max; glibc's default is 8 per
core). Sebulba's threads (actors, envpool, XLA's compute threads) allocate and free from one another's
arenas, and with one arena per thread a Sebulba Pong run held ~1 GB free in them beside ~650-850 MB in
use (mallinfo2); the free share drifted with fragmentation, so the resident size crept by 1.5-2.5%
an hour while the memory in use did not (docs/benchmarks.md, "Soak"). With 2 arenas the same run
holds ~350 MB free. On hosts whose CPUs run many allocating threads, raise it with
GLIBC_TUNABLES=glibc.malloc.arena_max=N or MALLOC_ARENA_MAX=N (docs/operations.md).

glibc reads its tunables only when a process starts, so `podray` re-executes itself once
with GLIBC_TUNABLES extended; workers of a local Ray inherit it. A tunable the environment already
sets is left alone (glibc.malloc.hugetlb=0 opts out of huge pages), and so is any platform without
glibc.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping

TUNABLES = {"glibc.malloc.hugetlb": "1", "glibc.malloc.arena_max": "2"}
# Environment variables that set the same tunable (glibc reads them too): a user's setting wins.
_ALIASES = {"glibc.malloc.arena_max": "MALLOC_ARENA_MAX"}
_MARK = "PODRAY_REEXECUTED"  # set in the re-executed process: never a second time


def environment(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` with podray's tunables added to GLIBC_TUNABLES (those it does not set already), or None
    where nothing is to change."""
    if env.get(_MARK) or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    current = env.get("GLIBC_TUNABLES", "")
    present = {item.split("=")[0] for item in current.split(":") if item}
    added = [
        f"{name}={value}"
        for name, value in TUNABLES.items()
        if name not in present and not env.get(_ALIASES.get(name, ""))
    ]
    if not added:
        return None
    new = dict(env)
    new["GLIBC_TUNABLES"] = ":".join(([current] if current else []) + added)
    new[_MARK] = "1"
    return new


def reexecute() -> None:
    """Replaces this process by the same command line with the tunables set (returns where nothing is
    to change, or where the exec fails: the run goes on with glibc's defaults)."""
    env = environment(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return
