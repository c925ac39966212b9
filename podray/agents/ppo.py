"""PPO (Schulman et al., 2017): clipped surrogate objective, GAE advantages, value and entropy terms.

Losses come from rlax. One `update` runs `epochs` passes of `num_minibatches` gradient steps over a
batch; with an axis name the gradients (and the advantage-normalisation statistics) are averaged over
devices, so N devices with B/N environments each take the same steps as one device with B.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import rlax

from podray.agents.base import Agent, AxisName, TrainState, Trajectory, log_prob, normalize, ratio_metrics


@chex.dataclass(frozen=True)
class PPOBatch:
    """A flat minibatch of N samples: obs [N, ...], action, old_log_prob, old_value, advantage,
    value_target, all [N]."""

    obs: chex.Array
    action: chex.Array
    old_log_prob: chex.Array
    old_value: chex.Array
    advantage: chex.Array
    value_target: chex.Array


class PPO(Agent):
    """PPO with a clipped surrogate policy loss, a clipped value loss and an entropy bonus."""

    def advantages(self, params: Any, trajectory: Trajectory) -> tuple[chex.Array, chex.Array]:
        """GAE advantages and value targets, both [T, B], from behaviour values and a bootstrap."""
        c = self.config
        bootstrap = self.apply(params, trajectory.obs[-1]).value  # [B]
        values = jnp.concatenate([trajectory.actor_out.value, bootstrap[None]], axis=0)  # [T+1, B]
        gae = jax.vmap(rlax.truncated_generalized_advantage_estimation, in_axes=(1, 1, None, 1), out_axes=1)
        advantage = gae(trajectory.reward, c.discount * trajectory.discount, c.gae_lambda, values)
        return advantage, advantage + values[:-1]

    def minibatch_loss(
        self, params: Any, batch: PPOBatch, axis_name: AxisName = None
    ) -> tuple[chex.Array, dict[str, chex.Array]]:
        c = self.config
        out = self.apply(params, batch.obs)
        new_log_prob = log_prob(out.logits, batch.action)
        advantage = normalize(batch.advantage, axis_name)  # statistics of the whole (cross-device) minibatch
        ratio = jnp.exp(new_log_prob - batch.old_log_prob)
        policy_loss = rlax.clipped_surrogate_pg_loss(ratio, advantage, c.clip_epsilon)
        value_clipped = batch.old_value + jnp.clip(out.value - batch.old_value, -c.clip_epsilon, c.clip_epsilon)
        value_loss = (
            0.5
            * jnp.maximum(
                jnp.square(out.value - batch.value_target), jnp.square(value_clipped - batch.value_target)
            ).mean()
        )
        entropy_loss = rlax.entropy_loss(out.logits, jnp.ones_like(ratio))  # = -mean entropy
        loss = policy_loss + c.value_coef * value_loss + c.entropy_coef * entropy_loss
        metrics = {
            "loss": loss,
            "policy_loss": policy_loss,
            "value_loss": value_loss,
            "entropy": -entropy_loss,
            **ratio_metrics(ratio, c.clip_epsilon),
        }
        return loss, metrics

    def make_batch(self, params: Any, trajectory: Trajectory) -> PPOBatch:
        """Flattens a trajectory [T, B] into N = T * B samples with advantages and targets."""
        advantage, target = self.advantages(params, trajectory)
        flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
        return PPOBatch(
            obs=flat(trajectory.obs[:-1]),
            action=flat(trajectory.action),
            old_log_prob=flat(log_prob(trajectory.actor_out.logits, trajectory.action)),
            old_value=flat(trajectory.actor_out.value),
            advantage=flat(advantage),
            value_target=flat(target),
        )

    def loss(self, params: Any, trajectory: Trajectory) -> tuple[chex.Array, dict[str, chex.Array]]:
        """The PPO loss of a whole trajectory, advantages from its behaviour values."""
        return self.minibatch_loss(params, self.make_batch(jax.lax.stop_gradient(params), trajectory))

    def update(
        self, state: TrainState, trajectory: Trajectory, key: chex.PRNGKey, axis_name: AxisName = None
    ) -> tuple[TrainState, dict[str, chex.Array]]:
        """`epochs` x `num_minibatches` gradient steps on one batch (the key shuffles it)."""
        batch = self.make_batch(state.params, trajectory)
        return self.sgd(state, batch, key, self.minibatch_loss, batch_axis=0, axis_name=axis_name)
