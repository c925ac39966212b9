"""The `podray` command re-executes itself once with glibc's malloc on transparent huge pages and
at most 2 arenas."""

import os
import subprocess
import sys

import pytest

from podray import hugepages

linux_glibc = pytest.mark.skipif(
    hugepages.environment({}) is None, reason="glibc tunables exist only on Linux with glibc"
)


@linux_glibc
def test_environment_adds_the_tunables_and_respects_a_setting():
    both = "glibc.malloc.hugetlb=1:glibc.malloc.arena_max=2"
    assert hugepages.environment({})["GLIBC_TUNABLES"] == both
    appended = hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=8", "HOME": "/x"})
    assert appended["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=8:glibc.malloc.hugetlb=1"
    assert appended["HOME"] == "/x"
    # The opt-out of huge pages keeps it, and still caps the arenas.
    assert hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})["GLIBC_TUNABLES"] == (
        "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"
    )
    # MALLOC_ARENA_MAX is glibc's other spelling of arena_max: a user's value wins.
    assert hugepages.environment({"MALLOC_ARENA_MAX": "16"})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert hugepages.environment({"GLIBC_TUNABLES": both}) is None  # nothing to add
    assert hugepages.environment(appended) is None  # already re-executed: never twice


@linux_glibc
def test_reexecute_runs_the_same_command_once_with_the_tunable():
    code = (
        "import os; print('run', os.environ.get('GLIBC_TUNABLES'), flush=True); "
        "from podray import hugepages; hugepages.reexecute(); print('done')"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PODRAY_REEXECUTED", "MALLOC_ARENA_MAX")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["run None", "run glibc.malloc.hugetlb=1:glibc.malloc.arena_max=2", "done"]


def test_the_console_script_is_the_reexecuting_entry():
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "podray"]
    assert script.value == "podray.cli:entry"
