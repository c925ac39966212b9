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


def test_bench_sebulba_measures_one_small_setting():
    """One tiny setting end to end (values are not asserted: speed is for benchmarks, not tests)."""
    from podray import host

    host.configure_cpu_devices_if_not_started(4)
    from podray.bench import sebulba_bench

    row = sebulba_bench.measure("nature_cnn", 4, 1, "1+1", rollout_length=5, min_seconds=0.5, learner_batch=2)
    assert row.actor_batch_size == 4 and row.learner_batch_size == 2 and "L=2" in row.setting
    for name in ("frames_per_s", "ceiling_frames_per_s", "env_frames_per_s", "inference_frames_per_s"):
        assert getattr(row, name) > 0, name
    assert row.learner_updates >= 3
    assert abs(row.efficiency - row.frames_per_s / row.ceiling_frames_per_s) < 1e-9


def test_learning_curve_plot_titles_itself_from_the_run_config(tmp_path, monkeypatch):
    from podray.bench import sebulba_bench

    rows = [{"env_steps": 1000 * i, "mean_return": -21.0 + i / 10} for i in range(1, 30)]
    rows.insert(3, {"env_steps": 3500, "mean_return": None})  # reports without a finished episode
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("agent: {name: ppo}\nenv: {name: Pong-v5}\n")
    titles = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda ax, t, *a, **k: titles.append(t) or original(ax, t))
    sebulba_bench.plot_learning_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert titles == ["Sebulba PPO on Pong-v5"]
