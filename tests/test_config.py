"""Config: presets, overrides, and every kind of bad input rejected before anything compiles."""

import ast
import pathlib
import subprocess
import sys

import pytest

from podray import config as config_lib
from podray import validation
from podray.config import ConfigError


def test_presets_load_and_validate():
    for name in config_lib.preset_names():
        config = config_lib.load(name)
        validation.validate(config)
        assert config.name == name


def test_override_types_and_scientific_notation():
    config = config_lib.load(None, ["agent.learning_rate=3e-4", "env.num_envs=8", "run.devices=[0, 1]"])
    assert config.agent.learning_rate == pytest.approx(3e-4)
    assert config.env.num_envs == 8
    assert config.run.devices == [0, 1]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["agent.nme=3"], "agent.nme"),
        (["bogus.x=1"], "bogus"),
        (["env.name=NotAnEnv-v0"], "env.name"),
        (["env.name=Pendulum-v1"], "env.name"),  # continuous actions
        (["agent.learning_rate=abc"], "agent.learning_rate"),
        (["agent.epochs=2.5"], "agent.epochs"),
        (["anakin.rollout_length=0"], "anakin.rollout_length"),
        (["env.num_envs=-4"], "env.num_envs"),
        (["network.depth=0"], "network.depth"),
        (["network.value_head_scale=-1"], "network.value_head_scale"),
        (["network.chunk_rows=-2"], "network.chunk_rows"),
        (["agent.discount=1.5"], "agent.discount"),
        (["agent.name=dqn"], "agent.name"),
        (["network.torso=nature_cnn"], "network.torso"),  # CartPole has no images
        (["run.checkpoint_every=7"], "run.checkpoint_every"),
        (["env.num_envs=6", "run.cpu_devices=4"], "env.num_envs"),
        (["agent.num_minibatches=3"], "agent.num_minibatches"),
        (["agent.epochs=-1"], "agent.epochs"),
        (["agent.name=impala", "agent.surrogate_clip=1.5"], "agent.surrogate_clip"),
        (["agent.surrogate_clip=0.1"], "agent.surrogate_clip"),  # ppo clips with clip_epsilon
        (["run.devices=[0, 0]"], "run.devices"),
    ],
)
def test_bad_config_names_the_field_without_compiling(overrides, field, compile_counter):
    with pytest.raises(ConfigError) as info:
        validation.validate(config_lib.load(None, overrides, check=False), num_devices=4)
    assert str(info.value).startswith(field), info.value
    assert compile_counter == []


def test_impala_minibatches_split_environments_not_samples(compile_counter):
    """IMPALA's minibatches are whole sequences: their count must divide the environments per device."""
    ok = config_lib.load("sebulba_pong", ["agent.epochs=1", "agent.num_minibatches=4", "sebulba.learner_batch_size=16"])
    assert config_lib.sgd_schedule(ok.agent) == (1, 4)
    # 16 environments x 64 steps: 1,024 samples split into 32, 16 environments do not
    with pytest.raises(ConfigError, match="^agent.num_minibatches: 32 does not divide the per-device environments"):
        config_lib.load("sebulba_pong", ["agent.num_minibatches=32"])
    # Anakin: 4 environments per device x 128 steps
    with pytest.raises(ConfigError, match="^agent.num_minibatches: 8 does not divide the per-device environments"):
        validation.validate(config_lib.load(None, ["agent.name=impala", "agent.num_minibatches=8"]), num_devices=4)
    assert compile_counter == []


def test_batch_not_divisible_over_devices_is_rejected():
    config = config_lib.load(None, ["env.num_envs=6"])
    with pytest.raises(ConfigError, match="env.num_envs: 6 environments do not divide over 4 devices"):
        validation.validate(config, num_devices=4)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.field=value"):
        config_lib.parse_override("agent.learning_rate")


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="anakin_cartpole"):
        config_lib.load("no_such_preset")


def test_cli_rejects_bad_config_quickly():
    proc = subprocess.run(
        [sys.executable, "-m", "podray.cli", "train", "--set", "env.name=Nope-v0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "podray: error: env.name: 'Nope-v0' is not a JAX (gymnax) environment" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_set_takes_several_overrides_after_one_flag():
    from podray.cli import build_parser

    args = build_parser().parse_args(
        ["train", "sebulba_pong", "--set", "agent.epochs=2", "agent.num_minibatches=4", "--set", "run.seed=3"]
    )
    assert args.preset == "sebulba_pong"
    assert args.set == ["agent.epochs=2", "agent.num_minibatches=4", "run.seed=3"]


def test_config_is_a_leaf_module():
    """podray.config imports nothing else of podray (at module level or inside a function): every layer
    imports it, it imports none of them."""
    tree = ast.parse(pathlib.Path(config_lib.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert [m for m in imported if m and m.split(".")[0] == "podray"] == []


def test_field_checks_need_no_environment_registry(compile_counter):
    """config.validate checks fields alone; the registry check is podray.envs' (run by validation)."""
    config = config_lib.load(None, ["env.name=NotAnEnv-v0"])  # the fields are fine
    with pytest.raises(ConfigError, match="^env.name: 'NotAnEnv-v0' is not a JAX"):
        validation.validate(config)
    assert compile_counter == []


def test_bare_on_off_yes_no_are_strings_and_true_false_booleans():
    """YAML 1.2's booleans: `--set run.compile_cache=off` is the documented 'off', not False."""
    config = config_lib.load(None, ["run.compile_cache=off", "run.tensorboard=false"])
    assert config.run.compile_cache == "off" and config.run.tensorboard is False
    assert config_lib.yaml_load("a: off\nb: yes\nc: True\nd: FALSE\ne: 'on'") == {
        "a": "off",
        "b": "yes",
        "c": True,
        "d": False,
        "e": "on",
    }
    with pytest.raises(config_lib.ConfigError, match="run.tensorboard"):
        config_lib.load(None, ["run.tensorboard=yes"])
