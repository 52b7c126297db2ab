"""The ``orbax-safetensors`` command.

Human-readable tables on a terminal, ``--json`` for scripts; failures print one
line on stderr and exit non-zero, never a traceback for a bad checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from orbax_safetensors.engine import consolidate, verify
from orbax_safetensors.engine import metadata as read_metadata
from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import dtype_for_numpy

_EXAMPLES = """examples:
  orbax-safetensors inspect ./llama-checkpoint
  orbax-safetensors inspect gs://bucket/run/step_100/params --json
  orbax-safetensors verify s3://bucket/run/step_100/params   # exit status 1 if anything is wrong
  orbax-safetensors consolidate ./distributed-ckpt ./hf-ckpt --max-shard-size 2GB
"""


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _inspect(args: argparse.Namespace) -> int:
    info = read_metadata(args.path)
    rows = []
    for name, spec in info.tensors.items():
        nbytes = dtype_for_numpy(spec.dtype).nbytes(spec.shape)
        rows.append({
            "name": name, "dtype": str(spec.dtype), "shape": list(spec.shape),
            "bytes": nbytes, "files": list(info.files[name])})
    if args.json:
        json.dump({"tensors": rows, "metadata": info.metadata}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    width = max((len(r["name"]) for r in rows), default=4)
    print(f"{'name':<{width}}  {'dtype':<16} {'shape':<20} {'size':>10}  file(s)")
    for r in rows:
        shape = "(" + ", ".join(map(str, r["shape"])) + ")"
        print(f"{r['name']:<{width}}  {r['dtype']:<16} {shape:<20} "
              f"{_human_bytes(r['bytes']):>10}  {', '.join(r['files'])}")
    files = {f for names in info.files.values() for f in names}
    total = sum(r["bytes"] for r in rows)
    print(f"\n{len(rows)} tensors, {_human_bytes(total)} in {len(files)} file(s)")
    for key, value in sorted(info.metadata.items()):
        print(f"metadata {key} = {value}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    report = verify(args.path)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for problem in report.problems:
            print(problem)
        for leftover in report.leftovers:
            print(f"note: file {leftover!r} is not part of the checkpoint (left over from an "
                  "earlier save?); readers ignore it")
        found = (f"{len(report.problems)} problem{'s' * (len(report.problems) != 1)}"
                 if report.problems else "ok")
        print(f"{found}: {report.layout}, {len(report.files)} file(s), {report.tensors} tensors, "
              f"{_human_bytes(report.bytes)}")
    return 0 if report.ok else 1


def _consolidate(args: argparse.Namespace) -> int:
    stats = consolidate(args.src, args.dst, max_shard_size=args.max_shard_size,
                        overwrite=args.overwrite, progress=None if args.progress else False)
    summary = {"bytes_written": stats.bytes_written, "seconds": round(stats.seconds, 3),
               "gb_per_s": round(stats.bytes_written / max(stats.seconds, 1e-9) / 1e9, 3)}
    print(json.dumps(summary) if args.json else
          f"wrote {stats.bytes_written / 1e9:.3f} GB to {args.dst} in {stats.seconds:.2f} s "
          f"({summary['gb_per_s']:.2f} GB/s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orbax-safetensors",
        description="Inspect and manage safetensors checkpoints (local paths or fsspec URLs).",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser(
        "inspect", help="list tensors, shapes, dtypes, sizes, files and metadata")
    inspect.add_argument("path", help="a .safetensors file or a checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(run=_inspect)
    check = commands.add_parser(
        "verify", help="check every file against the format and the index; list all problems")
    check.add_argument("path", help="a .safetensors file or a checkpoint directory")
    check.add_argument("--json", action="store_true", help="machine-readable report")
    check.set_defaults(run=_verify)
    merge = commands.add_parser(
        "consolidate", help="rewrite a distributed (or torch DCP) checkpoint as an HF checkpoint")
    merge.add_argument("src", help="the distributed checkpoint directory")
    merge.add_argument("dst", help="the HF checkpoint directory to write")
    merge.add_argument("--max-shard-size", default="5GB", help="bytes per file (default 5GB)")
    merge.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    merge.add_argument("--no-progress", dest="progress", action="store_false",
                       help="no progress line (it shows only on a terminal anyway)")
    merge.add_argument("--json", action="store_true", help="machine-readable summary")
    merge.set_defaults(run=_consolidate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (SafetensorsError, FileNotFoundError, OSError) as e:
        print(f"orbax-safetensors {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
