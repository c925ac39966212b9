"""Update time with the epoch/minibatch loops as lax.scan vs unrolled, for a pixel torso: PPO (2 epochs x
4 minibatches of 16 x 16 samples) and IMPALA (1 epoch x 4 minibatches of 64 x 16, Pong's preset).

  python -m podray.bench.scan_unroll_bench nature_cnn [impala_resnet]

On XLA:CPU a conv-net gradient inside a scan is far slower than unrolled (jax-ml/jax#12868); the agents
pick unrolled (Python) loops on CPU for pixel torsos (Agent.scan_unroll). Results: docs/benchmarks.md.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from podray.agents import ActorOut, Trajectory, make_agent
from podray.config import AgentConfig, NetworkConfig
from podray.envs.spec import EnvSpec

spec = EnvSpec("Pong-v5", (84, 84, 4), "uint8", 6)
rng = np.random.default_rng(0)


def trajectory(T: int, B: int) -> Trajectory:
    return Trajectory(
        obs=jnp.asarray(rng.integers(0, 255, (T + 1, B, 84, 84, 4), dtype=np.uint8)),
        action=jnp.asarray(rng.integers(0, 6, (T, B)), jnp.int32),
        reward=jnp.asarray(rng.random((T, B)), jnp.float32),
        discount=jnp.ones((T, B)),
        actor_out=ActorOut(logits=jnp.zeros((T, B, 6)), value=jnp.zeros((T, B))),
    )


CASES = [("ppo", 2, 4, 16, 16), ("impala", 1, 4, 64, 16)]  # agent, epochs, minibatches, T, B
for torso in sys.argv[1:]:
    for name, epochs, minibatches, T, B in CASES:
        traj = trajectory(T, B)
        for unroll in (False, True):
            agent = make_agent(
                AgentConfig(name=name, epochs=epochs, num_minibatches=minibatches),
                NetworkConfig(
                    torso=torso,
                    activation="relu",
                    width=256 if torso == "impala_resnet" else 512,
                    depth=2 if torso == "impala_resnet" else 1,
                    shared_torso=True,
                ),
                spec,
                100,
            )
            agent.scan_unroll = unroll
            state = agent.init(jax.random.PRNGKey(0))
            f = jax.jit(agent.update)
            t0 = time.perf_counter()
            state, m = f(state, traj, jax.random.PRNGKey(1))
            jax.block_until_ready(m)
            c = time.perf_counter() - t0
            ts = []
            for i in range(3):
                t0 = time.perf_counter()
                state, m = f(state, traj, jax.random.PRNGKey(i))
                jax.block_until_ready(m)
                ts.append(time.perf_counter() - t0)
            med = float(np.median(ts))
            print(
                f"{torso} {name} unroll={unroll}: compile+first {c:.1f} s, update median {med:.2f} s, "
                f"{epochs * T * B / med:.0f} samples/s ({epochs} epochs x {T * B})",
                flush=True,
            )
