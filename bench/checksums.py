"""What the block checksums cost with each hashing package, side by side, in one run.

    .venv/bin/python bench/checksums.py                 # ~1.1 GB model, 5 repeats, cold and warm
    .venv/bin/python bench/checksums.py --quick         # ~0.1 GB, 1 repeat: a smoke test

``orbax_safetensors`` hashes its block checksums with ``google-crc32c`` (Apache-2.0, a
dependency) or, where it is installed, the ``crc32c`` package (LGPL, the ``crc32c`` extra).
Both use the CPU's crc32c instructions; ``crc32c`` releases the GIL while it hashes,
``google-crc32c`` only for ``bytes`` of 1 MiB or more, which a 256 KiB block never is. Two
measurements, each worker a fresh process, the two packages alternating:

* **hashing**: ``format.checksums.crc32c`` over 1 GiB of random bytes (touched before the
  clock), as memoryviews of 256 KiB blocks (what the read and write paths hand it), on 1 thread
  and on 2 threads taking every other block; GB/s of the best of 5 passes per worker, median
  over the workers. A worker gets the ``google-crc32c`` path by making ``import crc32c`` fail
  (``common.without_crc32c_extra``), as an install without the extra does.
* **end to end**: ``bench/save.py``'s and ``bench/load.py``'s workers, unchanged (same model,
  checkpoint, timing, cold and warm, discarding disturbed runs): an hf save with checksums by
  either package and with ``checksums=False``; a load with checks by either package and with
  ``verify_checksums=False``. *cost* is a checked run's median over the unchecked one's, minus 1.

Results go to stdout and to ``bench/results/checksums.md`` (``checksums-quick.md``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common
import load as load_bench
import save as save_bench
from common import CONDITIONS, machine_line, model_spec, publish, run_undisturbed, spread, versions_line

PACKAGES = {"crc32c": "LGPL-2.1, the `crc32c` extra", "google-crc32c": "Apache-2.0, a dependency"}
SAVES = {"crc32c": "ours_hf", "google-crc32c": "ours_hf_google", None: "ours_nocrc"}
LOADS = {"crc32c": "ours", "google-crc32c": "ours_google", None: "ours_noverify"}
SHARDINGS = ("fsdp", "tensor_parallel")
HASHED_BYTES = 1 << 30
PASSES = 5


# ---------------------------------------------------------------------------
# The hashing worker: one package, in a fresh process.


def hashing_rates(threads: int) -> float:
    """GB/s of ``checksums.crc32c`` over 256 KiB memoryview blocks of 1 GiB, best of ``PASSES``."""
    import numpy as np
    from orbax_safetensors.format import checksums

    data = np.random.default_rng(0).integers(0, 256, HASHED_BYTES, np.uint8)
    view = memoryview(data)
    block, count = checksums.BLOCK_BYTES, HASHED_BYTES // checksums.BLOCK_BYTES

    def hash_every(first: int) -> None:
        for k in range(first, count, threads):
            checksums.crc32c(view[k * block:(k + 1) * block])

    best = 0.0
    for _ in range(PASSES):
        workers = [threading.Thread(target=hash_every, args=(t,)) for t in range(threads)]
        started = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, HASHED_BYTES / (time.perf_counter() - started) / 1e9)
    return best


def worker(args) -> None:
    if args.package == "google-crc32c":
        common.without_crc32c_extra()
    hasher = common.hasher()
    if hasher != args.package:
        raise RuntimeError(f"asked for {args.package}, hashing with {hasher}")
    with common.Probe() as probe:
        rates = {threads: hashing_rates(threads) for threads in (1, 2)}
    common.report_result({"ok": True, **probe.report, "rates": rates})


def run_hashing(package: str) -> dict:
    return common.run_worker(Path(__file__).resolve(), ["--package", package])


# ---------------------------------------------------------------------------
# The parent.


def render(spec: dict, hashing: dict, saves: dict, loads: dict, args, wall: float) -> str:
    lines = [
        f"### Block checksums by package: hashing, and the cost of a save and a load of "
        f"{spec['bytes'] / 1e9:.2f} GB",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"whole benchmark {wall:.0f} s)",
        f"- machine: {machine_line()}",
        f"- versions: {versions_line()}, {package_versions()}",
        f"- load average at the start {args.load_average}, at the end {os.getloadavg()[0]:.1f}; "
        "*discarded*: runs during which other processes used the CPU, run again (at most 3 times; "
        "*kept*: disturbed still)",
        f"- {args.repeats} repeats; end-to-end cells `median [min–max]` seconds, "
        f"**cold**: {common.CONDITION_NOTES['cold']}; **warm**: {common.CONDITION_NOTES['warm']}; "
        "saves as `bench/save.py` (FSDP on 8 CPU devices, `os.sync()` included), loads as "
        "`bench/load.py` (page cache warm)",
        "",
        "| package | licence | hashing GB/s, 1 thread | 2 threads | discarded |",
        "|---|---|---:|---:|---:|",
    ]
    for package, licence in PACKAGES.items():
        runs = [r for r in hashing[package] if r["ok"]]
        if not runs:
            lines.append(f"| {package} | {licence} | failed: {hashing[package][0]['error']} | | |")
            continue
        cells = [f"{statistics.median(r['rates'][t] for r in runs):.1f}" for t in ("1", "2")]
        cells.append(discarded(hashing[package]))
        lines.append(f"| {package} | {licence} | " + " | ".join(cells) + " |")
    lines += ["", "| | cold s | warm s | cost cold | cost warm | discarded |", "|---|---|---|---:|---:|---:|"]

    def rows(title: str, results: dict, names: dict) -> None:
        def median(package, condition):
            runs = [r for r in results[names[package]][condition] if r["ok"]]
            return statistics.median(r["seconds"] for r in runs) if runs else None
        for package in (*PACKAGES, None):
            runs = {c: [r for r in results[names[package]][c] if r["ok"]] for c in CONDITIONS}
            cells = [spread([r["seconds"] for r in runs[c]]) if runs[c] else "—" for c in CONDITIONS]
            for c in CONDITIONS:
                checked, unchecked = median(package, c), median(None, c)
                cells.append(f"**{checked / unchecked - 1:+.0%}**"
                             if package and checked and unchecked else "")
            cells.append(discarded([r for c in CONDITIONS for r in results[names[package]][c]]))
            label = f"{title}, {package}" if package else f"{title}, unchecked"
            lines.append(f"| {label} | " + " | ".join(cells) + " |")

    rows("save hf", saves, SAVES)
    for sharding in args.shardings:
        rows(f"load {sharding}", loads[sharding], LOADS)
    return "\n".join(lines) + "\n"


def discarded(runs: list[dict]) -> str:
    """Disturbed runs discarded, and how many kept disturbed (after the last attempt)."""
    kept = sum(bool(r.get("disturbed")) for r in runs if r["ok"])
    return f"{sum(r.get('discarded', 0) for r in runs)}" + (f" ({kept} kept)" if kept else "")


def package_versions() -> str:
    from importlib.metadata import PackageNotFoundError, version
    found = []
    for package in PACKAGES:
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/ost-bench", help="load checkpoint cache (default %(default)s)")
    parser.add_argument("--save-dir", default="/tmp/ost-bench-save", help="where saves write")
    parser.add_argument("--repeats", type=int, default=None, help="runs per contender and condition (5)")
    parser.add_argument("--shardings", default=",".join(SHARDINGS))
    parser.add_argument("--quick", action="store_true", help="~0.1 GB model, 1 repeat: a smoke test")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--package", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if importlib.util.find_spec("crc32c") is None:
        parser.error("needs the crc32c extra: pip install 'orbax-safetensors[crc32c]'")

    args.repeats = args.repeats or (1 if args.quick else 5)
    args.load_average = f"{os.getloadavg()[0]:.1f}"
    args.shardings = [s for s in args.shardings.split(",") if s]
    started = time.perf_counter()
    hashing: dict = {package: [] for package in PACKAGES}
    for repeat in range(args.repeats):
        for package in PACKAGES:
            result = run_undisturbed(lambda: run_hashing(package))
            hashing[package].append(result)
            shown = (", ".join(f"{t} thread(s) {r:.1f} GB/s" for t, r in result["rates"].items())
                     if result["ok"] else "failed: " + result["error"])
            print(f"[{repeat + 1}/{args.repeats} hashing] {package}: {shown}", file=sys.stderr, flush=True)

    size_gb = 0.1 if args.quick else 1.1
    save_spec = model_spec(size_gb, save_bench.QUICK_MAX_SHARD_SIZE if args.quick else save_bench.MAX_SHARD_SIZE)
    load_spec = model_spec(size_gb, load_bench.QUICK_MAX_SHARD_SIZE if args.quick else load_bench.MAX_SHARD_SIZE)
    home = load_bench.ensure_checkpoint(Path(args.dir), load_spec)
    files = load_bench.checkpoint_files(home / "checkpoint")
    root = Path(args.save_dir)
    root.mkdir(parents=True, exist_ok=True)
    saves = {c: {k: [] for k in CONDITIONS} for c in SAVES.values()}
    loads = {s: {c: {k: [] for k in CONDITIONS} for c in LOADS.values()} for s in args.shardings}
    for repeat in range(args.repeats):
        order = CONDITIONS if repeat % 2 == 0 else CONDITIONS[::-1]
        for contender in SAVES.values():
            for condition in order:
                result = run_undisturbed(lambda: save_bench.run_one(
                    contender, condition, save_spec,
                    root / f"run-{os.getpid()}-{repeat + 1}-{contender}-{condition}"))
                saves[contender][condition].append(result)
                print(f"[{repeat + 1}/{args.repeats} save {condition}] {contender}: "
                      f"{save_bench.describe(result)} ({result.get('hasher')})", file=sys.stderr, flush=True)
        for sharding in args.shardings:
            for contender in LOADS.values():
                for condition in order:
                    def run() -> dict:
                        load_bench.warm_page_cache(files)
                        return load_bench.run_worker(home, contender, sharding, condition)
                    result = run_undisturbed(run)
                    loads[sharding][contender][condition].append(result)
                    shown = (f"{result['seconds']:.2f} s ({result.get('hasher')})" if result["ok"]
                             else "failed: " + result["error"])
                    print(f"[{repeat + 1}/{args.repeats} load {sharding} {condition}] {contender}: {shown}",
                          file=sys.stderr, flush=True)
    table = render(load_spec, hashing, saves, loads, args, time.perf_counter() - started)
    publish(table, "checksums-quick.md" if args.quick else "checksums.md")


if __name__ == "__main__":
    main()
