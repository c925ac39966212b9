"""MuZero's three networks in flax: representation, dynamics and prediction (Schrittwieser et al., 2020).

- representation h(obs) -> latent: the torso of `network.torso` (MLP for vectors, Nature-CNN or
  IMPALA-ResNet for pixels, the same modules as the actor-critics) and a dense layer to the latent.
- dynamics g(latent, action) -> (next latent, reward logits): the action one-hot encoded beside the
  latent, a dense layer, then `dynamics_blocks` residual blocks.
- prediction f(latent) -> (policy logits, value logits).
Latents are min-max scaled to [0, 1] per state, as in MuZero, so that the dynamics sees inputs of one
scale whatever the unroll depth. Value and reward heads are categorical over `num_bins` bins (the
agent maps them to scalars with rlax's two-hot and h(x) pair).
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from podray.agents.networks import _as_float, _dense, _in_chunks, chunk_rows, make_torso
from podray.config import NetworkConfig


def scale_latent(x: chex.Array, eps: float = 1e-5) -> chex.Array:
    """Min-max scaling of latents [..., L] to [0, 1] over their features (MuZero, Appendix G)."""
    low = jnp.min(x, axis=-1, keepdims=True)
    high = jnp.max(x, axis=-1, keepdims=True)
    return (x - low) / (high - low + eps)


def standardize_over_batch(x: chex.Array, eps: float = 1e-5) -> chex.Array:
    """Each feature of x [..., F] standardised over all the leading axes (the batch): a batch norm
    without learned scale or running statistics, as EfficientZero ends its projection with. Without it
    the latents' shared component (min-max scaled, they are all non-negative) makes any two
    projections nearly parallel, and a cosine loss on them carries almost no signal."""
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.var(x, axis=axes, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps)


class _ResidualDense(nn.Module):
    """x + dense(relu(norm(dense(relu(norm(x)))))): a pre-activation residual block on vectors."""

    width: int

    @nn.compact
    def __call__(self, x: chex.Array) -> chex.Array:
        y = _dense(self.width)(nn.relu(nn.LayerNorm()(x)))
        y = _dense(self.width)(nn.relu(nn.LayerNorm()(y)))
        return x + y


class MuZeroNetwork(nn.Module):
    """Representation, dynamics and prediction of one MuZero model.

    Attributes:
      config: the torso's shape; `width` is also the latent size and the heads' hidden width.
      num_actions: A.
      num_bins: bins of the categorical value and reward heads.
      obs_rank: rank of one observation (the MLP flattens that many trailing axes).
      dynamics_blocks: residual blocks of the dynamics.
      consistency: build the projection and prediction heads of the consistency loss (EfficientZero).
    """

    config: NetworkConfig
    num_actions: int
    num_bins: int
    obs_rank: int = 1
    dynamics_blocks: int = 1
    consistency: bool = False

    def setup(self):
        width = self.config.width
        self.torso = make_torso(self.config, self.obs_rank)
        self.to_latent = _dense(width)
        self.dynamics_in = _dense(width)
        self.dynamics_blocks_ = [_ResidualDense(width) for _ in range(self.dynamics_blocks)]
        self.reward_hidden = _dense(width)
        self.reward_out = nn.Dense(self.num_bins, kernel_init=nn.initializers.zeros)
        self.prediction_hidden = _dense(width)
        self.policy_out = _dense(self.num_actions, scale=0.01)
        self.value_out = nn.Dense(self.num_bins, kernel_init=nn.initializers.zeros)
        if self.consistency:
            # SimSiam's heads as EfficientZero sizes them: a projection of the latent, and a narrower
            # prediction head applied to the dynamics' side only.
            self.projection = [_dense(width), nn.LayerNorm(), _dense(width)]
            self.projection_head = [_dense(width // 4), nn.LayerNorm(), _dense(width)]

    def represent(self, obs: chex.Array) -> chex.Array:
        """Latents [..., width] of observations [..., *obs_shape]."""
        features = _in_chunks(lambda o: self.torso(_as_float(o)), obs, self.obs_rank, chunk_rows(self.config))
        return scale_latent(self.to_latent(features))

    def dynamics(self, latent: chex.Array, action: chex.Array) -> tuple[chex.Array, chex.Array]:
        """(next latents [..., width], reward logits [..., num_bins]) for latents and int actions [...]."""
        x = jnp.concatenate([latent, jax.nn.one_hot(action, self.num_actions, dtype=latent.dtype)], axis=-1)
        x = nn.relu(self.dynamics_in(x))
        for block in self.dynamics_blocks_:
            x = block(x)
        reward_logits = self.reward_out(nn.relu(self.reward_hidden(x)))
        return scale_latent(x), reward_logits

    def predict(self, latent: chex.Array) -> tuple[chex.Array, chex.Array]:
        """(policy logits [..., A], value logits [..., num_bins]) at latents [..., width]."""
        x = nn.relu(self.prediction_hidden(latent))
        return self.policy_out(x), self.value_out(x)

    def project(self, latent: chex.Array, head: bool) -> chex.Array:
        """The consistency loss's projection [..., width] of latents; with `head`, followed by the
        prediction head (the side whose gradient flows: the dynamics' latents)."""
        x = latent
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
