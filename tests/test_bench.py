"""`podray bench anakin --quick` produces the rows the docs and scripts read (values are not asserted
as speeds: speed is a benchmark's job, not a test's)."""

import json
import subprocess
import sys

import pytest


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
    assert row.agent == "impala" and row.simulations == 0 and row.gradient_steps == 1.0


def test_bench_sebulba_measures_one_small_muzero_setting():
    """The MuZero path end to end on a tiny network: the search is the inference component, and the
    learner component is measured with the replay past min_size (its updates take gradient steps)."""
    import math

    from podray import host

    host.configure_cpu_devices_if_not_started(4)
    from podray.bench import sebulba_bench

    tiny = ("network.width=32", "replay.capacity=256", "replay.min_size=72", "replay.batch_size=8")
    row = sebulba_bench.measure(
        "nature_cnn", 4, 1, "1+1", agent="muzero", simulations=2, rollout_length=6, learner_batch=4,
        min_seconds=0.5, overrides=tiny,
    )  # fmt: skip
    assert (row.agent, row.simulations, row.actor_batch_size, row.learner_batch_size) == ("muzero", 2, 4, 4)
    assert row.setting.startswith("muzero sims=2 nature_cnn B=4 L=4")
    rates = ("env_steps_per_s", "inference_steps_per_s", "learner_steps_per_s", "ceiling_steps_per_s")
    rates += ("measured_steps_per_s", "frames_per_s", "ceiling_frames_per_s", "inference_frames_per_s", "efficiency")
    for name in rates:
        value = getattr(row, name)
        assert math.isfinite(value) and value > 0, (name, value)
    # the replay fills (72 transitions) in 3 updates of 4 x 6 before the timed ones, which take
    # round(2 x 24 / 8) = 6 gradient steps each (the preset's replay ratio is 2)
    assert row.gradient_steps == 6.0
    assert row.learner_updates >= 3 and math.isfinite(row.policy_lag)
    bound = 1 / (1 / row.env_steps_per_s + 1 / row.inference_steps_per_s + 1 / row.learner_steps_per_s)
    assert abs(row.ceiling_steps_per_s - bound) < 1e-9 * bound
    assert abs(row.efficiency - row.measured_steps_per_s / bound) < 1e-9


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


def _row(batch, frames, threads=1, **rates):
    from podray.bench import sebulba_bench

    steps = frames / 4
    values = dict(env_steps_per_s=7000.0, inference_steps_per_s=10000.0, learner_steps_per_s=4000.0)
    values.update(rates)
    return sebulba_bench.Row(
        setting=f"nature_cnn B={batch} L=32 threads={threads} split=1+1", agent="impala", simulations=0,
        torso="nature_cnn",
        actor_batch_size=batch, learner_batch_size=32, threads_per_actor_device=threads, split="1+1",
        ceiling_steps_per_s=0.0, measured_steps_per_s=steps, frames_per_s=frames, ceiling_frames_per_s=0.0,
        env_frames_per_s=0.0, inference_frames_per_s=0.0, learner_frames_per_s=0.0, efficiency=0.0,
        policy_lag=1.0, learner_updates=10, gradient_steps=1.0, measure_s=20.0, load_avg_1m=2.0, **values,
    )  # fmt: skip


def test_repeated_setting_keeps_medians_and_every_run():
    from podray.bench import sebulba_bench

    runs = [_row(32, 6000.0), _row(32, 9000.0, env_steps_per_s=5000.0), _row(32, 7000.0, learner_steps_per_s=3000.0)]
    row = sebulba_bench._median_row(runs)
    assert row.frames_per_s == 7000.0 and row.measured_steps_per_s == 1750.0
    assert row.frames_per_s_runs == [6000.0, 9000.0, 7000.0] and row.repeats == 3
    assert (row.env_steps_per_s, row.learner_steps_per_s) == (7000.0, 4000.0)  # medians, each on its own
    bound = 1 / (1 / 7000 + 1 / 10000 + 1 / 4000)
    assert abs(row.ceiling_steps_per_s - bound) < 1e-9 and abs(row.ceiling_frames_per_s - 4 * bound) < 1e-9
    assert abs(row.efficiency - 1750.0 / bound) < 1e-12 and row.learner_updates == 30


def test_rise_compares_each_line_at_its_largest_and_smallest_actor_batch():
    from podray.bench import sebulba_bench

    rows = [_row(128, 7800.0), _row(32, 6000.0), _row(64, 7000.0)]
    rows += [_row(32, 8000.0, threads=2), _row(128, 8000.0, threads=2)]
    assert sebulba_bench.rise(rows) == [
        ("nature_cnn threads=1 split=1+1 B=32->128", 1.3),
        ("nature_cnn threads=2 split=1+1 B=32->128", 1.0),
    ]


def test_bench_sebulba_flags_are_checked_before_anything_runs(capsys):
    from podray import cli

    for argv, message in (
        (["--split", "3+1"], "--split 3+1 is not one of 1+1, 1+2, 2+2"),
        (["--torso", "mlp"], "--torso mlp is not one of nature_cnn, impala_resnet"),
        (["--batch", "32,x"], "--batch '32,x' is not a comma-separated list of integers"),
        (["--threads", "0"], "--threads takes positive integers"),
        (["--repeats", "0"], "--repeats 0 must be >= 1"),
        (["--agent", "ppo"], "--agent ppo is not one of impala, muzero"),
        (["--simulations", "8"], "--simulations belongs to --agent muzero"),
        (["--agent", "muzero", "--simulations", "0,8"], "--simulations takes positive integers"),
        (["--agent", "muzero", "--simulations", "8,x"], "--simulations '8,x' is not a comma-separated list"),
        (["--agent", "muzero", "--batch", "3"], "sebulba.learner_batch_size: 8 must be a multiple or a divisor"),
    ):
        assert cli.main(["bench", "sebulba", *argv]) == 2
        assert message in capsys.readouterr().err
    assert cli.main(["bench", "anakin", "--agent", "muzero"]) == 2
    assert "--agent/--simulations/--torso/--batch/--threads/--split belong to" in capsys.readouterr().err
    assert cli.main(["bench", "anakin", "--repeats", "3"]) == 2
    assert "--repeats belongs to 'podray bench sebulba'" in capsys.readouterr().err
    assert cli.main(["bench", "anakin", "--peer", "x"]) == 2
    assert "--peer, --only and --envs belong to 'podray bench purejaxrl'" in capsys.readouterr().err
    assert cli.main(["bench", "anakin", "--set", "seed=1"]) == 2
    assert "--runs, --keep and --set belong to 'podray bench soak'" in capsys.readouterr().err
    for argv, message in (
        (["--runs", "pong"], "--runs 'pong' names pong; choose from sebulba_pong,anakin_minatar"),
        (["--set", "sebulba.queue_size=0"], "sebulba.queue_size"),
        (["--minutes", "0"], "--minutes 0.0 and --interval 60.0 must be > 0"),
    ):
        assert cli.main(["bench", "soak", *argv]) == 2
        assert message in capsys.readouterr().err


def test_ray_dashboard_gauges_carry_frames_and_env_steps_apart(monkeypatch):
    """podray_frames_per_s carries frames (Atari: 4 per env step), podray_env_steps_per_s env steps;
    a JAX environment's run, which reports no frames, shows its env steps as frames."""
    import ray.util.metrics

    from podray.cluster import metrics

    set_values: dict[str, float] = {}

    class FakeGauge:
        def __init__(self, name, description, tag_keys):
            self.name = name

        def set(self, value, tags):
            assert set(tags) == set(metrics.TAG_KEYS)
            set_values[self.name] = value

    monkeypatch.setattr(ray.util.metrics, "Gauge", FakeGauge)
    sink = metrics.RayMetricsSink({"run": "r", "host": "0"})
    sink.write(10, {"steps_per_s": 100.0, "frames_per_s": 400.0, "queue_occupancy": 1.5, "updates": 10})
    assert set_values["podray_env_steps_per_s"] == 100.0
    assert set_values["podray_frames_per_s"] == 400.0
    assert set_values["podray_queue_occupancy"] == 1.5
    assert "podray_policy_lag" not in set_values  # Sebulba reports its own
    set_values.clear()
    sink.write(20, {"steps_per_s": 50.0, "updates": 20})
    assert set_values["podray_frames_per_s"] == 50.0
    assert set_values["podray_policy_lag"] == 0.0


def test_purejaxrl_peer_is_edited_at_run_time_not_vendored(tmp_path):
    """The comparison reads the peer from a path and writes an edited copy elsewhere: gymnax 1.x's
    six-value step unpacked in FlattenObservationWrapper, brax/navix imports made optional."""
    from podray.bench import purejaxrl_compare

    peer = tmp_path / "peer" / "purejaxrl"
    peer.mkdir(parents=True)
    (peer / "ppo.py").write_text("from wrappers import LogWrapper\n")
    wrappers = (
        "import jax.numpy as jnp\nfrom brax import envs\nimport navix as nx\n"
        "class FlattenObservationWrapper:\n    def step(self, key, state, action, params=None):\n"
        + purejaxrl_compare._STEP_5
        + "        return obs, state, reward, done, info\n"
    )
    (peer / "wrappers.py").write_text(wrappers)
    out = purejaxrl_compare.prepare_peer(str(tmp_path / "peer"))
    edited = (out / "wrappers.py").read_text()
    assert "terminated, truncated, info = self._env.step" in edited
    assert "done = jnp.logical_or(terminated, truncated)" in edited
    assert "except ImportError:\n    nx = None" in edited and "except ImportError:\n    envs = None" in edited
    assert (peer / "wrappers.py").read_text() == wrappers  # the peer itself is left as it is
    (peer / "wrappers.py").write_text("class FlattenObservationWrapper:\n    pass\n")
    with pytest.raises(SystemExit, match="not the one this script edits"):
        purejaxrl_compare.prepare_peer(str(tmp_path / "peer"))
