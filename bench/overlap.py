"""What ``ost.async_load`` buys: compiling the step while the weights arrive.

    .venv/bin/python bench/overlap.py              # the 1.1 GB checkpoint of bench/load.py, 5 repeats
    .venv/bin/python bench/overlap.py --quick      # ~0.1 GB, 1 repeat

A serving or training job starts by loading its weights and compiling its
step; neither needs the other until the first call. Each run is a fresh
process (cold memory, 8 host CPU devices, FSDP target as in ``bench/load.py``)
that does, timed from before the load to the compiled step's first result:

* ``sequential``: ``ost.load(...)``, then ``jax.jit(step).lower(...).compile()``;
* ``overlapped``: ``ost.async_load(...)``, the same compile, then ``.result()``.

The step is a forward pass of the llama-like model (every layer's projections
and MLP, unrolled, so that its compile takes about as long as the load). The
two modes alternate run by run; the table gives ``median [min–max]`` seconds
and the saving. On a 2-CPU machine the compile and the reads compete for the
same cores, so the saving is bounded by how much of the load is waiting
(page faults, I/O) rather than computing.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common
from common import Probe, machine_line, model_spec, publish, report_result, run_undisturbed, spread
from load import MAX_SHARD_SIZE, QUICK_MAX_SHARD_SIZE, build_target, checkpoint_files, ensure_checkpoint, warm_page_cache

MODES = ("sequential", "overlapped")


def forward(params: dict, tokens, layers: int):
    """Logits of a llama-like forward pass (no attention softmax: the compile is the point)."""
    import jax.numpy as jnp

    x = params["model.embed_tokens.weight"][tokens]
    for i in range(layers):
        p = f"model.layers.{i}."
        h = x * params[p + "input_layernorm.weight"]
        q = h @ params[p + "self_attn.q_proj.weight"].T
        v = h @ params[p + "self_attn.v_proj.weight"].T
        k = h @ params[p + "self_attn.k_proj.weight"].T
        x = x + (q * jnp.tile(k * v, (1, q.shape[-1] // k.shape[-1]))) @ params[p + "self_attn.o_proj.weight"].T
        h = x * params[p + "post_attention_layernorm.weight"]
        gate = h @ params[p + "mlp.gate_proj.weight"].T
        up = h @ params[p + "mlp.up_proj.weight"].T
        x = x + (gate * up) @ params[p + "mlp.down_proj.weight"].T
    return (x * params["model.norm.weight"]) @ params["lm_head.weight"].T


def worker(args) -> None:
    import json

    import jax
    import jax.numpy as jnp
    import orbax_safetensors as ost

    home = Path(args.home)
    spec = json.loads((home / "spec.json").read_text())
    target = build_target(spec, "fsdp")
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    step = jax.jit(lambda p, t: forward(p, t, spec["layers"]))
    path = str(home / "checkpoint")
    with Probe() as probe:
        if args.mode == "sequential":
            params = ost.load(path, target)
            compiled = step.lower(target, tokens).compile()
        else:
            loading = ost.async_load(path, target)
            compiled = step.lower(target, tokens).compile()
            params = loading.result()
        logits = compiled(params, jnp.zeros((8, 16), jnp.int32))
        jax.block_until_ready(logits)
    report_result({"ok": True, **probe.report})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/ost-bench", help="checkpoint cache (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per mode (5)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    repeats = args.repeats or (1 if args.quick else 5)
    spec = model_spec(0.1 if args.quick else 1.1, QUICK_MAX_SHARD_SIZE if args.quick else MAX_SHARD_SIZE)
    home = ensure_checkpoint(Path(args.dir), spec)
    files = checkpoint_files(home / "checkpoint")
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for repeat in range(repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            def run() -> dict:
                warm_page_cache(files)
                return common.run_worker(Path(__file__).resolve(), ["--home", str(home), "--mode", mode])
            result = run_undisturbed(run)
            results[mode].append(result)
            print(f"[{repeat + 1}/{repeats}] {mode}: " + (f"{result['seconds']:.2f} s" if result["ok"]
                  else "failed: " + result["error"]), file=sys.stderr, flush=True)
    seconds = {m: [r["seconds"] for r in results[m] if r["ok"]] for m in MODES}
    lines = [
        f"### Load + compile, sequential vs `ost.async_load`: {spec['bytes'] / 1e9:.2f} GB, FSDP on 8 CPU devices, cold",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')})",
        f"- machine: {machine_line()}",
        "- timed in a fresh process: load + compile of a llama-like forward step + its first call; "
        f"modes alternate, {repeats} of each, `median [min–max]` seconds",
        "",
        "| mode | seconds | saved vs sequential |",
        "|---|---|---:|",
    ]
    base = statistics.median(seconds["sequential"]) if seconds["sequential"] else None
    for mode in MODES:
        if not seconds[mode]:
            lines.append(f"| {mode} | failed | |")
            continue
        saved = f"{base - statistics.median(seconds[mode]):.2f} s" if base and mode != "sequential" else ""
        lines.append(f"| {mode} | {spread(seconds[mode])} | {saved} |")
    table = "\n".join(lines) + "\n"
    publish(table, "overlap-quick.md" if args.quick else "overlap.md")


if __name__ == "__main__":
    main()
