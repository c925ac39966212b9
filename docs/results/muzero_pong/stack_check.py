"""Does a JAX stack compute the same MuZero update and search as another? The sebulba_muzero_pong
preset's agent on the same initial parameters and the same batch of real Pong-v5 frames, per stack.

  python stack_check.py data data.pkl           # 65 steps of 8 Pong envs (random play) + initial params
  VENV_A/bin/python stack_check.py run data.pkl a.pkl   # in each stack's virtualenv: the first gradient,
  VENV_B/bin/python stack_check.py run data.pkl b.pkl   # 60 steps on one batch of 128 items, the search
  python stack_check.py cmp a.pkl b.pkl

An older stack installs beside the README's with `pip install -e . "gymnax==1.0.0"` (JAX 0.6.2).
docs/benchmarks.md ("The JAX version") has the figures.
"""

import pickle
import sys

import numpy as np

mode = sys.argv[1]
if mode == "cmp":
    a, b = (pickle.load(open(p, "rb")) for p in sys.argv[2:4])
    print("versions", a["versions"], b["versions"])
    for name in ("losses", "value_loss", "policy_loss", "reward_loss", "consistency_loss"):
        x, y = np.asarray(a[name]), np.asarray(b[name])
        print(f"{name:18s} step0 {x[0]:.7f} {y[0]:.7f}  step9 {x[9]:.5f} {y[9]:.5f}  last {x[-1]:.5f} {y[-1]:.5f}")
    for name in ("grad0_norm", "params1_delta_norm"):
        print(name, a[name], b[name])
    ga, gb = a["grad0_flat"], b["grad0_flat"]
    print("grad0 relative diff", np.linalg.norm(ga - gb) / np.linalg.norm(ga))
    for name in ("search_logits", "search_value", "root_value"):
        x, y = np.asarray(a[name]), np.asarray(b[name])
        print(name, "max abs diff", np.max(np.abs(x - y)), "scale", np.max(np.abs(x)))
    print("actions equal", np.mean(np.asarray(a["actions"]) == np.asarray(b["actions"])))
    print("search entropy", a["search_entropy"], b["search_entropy"])
    sys.exit()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from podray import config as config_lib  # noqa: E402
from podray.agents import ActorOut, Trajectory, build_agent  # noqa: E402
from podray.envs.spec import EnvSpec  # noqa: E402

config = config_lib.load("sebulba_muzero_pong", [])
spec = EnvSpec("Pong-v5", (84, 84, 4), "uint8", 6)
agent = build_agent(config, spec, 4883, 1)

if mode == "data":
    import envpool

    env = envpool.make("Pong-v5", env_type="gym", num_envs=8, seed=0, episodic_life=True, reward_clip=True)
    rng = np.random.default_rng(0)
    obs, _ = env.reset()
    frames, actions, rewards, discounts = [np.asarray(obs)], [], [], []
    # Uniform random play; the last 64 steps (some with points scored) make the batch.
    for _ in range(200):
        a = rng.integers(0, 6, 8)
        obs, r, term, trunc, _ = env.step(a)
        frames.append(np.asarray(obs))
        actions.append(a)
        rewards.append(r)
        discounts.append(1.0 - term.astype(np.float32))
    frames = np.stack(frames)  # [T+1, B, 4, 84, 84] (envpool) or already HWC
    if frames.shape[-1] != 4:
        frames = np.moveaxis(frames, 2, -1)
    state = agent.init(jax.random.PRNGKey(0))
    data = dict(
        obs=frames[-65:],
        action=np.stack(actions)[-64:].astype(np.int32),
        reward=np.stack(rewards)[-64:].astype(np.float32),
        discount=np.stack(discounts)[-64:].astype(np.float32),
        logits=rng.normal(size=(64, 8, 6)).astype(np.float32),
        value=rng.normal(size=(64, 8)).astype(np.float32),
        params=jax.device_get(state.params.network),
    )
    print("rewards nonzero", np.count_nonzero(data["reward"]), "obs", data["obs"].shape, data["obs"].dtype)
    pickle.dump(data, open(sys.argv[2], "wb"))
    sys.exit()

data = pickle.load(open(sys.argv[2], "rb"))
state = agent.init(jax.random.PRNGKey(0))
ref = jax.tree_util.tree_structure(state.params.network)
network = jax.tree_util.tree_unflatten(ref, jax.tree_util.tree_leaves(data["params"]))
network = jax.tree.map(jnp.asarray, network)
traj = Trajectory(
    obs=jnp.asarray(data["obs"]),
    action=jnp.asarray(data["action"]),
    reward=jnp.asarray(data["reward"]),
    discount=jnp.asarray(data["discount"]),
    actor_out=ActorOut(logits=jnp.asarray(data["logits"]), value=jnp.asarray(data["value"])),
)
items = jax.jit(agent.items)(network, traj)
flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:128], items)

grads, _ = jax.jit(lambda n: jax.grad(agent.replay_loss, has_aux=True)(n, flat, None))(network)
gflat = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(grads)])


@jax.jit
def step(network, opt_state):
    updates, opt_state, metrics, _ = agent.learn_step(network, opt_state, flat, None, None)
    return jax.tree.map(jnp.add, network, updates), opt_state, metrics


opt_state = agent.optimizer.init(network)
n, o = network, opt_state
out = {k: [] for k in ("losses", "value_loss", "policy_loss", "reward_loss", "consistency_loss")}
for i in range(60):
    n, o, m = step(n, o)
    if i == 0:
        delta = jax.tree.map(lambda a, b: a - b, n, network)
        out["params1_delta_norm"] = float(np.sqrt(sum(float(jnp.sum(x**2)) for x in jax.tree_util.tree_leaves(delta))))
    out["losses"].append(float(m["loss"]))
    for k in ("value_loss", "policy_loss", "reward_loss", "consistency_loss"):
        out[k].append(float(m[k]))

# The search on 8 observations from the initial parameters, and from those after the 60 steps.
from podray.agents.muzero import MuZeroParams  # noqa: E402

params = MuZeroParams(network=network, progress=jnp.float32(0.0))
obs = jnp.asarray(data["obs"][10])
action, actor_out = jax.jit(agent.act)(params, obs, jax.random.PRNGKey(3))
params_late = MuZeroParams(network=n, progress=jnp.float32(0.5))
action2, actor_out2 = jax.jit(agent.act)(params_late, obs, jax.random.PRNGKey(3))
p = jax.nn.softmax(actor_out2.logits)
out.update(
    versions=(jax.__version__,),
    grad0_norm=float(np.linalg.norm(gflat)),
    grad0_flat=gflat,
    search_logits=np.asarray(actor_out.logits),
    search_value=np.asarray(actor_out.value),
    root_value=np.asarray(actor_out2.value),
    actions=np.concatenate([np.asarray(action), np.asarray(action2)]),
    search_entropy=float(-jnp.mean(jnp.sum(p * jnp.log(p + 1e-12), -1))),
)
pickle.dump(out, open(sys.argv[3], "wb"))
print("done", jax.__version__, out["losses"][0], out["losses"][-1])
