"""Quantized checkpoints loaded dequantized: ``ost.load(..., mapping=Mapping(rules, quantization=...))``
against load-then-dequantize and MaxText 0.2.5's dequantize scripts.

    .venv/bin/python bench/quantized.py                # ~1 GB stored per family, 3 repeats, cold and warm
    .venv/bin/python bench/quantized.py --quick        # a few MB, 1 repeat, every tensor checked: a smoke test
    .venv/bin/python bench/quantized.py --families fp8 --contenders ours,load_dequantize --repeats 5
    .venv/bin/python bench/quantized.py --families int4,nvfp4 --results quantized-int4-nvfp4

What it measures: loading a quantized Hugging Face checkpoint as bf16 ``jax.Array``s on 8 host
CPU devices, from four synthetic checkpoints (``tests/support/quantized_checkpoints.py``, written once
and cached under ``--work-dir``):

* ``fp8``: DeepSeek-V3-shaped (MLA attention, a dense first layer, then MoE layers of routed
  and shared experts), every ``Linear`` weight ``F8_E4M3`` with a float32 ``weight_scale_inv``
  per 128 × 128 block (``kv_a_proj_with_mqa``'s 576 rows end in a partial block); embeddings,
  norms, router bf16, ``e_score_correction_bias`` float32;
* ``mxfp4``: gpt-oss-shaped, the experts' ``gate_up_proj`` / ``down_proj`` as MXFP4
  ``*_blocks`` + ``*_scales`` (U8), everything else bf16;
* ``int4``: Kimi-K2-Thinking-shaped (DeepSeek-V3's architecture, 24 routed experts at "1" so
  that it stores ~1 GB): the routed experts compressed-tensors ``pack-quantized`` INT4
  (symmetric, a BF16 scale per 32 values, ``weight_shape``), everything else bf16 as the release
  ships it (its config's ``ignore``: attention, shared experts, the dense MLP, ``lm_head``);
* ``nvfp4``: DeepSeek-V3-shaped (32 routed experts at "1"), every ``Linear`` weight
  (attention, routed and shared experts, dense MLP) compressed-tensors ``nvfp4-pack-quantized``
  (U8 codes, an F8_E4M3 scale per 16, an F32 ``weight_global_scale``), the router, norms,
  embeddings and ``lm_head`` bf16.

The INT4 and NVFP4 checkpoints hold random codes and scales (``quantized_checkpoints.random_codes``):
a 4-bit result is 4× the bytes its codes store, so at "1" they are the biggest results here
(2.6 and 3.3 GB of bf16).

The result is every tensor's dequantized twin (bf16; float32 tensors stay float32; gpt-oss's
experts ``[experts, in, out]``), each 2-D or 3-D tensor split 8 ways along its first axis that 8
divides (the rows of a ``Linear`` weight, which cut ``kv_a_proj_with_mqa``'s 128-row blocks and
the 128-row blocks of the MLPs between devices; gpt-oss's stacked experts, expert-parallel), the
rest replicated. (Splits that cut MXFP4's 32-value groups are tested, not benchmarked:
``tests/benchmarks/test_bench_quantized.py``.)

Contenders:

* ``ours``: ``ost.load(path, target, mapping=ost.Mapping(rules, quantization=ost.FP8((128, 128)),
  ost.MXFP4(), ost.IntQuantized(4, 32) or ost.NVFP4()))``, identity-name rules (``{i}``, ``{e}``
  placeholders), ``target`` the twins' ``jax.ShapeDtypeStruct``s with their ``NamedSharding``s:
  each device's shard is dequantized from the bytes and scales that cover it;
* ``load_dequantize``: what a user writes without us: ``safetensors.safe_open(f,
  framework="numpy").get_tensor`` of each weight and its scales, whole, numpy dequantization
  in float32 (``tests/support/quantized_checkpoints.py``'s ``dequantize_fp8`` / ``dequantize_mxfp4``),
  then bf16, then
  ``jax.device_put(twin, sharding)``, tensor by tensor (safetensors 0.8's numpy backend looks
  float8 up on numpy, so the worker gives it ``ml_dtypes.float8_e4m3fn`` there first). For
  ``int4`` and ``nvfp4`` it is what transformers' dequantizing load does, without the model:
  ``safe_open(f, framework="pt").get_tensor`` of each module's stored tensors, whole, handed to
  compressed-tensors 0.20.1's own ``BaseCompressor.get_value_from_registry(format)
  .decompress(state_dict, scheme)`` (the scale in its stored dtype, as transformers 5.24's
  ``CompressedTensorsDequantize`` hands it), the weight ``.to(bfloat16)``, then
  ``jax.device_put``; torch and compressed-tensors are imported before the clock;
* ``maxtext``: MaxText 0.2.5's dequantize step as users run it today:
  ``standalone_scripts/deepseek_dequantize.py --input-path --output-path`` (fp8) and
  ``dequantize_mxfp4.py`` (mxfp4), the files from its package, unmodified, each writing a
  dequantized bf16 checkpoint (whole files in memory, torch on CPU). Its venv has no torch, so
  they run in this interpreter (torch 2.13 CPU, the ``interop`` extra) or the MaxText venv's if
  it has torch. ``dequantize_mxfp4.py`` hard-codes ``load_file(..., device="cuda")``: it runs
  through ``runpy`` with ``safetensors.torch.load_file`` mapped to the CPU, and its output
  directory is made first (the script creates its *input* directory). Its time is the whole
  command (imports and writing the bf16 checkpoint, which the user then still has to load into
  devices); it does not place anything on devices. MaxText 0.2.5 has no script for
  compressed-tensors checkpoints: for ``int4`` and ``nvfp4`` it is absent.

Method, as in ``bench/load.py`` / ``bench/convert.py`` (whose helpers this reuses): every run is
a fresh process; *cold* with nothing prefaulted, *warm* after a child touched and freed 4 GB
right before the timed region (``common.CONDITION_NOTES``); the checkpoint is read into the
page cache before every run. ``ours`` and ``load_dequantize`` time the load call plus
``block_until_ready`` (imports, devices and the target before it) with the worker's ``VmHWM``
reset right before it; "RSS growth ÷ result" is that peak minus the RSS before the load over
the bytes of the result. ``maxtext`` runs under GNU ``time``: wall time and ``ru_maxrss`` of the
whole command, whose "growth" is its whole peak (torch's imports included). Runs alternate
contender by contender and cold/warm; a run during which others used the CPU is run again
(``--attempts``). Every run's output is checked before its number counts: shapes, dtypes and
shardings of every leaf, and the values of a sample (layer 0, the last layer and the
non-layer tensors; every tensor with ``--quick`` or ``--check all``) bit for bit against the
numpy reference (``tests/support/quantized_reference.py``; ``int4`` / ``nvfp4``: its
``int_reference`` / ``nvfp4_reference`` of the unpacked codes); compressed-tensors'
decompression as values (−0 equal to +0; on these checkpoints it is also bit for bit equal:
its bf16 product of a bf16 scale, and its float32 NVFP4 group scale ``scale / global``
times the code, round once to bf16, as ours); the maxtext rows check their written bf16 tensors
as values (its e2m1 decoder writes −0 as +0, 5.6 % of the tiny gpt-oss experts' elements; the
float32 ``e_score_correction_bias``, which it casts to bf16, is left out).

Targets: ours ≥ 3× faster than load-then-dequantize (*ours ÷ row* time ≤ 1/3),
RSS growth ≤ 1.2× the bytes of the result.

Results go to stdout and ``bench/results/quantized.md`` (``quantized-quick.md`` with ``--quick``)
when every family runs, else ``quantized-<families>.md`` (``--results`` names another), so that a
run of some families leaves the whole table be.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
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
sys.path.insert(1, str(BENCH.parent))  # tests/: the checkpoints and their reference
import common
from common import (
    CONDITION_NOTES,
    CONDITIONS,
    fmt_gb,
    machine_line,
    run_undisturbed,
)
from convert import GNU_TIME, run_commands
from convert import rows as convert_rows
from load import checkpoint_files, warm_page_cache

from tests.support import quantized_checkpoints as qc

# family → (specs, twins, writer, MaxText 0.2.5's dequantize script or None: it has none).
FAMILIES = {"fp8": (qc.DEEPSEEK, qc.deepseek_twins, qc.write_deepseek, "deepseek_dequantize.py"),
            "mxfp4": (qc.GPT_OSS, qc.gpt_oss_twins, qc.write_gpt_oss, "dequantize_mxfp4.py"),
            "int4": (qc.KIMI_INT4, qc.kimi_int4_twins, qc.write_kimi_int4, None),
            "nvfp4": (qc.DEEPSEEK_NVFP4, qc.deepseek_nvfp4_twins, qc.write_deepseek_nvfp4, None)}
CONTENDERS = ("ours", "load_dequantize", "maxtext")
SIZES = ("tiny", "1")
SEED = 20260601
CONTENDER_NOTES = {
    "ours": "`ost.load(path, target, mapping=ost.Mapping(rules, quantization=ost.FP8((128, 128)) / "
            "ost.MXFP4() / ost.IntQuantized(4, 32) / ost.NVFP4()))`: each shard dequantized as it is read",
    "load_dequantize": "fp8, mxfp4: `safe_open(f, framework=\"numpy\").get_tensor` of each weight and its scales, "
                       "whole, numpy dequantization (float32, then bf16); int4, nvfp4: `safe_open(f, "
                       "framework=\"pt\")` whole tensors, compressed-tensors 0.20.1's own "
                       "`BaseCompressor.get_value_from_registry(format).decompress(state_dict, scheme)` per module "
                       "(scale in its stored dtype, as transformers 5.24 calls it), `.to(bfloat16)`; then "
                       "`jax.device_put(twin, sharding)`",
    "maxtext": "MaxText 0.2.5's `deepseek_dequantize.py` / `dequantize_mxfp4.py`, unmodified (the latter's "
               "`device=\"cuda\"` mapped to the CPU), torch on CPU, writing a bf16 checkpoint: the whole "
               "command's time and peak RSS, not placing anything on devices; MaxText has no script for "
               "compressed-tensors checkpoints (int4, nvfp4): absent there",
}


# ---------------------------------------------------------------------------
# Checkpoints, targets, samples.


def ensure_checkpoint(root: Path, family: str, size: str) -> Path:
    """The cached checkpoint of ``family`` at ``size`` (``home/checkpoint``), written if absent or stale."""
    specs, _, write, _ = FAMILIES[family]
    spec = {"family": family, "seed": SEED, **specs[size]}
    home = root / f"{family}-{size}"
    if not common.cached(home, spec):
        print(f"writing the {family} {size} checkpoint to {home} (once) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        write(home / "checkpoint", specs[size], seed=SEED)
        (home / "spec.json").write_text(json.dumps(spec, indent=1))  # last: marks the cache complete
        print(f"  written in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return home


def twins_of(home: Path) -> dict:
    spec = json.loads((home / "spec.json").read_text())
    return FAMILIES[spec["family"]][1](spec)


def sample(twins: dict, check: str) -> list[str]:
    """The twins whose values are compared: all, or layer 0, the last layer and the non-layer ones."""
    if check == "all":
        return list(twins)
    last = max(int(n.split(".")[2]) for n in twins if n.startswith("model.layers."))
    return [n for n in twins if not n.startswith("model.layers.") or n.split(".")[2] in ("0", str(last))]


def build_target(twins: dict, split=None) -> dict:
    """The twins as ``jax.ShapeDtypeStruct``s over the 8 devices, each split 8 ways along the axis
    ``split(shape)`` names (default ``first_split``; ``None``: replicated)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = common.mesh_1d()

    def spec(shape):
        axis = (split or first_split)(shape)
        return P() if axis is None else P(*[("x" if a == axis else None) for a in range(len(shape))])

    return {name: jax.ShapeDtypeStruct(shape, qc.twin_dtype(how), sharding=NamedSharding(mesh, spec(shape)))
            for name, (shape, how) in twins.items()}


def first_split(shape) -> int | None:
    """The first axis of a 2-D or 3-D tensor that 8 divides: a ``Linear`` weight's rows, stacked experts."""
    return next((a for a, d in enumerate(shape) if d % 8 == 0), None) if len(shape) >= 2 else None


def check_leaves(result: dict, target: dict) -> None:
    """Raises unless ``result`` has ``target``'s names, shapes, dtypes and shardings."""
    import jax

    if set(result) != set(target):
        raise AssertionError(f"names differ from the target: {sorted(set(result) ^ set(target))[:5]}")
    for name, want in target.items():
        got = result[name]
        if not isinstance(got, jax.Array) or got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(f"{name}: got {type(got).__name__} {getattr(got, 'shape', '?')} "
                                 f"{getattr(got, 'dtype', '?')}, want {want.shape} {want.dtype}")
        if not got.sharding.is_equivalent_to(want.sharding, len(want.shape)):
            raise AssertionError(f"{name}: got sharding {got.sharding}, want {want.sharding}")


def check_values(get, checkpoint: Path, twins: dict, names: list[str], bitwise: bool = True) -> None:
    """Raises unless ``get(name)`` equals the numpy reference's twin, for each of ``names``: bit for
    bit, or (``bitwise=False``) as values, where −0 equals +0."""
    import numpy as np

    for name, want in qc.reference_twins(checkpoint, twins, names):
        got = np.asarray(get(name))
        same = got.tobytes() == want.tobytes() if bitwise else np.array_equal(
            got.astype(np.float32), want.astype(np.float32))
        if got.shape != want.shape or got.dtype != want.dtype or not same:
            raise AssertionError(f"{name}: {got.shape} {got.dtype} differs from the reference "
                                 f"{want.shape} {want.dtype}")


# ---------------------------------------------------------------------------
# The in-process contenders (``--worker``).


def load_ours(checkpoint: Path, twins: dict, target: dict):
    import orbax_safetensors as ost

    mapping = ost.Mapping([ost.Rule(p, p) for p in qc.identity_patterns(twins)],
                          quantization=scheme_of(json.loads((checkpoint / "config.json").read_text())))
    return ost.load(str(checkpoint), target, mapping=mapping)


def scheme_of(config: dict):
    """The quantization scheme of a bench checkpoint's ``config.json``, written out as a user would."""
    import orbax_safetensors as ost

    config = config["quantization_config"]
    if config["quant_method"] == "fp8":
        return ost.FP8(tuple(config["weight_block_size"]))
    if config["quant_method"] == "mxfp4":
        return ost.MXFP4()
    weights = config["config_groups"]["group_0"]["weights"]
    if config["format"] == "pack-quantized":
        return ost.IntQuantized(weights["num_bits"], weights["group_size"], symmetric=weights["symmetric"])
    return ost.NVFP4("compressed-tensors", weights["group_size"])


def load_dequantize(checkpoint: Path, twins: dict, target: dict):
    import jax
    from safetensors import safe_open

    opened = partial(safe_open, framework="pt" if compressed_tensors(checkpoint) else "numpy")
    return {name: jax.device_put(twin, target[name].sharding)
            for name, twin in qc.reference_twins(checkpoint, twins, open_file=opened, reference=False)}


def compressed_tensors(checkpoint: Path) -> bool:
    """Whether the checkpoint is compressed-tensors' (its peer: torch and compressed-tensors' own
    decompression, checked as values)."""
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    return config["quant_method"] == "compressed-tensors"


LOADERS = {"ours": load_ours, "load_dequantize": load_dequantize}


def prepare(contender: str, checkpoint: Path) -> None:
    """Imports before the clock (and safetensors' numpy backend taught float8; compressed-tensors'
    compressor and scheme looked up)."""
    if contender == "ours":
        import orbax_safetensors  # noqa: F401
        return
    if compressed_tensors(checkpoint):
        import safetensors.torch  # noqa: F401

        qc._compressor(json.dumps(json.loads((checkpoint / "config.json").read_text())["quantization_config"],
                                  sort_keys=True))
        return
    import ml_dtypes
    import numpy as np
    import safetensors.numpy  # noqa: F401

    if not hasattr(np, "float8_e4m3fn"):
        np.float8_e4m3fn = ml_dtypes.float8_e4m3fn


def worker(args: dict) -> dict:
    import jax

    home = Path(args["home"])
    checkpoint, twins = home / "checkpoint", twins_of(home)
    target = build_target(twins)
    prepare(args["contender"], checkpoint)
    load = partial(LOADERS[args["contender"]], checkpoint, twins, target)
    result, report = common.timed_load(lambda: jax.block_until_ready(load()), args["condition"])
    check_leaves(result, target)
    check_values(lambda name: result[name], checkpoint, twins, sample(twins, args["check"]),
                 bitwise=args["contender"] == "ours" or not compressed_tensors(checkpoint))
    return {"ok": True, **report, "bytes": sum(int(x.nbytes) for x in result.values())}


# ---------------------------------------------------------------------------
# MaxText's scripts.


def maxtext_script(name: str) -> tuple[str, Path] | None:
    """(a python with torch, MaxText 0.2.5's standalone script ``name``), or None with why on stderr."""
    from convert import maxtext_python

    venv_python = maxtext_python()
    if venv_python is None:
        return None
    scripts = sorted(Path(venv_python).parent.parent.glob(
        "lib/python3*/site-packages/maxtext/checkpoint_conversion/standalone_scripts"))
    if not scripts:
        print("maxtext left out: no standalone_scripts in its venv", file=sys.stderr)
        return None
    has_torch = subprocess.run([venv_python, "-c", "import torch"], check=False, capture_output=True).returncode == 0
    if not has_torch and importlib.util.find_spec("torch") is None:
        print("maxtext left out: its scripts need torch (neither its venv nor this one has it)", file=sys.stderr)
        return None
    return (venv_python if has_torch else sys.executable), scripts[0] / name


CPU_RUNNER = ("import runpy, sys, safetensors.torch as st; load = st.load_file; "
              "st.load_file = lambda f, device='cpu': load(f, device='cpu'); "
              "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def maxtext_command(python: str, script: Path, src: Path, dst: Path) -> list[str]:
    arguments = [str(script), "--input-path", str(src), "--output-path", str(dst)]
    if script.name == "dequantize_mxfp4.py":
        dst.mkdir(parents=True)
        return [python, "-c", CPU_RUNNER, *arguments]
    return [python, *arguments]


def check_written(home: Path, written: Path, check: str) -> str | None:
    """Why MaxText's bf16 checkpoint ``written`` differs from the reference, or None (in a child).
    As values: its e2m1 decoder writes the −0 nibble (8) as +0 (``torch.where(is_zero, 0.0, ...)``);
    its float32 tensors, cast to bf16, are left out."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--check-written", str(home),
                           str(written), check], check=False, capture_output=True, text=True, cwd=BENCH.parent)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["check failed"])[-1][:300]


def check_written_here(home: Path, written: Path, check: str) -> None:
    twins = twins_of(home)
    where = qc.weight_map(written)
    files: dict[str, qc.RawFile] = {}

    def get(name: str):
        if where[name] not in files:
            files[where[name]] = qc.RawFile(str(written / where[name]))
        return files[where[name]].get_tensor(name)

    names = [n for n in sample(twins, check) if twins[n][1] != "f32"]
    check_values(get, home / "checkpoint", twins, names, bitwise=False)


# ---------------------------------------------------------------------------
# The parent.


class Bench:
    """One family's checkpoint and its runs."""

    def __init__(self, args, family: str):
        self.args, self.family = args, family
        self.home = ensure_checkpoint(Path(args.work_dir), family, args.size)
        self.files = checkpoint_files(self.home / "checkpoint")
        self.twins = twins_of(self.home)
        self.result_bytes = sum(int(qc.twin_dtype(how).itemsize) * math.prod(shape)
                                for shape, how in self.twins.values())

    def run(self, contender: str, condition: str) -> dict:
        warm_page_cache(self.files)
        if contender != "maxtext":
            return common.run_worker(Path(__file__).resolve(), [json.dumps({
                "home": str(self.home), "contender": contender, "condition": condition, "check": self.args.check})])
        dst = Path(self.args.work_dir) / "out" / f"{self.family}-maxtext"
        shutil.rmtree(dst, ignore_errors=True)
        dst.parent.mkdir(parents=True, exist_ok=True)
        python, script = self.args.maxtext[self.family]
        result = run_commands([maxtext_command(python, script, self.home / "checkpoint", dst)], condition,
                              dst.parent / f"{self.family}-maxtext-{condition}.log")
        if result["ok"]:
            problem = check_written(self.home, dst, self.args.check)
            result = result if problem is None else {"ok": False, "error": f"wrong output: {problem}"}
        shutil.rmtree(dst, ignore_errors=True)
        return result | {"baseline_rss": 0}  # its whole peak


def run_all(args) -> dict:
    """results[family][contender][condition] = [run, ...], and each family's Bench."""
    results, benches = {}, {}
    for family in args.families:
        bench = benches[family] = Bench(args, family)
        results[family] = {c: {k: [] for k in CONDITIONS} for c in contenders_of(args, family)}
        for repeat in range(args.repeats):
            order = args.conditions if repeat % 2 == 0 else args.conditions[::-1]
            for contender in contenders_of(args, family):
                for condition in order:
                    result = run_undisturbed(partial(bench.run, contender, condition), args.attempts)
                    results[family][contender][condition].append(result)
                    shown = common.progress(result, lambda r: f"{r['seconds']:.2f} s, peak RSS {fmt_gb(r['peak_rss'])} GB")
                    print(f"[{family} {repeat + 1}/{args.repeats} {condition}] {contender}: {shown}",
                          file=sys.stderr, flush=True)
    return {"results": results, "benches": benches}


def contenders_of(args, family: str) -> list[str]:
    """The contenders a family runs: maxtext only where MaxText has a script for it."""
    return [c for c in args.contenders if c != "maxtext" or FAMILIES[family][3] is not None]


def growth_rows(family: str, by_contender: dict, contenders: list[str], result_bytes: int) -> list[str]:
    """One family's RSS growth ÷ result rows, cold / warm medians."""
    out = []
    for contender in contenders:
        cells = []
        for condition in CONDITIONS:
            runs = [r for r in by_contender[contender][condition] if r["ok"]]
            cells.append(f"{statistics.median((r['peak_rss'] - r['baseline_rss']) / result_bytes for r in runs):.2f}"
                         if runs else "—")
        out.append(f"| {family} | {contender} | " + " / ".join(cells) + " |")
    return out


def render(args, measured: dict, wall: float) -> str:
    results, benches = measured["results"], measured["benches"]
    lines = [
        ("### Quantized checkpoints loaded dequantized (bf16) into 8 CPU devices: ours vs load-then-dequantize "
         "and MaxText 0.2.5's dequantize scripts, cold and warm"),
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, whole benchmark {wall:.0f} s)",
        f"- machine: {machine_line()}",
        f"- versions: {common.versions_line()}",
    ]
    for family, bench in benches.items():
        stored = sum(p.stat().st_size for p in bench.files)
        spec = {k: v for k, v in json.loads((bench.home / "spec.json").read_text()).items() if k not in ("family", "seed")}
        lines.append(f"- {family}: {stored / 1e9:.2f} GB stored in {len(bench.files)} files, {len(bench.twins)} "
                     f"tensors, result {fmt_gb(bench.result_bytes)} GB; {spec}")
    lines += [
        (f"- **cold**: {CONDITION_NOTES['cold']}; **warm**: {CONDITION_NOTES['warm']}. The checkpoint is in the page "
         f"cache (read right before each run); {args.repeats} runs of each, alternating; cells `median [min–max]`."),
        ("- seconds: ours and load_dequantize, the load call + `block_until_ready`; maxtext, its whole command "
         "(process start to exit). Peak RSS (GB): the worker's `VmHWM` over the load / the command's `ru_maxrss`. "
         "*ours ÷ row*: ours' median over this row's, cold / warm (time target ≤ 0.33 against load_dequantize). "
         "*RSS growth ÷ result* (second table; target ≤ 1.2): (peak − RSS before the load) ÷ the result's bytes "
         "(maxtext: its whole peak). Every run's output was checked against the numpy reference "
         f"({'every tensor' if args.check == 'all' else 'a sample: layer 0, the last layer, the rest'}, bit for bit; "
         "compressed-tensors' own decompression (int4, nvfp4 load_dequantize) as values; "
         "maxtext's written tensors as values: its e2m1 decoder writes −0 as +0) before it counted."),
        "",
        ("| size GB | family | contender | cold s | warm s | peak RSS cold GB | peak RSS warm GB | ours ÷ row, "
         "time | ours ÷ row, peak RSS | discarded |"),
        "|---|---|---|---|---|---|---|---:|---:|---|",
    ]
    for family, by_contender in results.items():
        lines += convert_rows(args.size, family, by_contender, list(by_contender))
    lines += ["", "| family | contender | RSS growth ÷ result, cold / warm |", "|---|---|---:|"]
    for family, by_contender in results.items():
        lines += growth_rows(family, by_contender, list(by_contender), benches[family].result_bytes)
    lines += ["", "Contenders: " + "; ".join(f"**{c}**: {CONTENDER_NOTES[c]}" for c in args.contenders) + "."]
    return "\n".join(lines) + "\n"


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="/tmp/ost-bench-quantized",
                        help="checkpoints and MaxText's outputs (default %(default)s)")
    parser.add_argument("--size", default="1", choices=SIZES, help="GB stored per family, or tiny (%(default)s)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="comma-separated; maxtext is left out when its scripts or torch cannot be had")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--repeats", type=int, default=None, help="runs per family, contender and condition (3)")
    parser.add_argument("--attempts", type=int, default=2, help="runs in all while disturbed (%(default)s)")
    parser.add_argument("--check", choices=("sample", "all"), default=None,
                        help="the tensors whose values are checked (sample; all with --quick)")
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoints, 1 repeat, every tensor checked")
    parser.add_argument("--results", default=None,
                        help="the results file's name under bench/results/, without .md (default: quantized when "
                             "every family runs, else quantized-<families>; -quick appended with --quick)")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.size = "tiny" if args.quick else args.size
    args.check = args.check or ("all" if args.quick else "sample")
    args.families = common.listed(parser, args.families, FAMILIES, "family")
    args.contenders = common.listed(parser, args.contenders, CONTENDERS, "contender")
    args.conditions = common.listed(parser, args.conditions, CONDITIONS, "condition")
    scripted = [family for family in args.families if FAMILIES[family][3] is not None]
    if "maxtext" in args.contenders:
        found = {family: maxtext_script(FAMILIES[family][3]) for family in scripted}
        if not scripted or None in found.values() or not os.path.exists(GNU_TIME):
            args.contenders.remove("maxtext")
        args.maxtext = found
    return args


def results_name(argv: list[str]) -> str:
    """``--results``, or ``quantized`` when every family runs and ``quantized-<families>`` when
    some do (a run of some families leaves the whole table's file as it was)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--results", default=None)
    known, _ = parser.parse_known_args(argv)
    if known.results:
        return known.results
    families = [f.strip() for f in known.families.split(",") if f.strip()]
    return "quantized" if set(families) >= set(FAMILIES) else "-".join(["quantized", *families])


def main() -> None:
    common.dispatch({"--worker": lambda payload: common.report_result(worker(json.loads(payload))),
                     "--check-written": lambda home, written, check: check_written_here(Path(home), Path(written), check)},
                    arguments, run_all, render, results_name(sys.argv[1:]))


if __name__ == "__main__":
    main()
