"""The ``orbax-safetensors`` command.

Human-readable tables on a terminal, ``--json`` for scripts; failures print one
line on stderr and exit non-zero, never a traceback for a bad checkpoint.
Long jobs (``consolidate``, ``convert``, ``verify --data``) draw a progress
line on stderr only when it is a terminal, so a script or CI log gets nothing
there but errors, and stdout holds exactly one line: the human summary, or
with ``--json`` a JSON object. Orbax and TensorStore are imported by ``convert`` alone, since
they take seconds to import and the other commands never need them. A reader that stops early
(``orbax-safetensors inspect --json CKPT | head -1``) ends the command quietly with status 141,
as SIGPIPE ends a C tool, instead of a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import platform
import select
import sys
import time
import warnings
from collections.abc import Sequence
from typing import NoReturn

from orbax_safetensors.engine import (
    CONVERT_DTYPES, DEFAULT_BLOCK_BYTES, DEFAULT_CONVERT_BUDGET, DEFAULT_MAX_SHARD_SIZE, Progress,
    consolidate, format_bytes, format_seconds, summary_line, verify)
from orbax_safetensors.engine import metadata as read_metadata
from orbax_safetensors.errors import ArgumentError, Error
from orbax_safetensors.format import dtype_for_numpy

_INSPECT_EXAMPLES = """examples:
  orbax-safetensors inspect ./llama-checkpoint
  orbax-safetensors inspect gs://bucket/run/step_100/params --json
"""
_VERIFY_EXAMPLES = """examples:
  orbax-safetensors verify ./llama-checkpoint
  orbax-safetensors verify s3://bucket/run/step_100/params --json   # exit status 1 if anything is wrong
  orbax-safetensors verify ./llama-checkpoint --data   # also read all tensor data, check its crc32c
"""
_CONSOLIDATE_EXAMPLES = """examples:
  orbax-safetensors consolidate ./distributed-ckpt ./hf-ckpt --max-shard-size 2GB
  orbax-safetensors consolidate ./torch-dcp-out ./hf-ckpt --json --no-progress
"""
_CONVERT_EXAMPLES = """examples:
  orbax-safetensors convert ./orbax/step_1000/default ./hf-ckpt --max-shard-size 2GB
  orbax-safetensors convert ./hf-ckpt ./orbax-ckpt   # restore: ocp.StandardCheckpointer().restore(...)
  orbax-safetensors convert ./hf-ckpt ./orbax-ckpt --flat   # keep "a.b.c" names as flat keys
  orbax-safetensors convert ./orbax-ckpt ./hf-ckpt --overwrite --json
  orbax-safetensors convert ./Llama-3.1-8B ./maxtext-ckpt --mapping maxtext:llama3.1 --dtype float32
    # its summary ends: MaxText: load_parameters_path=/abs/path/maxtext-ckpt/0/items
  orbax-safetensors convert ./maxtext-ckpt ./hf-out --mapping maxtext:llama3.1 --hf-config ./Llama-3.1-8B/config.json
    # writes the config as hf-out/config.json: a model directory transformers loads
  orbax-safetensors convert ./DeepSeek-V3 ./deepseek-mt --mapping maxtext:deepseek3 --dtype bfloat16
    # an FP8 (or MXFP4: gpt-oss) release, dequantized on the way

The direction follows SRC: an Orbax PyTree checkpoint (a directory with
Orbax's _METADATA, or a CheckpointManager step with one item) becomes a
safetensors checkpoint, and a safetensors checkpoint becomes an Orbax PyTree
checkpoint. Both stream one row block of one tensor at a time (--block-bytes),
so memory does not grow with the checkpoint; reading an Orbax checkpoint also
holds about twice its largest storage chunk (Orbax stores an unsharded array
as one chunk). Tensor names are key paths joined with "."; an Orbax output
nests them back into dicts ("model.layers.0.w" -> model/layers/0/w) unless
--flat, and converting back gives the same names and bytes.

With --mapping the Orbax side is a mapped tree: maxtext:FAMILY is MaxText's
params (llama3.1, qwen3, mixtral, deepseek3, gpt-oss, ...; scanned unless
--no-scan-layers), written as MaxText's to_maxtext.py writes it; llama, qwen3,
deepseek_v3, gpt_oss, ... (or auto) our Flax-style trees. The mapping reads the
Hugging Face config: --hf-config, or SRC/config.json; a quantized release (its
quantization_config: FP8 block-scaled, MXFP4) is dequantized as it is read.
Memory stays within --memory-budget whatever the model size.
Under jax.distributed (several processes) each converts its share.
"""
_EXAMPLES = ("examples:\n" + "".join(
    text.split("\n", 1)[1].split("\n\n", 1)[0].rstrip("\n") + "\n"
    for text in (_INSPECT_EXAMPLES, _VERIFY_EXAMPLES, _CONSOLIDATE_EXAMPLES, _CONVERT_EXAMPLES))
    + "\nrun 'orbax-safetensors COMMAND --help' for a command's options.\n")


_SIGPIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for a tool a closed pipe ended


def _version() -> str:
    """``orbax-safetensors X.Y.Z``, then the versions a bug report needs (none imported;
    the installed distribution's, which ``tests/project/test_packaging.py`` keeps equal to
    ``ost.__version__``)."""
    versions = []
    for name in ("orbax-safetensors", "jax", "jaxlib", "orbax-checkpoint"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    return f"{versions[0]}\nPython {platform.python_version()}, {', '.join(versions[1:])}"


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
        shape = str(tuple(r["shape"]))
        print(f"{r['name']:<{width}}  {r['dtype']:<16} {shape:<20} "
              f"{format_bytes(r['bytes']):>10}  {', '.join(r['files'])}")
    files = {f for names in info.files.values() for f in names}
    total = sum(r["bytes"] for r in rows)
    print(f"\n{len(rows)} tensors, {format_bytes(total)} in {len(files)} file(s)")
    for key, value in sorted(info.metadata.items()):
        print(f"metadata {key} = {value}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    on_terminal = args.progress and sys.stderr.isatty() and not args.json
    if on_terminal:  # verify reads every header, which takes a while on an object store
        sys.stderr.write(f"verify {args.path}: checking...")
        sys.stderr.flush()
        Progress.unfinished_line = True
    report = verify(args.path, data=args.data, progress=_progress(args))
    if on_terminal and not args.data:  # with --data the progress line says what was read
        sys.stderr.write(f"\rverify {args.path}: checked {len(report.files)} file(s) in "
                         f"{format_seconds(time.perf_counter() - started)}\x1b[K\n")
        Progress.unfinished_line = False
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for problem in report.problems:
            print(problem)
        for leftover in report.leftovers:
            print(f"note: file {leftover!r} is not part of the checkpoint (left over from an "
                  "earlier save?); readers ignore it")
        if report.unchecked:
            print(f"note: {len(report.unchecked)} file(s) store no checksums (written by another "
                  "library, or saved with checksums=False): their data was not checked")
        found = (f"{len(report.problems)} problem{'s' * (len(report.problems) != 1)}"
                 if report.problems else "ok")
        checked = f", {format_bytes(report.bytes_checked)} checked against checksums" if args.data else ""
        print(f"{found}: {report.kind}, {len(report.files)} file(s), {report.tensors} tensors, "
              f"{format_bytes(report.bytes)}{checked}")
    return 0 if report.ok else 1


def _progress(args: argparse.Namespace) -> bool | None:
    """``None`` (on a terminal only) unless ``--no-progress`` or ``--json`` silence it."""
    return False if not args.progress or args.json else None


def _consolidate(args: argparse.Namespace) -> int:
    stats = consolidate(args.src, args.dst, max_shard_size=args.max_shard_size,
                        block_bytes=args.block_bytes, overwrite=args.overwrite,
                        progress=_progress(args))
    summary = {"src": args.src, "dst": args.dst, "bytes_written": stats.bytes_written,
               "files": stats.files, "seconds": round(stats.seconds, 3),
               "gb_per_s": round(stats.bytes_written / max(stats.seconds, 1e-9) / 1e9, 3)}
    print(json.dumps(summary) if args.json else
          summary_line(stats.bytes_written, args.dst, stats.seconds))
    return 0


def _convert(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from orbax_safetensors.integrations.orbax_convert import convert

    mapping = config = None
    if args.mapping is not None:
        from orbax_safetensors.mappings import by_name

        config = _hf_config(args)
        mapping = by_name(args.mapping, config, scan_layers=args.scan_layers)
    stats = convert(args.src, args.dst, mapping=mapping, dtype=args.dtype,
                    memory_budget=args.memory_budget, max_shard_size=args.max_shard_size,
                    block_bytes=args.block_bytes, nest=not args.flat, overwrite=args.overwrite,
                    progress=_progress(args), config=config)
    if args.json:
        print(json.dumps({"src": args.src, "dst": args.dst, **stats.to_json()}))
        return 0
    # One line, as every command's summary, ending in how to use what was written.
    if stats.item_path and mapping is not None and mapping.checkpoint_form == "maxtext":
        use = f"MaxText: load_parameters_path={stats.item_path}"
    elif stats.item_path:
        use = f"restore: ocp.StandardCheckpointer().restore({stats.item_path!r})"
    else:
        use = "with config.json, a model transformers loads" if config is not None else "load: ost.load"
    print(summary_line(stats.bytes_written, args.dst, stats.seconds)
          + f": {stats.tensors} tensors, {stats.source_format} -> {stats.target_format}; {use}")
    return 0


def _hf_config(args: argparse.Namespace) -> dict:
    """The Hugging Face config a mapping reads: --hf-config, else SRC's config.json."""
    path = args.hf_config or os.path.join(args.src, "config.json")
    if not os.path.isfile(path):
        raise ArgumentError(f"--mapping {args.mapping} needs the model's Hugging Face config: "
                            f"no {path}; pass --hf-config PATH/config.json")
    with open(path) as f:
        return json.load(f)


def _quiet_libraries() -> None:
    """Orbax logs its progress at INFO/WARNING through absl; the command's stderr is for errors."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.getLogger("absl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="orbax")


def _add_job_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                         help="bytes per safetensors file, e.g. 2GB or 500MiB "
                              f"(default {DEFAULT_MAX_SHARD_SIZE})")
    command.add_argument("--block-bytes", default=DEFAULT_BLOCK_BYTES,
                         help="the most bytes of one tensor moved at once; bounds memory "
                              f"(default {DEFAULT_BLOCK_BYTES})")
    command.add_argument("--overwrite", action="store_true", help="replace the checkpoint at DST (never a directory that is not one)")
    command.add_argument("--no-progress", dest="progress", action="store_false",
                         help="no progress line (it shows only when stderr is a terminal)")
    command.add_argument("--json", action="store_true",
                         help="print one JSON line (bytes, seconds, GB/s) instead of the summary")


class _Parser(argparse.ArgumentParser):
    """A bad command line is one line on stderr, as any failure of the command is: what is
    wrong, and where the options are listed (argparse's usage block would bury it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="orbax-safetensors",
        description="Inspect, verify and convert safetensors checkpoints "
                    "(local paths or fsspec URLs), and convert Orbax checkpoints to and from them.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version(),
                        help="print the version (and Python's, JAX's, Orbax's) and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, examples: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                                   epilog=examples,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)

    inspect = command("inspect", "list tensors, shapes, dtypes, sizes, files and metadata",
                      _INSPECT_EXAMPLES)
    inspect.add_argument("path", help="a .safetensors file or a checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(run=_inspect)
    check = command("verify",
                    "check every file against the format and the index; list all problems",
                    _VERIFY_EXAMPLES)
    check.add_argument("path", help="a .safetensors file or a checkpoint directory")
    check.add_argument("--json", action="store_true", help="machine-readable report")
    check.add_argument("--data", action="store_true",
                       help="also read every byte of tensor data and check it against the "
                            "crc32c checksums its file stores; list every damaged tensor")
    check.add_argument("--no-progress", dest="progress", action="store_false",
                       help="no status or progress line (they show only when stderr is a terminal)")
    check.set_defaults(run=_verify)
    merge = command("consolidate",
                    "rewrite a distributed (or torch DCP) checkpoint as an HF checkpoint",
                    _CONSOLIDATE_EXAMPLES)
    merge.add_argument("src", help="the distributed checkpoint directory")
    merge.add_argument("dst", help="the HF checkpoint directory to write")
    _add_job_options(merge)
    merge.set_defaults(run=_consolidate)
    change = command("convert",
                     "convert an Orbax PyTree checkpoint to safetensors, or safetensors to Orbax",
                     _CONVERT_EXAMPLES)
    change.add_argument("src", help="an Orbax PyTree checkpoint directory, or a safetensors "
                                    "checkpoint (file or directory)")
    change.add_argument("dst", help="the directory to write (the other format)")
    _add_job_options(change)
    change.add_argument("--flat", action="store_true",
                        help="safetensors -> Orbax: keep the tensor names as flat keys instead "
                             "of nesting them on '.'")
    change.add_argument("--mapping", default=None,
                        help="the Orbax side is a mapped tree: maxtext:FAMILY (MaxText's params, "
                             "e.g. maxtext:llama3.1), auto, or a family (llama, qwen3, ...)")
    change.add_argument("--hf-config", default=None,
                        help="the Hugging Face config.json the mapping reads (default: SRC/config.json)")
    change.add_argument("--scan-layers", dest="scan_layers", action="store_true", default=None,
                        help="layers stacked on one axis (default for maxtext:)")
    change.add_argument("--no-scan-layers", dest="scan_layers", action="store_false",
                        help="one subtree per layer (default for the Flax-style families)")
    change.add_argument("--dtype", default=None, choices=CONVERT_DTYPES,
                        help="the output's floating-point dtype with --mapping "
                             f"({', '.join(CONVERT_DTYPES)}); default: the input's")
    change.add_argument("--memory-budget", default=DEFAULT_CONVERT_BUDGET,
                        help=f"memory for the conversion's buffers (default {DEFAULT_CONVERT_BUDGET})")
    change.set_defaults(run=_convert, block_bytes=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # so a reader gone (`| head -1`) shows here, not at exit
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail
        # too (see "Note on SIGPIPE" in the signal module's documentation).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _SIGPIPE_STATUS


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        _fail(args, "interrupted")
        return 130
    except BrokenPipeError as e:
        if _stdout_closed():
            raise  # the reader of our output left: no failure of the command to report
        _fail(args, str(e) or type(e).__name__)  # a pipe of the storage's, not stdout
        return 1
    except (Error, OSError) as e:  # ours, each worded; and the system's, naming the file
        _fail(args, str(e) or type(e).__name__)
        return 1
    except Exception as e:  # anything else still gets one line, with its type to search for
        _fail(args, f"{type(e).__name__}: {e}")
        return 1


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone: ``poll`` flags it an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or no real stdout
        return True


def _fail(args: argparse.Namespace, message: str) -> None:
    if Progress.unfinished_line:
        sys.stderr.write("\n")  # below the progress line the failure interrupted
    line = " ".join(message.split())  # one line, whatever the message holds
    print(f"orbax-safetensors {args.command}: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
