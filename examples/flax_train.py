"""Train a small Flax model with an Orbax CheckpointManager that writes params as safetensors.

    pip install "orbax_safetensors[examples]"
    python examples/flax_train.py [--directory DIR] [--steps N]

Runs on whatever devices JAX sees (CPU, GPU, TPU; several hosts too). The
params are sharded over all devices (FSDP on the hidden dimension), the
optimizer state is saved in Orbax's own format next to them, every step is
saved asynchronously and the last two are kept. Afterwards a fresh manager
restores the latest step into the same shardings and training resumes where
it stopped; each step's ``params`` directory is an HF safetensors checkpoint.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import orbax_safetensors as ost


class MLP(nn.Module):
    hidden: int = 256

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(self.hidden)(x))
        x = nn.gelu(nn.Dense(self.hidden)(x))
        return nn.Dense(1)(x)


def shardings(tree, mesh):
    """FSDP: split each matrix's largest dimension that divides evenly; replicate the rest."""
    def spec(x):
        for axis in np.argsort(x.shape)[::-1]:
            if x.shape[axis] % mesh.size == 0:
                return NamedSharding(mesh, P(*[("devices" if a == axis else None)
                                               for a in range(x.ndim)]))
        return NamedSharding(mesh, P())
    return jax.tree.map(spec, tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", default=os.path.join(tempfile.mkdtemp(), "checkpoints"))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    mesh = Mesh(np.array(jax.devices()), ("devices",))
    model, optimizer = MLP(), optax.adam(3e-3)
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((64, 16)).astype(np.float32)
    targets = np.sin(inputs.sum(axis=1, keepdims=True))

    def init():
        params = model.init(jax.random.key(0), inputs[:1])["params"]
        return params, optimizer.init(params)

    abstract = jax.eval_shape(init)
    out_shardings = shardings(abstract, mesh)
    params, opt_state = jax.jit(init, out_shardings=out_shardings)()

    def loss_fn(params):
        return jnp.mean((model.apply({"params": params}, inputs) - targets) ** 2)

    @jax.jit
    def train_step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(args.directory, options=options) as mngr:
        for step in range(args.steps):
            params, opt_state, loss = train_step(params, opt_state)
            mngr.save(step, args=ocp.args.Composite(
                params=ost.SafetensorsSave(params, metadata={"step": str(step)}),
                opt_state=ocp.args.StandardSave(opt_state)))
            print(f"step {step}: loss {float(loss):.5f}")
        mngr.wait_until_finished()
        kept = mngr.all_steps()
    next_loss = float(train_step(params, opt_state)[2])

    # A fresh manager (think: a restarted job) resumes from the latest step.
    abstract_params, abstract_opt = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, out_shardings)
    with ocp.CheckpointManager(args.directory) as mngr:
        step = mngr.latest_step()
        restored = mngr.restore(step, args=ocp.args.Composite(
            params=ost.SafetensorsRestore(abstract_params),
            opt_state=ocp.args.StandardRestore(abstract_opt)))
    resumed_loss = float(train_step(restored["params"], restored["opt_state"])[2])
    print(f"kept steps {kept}; restored step {step}; next loss {resumed_loss:.5f} "
          f"(uninterrupted: {next_loss:.5f})")
    if resumed_loss != next_loss:
        raise SystemExit("the restored state does not continue training identically")

    item = os.path.join(args.directory, str(step), "params")
    info = ost.metadata(item)
    print(f"{item}: {sorted(os.listdir(item))}")
    for name, tensor in info.tensors.items():
        print(f"  {name}: {tensor.dtype}{list(tensor.shape)}")


if __name__ == "__main__":
    main()
