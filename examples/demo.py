"""Save a sharded llama-like model as safetensors, reload it under another sharding.

    bash scripts/demo.sh [--dir DIR] [--layers N]

Runs on whatever devices JAX has; on a CPU-only machine it asks XLA for 8
host devices so the shardings are real.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import orbax_safetensors as ost


def llama_like(layers: int, hidden: int, vocab: int) -> dict:
    """Random bf16 weights with the names and shapes of a small Llama."""
    key = jax.random.key(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (hidden, hidden),
            prefix + "self_attn.k_proj.weight": (hidden, hidden),
            prefix + "self_attn.v_proj.weight": (hidden, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, hidden),
            prefix + "mlp.gate_proj.weight": (4 * hidden, hidden),
            prefix + "mlp.up_proj.weight": (4 * hidden, hidden),
            prefix + "mlp.down_proj.weight": (hidden, 4 * hidden),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
    keys = jax.random.split(key, len(shapes))
    return {name: jax.random.normal(k, shape, jnp.bfloat16) for k, (name, shape) in zip(keys, shapes.items())}


def shard(params: dict, mesh: Mesh, axis: int) -> dict:
    """Shards every matrix along ``axis`` (0: FSDP rows, 1: tensor-parallel columns)."""
    def spec(x):
        dims = [None] * x.ndim
        if x.ndim == 2:
            dims[axis] = "devices"
        return NamedSharding(mesh, P(*dims))
    return {n: jax.device_put(x, spec(x)) for n, x in params.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write, kept afterwards (default: a temporary "
                                      "directory, removed at the end)")
    parser.add_argument("--scratch", metavar="DIR",
                        help="where to write when no --dir is given: a temporary directory that "
                             "the caller removes (scripts/demo.sh's, removed however it ends)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each step as it happens, through a pipe too

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("devices",))
    print(f"{len(devices)} {devices[0].platform} devices, {jax.process_count()} process(es)")
    params = shard(llama_like(args.layers, args.hidden, args.vocab), mesh, axis=0)
    nbytes = sum(x.nbytes for x in params.values())
    print(f"model: {len(params)} tensors, {nbytes / 1e6:.1f} MB bf16, FSDP-sharded (rows)")

    if args.dir or args.scratch:
        run(params, mesh, os.path.join(args.dir or args.scratch, "checkpoint"))
    else:
        with tempfile.TemporaryDirectory(prefix="ost-demo-") as directory:  # gone however it ends
            run(params, mesh, os.path.join(directory, "checkpoint"))
    print(closing_line(args.dir))


def closing_line(kept: str | None) -> str:
    """Where the checkpoint is, or how to keep one: the demo's only trace once it has ended."""
    # The console script next to this interpreter: a venv's bin/ is rarely on PATH.
    cli = os.path.join(os.path.dirname(sys.executable), "orbax-safetensors")
    if not os.path.exists(cli) or shutil.which("orbax-safetensors") == cli:
        cli = "orbax-safetensors"
    else:
        cli = _shown(cli)
    if kept:
        checkpoint = shlex.quote(os.path.join(kept, "checkpoint"))
        return f"checkpoint kept in {checkpoint}; inspect it with: {cli} inspect {checkpoint}"
    script = _shown(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "scripts", "demo.sh"))
    return (f"checkpoint removed; keep one with: bash {script} --dir ./demo-ckpt, "
            f"then: {cli} inspect ./demo-ckpt/checkpoint")


def _shown(path: str) -> str:
    """``path`` for a command line typed where the demo runs: relative when below it."""
    relative = os.path.relpath(path)
    if relative.startswith(".."):
        return shlex.quote(path)
    return shlex.quote(relative if os.sep in relative else os.path.join(".", relative))


def run(params: dict, mesh: Mesh, path: str) -> None:
    nbytes = sum(x.nbytes for x in params.values())
    start = time.perf_counter()
    ost.save(path, params, max_shard_size="100MB", overwrite=True)
    saved = time.perf_counter() - start
    files = sorted(os.listdir(path))
    print(f"saved to {path} in {saved:.2f} s ({nbytes / saved / 1e9:.2f} GB/s): "
          f"{len(files)} files: {', '.join(files)}")

    target = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s.sharding)
              for n, x in params.items() for s in [shard({n: x}, mesh, axis=1)[n]]}
    start = time.perf_counter()
    restored = ost.load(path, target=target)
    loaded = time.perf_counter() - start
    print(f"loaded back tensor-parallel (columns) in {loaded:.2f} s ({nbytes / loaded / 1e9:.2f} GB/s)")

    for name, value in params.items():
        assert restored[name].sharding == target[name].sharding, name
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value))
    print(f"verified: all {len(params)} tensors equal, each with its new sharding")
    example = "model.layers.0.mlp.up_proj.weight"
    print(f"  e.g. {example}: saved {params[example].sharding.spec}, "
          f"loaded {restored[example].sharding.spec}")


if __name__ == "__main__":
    main()
