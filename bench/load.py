"""Load throughput of ``ost.load`` against its peers, on the same data, in one run.

    .venv/bin/python bench/load.py                 # ~1.1 GB checkpoint, 5 repeats, cold and warm
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

Memory, cold and warm: on a VM whose guest returns freed pages to its host
(virtio-balloon free page reporting, e.g. Firecracker), the first touch of
fresh memory is several times slower than on bare metal, and how much of it is
cold depends on what ran just before and how long ago. Users load in fresh
processes, so every contender runs both ways: *cold*, a fresh worker with
nothing prefaulted, and *warm*, the same after a child of the worker touched
and freed 4 GB right before the timed region (after imports and building the
target, so that the pages are still host-backed when the load starts). Runs
alternate contender by contender and cold/warm (which goes first flips every
repeat), 5 repeats by default. Each run counts its minor page faults and the
transparent huge pages faulted system-wide, which is where the cold penalty
shows; a run during which other processes used the CPU is discarded and run
again (``common.Probe``, ``common.run_undisturbed``).

Results go to stdout and to ``bench/results/load.md`` (``load-quick.md`` with
``--quick``, whose checkpoint uses ``max_shard_size="50MB"`` so that it too is a
sharded directory with an index), as a markdown table ready to paste into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common
import peers
from common import (
    cached,
    CONDITION_NOTES,
    CONDITIONS,
    current_rss,
    fmt_gb,
    llama_shapes,
    machine_line,
    mesh_1d,
    model_spec,
    partition_spec,
    peak_rss,
    prefault_memory_in_child,
    Probe,
    publish,
    report_result,
    reset_peak_rss,
    run_undisturbed,
    spread,
    versions_line,
    WARM_GB,
)

SHARDINGS = ("fsdp", "tensor_parallel", "replicated")
CONTENDERS = ("ours", "ours_noverify", "ours_google", "orbax_layout", "safe_open", "runai",
              "fastsafetensors")
MAX_SHARD_SIZE = "500MB"
QUICK_MAX_SHARD_SIZE = "50MB"  # --quick: still a sharded dir with an index
CONTENDER_NOTES = {
    "ours": "`ost.load(path, target)` (checks the block checksums of what it reads)",
    "ours_noverify": "`ost.load(path, target, verify_checksums=False)`",
    "ours_google": "`ours` hashing with google-crc32c (the `crc32c` package hidden, as without "
                   "the `crc32c` extra)",
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
    if cached(home, spec, "expected.npz"):
        return home
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


def load_ours(checkpoint: Path, target: dict, extra: dict, verify: bool = True):
    import dataclasses
    import orbax_safetensors as ost

    stats = ost.LoadStats()
    # The default call as users write it (and as every revision takes it: bench/revisions.py).
    unverified = {} if verify else {"verify_checksums": False}
    result = ost.load(str(checkpoint), target, stats=stats, **unverified)
    extra["stats"] = stats
    extra["to_json"] = lambda: dataclasses.asdict(stats)
    return result


def load_ours_noverify(checkpoint: Path, target: dict, extra: dict):
    return load_ours(checkpoint, target, extra, verify=False)


def load_ours_google(checkpoint: Path, target: dict, extra: dict):
    return load_ours(checkpoint, target, extra)  # prepare() hid the crc32c package


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


LOADERS = {"ours": load_ours, "ours_noverify": load_ours_noverify, "ours_google": load_ours_google,
           "orbax_layout": load_orbax_layout, "safe_open": load_safe_open,
           "runai": peers.load_runai, "fastsafetensors": peers.load_fastsafetensors}
PACKAGES = {"ours": "orbax_safetensors", "ours_noverify": "orbax_safetensors", "ours_google": "orbax_safetensors",
            "orbax_layout": "orbax.checkpoint.experimental.v1._src.layout.safetensors_layout",
            "safe_open": "safetensors"}
CONTENDER_NOTES.update({c: peers.CONTENDER_NOTES[c] for c in ("runai", "fastsafetensors")})


def available(contender: str) -> bool:
    """Whether the contender can run here (optional peers, the ``bench-peers`` extra, are
    skipped when not installed)."""
    if contender in peers.LOADERS:
        return peers.installed(contender)
    return importlib.util.find_spec(PACKAGES[contender].split(".")[0]) is not None


def prepare(contender: str) -> None:
    """Imports before the clock: a load's cost is not its imports."""
    if contender in peers.LOADERS:
        peers.prepare(contender)
    else:
        if contender == "ours_google":
            common.without_crc32c_extra()
        importlib.import_module(PACKAGES[contender])


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
    prepare(args.contender)
    extra: dict = {}
    if args.condition == "warm":
        prefault_memory_in_child(WARM_GB)
    reset_peak_rss()

    baseline = current_rss()
    with Probe() as probe:
        result = loader(checkpoint, target, extra)
        jax.block_until_ready(result)
    peak = peak_rss()

    verify(result, target, spec, home / "expected.npz")
    report = {
        "ok": True, **probe.report,
        "bytes": sum(int(x.nbytes) for x in result.values()),
        "tensors": len(result), "peak_rss": peak, "baseline_rss": baseline,
    }
    if "to_json" in extra:
        report["load_stats"] = extra["to_json"]()
        report["hasher"] = common.hasher()
    if orbax_scalars:
        report["orbax_read"] = {k.rsplit("/", 1)[1]: v for k, v in orbax_scalars.items()}
    report_result(report)


# ---------------------------------------------------------------------------
# The parent: runs the workers, alternating, and prints the table.


def run_worker(home: Path, contender: str, sharding: str, condition: str) -> dict:
    return common.run_worker(Path(__file__).resolve(), [
        "--home", str(home), "--contender", contender, "--sharding", sharding,
        "--condition", condition])


def render(spec: dict, files: list[Path], results: dict, args, wall: float) -> str:
    total = sum(p.stat().st_size for p in files)
    lines = [
        f"### `ost.load` vs peers: {spec['bytes'] / 1e9:.2f} GB bf16 checkpoint, "
        f"{'8 CPU devices' if common.PLATFORM == 'cpu' else common.PLATFORM + ' devices'}, cold and warm",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"whole benchmark {wall:.0f} s)",
        f"- machine: {machine_line()}",
        f"- versions: {versions_line()}",
        f"- checkpoint: {len(llama_shapes(spec['hidden'], spec['ffn']))} tensors, "
        f"{spec['bytes'] / 1e9:.3f} GB of tensor data in {len(files)} files ({total / 1e9:.3f} GB), "
        f"llama-like (layers {spec['layers']}, hidden {spec['hidden']}, ffn {spec['ffn']}, "
        f"vocab {spec['vocab']}), HF sharded dir, `max_shard_size=\"{spec['max_shard_size']}\"`, "
        + ("in the page cache (the parent reads every file right before each run)" if args.page_cache == "warm"
           else f"read from the disk: the page cache dropped right before each run (the disk's own sequential "
                f"read: {args.disk_gbps:.2f} GB/s)"),
        f"- devices: {common.PLATFORM} (`OST_BENCH_PLATFORM`; the workers' mesh spans its devices)",
        f"- **cold**: {CONDITION_NOTES['cold']}; **warm**: {CONDITION_NOTES['warm']}. "
        f"Every run is a fresh Python process (`JAX_PLATFORMS={common.PLATFORM}`, 1-D mesh over its devices); "
        f"runs alternate contender by contender and cold/warm (which goes first alternates), "
        f"{args.repeats} of each; cells give `median [min–max]` seconds. Timed: the load call + "
        "`block_until_ready`. A run during which other processes used more than 0.05 s + 10% of "
        "its wall time of user CPU is discarded and run again (column *discarded*).",
        "- faults: the run's minor page faults (thousands) and transparent huge pages faulted "
        "system-wide, medians. RSS: peak = the worker's `VmHWM` over the timed region (reset "
        "right before it); growth = peak − RSS just before the load, ÷ the tensor bytes loaded. "
        "CPU \"device\" arrays live in host RAM, so both include the result "
        "(×8 for peers that copy a replicated tensor to every device).",
        "- *× ours*: this row's median seconds over ours (above 1: ours is faster).",
        "",
        "| sharding | contender | cold s | warm s | × ours cold | × ours warm | faults cold "
        "(K minor / THP) | faults warm | peak RSS cold (GB) | RSS growth ÷ loaded | discarded |",
        "|---|---|---|---|---:|---:|---|---|---:|---:|---:|",
    ]
    notes = []
    for sharding in args.shardings:
        ours = {c: [r for r in results[sharding]["ours"][c] if r["ok"]] for c in CONDITIONS} \
            if "ours" in results[sharding] else {}
        for contender in args.contenders:
            runs = results[sharding][contender]
            ok = {c: [r for r in runs[c] if r["ok"]] for c in CONDITIONS}
            failed = [r for c in CONDITIONS for r in runs[c] if not r["ok"]]
            if not ok["cold"] and not ok["warm"]:
                error = failed[0]["error"].replace("|", "\\|") if failed else "not run"
                lines.append(f"| {sharding} | {contender} | failed: {error} |" + " |" * 9)
                continue
            cells = []
            for c in CONDITIONS:
                cells.append(spread([r["seconds"] for r in ok[c]]) if ok[c] else "—")
            for c in CONDITIONS:
                if ok[c] and ours.get(c):
                    cells.append(f"{statistics.median(r['seconds'] for r in ok[c]) / statistics.median(r['seconds'] for r in ours[c]):.2f}")
                else:
                    cells.append("—")
            for c in CONDITIONS:
                cells.append(f"{statistics.median(r['minor_faults'] for r in ok[c]) / 1e3:.0f} / "
                             f"{statistics.median(r['thp_faults'] for r in ok[c]):.0f}" if ok[c] else "—")
            cells.append(fmt_gb(statistics.median(r["peak_rss"] for r in ok["cold"])) if ok["cold"] else "—")
            cells.append(f"{statistics.median((r['peak_rss'] - r['baseline_rss']) / spec['bytes'] for r in ok['cold']):.2f}"
                         if ok["cold"] else "—")
            discarded = sum(r.get("discarded", 0) for c in CONDITIONS for r in runs[c])
            kept_disturbed = sum(bool(r.get("disturbed")) for c in CONDITIONS for r in ok[c])
            cells.append(f"{discarded}" + (f" ({kept_disturbed} kept)" if kept_disturbed else ""))
            if failed:
                cells[-1] += f"; {len(failed)} failed: {failed[0]['error'].replace('|', '/')}"
            lines.append(f"| {sharding} | {contender} | " + " | ".join(cells) + " |")
            if contender == "ours" and ok["cold"] and "load_stats" in ok["cold"][0]:
                s = ok["cold"][len(ok["cold"]) // 2]["load_stats"]
                notes.append(f"  - {sharding}: bytes_needed {fmt_gb(s['bytes_needed'])} GB, "
                             f"bytes_read {fmt_gb(s['bytes_read'])} GB, {s['requests']} requests, "
                             f"{s['files']} files, {s['tensors']} tensors")
            if contender == "orbax_layout" and ok["cold"] and "orbax_read" in ok["cold"][0]:
                s = ok["cold"][len(ok["cold"]) // 2]["orbax_read"]
                notes.append(f"  - {sharding} (orbax_layout, its `jax.monitoring` scalars): "
                             f"bytes_read {fmt_gb(s.get('bytes_read', 0))} GB, "
                             f"{int(s.get('num_reads', 0))} coalesced reads, "
                             f"{int(s.get('storage_reads', 0))} storage reads")
    lines += ["", "Contenders: " + "; ".join(f"**{c}**: {CONTENDER_NOTES[c]}" for c in args.contenders)
              + ". safe_open's numpy backend returns bf16 as `ml_dtypes.bfloat16` in this "
              "safetensors, so no `framework=\"flax\"` detour is needed."]
    if notes:
        lines += ["", "Read accounting (median cold run):", *notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/ost-bench", help="checkpoint cache (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs per contender, sharding and condition (5)")
    parser.add_argument("--shardings", default=",".join(SHARDINGS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="comma-separated; peers whose package is missing are left out")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--size-gb", type=float, default=None, help="checkpoint size (1.1)")
    parser.add_argument("--quick", action="store_true", help="~0.1 GB model, 1 repeat: a smoke test")
    parser.add_argument("--page-cache", choices=("warm", "cold"), default="warm",
                        help="warm: every file read right before each run; cold: the page cache dropped "
                             "instead (root), and the disk's own read bandwidth measured once")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--sharding", help=argparse.SUPPRESS)
    parser.add_argument("--condition", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    args.repeats = args.repeats or (1 if args.quick else 5)
    args.size_gb = args.size_gb or (0.1 if args.quick else 1.1)
    args.shardings = common.listed(parser, args.shardings, SHARDINGS, "sharding")
    args.contenders = common.listed(parser, args.contenders, CONTENDERS, "contender")
    conditions = common.listed(parser, args.conditions, CONDITIONS, "condition")
    missing = [c for c in args.contenders if not available(c)]
    if missing:
        print(f"left out (package not installed): {', '.join(missing)}", file=sys.stderr)
        args.contenders = [c for c in args.contenders if c not in missing]

    started = time.perf_counter()
    spec = model_spec(args.size_gb, QUICK_MAX_SHARD_SIZE if args.quick else MAX_SHARD_SIZE)
    home = ensure_checkpoint(Path(args.dir), spec)
    files = checkpoint_files(home / "checkpoint")
    args.disk_gbps = common.disk_read_gbps(files) if args.page_cache == "cold" else None
    page_cache = warm_page_cache if args.page_cache == "warm" else lambda files: common.drop_page_cache()
    results = {s: {c: {k: [] for k in CONDITIONS} for c in args.contenders} for s in args.shardings}
    for repeat in range(args.repeats):
        order = conditions if repeat % 2 == 0 else conditions[::-1]
        for sharding in args.shardings:
            for contender in args.contenders:
                for condition in order:
                    def run() -> dict:
                        page_cache(files)
                        return run_worker(home, contender, sharding, condition)
                    result = run_undisturbed(run)
                    results[sharding][contender][condition].append(result)
                    shown = (f"{result['seconds']:.2f} s, {result['minor_faults'] / 1e3:.0f}K faults, "
                             f"{result['thp_faults']} THP, peak RSS {fmt_gb(result['peak_rss'])} GB"
                             + (f", {result['discarded']} disturbed run(s) discarded"
                                if result["discarded"] else "")
                             if result["ok"] else "failed: " + result["error"])
                    print(f"[{repeat + 1}/{args.repeats} {sharding} {condition}] {contender}: {shown}",
                          file=sys.stderr, flush=True)
    table = render(spec, files, results, args, time.perf_counter() - started)
    publish(table, ("load-quick.md" if args.quick else "load.md"))


if __name__ == "__main__":
    main()
