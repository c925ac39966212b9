"""`podray eval` (scores, eval.json, videos) and `podray plot` on short Anakin and Sebulba runs."""

import json
import shutil

import numpy as np
import pytest

from podray import cli
from podray import config as config_lib
from podray.training import train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A short Anakin run and a short Sebulba run (both CartPole-v1), each with a final checkpoint."""
    root = tmp_path_factory.mktemp("runs")
    quiet = ["run.tensorboard=false", "run.progress=false"]
    anakin = config_lib.load("anakin_cartpole", ["total_env_steps=4096", "anakin.updates_per_call=1", *quiet])
    train(anakin, run_dir=root / "anakin")
    sebulba = config_lib.load(
        "sebulba_cartpole",
        [
            "total_env_steps=3072",
            "sebulba.log_every=1",
            "sebulba.threads_per_actor_device=1",
            "run.cpu_devices=0",
            *quiet,
        ],
    )
    train(sebulba, run_dir=root / "sebulba")
    return root


def _read_video(path):
    import imageio.v2 as imageio

    reader = imageio.get_reader(path)
    try:
        return [np.asarray(frame) for frame in reader]
    finally:
        reader.close()


def test_eval_anakin_run_writes_scores_and_a_gif(runs, capsys):
    video = runs / "anakin.gif"
    assert cli.main(["eval", str(runs / "anakin"), "--episodes", "3", "--greedy", "--video", str(video)]) == 0
    result = json.loads((runs / "anakin" / "eval.json").read_text())
    assert result["episodes"] == 3 and len(result["returns"]) == 3 and result["policy"] == "greedy"
    # CartPole pays 1 a step: every return is its episode's length
    assert result["returns"] == [float(n) for n in result["episode_lengths"]]
    assert result["min"] <= result["mean"] <= result["max"] and result["checkpoint_step"] == 2
    frames = _read_video(video)
    assert 1 < len(frames) <= result["video_frames"]  # Pillow merges identical consecutive gif frames
    assert frames[0].shape[:2] == (400, 600)  # gymnasium's CartPole renderer
    assert "eval: CartPole-v1 checkpoint 2" in capsys.readouterr().out


def test_eval_sebulba_run_writes_scores_and_an_mp4(runs):
    video = runs / "sebulba.mp4"
    assert cli.main(["eval", str(runs / "sebulba"), "--episodes", "4", "--video", str(video)]) == 0
    result = json.loads((runs / "sebulba" / "eval.json").read_text())
    assert result["episodes"] == 4 and len(result["returns"]) == 4 and result["policy"] == "sample"
    assert all(r >= 1 for r in result["returns"])
    frames = _read_video(video)
    assert abs(len(frames) - result["video_frames"]) <= 1 and len(frames) > 1
    assert frames[0].shape == (400, 600, 3)  # envpool's CartPole renderer


def test_atari_recorder_shows_the_real_game_in_colour():
    """The eval environment's renderer gives Pong's colour screen at 210x160, the frame the agent sees
    (84x84 grey) is that screen reduced, and eval's envs play whole games with real scores."""
    from PIL import Image

    from podray.envs import host_envs
    from podray.evaluation import _eval_options

    config = config_lib.load("sebulba_pong", check=False)
    options = _eval_options(config, render=True)
    assert not options.episodic_life and not options.reward_clip
    env = host_envs.HostEnv("Pong-v5", 1, seed=0, options=options)
    try:
        env.reset()
        for _ in range(60):
            step = env.step(np.array([2]))
        frame = env.render(0)
    finally:
        env.close()
    assert frame.shape == (210, 160, 3) and frame.dtype == np.uint8
    assert len(np.unique(frame.reshape(-1, 3), axis=0)) >= 3  # colours, not grey
    grey = np.asarray(Image.fromarray(frame).convert("L").resize((84, 84), Image.BOX), np.float64)
    seen = step.obs[0, -1].astype(np.float64)  # the newest frame of the agent's stack
    assert np.corrcoef(grey.ravel(), seen.ravel())[0, 1] > 0.9


def test_eval_bad_requests_get_one_line_before_anything_compiles(runs, tmp_path, capsys, compile_counter):
    empty = tmp_path / "no_checkpoints"
    empty.mkdir()
    shutil.copy(runs / "anakin" / "config.yaml", empty / "config.yaml")
    cases = [
        ([str(empty)], "no checkpoint in"),
        ([str(runs / "anakin"), "--step", "7"], "eval --step 7: no such checkpoint in"),
        ([str(runs / "anakin"), "--video", "out.avi"], "must end in .mp4 or .gif"),
        ([str(tmp_path / "nowhere")], "no config.yaml there"),
        ([str(runs / "anakin"), "--episodes", "0"], "eval --episodes 0: must be >= 1"),
    ]
    for args, message in cases:
        assert cli.main(["eval", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert "the steps kept are [2]" in cli_error(["eval", str(runs / "anakin"), "--step", "7"], capsys)
    # An environment that lacks the video writers (installed before they were dependencies).
    import importlib.util

    real = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else real(name, *a))
        err = cli_error(["eval", str(runs / "anakin"), "--video", str(tmp_path / "v.mp4")], capsys).strip()
    assert "eval --video" in err and "imageio_ffmpeg is not installed" in err and len(err.splitlines()) == 1, err
    assert compile_counter == []


def cli_error(argv, capsys) -> str:
    assert cli.main(argv) == 2
    return capsys.readouterr().err


def test_plot_overlays_two_runs(runs, capsys):
    from PIL import Image

    out = runs / "curves.png"
    assert cli.main(["plot", str(runs / "anakin"), str(runs / "sebulba"), "--out", str(out), "--names", "a,s"]) == 0
    assert "2 runs: a, s" in capsys.readouterr().out
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1600, 450)


def test_plot_empty_or_missing_metrics_get_one_line(runs, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    cases = [
        ([str(empty)], "no metrics rows"),
        ([str(tmp_path / "missing")], "no such directory"),
        ([str(tmp_path)], "no metrics.jsonl there"),
        ([str(runs / "anakin"), "--names", "a,b"], "2 names for 1 run directories"),
    ]
    for args, message in cases:
        assert cli.main(["plot", *args, "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert "write a .png file" in cli_error(["plot", str(runs / "anakin"), "--out", "x.jpg"], capsys)
    assert not (tmp_path / "x.png").exists()
