"""Per-tensor overhead: many tiny tensors saved, loaded and inspected, ours against ``safetensors.numpy``.

    .venv/bin/python bench/tiny_tensors.py              # 100 000 x 64 B and 10 000 x 4 KB, 5 repeats
    .venv/bin/python bench/tiny_tensors.py --quick      # 10 000 x 64 B, 1 repeat: a smoke test
    .venv/bin/python bench/tiny_tensors.py --cases tiny --operations load,metadata --repeats 3

A checkpoint of a few megabytes in 100 000 tensors costs nothing to move; what
a library spends on it is its per-tensor overhead (planning, allocation,
headers, checksums, Python objects). Two checkpoints, each of float32 vectors
named ``layers.{i}.w`` (values ``i``):

* ``tiny``: 100 000 tensors of 16 values (64 B each, 6.4 MB of data);
* ``small``: 10 000 tensors of 1024 values (4 KB each, 41 MB).

Operations, each ours against its natural peer, on the same data:

* ``save``: ``ost.save(dir, tree)`` (a dict of numpy arrays; block checksums on,
  the default) against ``safetensors.numpy.save_file(tree, file, metadata={"format":
  "pt"})`` followed by an ``fsync`` of the file: ours fsyncs its files before it
  commits, so both end durable. Each run writes into a fresh directory, deleted after it.
* ``load``: ``ost.load(dir)`` (no target: a flat dict of numpy arrays; checksums
  checked) against ``safetensors.numpy.load_file(file)``.
* ``load_host``: ``ost.load(dir, target)``, the target a dict of
  ``jax.ShapeDtypeStruct`` without a sharding (host numpy arrays), against
  ``load_file`` again (what it returns is what that target asks for).
* ``load_sharded``: ``ost.load(dir, target)``, every leaf a ``ShapeDtypeStruct``
  with ``NamedSharding(mesh, P())`` (replicated on the 8 host CPU devices),
  against ``load_file`` followed by ``jax.device_put(x, sharding)`` per tensor
  (``--sharding rows``: ``P("x")``, each device 1/8 of every tensor).
* ``metadata``: ``ost.metadata(dir)`` (names, shapes, dtypes, files) against
  ``safe_open(file, framework="numpy")`` reading every name's shape and dtype
  through ``get_slice``.

The files are written once (ours by ``ost.save``, the peer's by ``save_file``)
and cached under ``--dir``; before every load the parent reads them once so
both sides find them in the page cache. The timed region is the call alone
(plus ``block_until_ready`` for device arrays, and the peer's ``fsync``):
imports, building the tree or target and starting the JAX backend come before
it; the result is checked after it (names, shapes, and the values of a few
tensors). Every run is a fresh process on 8 host CPU devices; cold and warm,
alternation, the disturbed-run rule and peak RSS as in ``bench/load.py``
(``common``). Results go to stdout and ``bench/results/tiny_tensors.md``
(``tiny_tensors-quick.md`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common

CASES = {"tiny": (100_000, 16), "small": (10_000, 1024)}  # tensors, float32 values each
QUICK_CASES = {"tiny": (10_000, 16)}
OPERATIONS = ("save", "load", "load_host", "load_sharded", "metadata")
CONTENDERS = ("ours", "peer")
SPEC_VERSION = 1
PEER_NOTES = {
    "save": "`safetensors.numpy.save_file(tree, file, metadata={\"format\": \"pt\"})` + `fsync`",
    "load": "`safetensors.numpy.load_file(file)`",
    "load_host": "`safetensors.numpy.load_file(file)`",
    "load_sharded": "`load_file(file)` → `jax.device_put(x, sharding)` per tensor",
    "metadata": "`safe_open(file, \"numpy\")`: `get_slice(name).get_shape()`/`get_dtype()` of every name",
}
OUR_NOTES = {
    "save": "`ost.save(dir, tree)` (checksums on)",
    "load": "`ost.load(dir)` (checksums checked)",
    "load_host": "`ost.load(dir, target)`, host `ShapeDtypeStruct`s",
    "load_sharded": "`ost.load(dir, target)`, `ShapeDtypeStruct`s with the sharding",
    "metadata": "`ost.metadata(dir)`",
}
CHECKED = 5  # tensors whose values every worker checks
SPECS = {"replicated": "P()", "rows": 'P("x")'}


def names_of(count: int) -> list[str]:
    return [f"layers.{i}.w" for i in range(count)]


def make_tree(count: int, width: int) -> dict:
    import numpy as np
    return {name: np.full(width, i, np.float32) for i, name in enumerate(names_of(count))}


def checked_indices(count: int) -> list[int]:
    return sorted({0, 1, count // 2, count - 2, count - 1})[:CHECKED]


# ---------------------------------------------------------------------------
# The checkpoints, written once.


def ensure_files(root: Path, case: str, count: int, width: int) -> Path:
    """``root/<case>/ours`` (``ost.save``) and ``root/<case>/peer.safetensors`` (``save_file``)."""
    home = root / f"{case}-{count}x{width}"
    spec = {"version": SPEC_VERSION, "count": count, "width": width}
    if common.cached(home, spec, "ours", "peer.safetensors"):
        return home
    code = (f"import sys; sys.path.insert(0, {str(common.BENCH_DIR)!r}); import tiny_tensors as t; "
            f"import orbax_safetensors as ost; from safetensors.numpy import save_file; "
            f"tree = t.make_tree({count}, {width}); ost.save({str(home / 'ours')!r}, tree); "
            f"save_file(tree, {str(home / 'peer.safetensors')!r}, metadata={{'format': 'pt'}})")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=common.BENCH_DIR.parent)
    (home / "spec.json").write_text(json.dumps(spec))
    return home


def warm_page_cache(home: Path) -> None:
    for path in [*sorted((home / "ours").iterdir()), home / "peer.safetensors"]:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


# ---------------------------------------------------------------------------
# The worker: one operation of one contender, in a fresh process.


def sharding_of(name: str):
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(common.mesh_1d(), P() if name == "replicated" else P("x"))


def prepare(args, home: Path, count: int, width: int) -> dict:
    """Everything before the clock: imports, the tree or target, a fresh output directory."""
    import jax
    import numpy as np
    import orbax_safetensors  # noqa: F401
    import safetensors.numpy  # noqa: F401

    ready: dict = {}
    if args.operation == "save":
        ready["tree"] = make_tree(count, width)
        ready["out"] = Path(args.out)
    elif args.operation == "load_host":
        ready["target"] = {n: jax.ShapeDtypeStruct((width,), np.float32) for n in names_of(count)}
    elif args.operation == "load_sharded":
        sharding = ready["sharding"] = sharding_of(args.sharding)
        ready["target"] = {n: jax.ShapeDtypeStruct((width,), np.float32, sharding=sharding)
                           for n in names_of(count)}
    return ready


def run_ours(operation: str, home: Path, ready: dict):
    import jax
    import orbax_safetensors as ost
    if operation == "save":
        return ost.save(str(ready["out"] / "checkpoint"), ready["tree"])
    if operation == "load":
        return ost.load(str(home / "ours"))
    if operation == "load_host":  # numpy arrays: nothing to wait for
        return ost.load(str(home / "ours"), ready["target"])
    if operation == "load_sharded":
        return jax.block_until_ready(ost.load(str(home / "ours"), ready["target"]))
    if operation == "metadata":
        return ost.metadata(str(home / "ours"))
    raise ValueError(operation)


def run_peer(operation: str, home: Path, ready: dict):
    import jax
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file
    path = str(home / "peer.safetensors")
    if operation == "save":
        out = ready["out"] / "model.safetensors"
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(ready["tree"], str(out), metadata={"format": "pt"})
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return None
    if operation in ("load", "load_host"):
        return load_file(path)
    if operation == "load_sharded":
        sharding = ready["sharding"]
        return jax.block_until_ready({n: jax.device_put(x, sharding) for n, x in load_file(path).items()})
    if operation == "metadata":
        with safe_open(path, framework="numpy") as f:
            return {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype()) for n in f.keys()}
    raise ValueError(operation)


def check(args, home: Path, ready: dict, result, count: int, width: int) -> None:
    """What the timed call returned (or wrote) is the checkpoint: every name, a few values."""
    import numpy as np

    names = names_of(count)
    if args.operation == "save":
        from safetensors.numpy import load_file
        if args.contender == "ours":
            import orbax_safetensors as ost
            result = ost.load(str(ready["out"] / "checkpoint"))
        else:
            result = load_file(str(ready["out"] / "model.safetensors"))
    if args.operation == "metadata":
        tensors = result.tensors if args.contender == "ours" else result
        if sorted(tensors) != sorted(names):
            raise AssertionError("metadata names differ from the checkpoint's")
        for i in checked_indices(count):
            shape = tensors[names[i]].shape if args.contender == "ours" else tensors[names[i]][0]
            if tuple(shape) != (width,):
                raise AssertionError(f"{names[i]}: shape {shape}")
        return
    if len(result) != count or set(result) != set(names):
        raise AssertionError(f"got {len(result)} tensors, want {count}")
    for i in checked_indices(count):
        got = np.asarray(result[names[i]])
        if got.shape != (width,) or got.dtype != np.float32 or not (got == i).all():
            raise AssertionError(f"{names[i]}: wrong values {got[:4]}")


def worker(args) -> None:
    home = Path(args.home)
    count, width = args.count, args.width
    ready = prepare(args, home, count, width)
    run = run_ours if args.contender == "ours" else run_peer
    if args.condition == "warm":
        common.prefault_memory_in_child(common.WARM_GB)
    common.reset_peak_rss()
    baseline = common.current_rss()
    with common.Probe() as probe:
        result = run(args.operation, home, ready)
    peak = common.peak_rss()
    check(args, home, ready, result, count, width)
    common.report_result({"ok": True, **probe.report, "common.peak_rss": peak, "baseline_rss": baseline})


# ---------------------------------------------------------------------------
# The parent: runs the workers, alternating, and prints the table.


def run_one(home: Path, case: tuple[int, int], operation: str, contender: str, condition: str,
            sharding: str, scratch: Path) -> dict:
    count, width = case
    out = scratch / f"run-{os.getpid()}-{contender}"
    shutil.rmtree(out, ignore_errors=True)
    if operation != "save":
        warm_page_cache(home)
    try:
        return common.run_worker(Path(__file__).resolve(), [
            "--home", str(home), "--count", str(count), "--width", str(width),
            "--operation", operation, "--contender", contender, "--condition", condition,
            "--sharding", sharding, "--out", str(out)])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def render(cases: dict, results: dict, args, wall: float) -> str:
    def ok(runs: list[dict]) -> list[dict]:
        return [r for r in runs if r["ok"]]

    def median(runs: list[dict], key) -> float:
        return statistics.median(key(r) for r in runs)

    lines = [
        "### Per-tensor overhead: many tiny float32 tensors, ours vs `safetensors.numpy`, cold and warm",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"whole benchmark {wall:.0f} s)",
        f"- machine: {common.machine_line()}",
        f"- versions: {common.versions_line()}",
        "- checkpoints: " + "; ".join(f"**{c}**: {n:,} tensors of {w} float32 ({n * w * 4 / 1e6:.1f} MB "
                                      "of data)" for c, (n, w) in cases.items())
        + "; one file each (ours: `model.safetensors` by `ost.save`, block checksums included; "
        "the peer's by `save_file`), in the page cache before every load",
        f"- **cold**: {common.CONDITION_NOTES['cold']}; **warm**: {common.CONDITION_NOTES['warm']}. Every run is a "
        f"fresh Python process (`JAX_PLATFORMS=cpu`, 8 host devices); runs alternate ours/peer and "
        f"cold/warm, {args.repeats} of each; cells give `median [min–max]` seconds. A run during "
        "which other processes used more than 0.05 s + 10% of its wall time of user CPU is run "
        "again (*discarded*).",
        f"- sharded loads: every leaf `NamedSharding(mesh, {SPECS[args.sharding]})` on a 1-D mesh "
        "of the 8 devices.",
        "- *× peer*: our median over the peer's (below 3: within the 3× target). RSS (cold median): "
        "peak = the worker's `VmHWM` over the timed region (reset right before it); growth = peak − "
        "RSS right before the call.",
        "",
        "| case | operation | contender | cold s | warm s | × peer cold | × peer warm "
        "| peak RSS (MB) | RSS growth (MB) | discarded |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        for operation in args.operations:
            for contender in CONTENDERS:
                runs = results[case][operation][contender]
                good = {c: ok(runs[c]) for c in common.CONDITIONS}
                failed = [r for c in common.CONDITIONS for r in runs[c] if not r["ok"]]
                if not good["cold"] and not good["warm"]:
                    error = failed[0]["error"].replace("|", "\\|") if failed else "not run"
                    lines.append(f"| {case} | {operation} | {contender} | failed: {error} |" + " |" * 6)
                    continue
                cells = [common.spread([r["seconds"] for r in good[c]]) if good[c] else "—" for c in common.CONDITIONS]
                for c in common.CONDITIONS:
                    peer = ok(results[case][operation]["peer"][c])
                    cells.append(f"{median(good[c], lambda r: r['seconds']) / median(peer, lambda r: r['seconds']):.2f}"
                                 if contender == "ours" and good[c] and peer else "")
                first = good["cold"] or good["warm"]
                cells.append(f"{median(first, lambda r: r['common.peak_rss']) / 1e6:.0f}")
                cells.append(f"{median(first, lambda r: r['common.peak_rss'] - r['baseline_rss']) / 1e6:.0f}")
                discarded = sum(r.get("discarded", 0) for c in common.CONDITIONS for r in runs[c])
                cells.append(f"{discarded}" + (f"; {len(failed)} failed" if failed else ""))
                who = "**ours**" if contender == "ours" else "peer"
                lines.append(f"| {case} | {operation} | {who} | " + " | ".join(cells) + " |")
    lines += ["", "Ours: " + "; ".join(f"*{o}*: {OUR_NOTES[o]}" for o in args.operations) + ".",
              "", "Peers: " + "; ".join(f"*{o}*: {PEER_NOTES[o]}" for o in args.operations) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/ost-bench-tiny", help="checkpoint cache (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per operation, contender and condition (5)")
    parser.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)} (all)")
    parser.add_argument("--operations", default=",".join(OPERATIONS))
    parser.add_argument("--conditions", default=",".join(common.CONDITIONS))
    parser.add_argument("--sharding", default="replicated", choices=("replicated", "rows"),
                        help="of the sharded loads: P() or P(\"x\") (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="10 000 tiny tensors, 1 repeat: a smoke test")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--home", "--operation", "--contender", "--condition", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    args.repeats = args.repeats or (1 if args.quick else 5)
    known = QUICK_CASES if args.quick else CASES
    chosen = common.listed(parser, args.cases or ",".join(known), known, "case")
    args.operations = common.listed(parser, args.operations, OPERATIONS, "operation")
    conditions = common.listed(parser, args.conditions, common.CONDITIONS, "condition")
    cases = {c: known[c] for c in chosen}

    started = time.perf_counter()
    root = Path(args.dir)
    homes = {c: ensure_files(root, c, *cases[c]) for c in cases}
    scratch = root / "runs"
    results = {c: {o: {k: {x: [] for x in common.CONDITIONS} for k in CONTENDERS} for o in args.operations}
               for c in cases}
    for repeat in range(args.repeats):
        order = conditions if repeat % 2 == 0 else conditions[::-1]
        for case in cases:
            for operation in args.operations:
                for contender in CONTENDERS:
                    for condition in order:
                        result = common.run_undisturbed(lambda: run_one(
                            homes[case], cases[case], operation, contender, condition, args.sharding, scratch))
                        results[case][operation][contender][condition].append(result)
                        shown = common.progress(result, lambda r: f"{r['seconds']:.2f} s, peak RSS "
                                                                  f"{r['common.peak_rss'] / 1e6:.0f} MB")
                        print(f"[{repeat + 1}/{args.repeats} {case} {operation} {condition}] {contender}: {shown}",
                              file=sys.stderr, flush=True)
    table = render(cases, results, args, time.perf_counter() - started)
    common.publish(table, "tiny_tensors-quick.md" if args.quick else "tiny_tensors.md")


if __name__ == "__main__":
    main()
