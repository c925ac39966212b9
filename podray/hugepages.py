"""glibc's malloc on transparent huge pages for the `podray` command, set before the process starts.

XLA:CPU allocates a program's temporary buffers at every execution and frees them after it. The
IMPALA-ResNet learner step's ~330 MB came back from the kernel as ~82,000 freshly zeroed 4 KiB pages
each step: ~150 ms of system time in a ~390 ms step on 2 cores. With malloc's large blocks on
transparent huge pages (the tunable glibc.malloc.hugetlb=1, glibc >= 2.35; the kernel's THP mode
'madvise' or 'always') the same step takes ~2,000 faults and ~25% less time (docs/benchmarks.md).
glibc reads its tunables only when a process starts, so `podray` re-executes itself once
with GLIBC_TUNABLES extended; workers of a local Ray inherit it. A GLIBC_TUNABLES that already sets
glibc.malloc.hugetlb is left alone (glibc.malloc.hugetlb=0 opts out), and so is any platform without
glibc.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping

TUNABLE = "glibc.malloc.hugetlb"
_MARK = "PODRAY_REEXECUTED"  # set in the re-executed process: never a second time


def environment(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` with the tunable added to GLIBC_TUNABLES, or None where nothing is to change."""
    if env.get(_MARK) or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    current = env.get("GLIBC_TUNABLES", "")
    if any(item.split("=")[0] == TUNABLE for item in current.split(":")):
        return None
    new = dict(env)
    new["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"
    new[_MARK] = "1"
    return new


def reexecute() -> None:
    """Replaces this process by the same command line with the tunable set (returns where nothing is
    to change, or where the exec fails: the run goes on without huge pages)."""
    env = environment(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return
