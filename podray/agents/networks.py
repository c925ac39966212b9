"""Actor-critic networks in flax: an MLP torso for vectors, Nature-CNN and IMPALA-ResNet for pixels.

Depth and width come from `NetworkConfig`, so that Ray Tune can search them as plain config fields.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from podray.config import NetworkConfig

_ACTIVATIONS: dict[str, Callable] = {"tanh": nn.tanh, "relu": nn.relu}


@jax.custom_vjp
def _matmul(x: chex.Array, w: chex.Array) -> chex.Array:
    return jnp.matmul(x, w)


def _matmul_fwd(x, w):
    return jnp.matmul(x, w), (x, w)


def _matmul_bwd(residuals, g):
    x, w = residuals
    # The weight gradient x^T g contracts the batch axis of both operands. XLA:CPU sends that form of
    # dot to Eigen; with x^T materialised first (the barrier keeps XLA from folding the transpose back
    # into the dot) it is a plain [in, N] x [N, out] matmul, which YNNPACK runs faster: a PPO update
    # at 64 CartPole envs takes a quarter less time (docs/benchmarks.md).
    x_t = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)
    return jnp.matmul(g, w.T), jnp.matmul(x_t, g.reshape(-1, g.shape[-1]))


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """nn.Dense's contraction, with `_matmul`'s gradient on CPU; elsewhere lax.dot_general itself."""
    standard = dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ()))
    if jax.default_backend() == "cpu" and standard and precision is None and preferred_element_type is None:
        return _matmul(lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def _dense(features: int, scale: float = np.sqrt(2)) -> nn.Dense:
    return nn.Dense(
        features,
        kernel_init=nn.initializers.orthogonal(scale),
        bias_init=nn.initializers.zeros,
        dot_general=_dot_general,
    )


def _normed(x: chex.Array, layer_norm: bool) -> chex.Array:
    """x, or x layer-normalised over its features (before the activation): every state then has about
    half its units active, so a dense layer cannot die into features that are zero in every state."""
    return nn.LayerNorm()(x) if layer_norm else x


class MLPTorso(nn.Module):
    """`depth` dense layers of `width` units on the observation flattened (its last `obs_rank` axes)."""

    depth: int
    width: int
    activation: str = "tanh"
    obs_rank: int = 1
    layer_norm: bool = False

    @nn.compact
    def __call__(self, x: chex.Array) -> chex.Array:
        if self.obs_rank != 1:
            x = x.reshape(x.shape[: x.ndim - self.obs_rank] + (-1,))
        for _ in range(self.depth):
            x = _ACTIVATIONS[self.activation](_normed(_dense(self.width)(x), self.layer_norm))
        return x


class NatureCNN(nn.Module):
    """The DQN Nature torso (Mnih et al., 2015): three convolutions, then `depth` dense layers."""

    depth: int = 1
    width: int = 512
    layer_norm: bool = False

    @nn.compact
    def __call__(self, x: chex.Array) -> chex.Array:
        for features, kernel, stride in ((32, 8, 4), (64, 4, 2), (64, 3, 1)):
            # Orthogonal init with gain sqrt(2), as the Dense layers (and the usual Atari agents): flax's
            # default (lecun normal) halves the activations' variance at each ReLU layer, and Pong's
            # frames differ in a few pixels only, so the torso's features started almost constant.
            conv = nn.Conv(
                features,
                (kernel, kernel),
                (stride, stride),
                padding="VALID",
                kernel_init=nn.initializers.orthogonal(np.sqrt(2)),
                bias_init=nn.initializers.zeros,
            )
            x = nn.relu(conv(x))
        x = x.reshape(x.shape[:-3] + (-1,))
        for _ in range(self.depth):
            x = nn.relu(_normed(_dense(self.width)(x), self.layer_norm))
        return x


class _ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x: chex.Array) -> chex.Array:
        y = nn.Conv(self.channels, (3, 3), padding="SAME")(nn.relu(x))
        y = nn.Conv(self.channels, (3, 3), padding="SAME")(nn.relu(y))
        return x + y


class ImpalaResNet(nn.Module):
    """The IMPALA torso (Espeholt et al., 2018): stages of conv, max-pool and `depth` residual blocks."""

    depth: int = 2
    width: int = 256
    channels: Sequence[int] = (16, 32, 32)
    layer_norm: bool = False

    @nn.compact
    def __call__(self, x: chex.Array) -> chex.Array:
        for channels in self.channels:
            x = nn.Conv(channels, (3, 3), padding="SAME")(x)
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
            for _ in range(self.depth):
                x = _ResidualBlock(channels)(x)
        x = nn.relu(x).reshape(x.shape[:-3] + (-1,))
        return nn.relu(_normed(_dense(self.width)(x), self.layer_norm))


class ActorCriticOutput(NamedTuple):
    logits: chex.Array  # [..., num_actions]
    value: chex.Array  # [...]


def make_torso(config: NetworkConfig, obs_rank: int = 1) -> nn.Module:
    if config.torso == "mlp":
        return MLPTorso(
            depth=config.depth,
            width=config.width,
            activation=config.activation,
            obs_rank=obs_rank,
            layer_norm=config.layer_norm,
        )
    if config.torso == "nature_cnn":
        return NatureCNN(depth=config.depth, width=config.width, layer_norm=config.layer_norm)
    if config.torso == "impala_resnet":
        return ImpalaResNet(depth=config.depth, width=config.width, layer_norm=config.layer_norm)
    raise ValueError(f"network.torso: unknown torso {config.torso!r}")


CPU_CHUNK_ROWS = 32


def chunk_rows(config: NetworkConfig) -> int:
    """Rows per torso call (0: the whole batch); see NetworkConfig.chunk_rows."""
    if config.torso == "mlp":
        return 0
    if config.chunk_rows >= 0:
        return config.chunk_rows
    return CPU_CHUNK_ROWS if jax.default_backend() == "cpu" else 0


def _in_chunks(torso: Callable[[chex.Array], chex.Array], x: chex.Array, obs_rank: int, rows: int) -> chex.Array:
    """torso(x) over the leading axes of x, at most `rows` rows at a time (equal-sized pieces).

    The pieces are unrolled, not scanned: on CPU a conv gradient inside a scan is many times slower
    (jax-ml/jax#12868). Their weight gradients are summed by autodiff.
    """
    lead = x.shape[: x.ndim - obs_rank]
    n = int(np.prod(lead))
    if rows <= 0 or n <= rows:
        return torso(x)
    pieces = -(-n // rows)
    size = -(-n // pieces)
    flat = x.reshape((n,) + x.shape[len(lead) :])
    out = jnp.concatenate([torso(flat[i : i + size]) for i in range(0, n, size)])
    return out.reshape(lead + out.shape[1:])


def _as_float(obs: chex.Array) -> chex.Array:
    """float32 observations; uint8 pixels scaled to [0, 1]."""
    x = obs.astype(jnp.float32)
    return x / 255.0 if obs.dtype == jnp.uint8 else x


class ActorCritic(nn.Module):
    """Policy logits and state value from observations [..., *obs_shape].

    uint8 observations (pixels) are scaled to [0, 1]. With `config.shared_torso` one torso feeds both
    heads; otherwise policy and value each have their own. `obs_rank` is the rank of one observation
    (the MLP flattens that many trailing axes).
    """

    config: NetworkConfig
    num_actions: int
    obs_rank: int = 1

    @nn.compact
    def __call__(self, obs: chex.Array) -> ActorCriticOutput:
        def features() -> chex.Array:
            torso = make_torso(self.config, self.obs_rank)
            # Scaled per chunk, so that no float copy of the whole uint8 batch is made.
            return _in_chunks(lambda o: torso(_as_float(o)), obs, self.obs_rank, chunk_rows(self.config))

        policy_features = features()
        value_features = policy_features if self.config.shared_torso else features()
        logits = _dense(self.num_actions, scale=0.01)(policy_features)
        value = _dense(1, scale=self.config.value_head_scale)(value_features)[..., 0]
        return ActorCriticOutput(logits=logits, value=value)
