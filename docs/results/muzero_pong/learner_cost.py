"""What one gradient step of the sebulba_muzero_pong preset costs on this machine.

  python learner_cost.py [--set-style overrides, e.g. replay.batch_size=256]

Builds the preset's agent for Pong-v5's shapes, fills its replay past replay.min_size with random
[64, 8] trajectories, then times (a) MuZero.update as the Sebulba learner compiles it (state donated):
add the trajectory, sample, take replay_ratio x 512 / batch gradient steps, update the priorities;
and (b) the gradient of the K-step loss alone on one batch. Medians of 6 and 5 calls. Figures in
docs/benchmarks.md ("What the target costs here").
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from podray import config as config_lib
from podray.agents import ActorOut, Trajectory, build_agent
from podray.envs.spec import EnvSpec

config = config_lib.load("sebulba_muzero_pong", sys.argv[1:])
spec = EnvSpec("Pong-v5", (84, 84, 4), "uint8", 6)
agent = build_agent(config, spec, 4883, 1)
rng = np.random.default_rng(0)
T, B = config.sebulba.rollout_length, 8


def trajectory() -> Trajectory:
    return Trajectory(
        obs=jnp.asarray(rng.integers(0, 255, (T + 1, B, 84, 84, 4), dtype=np.uint8)),
        action=jnp.asarray(rng.integers(0, 6, (T, B)), jnp.int32),
        reward=jnp.asarray(rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0], (T, B)), jnp.float32),
        discount=jnp.ones((T, B), jnp.float32),
        actor_out=ActorOut(logits=jnp.asarray(rng.normal(size=(T, B, 6)), jnp.float32), value=jnp.zeros((T, B))),
    )


state = agent.init(jax.random.PRNGKey(0))
update = jax.jit(agent.update, donate_argnums=0)
key = jax.random.PRNGKey(1)
for i in range(config.replay.min_size // (T * B) + 1):
    state, metrics = update(state, trajectory(), jax.random.fold_in(key, i))
jax.block_until_ready(state)
steps = float(metrics["gradient_steps"])
batches = [trajectory() for _ in range(3)]
times = []
for i in range(6):
    start = time.perf_counter()
    state, metrics = update(state, batches[i % 3], jax.random.fold_in(key, 1000 + i))
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
print(f"update: {steps:.0f} gradient steps, median {np.median(times):.3f} s, {np.median(times) / steps:.4f} s per step")

items = agent.items(state.params.network, batches[0])
batch = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[: agent.batch_size], items)
grad = jax.jit(jax.grad(lambda network, items: agent.replay_loss(network, items)[0]))
jax.block_until_ready(grad(state.params.network, batch))
times = []
for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(grad(state.params.network, batch))
    times.append(time.perf_counter() - start)
print(f"gradient alone, batch {agent.batch_size}: median {np.median(times):.4f} s")
