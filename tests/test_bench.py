"""`podray bench anakin --quick` produces the rows the docs and scripts read (values are not asserted
as speeds: speed is a benchmark's job, not a test's)."""

import json
import subprocess
import sys


def test_bench_anakin_quick_writes_rows(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "podray.cli", "bench", "anakin", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [r["setting"] for r in rows] == ["1x4", "2x8"]
    for row in rows:
        assert row["steps_per_s"] > 0 and row["ceiling_steps_per_s"] > 0
        assert row["ceiling_steps_per_s"] > row["steps_per_s"]  # the env alone is faster than env + learning
