"""Actor-critic networks in flax: an MLP torso for vectors, Nature-CNN and IMPALA-ResNet for pixels.

Depth and width come from `NetworkConfig`, so that Ray Tune can search them as plain config fields.
"""

from __future__ import annotations

from functools import partial
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


def _same_padding(size: int, window: int, stride: int) -> tuple[int, int]:
    """lax's SAME padding (low, high) of one spatial axis for a strided window."""
    out = -(-size // stride)
    total = max((out - 1) * stride + window - size, 0)
    return total // 2, total - total // 2


def _pool_windows(x: chex.Array, window: int, stride: int):
    """(i, j, x's values at window offset (i, j) of every output position) in row-major offset order:
    strided slices of x padded with -inf to lax's SAME padding, each the output's size [N, Ho, Wo, C]."""
    n, h, w, c = x.shape
    (h_lo, h_hi), (w_lo, w_hi) = _same_padding(h, window, stride), _same_padding(w, window, stride)
    xp = jnp.pad(x, ((0, 0), (h_lo, h_hi), (w_lo, w_hi), (0, 0)), constant_values=-jnp.inf)
    ho, wo = -(-h // stride), -(-w // stride)
    for i in range(window):
        for j in range(window):
            limit = (n, i + stride * (ho - 1) + 1, j + stride * (wo - 1) + 1, c)
            yield i, j, jax.lax.slice(xp, (0, i, j, 0), limit, (1, stride, stride, 1))


def _max_and_argmax(x: chex.Array, window: int, stride: int) -> tuple[chex.Array, chex.Array]:
    """The pool's maximum and, as int8 i * window + j, the offset of its first maximum (row-major, as
    select-and-scatter picks it): one fused pass over x, where XLA:CPU's reduce_window ran ~3x slower."""
    best = first = None
    for i, j, seen in _pool_windows(x, window, stride):
        if best is None:
            best, first = seen, jnp.zeros(seen.shape, jnp.int8)
        else:
            better = seen > best  # strict: ties keep the earlier offset
            best, first = jnp.where(better, seen, best), jnp.where(better, jnp.int8(i * window + j), first)
    return best, first


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _max_pool(x: chex.Array, window: int, stride: int) -> chex.Array:
    return _max_and_argmax(x, window, stride)[0]


def _max_pool_fwd(x, window, stride):
    y, first = _max_and_argmax(x, window, stride)
    return y, (first, x.shape)


def _computed_once(x: chex.Array, live: chex.Array) -> chex.Array:
    """x in a buffer of its own, for a consumer that reads each element several times.

    XLA:CPU fuses a cheap elementwise producer into every consumer, and into a consumer that reads it at
    nine window offsets it is evaluated nine times per element. jax.lax.optimization_barrier does not
    stop that on CPU (XLA expands it before fusion); a conditional is a fusion boundary. `live` must be
    true at run time but unknown to XLA, which would otherwise fold the conditional away: the zeros
    branch is never taken.
    """
    return jax.lax.cond(live, lambda: x, lambda: jnp.zeros_like(x))


def _max_pool_bwd(window, stride, residuals, g):
    # XLA:CPU differentiates reduce_window's max with select-and-scatter, a scalar loop: at a learner
    # batch of 168 Atari frames the IMPALA-ResNet's three pools took ~1 s of its gradient's ~2.8 s.
    # Here it is a few fused elementwise passes. Each window offset (i, j) routes g to the input that
    # the forward pass picked there (`first`, saved as int8 instead of the input itself); offsets of the
    # same residue (i % stride, j % stride) land on the same input rows and columns, one output step
    # apart, so each residue's sum is built at the output's size and the stride x stride residue planes
    # are interleaved once. `first` and g are each computed once before that: fused into it, the
    # forward pass's nine comparisons (kept alive to redo them) and the next layer's ReLU gradient were
    # evaluated at every window offset, ~20% of the torso's gradient (docs/benchmarks.md).
    first, (n, h, w, c) = residuals
    live = first.ravel()[0] >= 0  # offsets are in [0, window * window)
    first, g = _computed_once(first, live), _computed_once(g, live)
    (h_lo, h_hi), (w_lo, w_hi) = _same_padding(h, window, stride), _same_padding(w, window, stride)
    ho, wo = g.shape[1], g.shape[2]
    rows, cols = -(-(h + h_lo + h_hi) // stride), -(-(w + w_lo + w_hi) // stride)  # residue planes' size
    zero = jnp.zeros((), g.dtype)
    planes: dict[tuple[int, int], chex.Array] = {}
    for i in range(window):
        for j in range(window):
            di, dj = i // stride, j // stride
            routed = jnp.where(first == i * window + j, g, zero)
            routed = jnp.pad(routed, ((0, 0), (di, rows - ho - di), (dj, cols - wo - dj), (0, 0)))
            key = (i % stride, j % stride)
            planes[key] = planes[key] + routed if key in planes else routed
    empty = jnp.zeros((n, rows, cols, c), g.dtype)  # residues no offset reaches (window < stride)
    grid = jnp.stack(
        [jnp.stack([planes.get((ri, rj), empty) for rj in range(stride)], axis=3) for ri in range(stride)], axis=2
    )  # [n, rows, stride, cols, stride, c]
    dxp = grid.reshape(n, rows * stride, cols * stride, c)
    return (dxp[:, h_lo : h_lo + h, w_lo : w_lo + w],)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


def max_pool(x: chex.Array, window: int = 3, stride: int = 2) -> chex.Array:
    """Max pool of [..., H, W, C] images with SAME padding: nn.max_pool's result and gradient. On CPU the
    pool is `_max_and_argmax` and its gradient `_max_pool_bwd` (both faster than XLA:CPU's own there:
    docs/benchmarks.md), elsewhere the backend's."""
    if jax.default_backend() == "cpu":
        lead = x.shape[:-3]
        y = _max_pool(x.reshape((-1,) + x.shape[-3:]), window, stride)
        return y.reshape(lead + y.shape[1:])
    return nn.max_pool(x, (window, window), strides=(stride, stride), padding="SAME")


_NHWC = ("NHWC", "HWIO", "NHWC")


def _conv(x: chex.Array, kernel: chex.Array, padding) -> chex.Array:
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), padding, dimension_numbers=_NHWC)


def _paired_kernel(kernel: chex.Array) -> chex.Array:
    """A 3x3 kernel [3, 3, C, O] as the kernel over column pairs [3, 3, 2C, 2O]: output pair b holds
    columns 2b and 2b+1, and tap d in {-1, 0, 1} reads input pair b+d; taps that reach past the three
    columns a pair needs are zero."""
    kh, _, c, o = kernel.shape
    paired = jnp.zeros((kh, 3, 2, c, 2, o), kernel.dtype)
    for d in (-1, 0, 1):
        for seen in range(2):  # which column of input pair b+d
            for out in range(2):  # which column of output pair b
                tap = 2 * d + seen - out + 1  # the original kernel's column
                if 0 <= tap <= 2:
                    paired = paired.at[:, d + 1, seen, :, out, :].set(kernel[:, tap])
    return paired.reshape(kh, 3, 2 * c, 2 * o)


@jax.custom_vjp
def _conv_paired(x: chex.Array, kernel: chex.Array) -> chex.Array:
    n, h, w, c = x.shape
    # [N, H, W, C] and [N, H, W/2, 2C] are the same bytes, and so are the outputs: no copy either way.
    y = _conv(x.reshape(n, h, w // 2, 2 * c), _paired_kernel(kernel), "SAME")
    return y.reshape(n, h, w, -1)


def _conv_paired_fwd(x, kernel):
    return _conv_paired(x, kernel), (x, kernel)


def _conv_paired_bwd(residuals, g):
    # The plain convolution's gradient: its weight gradient costs half the paired one's FLOPs.
    return jax.vjp(lambda x, k: _conv(x, k, "SAME"), *residuals)[1](g)


_conv_paired.defvjp(_conv_paired_fwd, _conv_paired_bwd)


def _conv_general_dilated(lhs, rhs, window_strides, padding, **options):
    """nn.Conv's convolution (lax.conv_general_dilated); on CPU a 3x3, stride-1, SAME convolution of an
    NHWC image with at most 4 channels and an even width (the IMPALA torso's first layer, on stacked
    frames) runs on column pairs instead.

    XLA:CPU's convolution contracts only 9 x C = 36 inputs per output there and ran at ~40 GFLOP/s
    (6 ms of the torso's ~18 ms forward pass at 28 Atari frames); on pairs of columns it contracts 72
    into 32 outputs, twice the FLOPs (half of them on zero taps) in half the time. Values and gradient
    are the plain convolution's.
    """
    ones = (1,) * (lhs.ndim - 2)
    paired = (
        jax.default_backend() == "cpu"
        and lhs.ndim == 4
        and rhs.shape[:2] == (3, 3)
        and lhs.shape[-1] <= 4
        and lhs.shape[2] % 2 == 0
        and tuple(window_strides) == (1, 1)
        and padding in ("SAME", ((1, 1), (1, 1)), [(1, 1), (1, 1)])
        and tuple(options.get("lhs_dilation") or ones) == ones
        and tuple(options.get("rhs_dilation") or ones) == ones
        and options.get("feature_group_count", 1) == 1
        and options.get("batch_group_count", 1) == 1
        and options.get("precision") is None
        and options.get("preferred_element_type") is None
        and options.get("dimension_numbers") == jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, _NHWC)
    )
    if paired:
        return _conv_paired(lhs, rhs)
    return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, **options)


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
    """The DQN Nature torso (Mnih et al., 2015): three convolutions, then `depth` dense layers (with
    `spatial`, none: the last feature map [..., 7, 7, 64] at 84x84 frames)."""

    depth: int = 1
    width: int = 512
    layer_norm: bool = False
    spatial: bool = False

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
        if self.spatial:
            return x
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
    """The IMPALA torso (Espeholt et al., 2018): stages of conv, max-pool and `depth` residual blocks,
    then a dense layer (with `spatial`, none: the last feature map [..., 11, 11, 32] at 84x84 frames)."""

    depth: int = 2
    width: int = 256
    channels: Sequence[int] = (16, 32, 32)
    layer_norm: bool = False
    spatial: bool = False

    @nn.compact
    def __call__(self, x: chex.Array) -> chex.Array:
        for channels in self.channels:
            x = nn.Conv(channels, (3, 3), padding="SAME", conv_general_dilated=_conv_general_dilated)(x)
            x = max_pool(x, 3, 2)
            for _ in range(self.depth):
                x = _ResidualBlock(channels)(x)
        x = nn.relu(x)
        if self.spatial:
            return x
        x = x.reshape(x.shape[:-3] + (-1,))
        return nn.relu(_normed(_dense(self.width)(x), self.layer_norm))


class ActorCriticOutput(NamedTuple):
    logits: chex.Array  # [..., num_actions]
    value: chex.Array  # [...]


def make_torso(config: NetworkConfig, obs_rank: int = 1, spatial: bool = False) -> nn.Module:
    """The torso `config.torso` names; with `spatial`, a pixel torso that ends at its last feature map
    [..., H, W, C] (MuZero's spatial latent), without the dense layers."""
    if spatial and config.torso == "mlp":
        raise ValueError("network.torso: the mlp torso has no feature map; a spatial torso needs a pixel torso")
    if config.torso == "mlp":
        return MLPTorso(
            depth=config.depth,
            width=config.width,
            activation=config.activation,
            obs_rank=obs_rank,
            layer_norm=config.layer_norm,
        )
    if config.torso == "nature_cnn":
        return NatureCNN(depth=config.depth, width=config.width, layer_norm=config.layer_norm, spatial=spatial)
    if config.torso == "impala_resnet":
        return ImpalaResNet(depth=config.depth, width=config.width, layer_norm=config.layer_norm, spatial=spatial)
    raise ValueError(f"network.torso: unknown torso {config.torso!r}")


# Rows per torso call on CPU, by torso: where a batch's activations stay in the caches. The ResNet's
# gradient ran ~4% faster in 16-row than in 32-row chunks once its pool stopped recomputing the forward
# pass (docs/benchmarks.md).
CPU_CHUNK_ROWS = {"nature_cnn": 32, "impala_resnet": 16}


def chunk_rows(config: NetworkConfig) -> int:
    """Rows per torso call (0: the whole batch); see NetworkConfig.chunk_rows."""
    if config.torso == "mlp":
        return 0
    if config.chunk_rows >= 0:
        return config.chunk_rows
    return CPU_CHUNK_ROWS.get(config.torso, 32) if jax.default_backend() == "cpu" else 0


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
