"""podray.host: the XLA options each program is compiled with."""

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from podray import host


def _ynn_convolutions(compiled_text: str) -> int:
    """Convolutions inside the YNNPACK fusions of an optimised HLO module."""
    bodies = dict(re.findall(r"^(%[\w.\-]+) \(.*?\{\n(.*?)^\}", compiled_text, re.S | re.M))
    calls = re.findall(r'calls=(%[\w.\-]+), [^\n]*"kind":"__ynn_fusion"', compiled_text)
    return sum(" convolution(" in bodies.get(c, "") for c in calls)


def test_cpu_programs_send_convolutions_to_xla_and_keep_the_numbers():
    """On CPU devices the options move convolutions out of YNNPACK (what makes the pixel torsos
    faster there); the results stay those of the default compilation."""
    devices = jax.devices("cpu")
    options = host.compiler_options(devices)
    assert options == host.CPU_COMPILER_OPTIONS

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def f(x, w):  # a 3x3 layer's output and its weight gradient, at the IMPALA-ResNet's last stage
        return conv(x, w), jax.grad(lambda w: jnp.sum(jnp.tanh(conv(x, w))))(w)

    x = jax.random.normal(jax.random.PRNGKey(0), (8, 11, 11, 32))
    w = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 32, 32)) / 17
    default = jax.jit(f).lower(x, w).compile()
    ours = jax.jit(f, compiler_options=options).lower(x, w).compile()
    assert _ynn_convolutions(default.as_text()) > 0  # if 0, XLA changed its default: re-measure
    assert _ynn_convolutions(ours.as_text()) == 0
    for a, b in zip(jax.tree.leaves(default(x, w)), jax.tree.leaves(ours(x, w))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_accelerators_and_mixed_device_lists_keep_the_backend_defaults():
    tpu = SimpleNamespace(platform="tpu")
    assert host.compiler_options([tpu, tpu]) is None
    assert host.compiler_options([jax.devices("cpu")[0], tpu]) is None
    assert host.compiler_options([]) is None


def test_sebulba_learner_and_policy_run_their_convolutions_outside_ynnpack():
    """Pong's Nature-CNN: the learner step and the actors' policy are compiled with the options."""
    from podray import config as config_lib
    from podray.sebulba import SebulbaProgram

    overrides = ["run.cpu_devices=0", "sebulba.rollout_length=2", "sebulba.actor_batch_size=2"]
    overrides += ["sebulba.learner_batch_size=2", "agent.epochs=1", "agent.num_minibatches=1"]
    program = SebulbaProgram(config_lib.load("sebulba_pong", overrides), host.local_context())
    state = program.learner.initial_state(0)
    program.compile(state)
    device = program.actor_devices[0]
    obs = jax.device_put(np.zeros((2, *program._raw_obs_shape()), np.uint8), device)  # noqa: SLF001
    params = jax.device_put(state.train.params, device)
    policy = program.policy.lower(params, obs, jax.device_put(jax.random.PRNGKey(0), device)).compile()
    for compiled in (program._compiled_step, policy):  # noqa: SLF001
        text = compiled.as_text()
        assert " convolution(" in text and _ynn_convolutions(text) == 0


def test_anakin_compiles_with_the_options_of_its_mesh(monkeypatch):
    from podray import anakin
    from podray import config as config_lib

    seen = []
    monkeypatch.setattr(anakin, "compiler_options", lambda devices: seen.append(list(devices)) or {})
    mesh = host.local_context().mesh()
    anakin.AnakinProgram(config_lib.load("anakin_cartpole", ["run.cpu_devices=0"]), mesh)
    assert seen == [list(mesh.devices.flat)]
