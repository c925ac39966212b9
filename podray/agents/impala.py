"""IMPALA (Espeholt et al., 2018): an actor-critic whose off-policy correction is V-trace (rlax).

Under Anakin the behaviour policy is the current one (the ratios are 1); under Sebulba the actors lag
the learner and V-trace corrects for it. One `update` is one gradient step on the whole batch by
default; `epochs` and `num_minibatches` make it several, each on a minibatch of whole sequences.
With `surrogate_clip` the policy loss is PPO's clipped surrogate on V-trace advantages (APPO), the
trust region that lets it take several normalised-advantage steps per batch without collapsing.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import rlax

from podray.agents.base import Agent, AxisName, TrainState, Trajectory, log_prob, normalize, ratio_metrics


class IMPALA(Agent):
    """V-trace actor-critic: policy gradient with V-trace advantages, V-trace value targets, entropy."""

    def loss(
        self, params: Any, trajectory: Trajectory, axis_name: AxisName = None
    ) -> tuple[chex.Array, dict[str, chex.Array]]:
        """The V-trace loss of a trajectory [T, B]; `axis_name` names the devices sharing the batch."""
        c = self.config
        out = self.apply(params, trajectory.obs[:-1])  # logits [T, B, A], value [T, B]
        # The last observation only bootstraps V-trace's targets, which carry no gradient (rlax stops
        # it): a forward pass alone, without the backward pass through the torso that 1/T of the batch
        # would otherwise cost.
        bootstrap = self.apply(jax.lax.stop_gradient(params), trajectory.obs[-1]).value  # [B]
        values = jnp.concatenate([out.value, bootstrap[None]])  # [T+1, B]
        logits = out.logits
        target_log_prob = log_prob(logits, trajectory.action)
        behaviour_log_prob = log_prob(trajectory.actor_out.logits, trajectory.action)
        rho = jnp.exp(target_log_prob - behaviour_log_prob)
        vtrace = jax.vmap(
            lambda v_tm1, v_t, r_t, d_t, rho_tm1: rlax.vtrace_td_error_and_advantage(
                v_tm1, v_t, r_t, d_t, rho_tm1, c.vtrace_lambda, c.clip_rho_threshold, c.clip_pg_rho_threshold
            ),
            in_axes=1,
            out_axes=1,
        )(out.value, values[1:], trajectory.reward, c.discount * trajectory.discount, rho)
        ones = jnp.ones_like(trajectory.reward)
        clipped = c.surrogate_clip > 0
        # With the trust region (APPO) the advantage goes without V-trace's importance weight: the
        # surrogate's ratio rho = pi / mu takes its place.
        advantage = jax.lax.stop_gradient(vtrace.q_estimate - out.value) if clipped else vtrace.pg_advantage
        if c.normalize_advantages:
            advantage = normalize(advantage, axis_name)
        if clipped:
            policy_loss = rlax.clipped_surrogate_pg_loss(rho.ravel(), advantage.ravel(), c.surrogate_clip)
        else:
            policy_loss = jax.vmap(rlax.policy_gradient_loss, in_axes=1)(
                logits, trajectory.action, advantage, ones
            ).mean()
        value_loss = 0.5 * jnp.mean(jnp.square(vtrace.errors))
        entropy_loss = jax.vmap(rlax.entropy_loss, in_axes=1)(logits, ones).mean()
        loss = policy_loss + c.value_coef * value_loss + c.entropy_coef * entropy_loss
        metrics = {
            "loss": loss,
            "policy_loss": policy_loss,
            "value_loss": value_loss,
            "entropy": -entropy_loss,
            "mean_rho": rho.mean(),
            **(ratio_metrics(rho, c.surrogate_clip) if clipped else {}),
        }
        return loss, metrics

    def update(
        self, state: TrainState, trajectory: Trajectory, key: chex.PRNGKey, axis_name: AxisName = None
    ) -> tuple[TrainState, dict[str, chex.Array]]:
        """`epochs` x `num_minibatches` gradient steps (default one step on the whole batch).

        Minibatches are whole sequences (environments of the batch, shuffled by the key), so V-trace
        runs over each one with the current parameters at every step, as in Cleanba's IMPALA.
        """
        return self.sgd(state, trajectory, key, self.loss, batch_axis=1, axis_name=axis_name)
