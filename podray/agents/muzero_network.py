"""MuZero's three networks in flax: representation, dynamics and prediction (Schrittwieser et al., 2020).

The latent is a vector (`latent_channels` 0) or, for pixels, a feature map (`latent_channels` > 0),
as MuZero and EfficientZero use on Atari: there the dynamics is convolutional, so an action's local
effect (a paddle a few pixels up) stays at its place in the latent instead of being mixed into every
feature by a dense layer.

- representation h(obs) -> latent: the torso of `network.torso` (MLP for vectors, Nature-CNN or
  IMPALA-ResNet for pixels, the same modules as the actor-critics), then a dense layer to the vector
  latent, or a 3x3 convolution of the torso's last feature map to the spatial latent [H, W, channels].
- dynamics g(latent, action) -> (next latent, reward logits): the action one-hot encoded beside the
  latent (as A constant planes for a spatial latent), a dense layer (3x3 convolution), then
  `dynamics_blocks` residual blocks.
- prediction f(latent) -> (policy logits, value logits); on a spatial latent the reward, policy and
  value heads first reduce it with a 1x1 convolution to a few channels and flatten it.
Latents are min-max scaled to [0, 1] per state, as in MuZero, so that the dynamics sees inputs of one
scale whatever the unroll depth. Value and reward heads are categorical over `num_bins` bins (the
agent maps them to scalars with rlax's two-hot and h(x) pair).
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from podray.agents.networks import _as_float, _dense, _in_chunks, chunk_rows, make_torso
from podray.config import NetworkConfig


def scale_latent(x: chex.Array, rank: int = 1, eps: float = 1e-5) -> chex.Array:
    """Min-max scaling of latents [..., *latent_shape] (their last `rank` axes) to [0, 1] over all
    their features (MuZero, Appendix G)."""
    axes = tuple(range(x.ndim - rank, x.ndim))
    low = jnp.min(x, axis=axes, keepdims=True)
    high = jnp.max(x, axis=axes, keepdims=True)
    return (x - low) / (high - low + eps)


def flatten_latent(x: chex.Array, rank: int) -> chex.Array:
    """Latents [..., *latent_shape] (the last `rank` axes) as vectors [..., L]."""
    return x.reshape(x.shape[: x.ndim - rank] + (-1,))


def standardize_over_batch(x: chex.Array, eps: float = 1e-5) -> chex.Array:
    """Each feature of x [..., F] standardised over all the leading axes (the batch): a batch norm
    without learned scale or running statistics, as EfficientZero ends its projection with. Without it
    the latents' shared component (min-max scaled, they are all non-negative) makes any two
    projections nearly parallel, and a cosine loss on them carries almost no signal."""
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.var(x, axis=axes, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps)


class _Residual(nn.Module):
    """x + layer(relu(norm(layer(relu(norm(x)))))): a pre-activation residual block of dense layers on
    vectors [..., width], or with `conv` of 3x3 convolutions on feature maps [..., H, W, width]; the
    layer norms are over the last axis (the features, or each position's channels)."""

    width: int
    conv: bool = False

    @nn.compact
    def __call__(self, x: chex.Array) -> chex.Array:
        layer = _conv if self.conv else _dense
        y = layer(self.width)(nn.relu(nn.LayerNorm()(x)))
        y = layer(self.width)(nn.relu(nn.LayerNorm()(y)))
        return x + y


def _conv(channels: int, size: int = 3) -> nn.Conv:
    """A size x size SAME convolution, orthogonally initialised with gain sqrt(2) as `_dense`."""
    return nn.Conv(channels, (size, size), padding="SAME", kernel_init=nn.initializers.orthogonal(np.sqrt(2)))


class _SpatialHead(nn.Module):
    """The hidden layer of a head on a spatial latent [..., H, W, C]: a 1x1 convolution to `channels`,
    ReLU, flattened, then a dense layer of `width` units (the vector latent's heads have the dense
    layer alone)."""

    channels: int
    width: int

    @nn.compact
    def __call__(self, x: chex.Array) -> chex.Array:
        x = nn.relu(_conv(self.channels, 1)(x))
        return _dense(self.width)(flatten_latent(x, 3))


class MuZeroNetwork(nn.Module):
    """Representation, dynamics and prediction of one MuZero model.

    Attributes:
      config: the torso's shape; `width` is also the latent size and the heads' hidden width.
      num_actions: A.
      num_bins: bins of the categorical value and reward heads.
      obs_rank: rank of one observation (the MLP flattens that many trailing axes).
      dynamics_blocks: residual blocks of the dynamics.
      consistency: build the projection and prediction heads of the consistency loss (EfficientZero).
      latent_channels: 0 for a vector latent of `config.width` features; above 0, a spatial latent
        of this many channels on the pixel torso's last feature map, and convolutional dynamics.
    """

    config: NetworkConfig
    num_actions: int
    num_bins: int
    obs_rank: int = 1
    dynamics_blocks: int = 1
    consistency: bool = False
    latent_channels: int = 0

    # Channels the spatial heads reduce the latent to before flattening it (EfficientZero's 16).
    HEAD_CHANNELS = 16

    @property
    def latent_rank(self) -> int:
        """Axes of one latent: 1 (vector) or 3 (H, W, channels)."""
        return 3 if self.latent_channels else 1

    def setup(self):
        width, spatial = self.config.width, self.latent_channels > 0
        self.torso = make_torso(self.config, self.obs_rank, spatial=spatial)
        if spatial:
            channels = self.latent_channels
            self.to_latent = _conv(channels)
            self.dynamics_in = _conv(channels)
            self.dynamics_blocks_ = [_Residual(channels, conv=True) for _ in range(self.dynamics_blocks)]
            self.reward_hidden = _SpatialHead(self.HEAD_CHANNELS, width)
            self.prediction_hidden = _SpatialHead(self.HEAD_CHANNELS, width)
        else:
            self.to_latent = _dense(width)
            self.dynamics_in = _dense(width)
            self.dynamics_blocks_ = [_Residual(width) for _ in range(self.dynamics_blocks)]
            self.reward_hidden = _dense(width)
            self.prediction_hidden = _dense(width)
        self.reward_out = nn.Dense(self.num_bins, kernel_init=nn.initializers.zeros)
        self.policy_out = _dense(self.num_actions, scale=0.01)
        self.value_out = nn.Dense(self.num_bins, kernel_init=nn.initializers.zeros)
        if self.consistency:
            # SimSiam's heads as EfficientZero sizes them: a projection of the latent, and a narrower
            # prediction head applied to the dynamics' side only.
            self.projection = [_dense(width), nn.LayerNorm(), _dense(width)]
            self.projection_head = [_dense(width // 4), nn.LayerNorm(), _dense(width)]

    def represent(self, obs: chex.Array) -> chex.Array:
        """Latents [..., *latent_shape] of observations [..., *obs_shape]; latent_shape is (width,)
        or (H, W, latent_channels)."""
        features = _in_chunks(lambda o: self.torso(_as_float(o)), obs, self.obs_rank, chunk_rows(self.config))
        return scale_latent(self.to_latent(features), self.latent_rank)

    def dynamics(self, latent: chex.Array, action: chex.Array) -> tuple[chex.Array, chex.Array]:
        """(next latents [..., *latent_shape], reward logits [..., num_bins]) for latents and int
        actions [...]."""
        action = jax.nn.one_hot(action, self.num_actions, dtype=latent.dtype)
        if self.latent_channels:  # one constant plane per action
            action = jnp.broadcast_to(action[..., None, None, :], latent.shape[:-1] + (self.num_actions,))
        x = nn.relu(self.dynamics_in(jnp.concatenate([latent, action], axis=-1)))
        for block in self.dynamics_blocks_:
            x = block(x)
        reward_logits = self.reward_out(nn.relu(self.reward_hidden(x)))
        return scale_latent(x, self.latent_rank), reward_logits

    def predict(self, latent: chex.Array) -> tuple[chex.Array, chex.Array]:
        """(policy logits [..., A], value logits [..., num_bins]) at latents [..., *latent_shape]."""
        x = nn.relu(self.prediction_hidden(latent))
        return self.policy_out(x), self.value_out(x)

    def project(self, latent: chex.Array, head: bool) -> chex.Array:
        """The consistency loss's projection [..., width] of latents [..., *latent_shape] (flattened);
        with `head`, followed by the prediction head (the side whose gradient flows: the dynamics'
        latents)."""
        x = flatten_latent(latent, self.latent_rank)
        for layer in self.projection:
            x = layer(x)
            if isinstance(layer, nn.LayerNorm):
                x = nn.relu(x)
        x = standardize_over_batch(x)
        if head:
            for layer in self.projection_head:
                x = layer(x)
                if isinstance(layer, nn.LayerNorm):
                    x = nn.relu(x)
        return x

    def __call__(self, obs: chex.Array, action: chex.Array):
        """All the networks once (what `init` traces): obs [B, ...], action [B]."""
        latent = self.represent(obs)
        next_latent, reward_logits = self.dynamics(latent, action)
        out = (self.predict(latent), self.predict(next_latent), reward_logits)
        if self.consistency:
            out = out + (self.project(next_latent, head=True),)
        return out
