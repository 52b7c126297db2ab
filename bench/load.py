"""Load throughput of ``ost.load`` against its peers, on the same data, in one run.

    .venv/bin/python bench/load.py                 # ~1.1 GB checkpoint, 3 repeats
    .venv/bin/python bench/load.py --quick         # ~0.1 GB, 1 repeat: a smoke test
    .venv/bin/python bench/load.py --shardings fsdp --contenders ours,safe_open --repeats 5

What it measures: the wall time of loading a synthetic llama-like bf16 checkpoint
(75 tensors, HF sharded directory with ``model.safetensors.index.json``, written
once by ``ost.save(..., max_shard_size="500MB")`` and cached under ``--dir``) into
``jax.Array``s on 8 host CPU devices, for three target shardings over a 1-D mesh:

* ``fsdp``: every 2-D tensor ``P("x", None)`` (rows), 1-D tensors replicated;
* ``tensor_parallel``: every 2-D tensor ``P(None, "x")`` (columns), 1-D replicated;
* ``replicated``: ``P()`` for everything (each of the 8 devices holds all of it).

Contenders:

* ``ours``: ``ost.load(path, target)``, target a flat dict of
  ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``;
* ``orbax_layout``: Orbax's own v1 ``SafetensorsLayout().load(path, abstract_state=target)``
  (default Orbax context), awaited;
* ``safe_open``: ``safetensors.safe_open(file, framework="numpy")`` over the index's
  files, ``get_tensor`` per tensor, then ``jax.device_put(array, sharding)``
  (the installed safetensors, 0.8.0, returns bf16 as an ``ml_dtypes.bfloat16``
  numpy array, so no ``framework="flax"`` detour is needed).

The timed region is the load call plus ``jax.block_until_ready`` of every result,
nothing else: imports, backend start-up and building the target happen before, and
checking the result (shapes, dtypes, shardings, and the first/last rows of a few
tensors against values saved next to the checkpoint) after. Peak RSS is the
worker's ``VmHWM`` (its own high-water mark; ``ru_maxrss`` would inherit the
parent's peak, see ``peak_rss``) read right after the timed region; "RSS
growth" is that peak minus the RSS right before the load. On CPU the "device" buffers live in host memory,
so RSS includes the loaded arrays themselves (8 copies of everything when
replicated).

Why fresh processes: every run starts from the same state (no allocator pools,
jit caches, thread pools or imported-module side effects left by an earlier
contender), and peak RSS is per contender. Why alternation (ours, orbax,
safe_open, ours, ...): slow drifts of the machine (other tenants, thermal state,
memory fragmentation) fall on every contender alike instead of on whichever ran
last; the table shows medians.

Page cache: this is a warm-cache measurement. Before every run the parent reads
every checkpoint file once (untimed), so each contender finds the whole
checkpoint in the page cache; the numbers are the loaders' CPU/memory cost, not
the disk's.

Memory: on a VM whose guest returns freed pages to the host (virtio-balloon free
page reporting, e.g. Firecracker), the first touch of freshly freed memory is
several times slower than on bare metal, and how much of it is "cold" depends on
what ran just before, which makes runs noisy and can favour whoever follows a
big process. ``--prefault-gb N`` touches and frees N GB in the parent before
every run (untimed), so every contender starts with that much host-backed free
memory. Off by default; the header says when it was on.

Results go to stdout and to ``bench/results/load.md`` (``load-quick.md`` with
``--quick``, whose checkpoint uses ``max_shard_size="50MB"`` so that it too is a
sharded directory with an index), as a markdown table ready to paste into the README.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common
from common import (
    BENCH_DIR,
    current_rss,
    fmt_gb,
    llama_shapes,
    machine_line,
    mesh_1d,
    model_spec,
    partition_spec,
    peak_rss,
    prefault_memory,
    report_result,
    versions_line,
)

SHARDINGS = ("fsdp", "tensor_parallel", "replicated")
CONTENDERS = ("ours", "orbax_layout", "safe_open")
MAX_SHARD_SIZE = "500MB"
QUICK_MAX_SHARD_SIZE = "50MB"  # --quick: still a sharded dir with an index
CONTENDER_NOTES = {
    "ours": "`ost.load(path, target)`",
    "orbax_layout": "Orbax v1 `SafetensorsLayout().load(path, abstract_state=target)`, default context",
    "safe_open": "`safetensors.safe_open(f, framework=\"numpy\").get_tensor(name)` → "
                 "`jax.device_put(x, sharding)`, tensor by tensor",
}


# ---------------------------------------------------------------------------
# The synthetic checkpoint.


def checked_names(spec: dict) -> list[str]:
    """The tensors whose first and last rows every worker compares with the source."""
    last = spec["layers"] - 1
    return ["model.embed_tokens.weight", f"model.layers.{spec['layers'] // 2}.self_attn.q_proj.weight",
            f"model.layers.{last}.mlp.down_proj.weight", f"model.layers.{last}.input_layernorm.weight",
            "model.norm.weight", "lm_head.weight"]


def random_bf16(rng, shape):
    """Random finite bf16 values: uniform bit patterns below the inf/NaN exponent, random sign."""
    import ml_dtypes
    import numpy as np
    bits = rng.integers(0, 0x7F80, size=shape, dtype=np.uint16)
    bits |= (rng.integers(0, 2, size=shape, dtype=np.uint16) << 15).astype(np.uint16)
    return bits.view(ml_dtypes.bfloat16)


def ensure_checkpoint(root: Path, spec: dict) -> Path:
    """The cached checkpoint for ``spec`` under ``root``, written if absent or different."""
    import numpy as np

    home = root / f"llama-l{spec['layers']}-h{spec['hidden']}-f{spec['ffn']}-v{spec['vocab']}"
    checkpoint = home / "checkpoint"
    spec_file = home / "spec.json"
    if spec_file.exists() and (home / "expected.npz").exists():
        try:
            if json.loads(spec_file.read_text()) == spec:
                return home
        except ValueError:
            pass
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    import orbax_safetensors as ost

    print(f"writing a {spec['bytes'] / 1e9:.2f} GB checkpoint to {checkpoint} (once) ...",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    rng = np.random.default_rng(spec["seed"])
    shapes = llama_shapes(spec["hidden"], spec["ffn"], spec["vocab"], spec["layers"])
    params = {name: random_bf16(rng, shape) for name, shape in shapes.items()}
    ost.save(checkpoint, params, max_shard_size=spec["max_shard_size"])
    expected = {}
    for name in checked_names(spec):
        bits = params[name].view(np.uint16)
        expected[name + "/head"] = bits[:4].copy()
        expected[name + "/tail"] = bits[-4:].copy()
    np.savez(home / "expected.npz", **expected)
    spec_file.write_text(json.dumps(spec, indent=1))  # last: marks the cache complete
    print(f"  written in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return home


def weight_map(checkpoint: Path) -> dict[str, str]:
    """Tensor name -> file name, from the index (or the single file's header)."""
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    with open(checkpoint / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: "model.safetensors" for name in header if name != "__metadata__"}


def checkpoint_files(checkpoint: Path) -> list[Path]:
    return [checkpoint / f for f in sorted(set(weight_map(checkpoint).values()))]


def warm_page_cache(files: list[Path]) -> None:
    """Reads every file once so that it is in the page cache (untimed)."""
    buffer = bytearray(64 << 20)
    view = memoryview(buffer)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


# ---------------------------------------------------------------------------
# The worker: one contender, one sharding, in a fresh process.


def build_target(spec: dict, sharding_name: str) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    mesh = mesh_1d()
    shapes = llama_shapes(spec["hidden"], spec["ffn"], spec["vocab"], spec["layers"])
    return {name: jax.ShapeDtypeStruct(
                shape, jnp.bfloat16, sharding=NamedSharding(mesh, partition_spec(sharding_name, len(shape))))
            for name, shape in shapes.items()}


def load_ours(checkpoint: Path, target: dict, extra: dict):
    import dataclasses
    import orbax_safetensors as ost

    stats = ost.LoadStats()
    result = ost.load(str(checkpoint), target, stats=stats)
    extra["stats"] = stats
    extra["to_json"] = lambda: dataclasses.asdict(stats)
    return result


def load_orbax_layout(checkpoint: Path, target: dict, extra: dict):
    import asyncio
    from etils import epath
    from orbax.checkpoint.experimental.v1._src.layout.safetensors_layout import SafetensorsLayout

    async def run():
        layout = SafetensorsLayout()
        awaitable = await layout.load(epath.Path(checkpoint), abstract_state=target)
        return await awaitable

    return asyncio.run(run())


def load_safe_open(checkpoint: Path, target: dict, extra: dict):
    import jax
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, file in weight_map(checkpoint).items():
        by_file.setdefault(file, []).append(name)
    result = {}
    for file, names in sorted(by_file.items()):
        with safe_open(str(checkpoint / file), framework="numpy") as f:
            for name in names:
                result[name] = jax.device_put(f.get_tensor(name), target[name].sharding)
    return result


LOADERS = {"ours": load_ours, "orbax_layout": load_orbax_layout, "safe_open": load_safe_open}


def verify(result: dict, target: dict, spec: dict, expected_file: Path) -> None:
    import jax
    import numpy as np

    if set(result) != set(target):
        raise AssertionError(f"result names differ from target: {sorted(set(result) ^ set(target))[:5]}")
    for name, want in target.items():
        got = result[name]
        if not isinstance(got, jax.Array):
            raise AssertionError(f"{name}: got a {type(got).__name__}, not a jax.Array")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(f"{name}: got {got.shape} {got.dtype}, want {want.shape} {want.dtype}")
        if not got.sharding.is_equivalent_to(want.sharding, len(want.shape)):
            raise AssertionError(f"{name}: got sharding {got.sharding}, want {want.sharding}")
    expected = np.load(expected_file)
    for name in checked_names(spec):
        for part, rows in (("head", slice(None, 4)), ("tail", slice(-4, None))):
            got = np.asarray(result[name][rows]).view(np.uint16)
            if not np.array_equal(got, expected[f"{name}/{part}"]):
                raise AssertionError(f"{name}: {part} rows differ from the source")


def worker(args) -> None:
    home = Path(args.home)
    spec = json.loads((home / "spec.json").read_text())
    checkpoint = home / "checkpoint"
    import jax

    orbax_scalars: dict[str, float] = {}
    if args.contender == "orbax_layout":
        jax.monitoring.register_scalar_listener(
            lambda event, value, **_: orbax_scalars.__setitem__(event, value)
            if event.startswith("/jax/orbax/read/safetensors/") else None)
    target = build_target(spec, args.sharding)
    loader = LOADERS[args.contender]
    extra: dict = {}

    baseline = current_rss()
    started = time.perf_counter()
    result = loader(checkpoint, target, extra)
    jax.block_until_ready(result)
    seconds = time.perf_counter() - started
    peak = peak_rss()

    verify(result, target, spec, home / "expected.npz")
    report = {
        "ok": True, "seconds": seconds,
        "bytes": sum(int(x.nbytes) for x in result.values()),
        "tensors": len(result), "peak_rss": peak, "baseline_rss": baseline,
    }
    if "to_json" in extra:
        report["load_stats"] = extra["to_json"]()
    if orbax_scalars:
        report["orbax_read"] = {k.rsplit("/", 1)[1]: v for k, v in orbax_scalars.items()}
    report_result(report)


# ---------------------------------------------------------------------------
# The parent: runs the workers, alternating, and prints the table.


def run_worker(home: Path, contender: str, sharding: str) -> dict:
    return common.run_worker(Path(__file__).resolve(), [
        "--home", str(home), "--contender", contender, "--sharding", sharding])


def render(spec: dict, files: list[Path], results: dict, args, wall: float) -> str:
    total = sum(p.stat().st_size for p in files)
    lines = [
        f"### `ost.load` vs peers: {spec['bytes'] / 1e9:.2f} GB bf16 checkpoint, 8 CPU devices",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"whole benchmark {wall:.0f} s)",
        f"- machine: {machine_line()}",
        f"- versions: {versions_line()}",
        f"- checkpoint: {len(llama_shapes(spec['hidden'], spec['ffn']))} tensors, "
        f"{spec['bytes'] / 1e9:.3f} GB of tensor data in {len(files)} files ({total / 1e9:.3f} GB), "
        f"llama-like (layers {spec['layers']}, hidden {spec['hidden']}, ffn {spec['ffn']}, "
        f"vocab {spec['vocab']}), HF sharded dir, `max_shard_size=\"{spec['max_shard_size']}\"`",
        f"- **warm page cache**: every file read once by the parent right before each run. "
        f"Each run is a fresh Python process (`JAX_PLATFORMS=cpu`, 8 host devices, 1-D mesh); "
        f"contenders alternate; medians of {args.repeats} run(s). Timed: the load call + "
        f"`block_until_ready`. GB = 1e9 bytes; GB/s = tensor bytes / median seconds."
        + (f" Before every run the parent also touched and freed {args.prefault_gb:g} GB of memory "
           f"(`--prefault-gb`), so that free memory is host-backed on VMs with free page reporting."
           if args.prefault_gb else ""),
        "- RSS: peak = the worker's `VmHWM` (its own high-water mark) right after the load; growth = peak − RSS "
        "just before the load. CPU \"device\" arrays live in host RAM, so both include the "
        "loaded arrays (×8 when replicated).",
        "",
        "| sharding | contender | seconds (median) | GB/s | peak RSS (GB) | RSS growth (GB) "
        "| ours ÷ this (GB/s) | runs (s) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    notes = []
    for sharding in args.shardings:
        ours = results[sharding].get("ours", [])
        ours_ok = [r for r in ours if r["ok"]]
        ours_s = statistics.median(r["seconds"] for r in ours_ok) if ours_ok else None
        for contender in args.contenders:
            runs = results[sharding][contender]
            ok = [r for r in runs if r["ok"]]
            failed = [r for r in runs if not r["ok"]]
            if not ok:
                error = failed[0]["error"].replace("|", "\\|") if failed else "not run"
                lines.append(f"| {sharding} | {contender} | failed: {error} | | | | | |")
                continue
            seconds = statistics.median(r["seconds"] for r in ok)
            size = statistics.median(r["bytes"] for r in ok)
            peak = statistics.median(r["peak_rss"] for r in ok)
            growth = statistics.median(r["peak_rss"] - r["baseline_rss"] for r in ok)
            if contender == "ours":
                ratio = "1.00"
            elif ours_s is not None:
                ratio = f"{seconds / ours_s:.2f}"
            else:
                ratio = "n/a"
            all_runs = ", ".join(f"{r['seconds']:.2f}" for r in ok)
            if failed:
                all_runs += f"; {len(failed)} failed: {failed[0]['error'].replace('|', '/')}"
            lines.append(f"| {sharding} | {contender} | {seconds:.2f} | {size / seconds / 1e9:.2f} "
                         f"| {fmt_gb(peak)} | {fmt_gb(growth)} | {ratio} | {all_runs} |")
            if contender == "ours" and ok and "load_stats" in ok[0]:
                s = ok[len(ok) // 2]["load_stats"]
                notes.append(f"  - {sharding}: bytes_needed {fmt_gb(s['bytes_needed'])} GB, "
                             f"bytes_read {fmt_gb(s['bytes_read'])} GB, {s['requests']} requests, "
                             f"{s['files']} files, {s['tensors']} tensors")
            if contender == "orbax_layout" and ok and "orbax_read" in ok[0]:
                s = ok[len(ok) // 2]["orbax_read"]
                notes.append(f"  - {sharding} (orbax_layout, its `jax.monitoring` scalars): "
                             f"bytes_read {fmt_gb(s.get('bytes_read', 0))} GB, "
                             f"{int(s.get('num_reads', 0))} coalesced reads, "
                             f"{int(s.get('storage_reads', 0))} storage reads")
    lines += ["", "Contenders: " + "; ".join(f"**{c}**: {CONTENDER_NOTES[c]}" for c in args.contenders)
              + ". safe_open's numpy backend returns bf16 as `ml_dtypes.bfloat16` in this "
              "safetensors, so no `framework=\"flax\"` detour is needed."]
    if notes:
        lines += ["", "Read accounting (median run):", *notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/ost-bench", help="checkpoint cache (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per contender and sharding (3)")
    parser.add_argument("--shardings", default=",".join(SHARDINGS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--size-gb", type=float, default=None, help="checkpoint size (1.1)")
    parser.add_argument("--quick", action="store_true", help="~0.1 GB model, 1 repeat: a smoke test")
    parser.add_argument("--prefault-gb", type=float, default=0.0,
                        help="touch and free this many GB before every run (VMs with free page reporting)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--sharding", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    args.repeats = args.repeats or (1 if args.quick else 3)
    args.size_gb = args.size_gb or (0.1 if args.quick else 1.1)
    args.shardings = [s for s in args.shardings.split(",") if s]
    args.contenders = [c for c in args.contenders.split(",") if c]
    for s in args.shardings:
        if s not in SHARDINGS:
            parser.error(f"unknown sharding {s!r}; choose from {', '.join(SHARDINGS)}")
    for c in args.contenders:
        if c not in CONTENDERS:
            parser.error(f"unknown contender {c!r}; choose from {', '.join(CONTENDERS)}")

    started = time.perf_counter()
    spec = model_spec(args.size_gb, QUICK_MAX_SHARD_SIZE if args.quick else MAX_SHARD_SIZE)
    home = ensure_checkpoint(Path(args.dir), spec)
    files = checkpoint_files(home / "checkpoint")
    results = {s: {c: [] for c in args.contenders} for s in args.shardings}
    for sharding in args.shardings:
        for repeat in range(args.repeats):
            for contender in args.contenders:
                if args.prefault_gb:
                    prefault_memory(args.prefault_gb)
                warm_page_cache(files)
                result = run_worker(home, contender, sharding)
                results[sharding][contender].append(result)
                shown = (f"{result['seconds']:.2f} s, {result['bytes'] / result['seconds'] / 1e9:.2f} GB/s, "
                         f"peak RSS {fmt_gb(result['peak_rss'])} GB" if result["ok"]
                         else "failed: " + result["error"])
                print(f"[{sharding} {repeat + 1}/{args.repeats}] {contender}: {shown}",
                      file=sys.stderr, flush=True)
    table = render(spec, files, results, args, time.perf_counter() - started)
    out = BENCH_DIR / "results" / ("load-quick.md" if args.quick else "load.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    print(table)
    print(f"(written to {out.relative_to(BENCH_DIR.parent)})", file=sys.stderr)


if __name__ == "__main__":
    main()
