"""Loading a Hugging Face Llama checkpoint into MaxText's scanned params tree: ``ost.load`` vs MaxText's host path.

    .venv/bin/python bench/scanned.py              # ~1.04 GB checkpoint, 5 repeats, cold and warm
    .venv/bin/python bench/scanned.py --quick      # ~0.045 GB, 1 repeat: a smoke test
    .venv/bin/python bench/scanned.py --shardings tp --contenders scanned,maxtext_host --repeats 3

What it measures: the wall time, page faults and peak memory of filling MaxText's
Llama-3.1 params tree (``token_embedder.embedding``, ``decoder.layers.self_attention.query.kernel``,
... without the leading ``params`` and without value wrappers) from one synthetic
llama-like bf16 checkpoint with transformers' names (GQA: 16 layers, hidden 1536, 12 heads,
4 KV heads, head_dim 128, ffn 4352, vocab 32000, untied head; an HF sharded directory with
``model.safetensors.index.json`` and a ``config.json``, written once by ``ost.save(...,
max_shard_size="500MB")`` and cached under ``--dir``), on 8 host CPU devices. Targets are bf16,
the stored dtype, so the bytes loaded are the bytes stored. Contenders:

* ``unscanned``: ``ost.load(dir, target, mapping=ost.mappings.maxtext("llama3.1", config,
  scan_layers=False))`` into the unscanned tree (``decoder.layers_{i}.…``, one leaf per layer);
* ``scanned``: the same with ``scan_layers=True``: each per-layer leaf holds every layer,
  stacked at axis 1 (MaxText's ``param_scan_axis=1``), e.g. query ``(D, L, H, hd)``;
* ``maxtext_host``: what MaxText's converter (``checkpoint_conversion/to_maxtext.py`` with
  ``LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN``) does, leaf by leaf of the scanned tree: every
  layer's whole tensor read on the host (``safetensors.safe_open(f, framework="np")``,
  ``get_tensor``), transformed in numpy (``x.transpose().reshape(shape)``; q/k: RoPE halves →
  interleaved; q: times ``1/sqrt(head_dim)`` in float32, cast back to bf16), ``np.stack(axis=1)``,
  then ``jax.device_put(leaf, sharding)``; each leaf's host arrays are dropped before the next.
  (MaxText's RoPE hook uses ``jax.numpy``; numpy here spares it the device round trips.
  The real converter also reads the whole checkpoint before converting; this path holds one
  leaf's layers at a time, the cheapest form of that recipe.)

Shardings: MaxText's logical axis rules give every leaf the same ``PartitionSpec`` over a
mesh ``("fsdp", "tensor")``; the two settings differ in the mesh's shape only, and the
spec of every leaf is printed under the table:

* ``fsdp``: mesh ``(8, 1)``: the embed axis (D) of every kernel over 8 devices
  (``tensor`` has size 1);
* ``tp``: mesh ``(2, 4)``: D over ``fsdp`` = 2, and heads / kv heads / ffn / vocab over
  ``tensor`` = 4 (query ``P("fsdp", None, "tensor", None)``, out ``P("tensor", None, None,
  "fsdp")``, wi ``P("fsdp", None, "tensor")``, wo ``P("tensor", None, "fsdp")``).

Norm scales are replicated; the layer axis is never sharded. Unscanned leaves have the
same specs minus the layer axis.

Method, as in ``bench/load.py`` (whose helpers this reuses): every run is a fresh worker
process; *cold* starts with nothing prefaulted, *warm* after a child of the worker
touched and freed 4 GB right before the timed region (``common.CONDITION_NOTES``). Before
every run the parent reads every checkpoint file (untimed), so the whole checkpoint is
in the page cache for every contender alike: these are the loaders' CPU and memory
costs, not the disk's. Runs alternate contender by contender and cold/warm (which goes
first flips every repeat); a run during which other processes used the CPU is discarded
and run again (``common.run_undisturbed``). Timed: the load call plus
``jax.block_until_ready`` on every leaf (imports, backend start-up, target and mapping
built before). Afterwards (untimed) every worker checks the tree's names, shapes, dtypes
and shardings, and compares bitwise several leaves (embedding, head, final norm, q, k,
v, out, wo, a layer norm; for the unscanned tree the first and last layers' leaves)
with the ``maxtext_host`` recipe applied to the checkpoint, so that every contender
loads exactly the same values.

Reading the table: cells are ``median [min–max]`` seconds over the repeats; ``÷ scanned``
is the row's median over the scanned load's (1.00 for scanned itself; below 1.10 for
unscanned means scanned is within 10 % of unscanned; above 5 for ``maxtext_host`` means
scanned is more than 5x faster). Faults are the run's minor page faults (thousands) and
transparent huge pages faulted system-wide. Peak RSS is the worker's ``VmHWM`` over the
timed region (reset right before it), growth = peak minus the RSS right before the load;
both ÷ the bytes loaded. CPU "device" buffers live in host RAM, so the loaded tree itself
counts: a loader that holds nothing else grows by 1.00x.

Results go to stdout and ``bench/results/scanned.md`` (``scanned-quick.md`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests/ (trees: flat names ↔ nested)
import common
from common import (
    cached,
    CONDITION_NOTES,
    CONDITIONS,
    fmt_gb,
    machine_line,
    publish,
    report_result,
    run_undisturbed,
    spread,
    versions_line,
)
from load import checkpoint_files, random_bf16, warm_page_cache, weight_map
from tests.support.trees import flat, nest

CONTENDERS = ("unscanned", "scanned", "maxtext_host")
SHARDINGS = ("fsdp", "tp")
MESHES = {"fsdp": (8, 1), "tp": (2, 4)}  # ("fsdp", "tensor")
FAMILY = "llama3.1"
SPEC_VERSION = 1
# GQA llama-like; 1.04 GB in bf16. hidden, heads, kv heads and ffn divide by 8 / 4 as the meshes need.
FULL = dict(layers=16, hidden=1536, heads=12, kv_heads=4, head_dim=128, ffn=4352, vocab=32000,
            max_shard_size="500MB")
QUICK = dict(layers=8, hidden=256, heads=8, kv_heads=4, head_dim=32, ffn=704, vocab=32000,
             max_shard_size="20MB")  # ~0.045 GB, still a sharded dir with an index
CONTENDER_NOTES = {
    "unscanned": f'`ost.load(dir, target, mapping=ost.mappings.maxtext("{FAMILY}", config, scan_layers=False))`',
    "scanned": "the same with `scan_layers=True` (layers stacked at axis 1)",
    "maxtext_host": "per leaf: every layer's `safe_open(f, framework=\"np\").get_tensor(name)`, "
                    "numpy transforms (transpose/reshape, RoPE, q scale in f32), `np.stack(axis=1)`, "
                    "`jax.device_put(leaf, sharding)`",
}


# ---------------------------------------------------------------------------
# The model: HF names and shapes, MaxText tree names, shapes and specs.


def hf_shapes(s: dict) -> dict:
    """transformers' ``LlamaForCausalLM`` tensor names and shapes."""
    d, q, kv, f = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["ffn"]
    shapes = {"model.embed_tokens.weight": (s["vocab"], d)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        }
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (s["vocab"], d)
    return shapes


def hf_config(s: dict) -> dict:
    """The ``config.json`` written next to the checkpoint (and handed to the mapping)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": s["vocab"], "hidden_size": s["hidden"], "intermediate_size": s["ffn"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }


# Per-layer leaves: tree suffix -> (HF suffix, shape of one layer, spec of one layer). The
# specs are MaxText's logical axis rules resolved: embed -> fsdp, heads/kv_heads/mlp/vocab -> tensor.
def layer_leaves(s: dict) -> dict:
    d, h, k, hd, f = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["ffn"]
    return {
        "self_attention.query.kernel": ("self_attn.q_proj.weight", (d, h, hd), ("fsdp", "tensor", None)),
        "self_attention.key.kernel": ("self_attn.k_proj.weight", (d, k, hd), ("fsdp", "tensor", None)),
        "self_attention.value.kernel": ("self_attn.v_proj.weight", (d, k, hd), ("fsdp", "tensor", None)),
        "self_attention.out.kernel": ("self_attn.o_proj.weight", (h, hd, d), ("tensor", None, "fsdp")),
        "mlp.wi_0.kernel": ("mlp.gate_proj.weight", (d, f), ("fsdp", "tensor")),
        "mlp.wi_1.kernel": ("mlp.up_proj.weight", (d, f), ("fsdp", "tensor")),
        "mlp.wo.kernel": ("mlp.down_proj.weight", (f, d), ("tensor", "fsdp")),
        "pre_self_attention_layer_norm.scale": ("input_layernorm.weight", (d,), (None,)),
        "post_self_attention_layer_norm.scale": ("post_attention_layernorm.weight", (d,), (None,)),
    }


SCAN_AXIS = 1  # MaxText's param_scan_axis


def tree_leaves(s: dict, scanned: bool) -> dict:
    """Flat dotted tree name -> (HF names whose layers form it, leaf shape, spec tuple)."""
    d, v = s["hidden"], s["vocab"]
    leaves = {
        "token_embedder.embedding": (["model.embed_tokens.weight"], (v, d), ("tensor", "fsdp")),
        "decoder.decoder_norm.scale": (["model.norm.weight"], (d,), (None,)),
        "decoder.logits_dense.kernel": (["lm_head.weight"], (d, v), ("fsdp", "tensor")),
    }
    for suffix, (hf, shape, spec) in layer_leaves(s).items():
        if scanned:
            leaves[f"decoder.layers.{suffix}"] = (
                [f"model.layers.{i}.{hf}" for i in range(s["layers"])],
                shape[:SCAN_AXIS] + (s["layers"],) + shape[SCAN_AXIS:],
                spec[:SCAN_AXIS] + (None,) + spec[SCAN_AXIS:])
        else:
            for i in range(s["layers"]):
                leaves[f"decoder.layers_{i}.{suffix}"] = ([f"model.layers.{i}.{hf}"], shape, spec)
    return leaves


def nbytes(s: dict) -> int:
    return sum(2 * math.prod(shape) for shape in hf_shapes(s).values())


def spec_lines(s: dict) -> list[str]:
    """Every scanned leaf's shape and PartitionSpec, for the table's notes."""
    out = []
    for name, (_, shape, spec) in tree_leaves(s, scanned=True).items():
        shown = ", ".join("None" if a is None else f'"{a}"' for a in spec)
        out.append(f"  - `{name}` {shape}: `P({shown})`")
    return out


# ---------------------------------------------------------------------------
# The synthetic checkpoint.


def ensure_checkpoint(root: Path, s: dict) -> Path:
    """The cached checkpoint for ``s`` under ``root``, written if absent or different."""
    spec = {"version": SPEC_VERSION, "seed": common.SEED, **s, "bytes": nbytes(s)}
    home = root / ("maxtext-llama-l{layers}-d{hidden}-h{heads}-k{kv_heads}-hd{head_dim}-f{ffn}-v{vocab}"
                   .format(**s))
    checkpoint, spec_file = home / "checkpoint", home / "spec.json"
    if cached(home, spec):
        return home
    import numpy as np

    import orbax_safetensors as ost

    print(f"writing a {spec['bytes'] / 1e9:.2f} GB checkpoint to {checkpoint} (once) ...",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    rng = np.random.default_rng(spec["seed"])
    params = {name: random_bf16(rng, shape) for name, shape in hf_shapes(s).items()}
    ost.save(checkpoint, params, max_shard_size=s["max_shard_size"])
    (checkpoint / "config.json").write_text(json.dumps(hf_config(s), indent=1))
    spec_file.write_text(json.dumps(spec, indent=1))  # last: marks the cache complete
    print(f"  written in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return home


# ---------------------------------------------------------------------------
# MaxText's host recipe (LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN, saving_to_hf=False), in numpy.


def reshape_kernel(x, shape):
    return x.transpose().reshape(shape)


def adjust_rope(x):
    """HF's concatenated halves → MaxText's interleaved pairs, on the last axis (head_dim)."""
    import numpy as np
    half = x.shape[-1] // 2
    return np.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)


def scale_query(x, head_dim: int):
    import numpy as np
    depth_scale = np.dtype("float32").type(1 / np.sqrt(head_dim))
    return (x.astype(np.float32) * depth_scale).astype(x.dtype)


def host_layer(name: str, x, shape: tuple, head_dim: int):
    """One stored tensor → its (per-layer) leaf, with MaxText's hook chain for ``name``."""
    if name.endswith(("query.kernel", "key.kernel", "value.kernel", "out.kernel", "wi_0.kernel",
                      "wi_1.kernel", "wo.kernel", "logits_dense.kernel")):
        x = reshape_kernel(x, shape)
    if name.endswith(("query.kernel", "key.kernel")):
        x = adjust_rope(x)
    if name.endswith("query.kernel"):
        x = scale_query(x, head_dim)
    return x


def host_leaf(name: str, hf_names: list[str], shape: tuple, scanned: bool, get, head_dim: int):
    """The leaf ``name`` built on the host from ``get(hf_name)`` (numpy)."""
    import numpy as np
    if len(hf_names) == 1 and not (scanned and name.startswith("decoder.layers.")):
        return host_layer(name, get(hf_names[0]), shape, head_dim)
    layer_shape = shape[:SCAN_AXIS] + shape[SCAN_AXIS + 1:]
    return np.stack([host_layer(name, get(n), layer_shape, head_dim) for n in hf_names], axis=SCAN_AXIS)


class Handles:
    """``safe_open`` handles of every file of the checkpoint, by tensor name."""

    def __init__(self, checkpoint: Path):
        from safetensors import safe_open
        self.files = {file: safe_open(str(checkpoint / file), framework="np")
                      for file in sorted(set(weight_map(checkpoint).values()))}
        self.where = weight_map(checkpoint)

    def get(self, name: str):
        return self.files[self.where[name]].get_tensor(name)


# ---------------------------------------------------------------------------
# The worker: one contender, one sharding, in a fresh process.


def build_target(s: dict, sharding_name: str, scanned: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    if len(devices) != 8:
        raise RuntimeError(f"expected 8 CPU devices, got {len(devices)}: {devices}")
    mesh = Mesh(np.array(devices).reshape(MESHES[sharding_name]), ("fsdp", "tensor"))
    return nest({name: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(*spec)))
                 for name, (_, shape, spec) in tree_leaves(s, scanned).items()})


def load_ours(checkpoint: Path, target: dict, extra: dict):
    import dataclasses

    import orbax_safetensors as ost

    stats = ost.LoadStats()
    result = ost.load(str(checkpoint), target, mapping=extra["mapping"], stats=stats)
    extra["to_json"] = lambda: dataclasses.asdict(stats)
    return result


def load_maxtext_host(checkpoint: Path, target: dict, extra: dict):
    import jax

    s = extra["spec"]
    handles = Handles(checkpoint)
    flat_target = flat(target)
    result = {}
    for name, (hf_names, shape, _) in tree_leaves(s, scanned=True).items():
        leaf = host_leaf(name, hf_names, shape, True, handles.get, s["head_dim"])
        result[name] = jax.device_put(leaf, flat_target[name].sharding)
        del leaf
    return nest(result)


LOADERS = {"unscanned": load_ours, "scanned": load_ours, "maxtext_host": load_maxtext_host}


def checked_leaves(s: dict, scanned: bool) -> list[str]:
    """The leaves every worker compares bitwise with the host recipe."""
    layers = ["decoder.layers."] if scanned else ["decoder.layers_0.", f"decoder.layers_{s['layers'] - 1}."]
    names = ["token_embedder.embedding", "decoder.logits_dense.kernel", "decoder.decoder_norm.scale"]
    for prefix in layers:
        names += [prefix + suffix for suffix in (
            "self_attention.query.kernel", "self_attention.key.kernel", "self_attention.value.kernel",
            "self_attention.out.kernel", "mlp.wo.kernel", "pre_self_attention_layer_norm.scale")]
    return names


def verify(result: dict, target: dict, s: dict, scanned: bool, checkpoint: Path, *,
           flushed: bool = False) -> None:
    """Names, shapes, dtypes, shardings, and ``checked_leaves`` bitwise against the host recipe.
    ``flushed``: the result was computed by XLA on CPU (MaxText's hooks on device), which flushes
    subnormal float32 intermediates to zero: where the recipe gives a magnitude at or below the
    smallest normal (the query scale), the result may be a zero of the same sign instead."""
    import jax
    import numpy as np

    got_flat, want_flat = flat(result), flat(target)
    if set(got_flat) != set(want_flat):
        raise AssertionError(f"result names differ from target: {sorted(set(got_flat) ^ set(want_flat))[:5]}")
    for name, want in want_flat.items():
        got = got_flat[name]
        if not isinstance(got, jax.Array):
            raise AssertionError(f"{name}: got a {type(got).__name__}, not a jax.Array")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(f"{name}: got {got.shape} {got.dtype}, want {want.shape} {want.dtype}")
        if not got.sharding.is_equivalent_to(want.sharding, len(want.shape)):
            raise AssertionError(f"{name}: got sharding {got.sharding}, want {want.sharding}")
    handles = Handles(checkpoint)
    leaves = tree_leaves(s, scanned)
    for name in checked_leaves(s, scanned):
        hf_names, shape, _ = leaves[name]
        want = host_leaf(name, hf_names, shape, scanned, handles.get, s["head_dim"])
        got = np.asarray(got_flat[name]).view(np.uint16)
        want = np.ascontiguousarray(want).view(np.uint16)
        differs = got != want
        if flushed:  # bf16 0x0080: the smallest normal; sign bit kept, magnitude bits zero
            differs &= ~(((want & 0x7FFF) <= 0x0080) & (got == (want & 0x8000)))
        if differs.any():
            raise AssertionError(f"{name}: differs from MaxText's host recipe")


def worker(args) -> None:
    home = Path(args.home)
    spec = json.loads((home / "spec.json").read_text())
    checkpoint = home / "checkpoint"
    import jax
    import safetensors  # noqa: F401  (imported before the clock)

    import orbax_safetensors as ost

    scanned = args.contender != "unscanned"
    target = build_target(spec, args.sharding, scanned)
    extra: dict = {"spec": spec}
    if args.contender in ("unscanned", "scanned"):
        config = json.loads((checkpoint / "config.json").read_text())
        extra["mapping"] = ost.mappings.maxtext(FAMILY, config, scan_layers=scanned)
    loader = LOADERS[args.contender]
    result, measured = common.timed_load(
        lambda: jax.block_until_ready(loader(checkpoint, target, extra)), args.condition)

    loaded = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(result))
    verify(result, target, spec, scanned, checkpoint)
    report = {"ok": True, **measured, "bytes": loaded, "leaves": len(jax.tree_util.tree_leaves(result))}
    if "to_json" in extra:
        report["load_stats"] = extra["to_json"]()
    report_result(report)


# ---------------------------------------------------------------------------
# The parent: runs the workers, alternating, and prints the table.


def median_of(runs: list[dict], key) -> float:
    return statistics.median(key(r) for r in runs)


def render(spec: dict, files: list[Path], results: dict, args, wall: float) -> str:
    total = sum(p.stat().st_size for p in files)
    loaded = spec["bytes"]
    lines = [
        f"### MaxText scanned tree: `ost.load` vs MaxText's host path, {loaded / 1e9:.2f} GB bf16 "
        "Llama checkpoint, 8 CPU devices",
        "",
        f"- command: `{shlex.join(sys.orig_argv)}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"whole benchmark {wall:.0f} s)",
        f"- machine: {machine_line()}",
        f"- versions: {versions_line()}",
        f"- checkpoint: {len(hf_shapes(spec))} tensors with transformers' names, {loaded / 1e9:.3f} GB "
        f"of tensor data in {len(files)} files ({total / 1e9:.3f} GB), llama-like GQA (layers "
        f"{spec['layers']}, hidden {spec['hidden']}, heads {spec['heads']}, kv heads {spec['kv_heads']}, "
        f"head_dim {spec['head_dim']}, ffn {spec['ffn']}, vocab {spec['vocab']}, untied head), HF sharded "
        f"dir (`ost.save(..., max_shard_size=\"{spec['max_shard_size']}\")`, index + config.json), "
        "in the page cache (the parent reads every file right before each run); targets bf16 "
        "like the file, so the bytes loaded are the bytes stored",
        f"- meshes `(\"fsdp\", \"tensor\")`: fsdp = {MESHES['fsdp']}, tp = {MESHES['tp']}; "
        "same PartitionSpecs for both (MaxText's logical axis rules), listed below",
        f"- **cold**: {CONDITION_NOTES['cold']}; **warm**: {CONDITION_NOTES['warm']}. "
        f"Every run is a fresh Python process (`JAX_PLATFORMS=cpu`, 8 host devices); runs alternate "
        f"contender by contender and cold/warm (which goes first alternates), {args.repeats} of "
        "each; cells give `median [min–max]` seconds. Timed: the load call + `block_until_ready` "
        "of every leaf. A run during which other processes used more than 0.05 s + 10% of its "
        "wall time of user CPU is discarded and run again, up to 4 times (column *discarded*; "
        "*kept*: still disturbed at the 4th try). Every run's "
        "result is checked: names, shapes, dtypes, shardings, and several leaves bitwise "
        "against MaxText's host recipe.",
        "- *÷ scanned*: the row's median seconds over the scanned load's (unscanned: scanned is "
        "within 10 % if ≥ 0.91; maxtext_host: how many times slower than scanned). Faults: minor "
        "page faults (thousands) / transparent huge pages faulted system-wide, medians. "
        "RSS (cold runs, medians): peak = the worker's `VmHWM` over the timed region; "
        "÷ loaded = peak ÷ the tensor bytes loaded; growth = (peak − RSS just before the load) ÷ "
        "the bytes loaded (1.00: nothing held but the result).",
    ]
    lines += table(results, args, loaded, "scanned", CONTENDER_NOTES)
    lines += ["", "PartitionSpecs (scanned leaves; unscanned: the same without the layer axis, "
              "`decoder.layers_{i}.…`):", *spec_lines(spec)]
    return "\n".join(lines) + "\n"


def table(results: dict, args: argparse.Namespace, loaded: int, baseline: str, notes_of: dict) -> list[str]:
    """The side-by-side table of ``results`` (``run_all``'s) with each row's ratio to ``baseline``'s
    median, the contenders' notes, and read accounting and CPU per contender: the lines that
    follow a benchmark's header."""
    lines = [
        "",
        f"| sharding | contender | cold s | warm s | ÷ {baseline} cold | ÷ {baseline} warm | faults cold "
        "(K minor / THP) | faults warm | peak RSS cold (GB) | peak ÷ loaded | growth ÷ loaded | discarded |",
        "|---|---|---|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    notes = []
    for sharding in args.shardings:
        base = {c: [r for r in results[sharding][baseline][c] if r["ok"]] for c in CONDITIONS} \
            if baseline in results[sharding] else {}
        for contender in args.contenders:
            runs = results[sharding][contender]
            ok = {c: [r for r in runs[c] if r["ok"]] for c in CONDITIONS}
            failed = [r for c in CONDITIONS for r in runs[c] if not r["ok"]]
            if not ok["cold"] and not ok["warm"]:
                error = failed[0]["error"].replace("|", "\\|") if failed else "not run"
                lines.append(f"| {sharding} | {contender} | failed: {error} |" + " |" * 10)
                continue
            cells = [spread([r["seconds"] for r in ok[c]]) if ok[c] else "—" for c in CONDITIONS]
            for c in CONDITIONS:
                cells.append(f"{median_of(ok[c], lambda r: r['seconds']) / median_of(base[c], lambda r: r['seconds']):.2f}"
                             if ok[c] and base.get(c) else "—")
            for c in CONDITIONS:
                cells.append(f"{median_of(ok[c], lambda r: r['minor_faults']) / 1e3:.0f} / "
                             f"{median_of(ok[c], lambda r: r['thp_faults']):.0f}" if ok[c] else "—")
            cold = ok["cold"]
            cells.append(fmt_gb(median_of(cold, lambda r: r["peak_rss"])) if cold else "—")
            cells.append(f"{median_of(cold, lambda r: r['peak_rss'] / loaded):.2f}" if cold else "—")
            cells.append(f"{median_of(cold, lambda r: (r['peak_rss'] - r['baseline_rss']) / loaded):.2f}"
                         if cold else "—")
            discarded = sum(r.get("discarded", 0) for c in CONDITIONS for r in runs[c])
            kept_disturbed = sum(bool(r.get("disturbed")) for c in CONDITIONS for r in ok[c])
            cells.append(f"{discarded}" + (f" ({kept_disturbed} kept)" if kept_disturbed else ""))
            if failed:
                cells[-1] += f"; {len(failed)} failed: {failed[0]['error'].replace('|', '/')}"
            lines.append(f"| {sharding} | {contender} | " + " | ".join(cells) + " |")
            if cold and "load_stats" in cold[0]:
                st = cold[len(cold) // 2]["load_stats"]
                notes.append(f"  - {sharding} {contender}: bytes_needed {fmt_gb(st['bytes_needed'])} GB, "
                             f"bytes_read {fmt_gb(st['bytes_read'])} GB, {st['requests']} requests, "
                             f"{st['files']} files, {st['tensors']} tensors; CPU user "
                             f"{median_of(cold, lambda r: r['cpu_user']):.2f} s, system "
                             f"{median_of(cold, lambda r: r['cpu_system']):.2f} s")
            elif cold:
                notes.append(f"  - {sharding} {contender}: CPU user "
                             f"{median_of(cold, lambda r: r['cpu_user']):.2f} s, system "
                             f"{median_of(cold, lambda r: r['cpu_system']):.2f} s")
    lines += ["", "Contenders: " + "; ".join(f"**{c}**: {notes_of[c]}" for c in args.contenders) + "."]
    if notes:
        lines += ["", "Read accounting and CPU (median cold run):", *notes]
    return lines


def arguments(description: str, contenders: tuple[str, ...], *, shardings: str, repeats: int) -> argparse.Namespace:
    """The command line of a benchmark of contenders × shardings × conditions (this one's and
    ``bench/maxtext_dynamic.py``'s), with a worker's hidden arguments; validated, lists split."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dir", default="/tmp/ost-bench", help="checkpoint cache (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"runs per contender, sharding and condition ({repeats})")
    parser.add_argument("--shardings", default=shardings, help=f"of {', '.join(SHARDINGS)}")
    parser.add_argument("--contenders", default=",".join(contenders))
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--quick", action="store_true", help="~0.045 GB model, 1 repeat: a smoke test")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--sharding", help=argparse.SUPPRESS)
    parser.add_argument("--condition", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return args
    args.repeats = args.repeats or (1 if args.quick else repeats)
    args.shardings = common.listed(parser, args.shardings, SHARDINGS, "sharding")
    args.contenders = common.listed(parser, args.contenders, contenders, "contender")
    args.conditions = common.listed(parser, args.conditions, CONDITIONS, "condition")
    return args


def run_all(args: argparse.Namespace, script: Path, home: Path, files: list[Path], loaded: int) -> dict:
    """``results[sharding][contender][condition]``: every run a fresh worker of ``script``,
    alternating contender by contender and cold/warm (which goes first flips every repeat),
    the checkpoint's ``files`` read into the page cache right before each."""
    results = {s: {c: {k: [] for k in CONDITIONS} for c in args.contenders} for s in args.shardings}
    for repeat in range(args.repeats):
        order = args.conditions if repeat % 2 == 0 else args.conditions[::-1]
        for sharding in args.shardings:
            for contender in args.contenders:
                for condition in order:
                    def run() -> dict:
                        warm_page_cache(files)
                        return common.run_worker(script, ["--home", str(home), "--contender", contender,
                                                          "--sharding", sharding, "--condition", condition])
                    result = run_undisturbed(run)
                    results[sharding][contender][condition].append(result)
                    shown = (f"{result['seconds']:.2f} s, {result['minor_faults'] / 1e3:.0f}K faults, "
                             f"{result['thp_faults']} THP, peak RSS {fmt_gb(result['peak_rss'])} GB, growth "
                             f"{(result['peak_rss'] - result['baseline_rss']) / loaded:.2f}x"
                             + (f", {result['discarded']} disturbed run(s) discarded" if result["discarded"] else "")
                             if result["ok"] else "failed: " + result["error"])
                    print(f"[{repeat + 1}/{args.repeats} {sharding} {condition}] {contender}: {shown}",
                          file=sys.stderr, flush=True)
    return results


def main() -> None:
    args = arguments(__doc__.splitlines()[0], CONTENDERS, shardings=",".join(SHARDINGS), repeats=5)
    if args.worker:
        worker(args)
        return
    started = time.perf_counter()
    home = ensure_checkpoint(Path(args.dir), QUICK if args.quick else FULL)
    spec = json.loads((home / "spec.json").read_text())
    files = checkpoint_files(home / "checkpoint")
    print(f"checkpoint {home} ({spec['bytes'] / 1e9:.3f} GB in {len(files)} files)", file=sys.stderr)
    results = run_all(args, Path(__file__).resolve(), home, files, spec["bytes"])
    table = render(spec, files, results, args, time.perf_counter() - started)
    publish(table, ("scanned-quick.md" if args.quick else "scanned.md"))


if __name__ == "__main__":
    main()
