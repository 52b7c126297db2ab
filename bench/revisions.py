"""This checkout against another checkout of orbax_safetensors, side by side in one run.

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/revisions.py --baseline /tmp/base              # 1.1 GB, 5 repeats
    .venv/bin/python bench/revisions.py --baseline /tmp/base --quick      # a smoke test

Why: a change meant to move code and not behaviour (a restructuring, a rename)
must leave the speed where it was, and "where it was" is only worth comparing
on the same machine in the same minutes. So each run of every operation is the
existing benchmark's own worker (``bench/load.py``, ``bench/save.py``,
``bench/tiny_tensors.py``: same data, same timed region, cold and warm), run in a
fresh process once with this checkout's package and once with the baseline's
(``PYTHONPATH``), alternating, and the table gives medians, their ratio and peak
RSS. The checkpoints read are written once, by this checkout.

Operations: ``ost.load`` into an FSDP, a tensor-parallel and a replicated
target (``bench/load.py``'s contender ``ours``), ``ost.save`` of an HF sharded
directory (``bench/save.py``'s ``ours_hf``), and the 100 000-tensor case of
``bench/tiny_tensors.py`` (save, load without a target, sharded load, metadata).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import common  # noqa: E402
import load as load_bench  # noqa: E402
import save as save_bench  # noqa: E402
import tiny_tensors as tiny_bench  # noqa: E402

REVISIONS = ("this", "baseline")
LOAD_SHARDINGS = ("fsdp", "tensor_parallel", "replicated")
TINY_OPERATIONS = ("save", "load", "load_sharded", "metadata")
OPERATIONS = (*(f"load {s}" for s in LOAD_SHARDINGS), "save hf", *(f"tiny {o}" for o in TINY_OPERATIONS))


@contextlib.contextmanager
def package_from(checkout: Path | None):
    """Workers started inside import orbax_safetensors from ``checkout`` (this one's when None):
    ``PYTHONPATH`` comes before the installed package on ``sys.path``."""
    before = os.environ.get("PYTHONPATH")
    if checkout is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), before]))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def imported_package(checkout: Path | None) -> str:
    """Where a worker started under ``package_from(checkout)`` imports orbax_safetensors from."""
    with package_from(checkout):
        return subprocess.run([sys.executable, "-c", "import orbax_safetensors as o; print(o.__file__)"],
                              check=True, capture_output=True, text=True, cwd=common.BENCH_DIR).stdout.strip()


def operations(args) -> dict:
    """Every operation's run, a function of (condition) → the worker's result."""
    root = Path(args.dir)
    spec = common.model_spec(args.size_gb, load_bench.QUICK_MAX_SHARD_SIZE if args.quick else load_bench.MAX_SHARD_SIZE)
    home = load_bench.ensure_checkpoint(root / "load", spec)
    files = load_bench.checkpoint_files(home / "checkpoint")

    def load(sharding: str):
        def run(condition: str) -> dict:
            load_bench.warm_page_cache(files)
            return load_bench.run_worker(home, "ours", sharding, condition)
        return run

    def save(condition: str) -> dict:
        return save_bench.run_one("ours_hf", condition, spec, root / f"save-{os.getpid()}")

    cases = tiny_bench.QUICK_CASES if args.quick else {"tiny": tiny_bench.CASES["tiny"]}
    args.tiny_count = cases["tiny"][0]
    tiny_home = tiny_bench.ensure_files(root / "tiny", "tiny", *cases["tiny"])

    def tiny(operation: str):
        return lambda condition: tiny_bench.run_one(tiny_home, cases["tiny"], operation, "ours", condition,
                                                    "replicated", root / "tiny-runs")

    runs = {f"load {s}": load(s) for s in LOAD_SHARDINGS}
    runs["save hf"] = save
    runs.update({f"tiny {o}": tiny(o) for o in TINY_OPERATIONS})
    return {name: runs[name] for name in args.operations}


def render(results: dict, args, wall: float) -> str:
    def ok(runs: list[dict]) -> list[dict]:
        return [r for r in runs if r["ok"]]

    lines = [
        "### This checkout against a baseline checkout: the same workers, alternating, in one run",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"whole benchmark {wall:.0f} s)",
        f"- baseline: `{args.baseline}`; {args.repeats} run(s) per operation, revision and condition; "
        f"tiny: {args.tiny_count:,} tensors",
        f"- {common.machine_line()}",
        f"- {common.versions_line()}",
        "",
        "| operation | condition | this (s): median [range] | baseline (s) | this / baseline (medians) "
        "| peak RSS this / baseline (GB) |",
        "|---|---|---|---|---|---|",
    ]
    for operation, by_revision in results.items():
        for condition in args.conditions:
            this, base = (ok(by_revision[r][condition]) for r in REVISIONS)
            if not this or not base:
                failed = [r["error"] for rev in REVISIONS for r in by_revision[rev][condition] if not r["ok"]]
                lines.append(f"| {operation} | {condition} | failed: {failed[:1]} | | | |")
                continue
            t, b = ([r["seconds"] for r in runs] for runs in (this, base))
            rss = [max(r.get("peak_rss", r.get("common.peak_rss", 0)) for r in runs) for runs in (this, base)]
            lines.append(f"| {operation} | {condition} | {common.spread(t)} | {common.spread(b)} "
                         f"| {statistics.median(t) / statistics.median(b):.2f} "
                         f"| {common.fmt_gb(rss[0])} / {common.fmt_gb(rss[1])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, type=Path,
                        help="another checkout's root (a git worktree of the commit to compare against)")
    parser.add_argument("--dir", default="/tmp/ost-bench-revisions", help="checkpoint cache (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per operation, revision and condition (5)")
    parser.add_argument("--size-gb", type=float, default=None, help="the load and save model's size (1.1)")
    parser.add_argument("--conditions", default=",".join(common.CONDITIONS))
    parser.add_argument("--operations", default=",".join(OPERATIONS))
    parser.add_argument("--quick", action="store_true", help="~0.1 GB model, 10 000 tiny tensors, 1 repeat")
    args = parser.parse_args()
    if not (args.baseline / "orbax_safetensors" / "__init__.py").is_file():
        parser.error(f"{args.baseline} holds no orbax_safetensors package: give a checkout's root")
    args.baseline = args.baseline.resolve()
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.size_gb = args.size_gb or (0.1 if args.quick else 1.1)
    args.conditions = common.listed(parser, args.conditions, common.CONDITIONS, "condition")
    args.operations = common.listed(parser, args.operations, OPERATIONS, "operation")

    imported = imported_package(args.baseline)
    if not imported.startswith(str(args.baseline)):
        parser.error(f"a worker given {args.baseline} imports orbax_safetensors from {imported}")
    started = time.perf_counter()
    runs = operations(args)
    checkouts = {"this": None, "baseline": args.baseline}
    results = {op: {rev: {c: [] for c in args.conditions} for rev in REVISIONS} for op in runs}
    for repeat in range(args.repeats):
        revisions = REVISIONS if repeat % 2 == 0 else REVISIONS[::-1]
        conditions = args.conditions if repeat % 2 == 0 else args.conditions[::-1]
        for operation, run in runs.items():
            for condition in conditions:
                for revision in revisions:
                    with package_from(checkouts[revision]):
                        result = common.run_undisturbed(lambda: run(condition))
                    results[operation][revision][condition].append(result)
                    shown = common.progress(result, lambda r: f"{r['seconds']:.3f} s")
                    print(f"[{repeat + 1}/{args.repeats} {operation} {condition}] {revision}: {shown}",
                          file=sys.stderr, flush=True)
    common.publish(render(results, args, time.perf_counter() - started),
                   "revisions-quick.md" if args.quick else "revisions.md")


if __name__ == "__main__":
    main()
