"""Property-based tests (hypothesis) of every way input reaches podray: config fields, `--set` strings,
YAML presets and Tune search spaces. Every input is either accepted or rejected with a ConfigError of
one line that names a field, never another exception; inputs built inside the documented domains are
never rejected. Nothing compiles: these only validate (2,100 generated inputs per run)."""

import dataclasses
import re
import typing

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from podray import config as config_lib
from podray import validation
from podray.config import ConfigError

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def _leaf_fields(cls=config_lib.Config, prefix: str = "") -> dict[str, typing.Any]:
    """Every leaf field of Config as dotted path -> annotated type."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_leaf_fields(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = tp
    return out


FIELDS = _leaf_fields()
SECTIONS = sorted({k.split(".")[0] for k in FIELDS if "." in k})
FIELD_NAME = re.compile(
    "|".join(re.escape(k) for k in sorted([*FIELDS, *SECTIONS], key=len, reverse=True)) + r"|\b[a-z_]+\.[a-z_]+"
)


def _load(preset: str | None = None, overrides: typing.Sequence[str] = ()) -> config_lib.Config:
    """What `podray train` does with its input before anything compiles: parse, then the whole check."""
    config = config_lib.load(preset, overrides)
    validation.validate(config)
    return config


def _accepted_or_named(build: typing.Callable[[], typing.Any], field: str | None = None):
    """Runs `build`; a rejection must be one ConfigError line that names a field (`field` if given)."""
    try:
        return build()
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message, f"a multi-line error: {message!r}"
        assert FIELD_NAME.search(message) or message.startswith("--set"), f"no field named in: {message!r}"
        if field is not None:
            section = field.split(".")[0]
            assert field in message or section in message or "--set" in message, (field, message)
        return None


# ---- --set strings ------------------------------------------------------------------------------------

yaml_scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
)
yaml_values = st.recursive(
    yaml_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=2),
    max_leaves=4,
)


def _render(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


@settings(max_examples=400, **SETTINGS)
@given(st.text(max_size=40))
@example("0\n0=")  # a line break in the field name once reached the unknown-key message
@example("agent.\tlearning_rate=1")
def test_any_set_string_is_accepted_or_rejected_in_one_line(text):
    _accepted_or_named(lambda: _load(None, [text]))


@settings(max_examples=500, **SETTINGS)
@given(
    st.sampled_from(sorted(FIELDS) + ["agent.nope", "network", "run.hosts.x", "zzz"]),
    st.one_of(yaml_values.map(_render), st.text(max_size=15)),
)
def test_set_of_any_value_on_any_field_names_the_field(field, raw):
    _accepted_or_named(lambda: _load(None, [f"{field}={raw}"]), field=field)


FLOAT_FIELDS = sorted(k for k, tp in FIELDS.items() if tp is float)


@settings(max_examples=100, **SETTINGS)
@given(st.sampled_from(FLOAT_FIELDS), st.sampled_from([".nan", ".inf", "-.inf", "nan", "inf", "1e400"]))
def test_non_finite_numbers_are_rejected_naming_the_field(field, raw):
    with pytest.raises(ConfigError, match=re.escape(field) + ": must be a finite number"):
        config_lib.load(None, [f"{field}={raw}"])


# ---- valid configs are accepted (through --set, through a YAML file) --------------------------------

JAX_ENVS = ["CartPole-v1", "Acrobot-v1", "MountainCar-v0"]


@st.composite
def valid_overrides(draw) -> dict[str, typing.Any]:
    agent = draw(st.sampled_from(config_lib.AGENTS))
    updates_per_call = draw(st.integers(1, 100))
    unit = st.floats(0.0, 1.0, allow_nan=False)
    positive = st.floats(1e-6, 100.0, allow_nan=False)
    seeds = draw(st.lists(st.integers(0, 2**31 - 1), unique=True, max_size=4))
    out = {
        "total_env_steps": draw(st.integers(1, 10**10)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "env.name": draw(st.sampled_from(JAX_ENVS)),
        "env.envs_per_device": draw(st.integers(1, 256)),
        "network.torso": "mlp",
        "network.depth": draw(st.integers(1, 8)),
        "network.width": draw(st.integers(1, 2048)),
        "network.activation": draw(st.sampled_from(config_lib.ACTIVATIONS)),
        "agent.name": agent,
        "agent.optimizer": draw(st.sampled_from(config_lib.OPTIMIZERS)),
        "agent.learning_rate": draw(st.floats(1e-8, 1.0)),
        "agent.anneal_lr": draw(st.booleans()),
        "agent.discount": draw(unit),
        "agent.gae_lambda": draw(unit),
        "agent.vtrace_lambda": draw(unit),
        "agent.clip_epsilon": draw(positive),
        "agent.clip_rho_threshold": draw(positive),
        "agent.clip_pg_rho_threshold": draw(positive),
        "agent.value_coef": draw(st.floats(0.0, 100.0)),
        "agent.entropy_coef": draw(st.floats(0.0, 100.0)),
        "agent.max_grad_norm": draw(st.floats(0.0, 100.0)),
        "agent.surrogate_clip": draw(st.floats(0.0, 0.99)) if agent == "impala" else 0.0,
        "anakin.rollout_length": draw(st.integers(1, 1024)),
        "anakin.updates_per_call": updates_per_call,
        "anakin.replicas": draw(st.integers(1, 16)),
        "run.checkpoint_every": updates_per_call * draw(st.integers(0, 20)),
        "run.keep_checkpoints": draw(st.integers(1, 20)),
        "run.max_restarts": draw(st.integers(0, 10)),
        "run.hosts": draw(st.integers(1, 8)),
        "run.seeds": seeds,
        "run.progress": draw(st.booleans()),
    }
    if agent == "muzero":  # its gradient steps come from the replay, not from epochs x minibatches
        out.update({"agent.epochs": 0, "agent.num_minibatches": 0})
    return out


@settings(max_examples=250, **SETTINGS)
@given(valid_overrides())
def test_valid_set_strings_are_never_rejected(overrides):
    config = _load(None, [f"{k}={_render(v)}" for k, v in overrides.items()])
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        got = getattr(getattr(config, section) if section else config, name)
        assert got == value or (isinstance(value, float) and got == pytest.approx(value)), key


@settings(max_examples=150, **SETTINGS)
@given(valid_overrides())
def test_valid_yaml_files_are_never_rejected(tmp_path_factory, overrides):
    path = tmp_path_factory.mktemp("yaml") / "config.yaml"
    path.write_text(yaml.safe_dump(config_lib.nest(overrides)))
    _load(str(path))


# ---- YAML presets, mutated ----------------------------------------------------------------------------


def _leaves(data: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in data.items():
        out.extend(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"])
    return out


PRESETS = {name: config_lib.load_yaml(name) for name in config_lib.preset_names()}


@settings(max_examples=350, **SETTINGS)
@given(st.data())
def test_mutated_presets_are_accepted_or_name_the_field(tmp_path_factory, data):
    name = data.draw(st.sampled_from(sorted(PRESETS)))
    preset = PRESETS[name]
    field = data.draw(st.sampled_from(_leaves(preset) + sorted(FIELDS)))
    value = data.draw(yaml_values)
    mutated = config_lib._merge(preset, config_lib.nest({field: value}))
    path = tmp_path_factory.mktemp("preset") / f"{name}.yaml"
    path.write_text(yaml.safe_dump(mutated))
    _accepted_or_named(lambda: _load(str(path)), field=field)


def test_a_yaml_key_with_a_line_break_is_named_on_one_line(tmp_path):
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump({"agent": {"learning\nrate": 1e-3}}))
    with pytest.raises(ConfigError, match=r"agent\.learning\\nrate.*unknown key") as e:
        _load(str(path))
    assert "\n" not in str(e.value)


# ---- Tune search spaces -------------------------------------------------------------------------------


def _study(search: dict) -> dict:
    return {
        "name": "fuzz",
        "base": "anakin_cartpole",
        "overrides": {"total_env_steps": 51200, "run.tensorboard": False},
        "search": search,
        "metric": "mean_return",
        "mode": "max",
        "resources": {"cpus": 1, "accelerator": "cpu", "devices": 1},
    }


numbers = st.one_of(st.integers(-(10**6), 10**6), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4))
distributions = st.one_of(
    st.fixed_dictionaries({"grid": st.lists(numbers | st.booleans(), max_size=3)}),
    st.fixed_dictionaries({"choice": st.lists(numbers, max_size=3)}),
    st.fixed_dictionaries({"uniform": st.lists(numbers, min_size=0, max_size=3)}),
    st.fixed_dictionaries({"loguniform": st.lists(numbers, min_size=2, max_size=2)}),
    st.fixed_dictionaries({"randint": st.lists(numbers, min_size=2, max_size=2)}),
    yaml_values,
)


@settings(max_examples=200, **SETTINGS)
@given(st.dictionaries(st.sampled_from(sorted(FIELDS) + ["agent.nope"]), distributions, max_size=2))
def test_any_search_space_is_accepted_or_names_the_field(search):
    from podray.tuning import parse

    _accepted_or_named(lambda: parse.from_dict(_study(search)))


@settings(max_examples=150, **SETTINGS)
@given(
    lr=st.tuples(st.floats(1e-7, 1e-2), st.floats(1.01, 100.0)),
    entropy=st.tuples(st.floats(0.0, 0.5), st.floats(0.001, 0.5)),
    depth=st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True),
    activation=st.lists(st.sampled_from(config_lib.ACTIVATIONS), min_size=1, max_size=2, unique=True),
)
def test_valid_search_spaces_are_never_rejected(lr, entropy, depth, activation):
    from podray.tuning import parse

    low, factor = lr
    search = {
        "agent.learning_rate": {"loguniform": [low, min(low * factor, 1.0)]},
        "agent.entropy_coef": {"uniform": [entropy[0], entropy[0] + entropy[1]]},
        "network.depth": {"grid": depth},
        "network.activation": {"choice": activation},
    }
    spec = parse.from_dict(_study(search))
    assert [d.field for d in spec.search] == list(search)
