"""PPO update time with its epoch/minibatch loops as lax.scan vs unrolled, for a pixel torso.

  python -m podray.bench.scan_unroll_bench nature_cnn [impala_resnet]

On XLA:CPU a conv-net gradient inside a scan is far slower than unrolled (jax-ml/jax#12868); PPO picks
unrolled loops on CPU for pixel torsos (Agent.scan_unroll). Results: docs/benchmarks.md.
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
T, B = 16, 16
rng = np.random.default_rng(0)
traj = Trajectory(
    obs=jnp.asarray(rng.integers(0, 255, (T + 1, B, 84, 84, 4), dtype=np.uint8)),
    action=jnp.asarray(rng.integers(0, 6, (T, B)), jnp.int32),
    reward=jnp.asarray(rng.random((T, B)), jnp.float32),
    discount=jnp.ones((T, B)),
    actor_out=ActorOut(logits=jnp.zeros((T, B, 6)), value=jnp.zeros((T, B))),
)
for torso in sys.argv[1:]:
    for unroll in (False, True):
        agent = make_agent(
            AgentConfig(name="ppo", epochs=2, num_minibatches=4),
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
            f"{torso} unroll={unroll}: compile+first {c:.1f} s, update median {med:.2f} s, "
            f"{2 * T * B / med:.0f} samples/s (2 epochs x {T * B})",
            flush=True,
        )
