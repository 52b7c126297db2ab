"""HF ↔ MaxText conversion: ``ost.convert(..., mapping=...)`` against MaxText 0.2.5's own scripts.

    .venv/bin/python bench/convert.py                          # 0.29, 1.03, 3.9 GB; 3 repeats, cold and warm
    .venv/bin/python bench/convert.py --quick                  # a 0.04 GB model, 1 repeat: a smoke test
    .venv/bin/python bench/convert.py --sizes 1 --contenders ours,maxtext --directions to_maxtext

What it measures: the wall time and the peak RSS of one conversion command, from process start
to exit, both ways between a synthetic Llama-3-like bf16 Hugging Face checkpoint (a sharded
directory with its index, ``config.json`` and a tokenizer) and MaxText's scanned Orbax
checkpoint (``dst/0/items``, what ``load_parameters_path`` restores):

* ``to_maxtext``: HF directory → MaxText checkpoint;
* ``to_hf``: MaxText checkpoint → HF directory. Every contender reads the same MaxText
  checkpoint, written once per size (untimed) by MaxText's ``to_maxtext.py`` when the MaxText
  venv is there, else by ours; the table says which.

Contenders:

* ``ours``: ``ost.convert(src, dst, mapping=ost.mappings.maxtext("llama3.1", config,
  scan_layers=True), dtype=..., memory_budget=...)`` in a fresh Python process (``--worker``),
  ``config`` the HF ``config.json``, ``dtype="bfloat16"`` to MaxText (as MaxText's
  ``--save_dtype=bfloat16``), the stored dtype back;
* ``ours_2proc``: the same call in two processes joined by ``jax.distributed`` on 127.0.0.1,
  started the way the tests start them (``tests/support/_multiprocess_child.py``); its time is the
  slower process's exit, its RSS the larger process's peak;
* ``maxtext``: MaxText 0.2.5's ``python -m maxtext.checkpoint_conversion.to_maxtext`` and
  ``to_huggingface``, unmodified, in the MaxText venv (``tests/families/test_maxtext_mapping.py``'s
  ``ensure_maxtext_venv``; left out when it cannot be had), with the settings its conversion
  guide gives for a big model: ``model_name=llama3.1-8b scan_layers=True hardware=cpu
  skip_jax_distributed_system=True checkpoint_storage_use_ocdbt=True
  checkpoint_storage_use_zarr3=True --lazy_load_tensors=True`` (its memory-saving mode, the
  default since 0.2.5) ``--save_dtype=bfloat16`` and the default ``--simulated_cpu_devices_count=16``
  (the output sharded 16 ways on axis 0); back with ``load_parameters_path=.../0/items
  weight_dtype=bfloat16`` (the dtype its docstring recommends; the stored one) and
  ``--override_model_architecture --hf_model_path=<the HF dir>`` (its tokenizer). The model's
  sizes go in as pyconfig overrides (``override_model_config=True base_emb_dim=...``).

MaxText's scripts take the HF layer count and head_dim of ``llama3.1-8b`` from their built-in
config (``HF_MODEL_CONFIGS``), not from the checkpoint, so every synthetic model keeps Llama
3.1 8B's 32 layers and head_dim 128 (and its RoPE scaling); hidden, heads, KV heads (8 or
fewer), ffn (3.5x hidden) and vocab scale with the size. Weights are random bf16 bit patterns
(finite), written once by ``ost.save`` and cached under ``--work-dir``. Both tools write bf16
(ours: the stored dtype), so the query's ``1/sqrt(head_dim)`` scale rounds in both and a
round trip gives back every tensor but ``q_proj`` bitwise.

Method, as in ``bench/load.py`` (whose helpers this reuses): every run is a fresh process;
*cold* starts with nothing prefaulted, *warm* after a child touched and freed 4 GB right
before the command (``common.CONDITION_NOTES``). Before every run the parent removes the
destination and reads every source file once (untimed), so the source is in the page cache
for every contender alike. Runs alternate contender by contender and cold/warm (which goes
first flips every repeat); a run during which other processes used more than 0.05 s + 10 % of
its wall time of user CPU is discarded and run again (``--attempts``: 2 runs in all), then
kept and counted
(``common.Probe``, ``common.run_undisturbed``). Peak RSS is each command's ``ru_maxrss``, as
GNU ``time`` reports it: every command runs under ``/usr/bin/time``, so it is forked from that
small process (a command spawned by the parent itself would report at least the parent's own
peak, ``common.peak_rss``: the parent that wrote a 4 GB checkpoint). Time includes each tool's imports and start-up (``convert()`` alone is given
for ours under the table). After every run (untimed) the output is checked: a MaxText
checkpoint's ``0/items`` committed; an HF directory's tensors, names, shapes and dtypes those
of the source, and its tensors other than ``q_proj`` bitwise the source's.

Results go to stdout and ``bench/results/convert.md`` (``convert-quick.md`` with ``--quick``).
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
from functools import partial
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # bench/ is not a package
sys.path.insert(1, str(BENCH.parent))  # tests/: the MaxText venv, the multi-process child
import common
import scanned
from common import (
    CONDITION_NOTES,
    CONDITIONS,
    fmt_gb,
    machine_line,
    run_undisturbed,
    spread,
)
from load import checkpoint_files, warm_page_cache

CONTENDERS = ("ours", "ours_2proc", "maxtext")
DIRECTIONS = ("to_maxtext", "to_hf")
FAMILY, MODEL_NAME = "llama3.1", "llama3.1-8b"
LAYERS, HEAD_DIM = 32, 128  # MaxText's HF_MODEL_CONFIGS["llama3.1-8b"]: see the docstring


def llama3(hidden: int, heads: int, kv_heads: int, vocab: int = 32000, max_shard_size: str = "1GB") -> dict:
    return dict(layers=LAYERS, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=HEAD_DIM,
                ffn=hidden * 7 // 2, vocab=vocab, max_shard_size=max_shard_size)


SIZES = {"0.25": llama3(512, 4, 2), "1": llama3(1024, 8, 4), "4": llama3(2048, 16, 8),
         "tiny": llama3(256, 2, 1, vocab=1024, max_shard_size="20MB")}
DEFAULT_SIZES = ("0.25", "1", "4")
TIMEOUT = 1800.0
GNU_TIME = "/usr/bin/time"  # its %M: the command's ru_maxrss, in KB
TOKENIZER = {  # a one-word WordLevel tokenizer: to_huggingface.py loads and re-saves the source's
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
    "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"}}
CONTENDER_NOTES = {
    "ours": f'`ost.convert(src, dst, mapping=ost.mappings.maxtext("{FAMILY}", config, scan_layers=True))` '
            "in a fresh process",
    "ours_2proc": "the same in 2 processes (`jax.distributed` on 127.0.0.1), each converting its share; "
                  "time: the last to exit, RSS: the larger peak",
    "maxtext": "MaxText 0.2.5 `python -m maxtext.checkpoint_conversion.to_maxtext` "
               "(`--lazy_load_tensors=True`, 16 simulated devices) / `to_huggingface` "
               "(`weight_dtype=bfloat16`), unmodified, in its venv",
}


# ---------------------------------------------------------------------------
# The model and the sources.


def ensure_model(root: Path, s: dict) -> Path:
    """The cached HF checkpoint (``bench/scanned.py``'s writer) with a tokenizer beside it."""
    checkpoint = scanned.ensure_checkpoint(root, s) / "checkpoint"
    (checkpoint / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}))
    return checkpoint


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def maxtext_python() -> str | None:
    """The MaxText venv's python (built if needed, as the MaxText tests build it), or None with why."""
    import pytest

    from tests.families.test_maxtext_mapping import DEFAULT_VENV, ensure_maxtext_venv
    try:
        return ensure_maxtext_venv(os.environ.get("OST_MAXTEXT_VENV") or DEFAULT_VENV, {})
    except pytest.skip.Exception as e:
        print(f"maxtext left out: {e}", file=sys.stderr)
        return None


# ---------------------------------------------------------------------------
# The commands.


def maxtext_command(python: str, direction: str, s: dict, src: Path, dst: Path, hf_dir: Path) -> list[str]:
    """MaxText's own script for ``direction``, as its guide runs it, with the model's sizes."""
    base_yml = Path(python).parent.parent / "lib" / "python3.12" / "site-packages" / "maxtext" / "configs" / "base.yml"
    sizes = [f"model_name={MODEL_NAME}", "override_model_config=True", f"base_emb_dim={s['hidden']}",
             f"base_num_query_heads={s['heads']}", f"base_num_kv_heads={s['kv_heads']}",
             f"head_dim={s['head_dim']}", f"base_mlp_dim={s['ffn']}", f"base_num_decoder_layers={s['layers']}",
             f"vocab_size={s['vocab']}", "scan_layers=True", "hardware=cpu",
             "skip_jax_distributed_system=True", f"base_output_directory={dst}", "run_name=bench"]
    if direction == "to_maxtext":
        return [python, "-m", "maxtext.checkpoint_conversion.to_maxtext", str(base_yml), *sizes,
                "checkpoint_storage_use_ocdbt=True", "checkpoint_storage_use_zarr3=True",
                "--lazy_load_tensors=True", "--save_dtype=bfloat16", f"--hf_model_path={src}"]
    return [python, "-m", "maxtext.checkpoint_conversion.to_huggingface", str(base_yml), *sizes,
            f"load_parameters_path={src / '0' / 'items'}", "weight_dtype=bfloat16",
            "--override_model_architecture", f"--hf_model_path={hf_dir}"]


def ours_commands(processes: int, direction: str, src: Path, dst: Path, hf_dir: Path,
                  budget: str | None) -> list[list[str]]:
    """One ``--worker`` per process; with several, each joins ``jax.distributed`` first
    (``tests/support/_multiprocess_child.py``), which then calls ``convert_share``. To MaxText in bf16,
    as ``--save_dtype=bfloat16`` (left to the mapping, the scaled query kernel stays float32)."""
    args = {"src": str(src), "dst": str(dst), "config": str(hf_dir / "config.json"), "budget": budget,
            "dtype": "bfloat16" if direction == "to_maxtext" else None}
    if processes == 1:
        return [[sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(args)]]
    from tests.support.multiprocess import free_port

    address = f"127.0.0.1:{free_port()}"
    return [[sys.executable, "-m", "tests.support._multiprocess_child", json.dumps({
        "target": "bench.convert:convert_share", "coordinator_address": address,
        "num_processes": processes, "process_id": i, "args": args,
        "result_path": str(dst.parent / f".{dst.name}.process_{i}.json"),
        "initialization_timeout": 120})] for i in range(processes)]


def convert_share(args: dict) -> dict:
    """In a worker: this process's ``ost.convert`` (all of it, or its share with ``jax.distributed``)."""
    import orbax_safetensors as ost

    config = json.loads(Path(args["config"]).read_text())
    mapping = ost.mappings.maxtext(FAMILY, config, scan_layers=True)
    options = {} if args["budget"] is None else {"memory_budget": args["budget"]}
    started = time.perf_counter()
    stats = ost.convert(args["src"], args["dst"], mapping=mapping, dtype=args["dtype"], **options)
    return {"convert_seconds": time.perf_counter() - started, "stats": repr(stats)}


# ---------------------------------------------------------------------------
# A run: the commands in fresh processes, timed and measured from outside.


def run_commands(commands: list[list[str]], condition: str, log: Path) -> dict:
    """Starts every command at once (under GNU ``time``), waits for all; wall time, CPU and each one's peak RSS."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(BENCH.parent))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # MaxText's scripts set their own
    if condition == "warm":
        common.prefault_memory_in_child(common.WARM_GB)
    peaks = [log.with_suffix(f".maxrss{i}") for i in range(len(commands))]
    with common.Probe(children=True) as probe, open(log, "w") as out:
        procs = [subprocess.Popen([GNU_TIME, "-f", "%M", "-o", str(peak), *c], stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=BENCH.parent,
                                  start_new_session=True)  # its own group: a timeout kills the command too
                 for c, peak in zip(commands, peaks)]
        deadline = time.monotonic() + TIMEOUT
        try:
            codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
        except subprocess.TimeoutExpired:
            for proc in procs:
                os.killpg(proc.pid, 9)
                proc.wait()
            return {"ok": False, "error": f"timeout after {TIMEOUT:.0f} s (log {log})"}
    if any(codes):
        lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()]
        errors = [l for l in lines if "Error" in l or "Exception" in l]
        return {"ok": False, "error": ((errors or lines or ["?"])[-1])[:200] + f" (exit {codes}, log {log})"}
    kilobytes = [int(peak.read_text().split()[-1]) for peak in peaks]
    return {"ok": True, **probe.report, "peak_rss": max(kilobytes) * 1024,
            "peak_rss_each": [k * 1024 for k in kilobytes]}


def worker_results(dst: Path, processes: int) -> dict:
    """What ``convert_share`` returned in each process (``--worker`` prints it, the child writes it)."""
    if processes == 1:
        return {}
    paths = [dst.parent / f".{dst.name}.process_{i}.json" for i in range(processes)]
    values = [json.loads(p.read_text()) for p in paths]
    for p in paths:
        p.unlink()
    return {"convert_seconds": max(v["convert_seconds"] for v in values)}


def from_log(log: Path) -> dict:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith(common.RESULT_MARK):
            return json.loads(line[len(common.RESULT_MARK):])
    return {}


# ---------------------------------------------------------------------------
# Checking what a run wrote (in a child: the parent stays light).


def check_output(direction: str, dst: Path, hf_dir: Path) -> str | None:
    """Why ``dst`` is not what ``direction`` should write, or None."""
    if direction == "to_maxtext":
        items = dst / "0" / "items"
        return None if (items / "_METADATA").exists() else f"no committed checkpoint at {items}"
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--check", str(dst), str(hf_dir)],
                          check=False, capture_output=True, text=True, cwd=BENCH.parent)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["check failed"])[-1][:300]


def check_hf(dst: Path, source: Path) -> None:
    """Raises unless ``dst`` holds the source's tensors (names, shapes, dtypes; bitwise but q_proj)."""
    import numpy as np
    from safetensors import safe_open

    def tensors(directory: Path) -> dict:
        return {name: (f, directory / file) for file in sorted({p.name for p in directory.glob("*.safetensors")})
                for f in [safe_open(str(directory / file), framework="np")] for name in f.keys()}  # noqa: SIM118

    got, want = tensors(dst), tensors(source)
    if set(got) != set(want):
        raise AssertionError(f"names differ: {sorted(set(got) ^ set(want))[:5]}")
    for name, (f, _) in want.items():
        a, b = f.get_tensor(name), got[name][0].get_tensor(name)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise AssertionError(f"{name}: {b.shape} {b.dtype}, want {a.shape} {a.dtype}")
        if "q_proj" not in name and not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            raise AssertionError(f"{name}: bytes differ from the source")


# ---------------------------------------------------------------------------
# The parent.


class Bench:
    """Sources, commands and runs for one size."""

    def __init__(self, args, size: str, python: str | None):
        self.args, self.size, self.s, self.python = args, size, SIZES[size], python
        self.hf_dir = ensure_model(Path(args.work_dir), self.s)
        self.out = Path(args.work_dir) / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.mt_source, self.mt_source_by = self.ensure_maxtext_source()

    def commands(self, contender: str, direction: str, dst: Path) -> list[list[str]]:
        src = self.hf_dir if direction == "to_maxtext" else self.mt_source
        if contender == "maxtext":
            return [maxtext_command(self.python, direction, self.s, src, dst, self.hf_dir)]
        return ours_commands(2 if contender == "ours_2proc" else 1, direction, src, dst, self.hf_dir,
                             self.args.memory_budget)

    def ensure_maxtext_source(self) -> tuple[Path, str]:
        """The MaxText checkpoint every ``to_hf`` run reads: MaxText's own when it can run, else ours."""
        by = "maxtext" if self.python else "ours"
        home = self.hf_dir.parent / f"maxtext-source-{by}"
        if not (home / "0" / "items" / "_METADATA").exists():
            shutil.rmtree(home, ignore_errors=True)
            print(f"writing the MaxText checkpoint to {home} with {by} (once) ...", file=sys.stderr, flush=True)
            result = run_commands(self.commands(by, "to_maxtext", home), "cold", self.out / "source.log")
            if not result["ok"]:
                raise RuntimeError(f"could not write the MaxText source: {result['error']}")
        return home, by

    def run(self, contender: str, direction: str, condition: str) -> dict:
        dst = self.out / f"{contender}-{direction}"
        log = self.out / f"{contender}-{direction}-{condition}.log"
        src = self.hf_dir if direction == "to_maxtext" else self.mt_source
        shutil.rmtree(dst, ignore_errors=True)
        warm_page_cache(checkpoint_files(src) if direction == "to_maxtext" else files_under(src))
        result = run_commands(self.commands(contender, direction, dst), condition, log)
        if result["ok"]:
            result |= from_log(log) if contender == "ours" else worker_results(dst, 2) if contender == "ours_2proc" else {}
            problem = check_output(direction, dst, self.hf_dir)
            if problem:
                result = {"ok": False, "error": f"wrong output: {problem}"}
        shutil.rmtree(dst, ignore_errors=True)
        return result


def run_all(args) -> dict:
    """results[size][direction][contender][condition] = [run, ...]."""
    results, sources = {}, {}
    for size in args.sizes:
        bench = Bench(args, size, args.python)
        sources[size] = (bench.s, bench.hf_dir, bench.mt_source_by)
        results[size] = {d: {c: {k: [] for k in CONDITIONS} for c in args.contenders} for d in args.directions}
        for repeat in range(args.repeats):
            order = args.conditions if repeat % 2 == 0 else args.conditions[::-1]
            for direction in args.directions:
                for contender in args.contenders:
                    for condition in order:
                        result = run_undisturbed(partial(bench.run, contender, direction, condition),
                                                 args.attempts)
                        results[size][direction][contender][condition].append(result)
                        shown = common.progress(result, lambda r: f"{r['seconds']:.1f} s, peak RSS "
                                                                  f"{fmt_gb(r['peak_rss'])} GB")
                        print(f"[{size} GB {repeat + 1}/{args.repeats} {direction} {condition}] {contender}: {shown}",
                              file=sys.stderr, flush=True)
    return {"results": results, "sources": sources}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def rows(size: str, direction: str, by_contender: dict, contenders: list[str]) -> list[str]:
    """The table's rows for one size and direction: cells and ratios against ``ours``."""
    ok = {c: {k: [r for r in by_contender[c][k] if r["ok"]] for k in CONDITIONS} for c in contenders}
    out = []
    for contender in contenders:
        runs = ok[contender]
        failed = [r for k in CONDITIONS for r in by_contender[contender][k] if not r["ok"]]
        if not runs["cold"] and not runs["warm"]:
            error = failed[0]["error"].replace("|", "/") if failed else "not run"
            out.append(f"| {size} | {direction} | {contender} | failed: {error} |" + " |" * 7)
            continue
        cells = [spread([r["seconds"] for r in runs[k]]) if runs[k] else "—" for k in CONDITIONS]
        cells += [spread([r["peak_rss"] / 1e9 for r in runs[k]]) if runs[k] else "—" for k in CONDITIONS]
        ours = ok.get("ours", {})
        for key in ("seconds", "peak_rss"):
            both = [k for k in CONDITIONS if runs[k] and ours.get(k)]
            cells.append(" / ".join(f"{median_of(ours[k], key) / median_of(runs[k], key):.2f}" for k in both) or "—")
        discarded = sum(r.get("discarded", 0) for k in CONDITIONS for r in by_contender[contender][k])
        kept = sum(bool(r.get("disturbed")) for k in CONDITIONS for r in runs[k])
        cells.append(f"{discarded}" + (f" ({kept} kept)" if kept else "")
                     + (f"; {len(failed)} failed: {failed[0]['error'].replace('|', '/')}" if failed else ""))
        out.append(f"| {size} | {direction} | {contender} | " + " | ".join(cells) + " |")
    return out


def render(args, measured: dict, wall: float) -> str:
    results, sources = measured["results"], measured["sources"]
    budget = args.memory_budget or "the default (1GB)"
    lines = [
        ("### HF ↔ MaxText conversion: `ost.convert(..., mapping=ost.mappings.maxtext(...))` vs MaxText 0.2.5's "
         "scripts, scanned Llama-3-like bf16, cold and warm"),
        "",
        (f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, whole benchmark "
         f"{wall:.0f} s)"),
        f"- machine: {machine_line()}",
        f"- versions: {common.versions_line()}; MaxText 0.2.5 in its own venv (Python 3.12, its pinned stack)",
        f"- ours: `memory_budget` {budget}",
    ]
    for size, (s, hf_dir, by) in sources.items():
        lines.append(f"- {size} GB: {scanned.nbytes(s) / 1e9:.2f} GB of bf16 tensors, layers {s['layers']}, hidden "
                     f"{s['hidden']}, heads {s['heads']}, KV heads {s['kv_heads']}, head_dim {s['head_dim']}, ffn "
                     f"{s['ffn']}, vocab {s['vocab']}, untied head, {len(checkpoint_files(hf_dir))} files "
                     f"(`max_shard_size=\"{s['max_shard_size']}\"`); to_hf reads the MaxText checkpoint {by} wrote")
    lines += [
        (f"- **cold**: {CONDITION_NOTES['cold']}; **warm**: {CONDITION_NOTES['warm']}. The source is in the page "
         f"cache (read right before each run); {args.repeats} runs of each, alternating; cells `median [min–max]`."),
        ("- seconds: the command's wall time, process start to exit (imports and start-up included); peak RSS: "
         "its `ru_maxrss` (GB). *ours ÷ row*: ours' median over this row's, cold / warm (time below 0.5: ours "
         "takes less than half; RSS: the fraction of this row's peak ours needs). Disturbed runs (others used the "
         f"CPU) are run again, {args.attempts} runs in all, then kept."),
        "",
        ("| size GB | direction | contender | cold s | warm s | peak RSS cold GB | peak RSS warm GB | ours ÷ row, "
         "time | ours ÷ row, RSS | discarded |"),
        "|---|---|---|---|---|---|---|---:|---:|---|",
    ]
    notes = []
    for size, by_direction in results.items():
        for direction, by_contender in by_direction.items():
            lines += rows(size, direction, by_contender, args.contenders)
            for contender in ("ours", "ours_2proc"):
                runs = [r for k in CONDITIONS for r in by_contender.get(contender, {}).get(k, [])
                        if r["ok"] and "convert_seconds" in r]
                if runs:
                    notes.append(f"  - {size} GB {direction} {contender}: `convert()` alone "
                                 f"{spread([r['convert_seconds'] for r in runs])} s (cold and warm)")
    lines += ["", "Contenders: " + "; ".join(f"**{c}**: {CONTENDER_NOTES[c]}" for c in args.contenders) + "."]
    if notes:
        lines += ["", "Ours without the process start-up and imports:", *notes]
    return "\n".join(lines) + "\n"


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="/tmp/ost-bench-convert",
                        help="checkpoints and outputs; needs ~3.5x the largest model free (default %(default)s)")
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"of {', '.join(SIZES)} (GB)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per contender, direction and condition (3)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="comma-separated; maxtext is left out when its venv cannot be had")
    parser.add_argument("--directions", default=",".join(DIRECTIONS))
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--memory-budget", default=None, help="ours' memory_budget (its default)")
    parser.add_argument("--attempts", type=int, default=2,
                        help="runs in all while disturbed (%(default)s; 1 keeps every run, on a busy machine)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 1 repeat: a smoke test")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.sizes = ["tiny"] if args.quick else common.listed(parser, args.sizes, SIZES, "size")
    args.contenders = common.listed(parser, args.contenders, CONTENDERS, "contender")
    args.directions = common.listed(parser, args.directions, DIRECTIONS, "direction")
    args.conditions = common.listed(parser, args.conditions, CONDITIONS, "condition")
    args.python = maxtext_python() if "maxtext" in args.contenders else None
    if "maxtext" in args.contenders and args.python is None:
        args.contenders.remove("maxtext")
    return args


def main() -> None:
    common.dispatch({"--worker": lambda payload: common.report_result(convert_share(json.loads(payload))),
                     "--check": lambda src, dst: check_hf(Path(src), Path(dst))}, arguments, run_all, render, "convert")


if __name__ == "__main__":
    main()
