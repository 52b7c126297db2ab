"""Child of tests/families/test_maxtext_mapping.py: MaxText 0.2.5 loads Hugging Face checkpoints through
``ost.mappings.maxtext`` and must give the reference logits.

Run with the MaxText venv's Python (3.12), never imported by pytest: every import that needs
MaxText or JAX is inside ``main()``. One process runs every case and variant, paying MaxText's
import (~12 s) once; pyconfig is re-initialised per case and variant::

    $MAXTEXT_VENV/bin/python tests/support/maxtext_child.py --cases cases.json --tokens tokens.npy \\
        --variants scan,unscan --devices 4 --mesh fsdp=2,tensor=2

``cases.json`` is a list of ``{"case", "family", "hf_dir", "reference"[, "atol"][, "model_name"][, "mesh"]}``
(``atol``: an .npy of each logit's tolerance, ``tests/support/tolerances.py``; else ``--atol``; ``mesh``:
the case's, in ``--mesh``'s form, instead of ``--mesh``): ``family``
is what is passed to ``ost.mappings.maxtext`` (``llama3.1``, ``qwen3``, ``mixtral``, ``mistral``,
``gemma3``, ``deepseek3``, ``deepseek2``, ``deepseek3.2``, ``gpt-oss``, ``qwen3-next``, ``qwen3.5``), ``model_name`` the MaxText model whose
yml, layers and conversion tables are used (by default ``llama3.1-8b``, ``qwen3-0.6b`` or, with experts, ``qwen3-30b-a3b``,
``mixtral-8x7b``, ``mistral-7b``, ``gemma3-4b``, ``deepseek3-671b``, ``deepseek2-16b``, ``deepseek3.2-671b``,
``gpt-oss-20b``; ``qwen2.5-7b``; ``olmo3-7b``, or ``olmo3-7b-pt`` with default RoPE; ``qwen3-next-80b-a3b``,
``qwen3.5-35b-a3b``; ``gemma2-2b``; ``gemma4-31b``, with experts ``gemma4-26b``, with per-layer
inputs ``gemma4-e2b`` or ``gemma4-e4b`` by its attention pattern; ``deepseek4-284b`` for ``deepseek4``,
whose checkpoint has the release's names, not save_pretrained's). ``--hf-dir``/``--reference``/``--family``
give a single case instead.

For each case and variant (``scan``: ``scan_layers=True``, ``unscan``: ``scan_layers=False``) it
builds the MaxText config from the HF ``config.json`` (pyconfig with ``override_model_config``,
float32, dot-product attention, CPU; MoE through the dense, dropless ``dense_matmul`` path), takes
the abstract params of MaxText's own model (``jax.eval_shape`` of its init) with the shardings
MaxText's logical axis rules give on the mesh, strips the Linen ``params`` collection and the
``LogicallyPartitioned`` boxes to get the nested-dict target of ``jax.ShapeDtypeStruct``s, loads
the checkpoint into it through the mapping, boxes the arrays back into MaxText's tree and runs
the forward. It checks

* the logits against the reference (each within its ``atol``);
* that every loaded array has the target's sharding;
* every loaded tensor against MaxText's own converter (``checkpoint_conversion``'s
  ``PARAM_MAPPING``/``HOOK_FNS`` for the model, stacked by ``to_maxtext.py``'s own loading
  functions, in numpy), where MaxText has one (``mistral-7b`` has none: ``"converter": false``;
  Gemma 3's are for ``Gemma3ForConditionalGeneration``, so the text checkpoint's names are
  read as ``model.language_model.…``);
* that ``ost.save`` through the mapping writes back the HF tensors byte for byte.

Each case and variant prints one line ``MAXTEXT_RESULT {json}``; the exit status is 1 when one
fails. ``--loader`` picks what fills the target:

* ``ost`` (the default): ``ost.load`` / ``ost.save`` through ``ost.mappings.maxtext``;
* ``dynamic-ost`` / ``dynamic-orbax``: MaxText's own ``source_checkpoint_layout="safetensors_dynamic"``
  path, ``checkpoint_conversion/utils/load_dynamic.py``'s ``load_safetensors_dynamic_state``
  (``ocp.v1.pytree_metadata`` and ``load_pytree`` under ``Context(checkpoint_layout=SAFETENSORS)``,
  then MaxText's hooks on device), with ``ost.install_orbax_layout()`` in force or with Orbax's
  own layout. It reads MaxText's HF config table (``HF_MODEL_CONFIGS[model_name]``), which holds
  the real model's sizes: the checkpoint's ``config.json`` is put there, as ``override_model_config``
  puts it into pyconfig. It saves nothing (no round trip);
* ``converted`` / ``converted-bf16``: ``ost.convert`` through the mapping writes MaxText's form of the
  checkpoint (``dtype`` float32 / bfloat16) and MaxText's own ``load_params_from_path`` restores it
  (what ``load_parameters_path`` does); the round trip saves through the mapping as ``ost`` does
  (none for bfloat16: the params are the rounded weights), and the converter check rounds MaxText's
  converter's tensors to that dtype first (its ``--save_dtype``);
* the path of a module with ``make_loader(family, hf_config, scan_layers)``: an object with
  ``load(hf_dir, target, maxtext_config)`` and ``save(out_dir, params)`` (``save = None``: no
  round trip), to debug this harness without the mapping.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

RESULT_PREFIX = "MAXTEXT_RESULT "
# Our family name -> the MaxText model whose yml, layers and conversion tables it uses
# (qwen3 with experts: MOE_MODEL).
MAXTEXT_MODEL = {"llama3.1": "llama3.1-8b", "qwen3": "qwen3-0.6b", "mixtral": "mixtral-8x7b", "mistral": "mistral-7b",
                 "gemma3": "gemma3-4b", "deepseek3": "deepseek3-671b", "gpt-oss": "gpt-oss-20b"}
MAXTEXT_MODEL.update({"qwen2.5": "qwen2.5-7b", "olmo3": "olmo3-7b"})  # olmo3 with default RoPE: olmo3-7b-pt
MAXTEXT_MODEL.update({"gemma2": "gemma2-2b", "gemma4": "gemma4-31b"})
MAXTEXT_MODEL.update({"deepseek2": "deepseek2-16b", "deepseek3.2": "deepseek3.2-671b"})
MAXTEXT_MODEL["deepseek4"] = "deepseek4-284b"  # every layer MoE: the routed experts are in its own overrides
MOE_MODEL = {"qwen3": "qwen3-30b-a3b", "mixtral": "mixtral-8x7b", "gpt-oss": "gpt-oss-20b"}
MAXTEXT_MODEL["qwen3-next"] = MOE_MODEL["qwen3-next"] = "qwen3-next-80b-a3b"
MAXTEXT_MODEL["qwen3.5"] = MOE_MODEL["qwen3.5"] = "qwen3.5-35b-a3b"
MAXTEXT_MODEL["qwen3-vl"], MOE_MODEL["qwen3-vl"] = "qwen3-vl-2b", "qwen3-vl-30b-a3b"
MAXTEXT_MODEL["qwen3-omni"] = MOE_MODEL["qwen3-omni"] = "qwen3-omni-30b-a3b"
MOE_MODEL["gemma4"] = "gemma4-26b"
# Multimodal releases: the config keys of the text decoder's config. MaxText runs that decoder
# alone (use_multimodal, use_audio off: _qwen3_multimodal_overrides), so its tree holds no tower, and
# the round trip compares the text tensors, not those under TOWERS (the mapping leaves them out).
TEXT_CONFIG = {"qwen3-vl": ("text_config",), "qwen3-omni": ("thinker_config", "text_config")}
TOWERS = {"qwen3-vl": ("model.visual.",), "qwen3-omni": ("thinker.visual.", "thinker.audio_tower.")}
# The llama3.1 RoPE scaling MaxText hard-codes (layers/embeddings.py LLaMARotaryEmbedding).
MAXTEXT_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=None,
                   help='JSON file: [{"case", "family", "hf_dir", "reference"[, "atol"][, "model_name"][, "mesh"]}, ...]')
    p.add_argument("--hf-dir", default=None, help="a single case (with --reference, --family)")
    p.add_argument("--reference", default=None, help=".npy of the reference logits (batch, seq, vocab)")
    p.add_argument("--family", default="llama3.1", choices=sorted(MAXTEXT_MODEL))
    p.add_argument("--tokens", required=True, help=".npy of int tokens (batch, seq)")
    p.add_argument("--variants", default="scan,unscan", help="comma-separated: scan, unscan")
    p.add_argument("--devices", type=int, default=4, help="CPU devices (XLA host platform device count)")
    p.add_argument("--mesh", default="fsdp=2,tensor=2",
                   help="MaxText ici_*_parallelism, e.g. fsdp=2,tensor=2 (the product must equal --devices)")
    p.add_argument("--atol", type=float, default=1e-4, help="every logit's tolerance, where a case gives none")
    p.add_argument("--out-dir", default=None, help="where the round-trip saves go (default: a temp dir)")
    p.add_argument("--loader", default="ost",
                   help="'ost' (ost.mappings.maxtext), 'dynamic-ost' / 'dynamic-orbax' (MaxText's "
                        "load_dynamic with our / Orbax's layout), 'converted' / 'converted-bf16' (ost.convert, "
                        "then MaxText's load_params_from_path) or the path of a module with make_loader(...)")
    p.add_argument("--print-tree", action="store_true", help="print MaxText's param names, shapes and specs")
    return p.parse_args(argv)


def main(argv=None):
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    # Before JAX is imported: the CPU devices of the mesh.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={args.devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText: stubs instead of Google Cloud clients
    # This checkout's orbax_safetensors, whatever the venv has installed.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, repo)

    t_import = time.perf_counter()
    import jax
    import numpy as np
    from flax import linen as nn

    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.configs import pyconfig
    from maxtext.layers import quantizations
    from maxtext.models import models
    from maxtext.utils import maxtext_utils
    import_seconds = time.perf_counter() - t_import

    tokens = np.load(args.tokens).astype(np.int32)
    make_loader = _loader_factory(args.loader)
    out_root = args.out_dir or tempfile.mkdtemp(prefix="maxtext-child-")

    def mesh_overrides(mesh):
        return {f"ici_{axis}_parallelism": int(n) for axis, n in (item.split("=") for item in mesh.split(",") if item)}

    failed = False
    for case in _cases(args):
        with open(os.path.join(case["hf_dir"], "config.json")) as f:
            hf_config = json.load(f)
        reference = np.load(case["reference"])
        atol = np.load(case["atol"]) if case.get("atol") else args.atol
        model_name = case.get("model_name") or maxtext_model_name(case["family"], hf_config)
        for variant in [v for v in args.variants.split(",") if v]:
            scan = {"scan": True, "unscan": False}[variant]
            result = {"case": case["case"], "family": case["family"], "model_name": model_name,
                      "variant": variant, "scan_layers": scan, "loader": args.loader, "devices": args.devices,
                      "mesh": case.get("mesh", args.mesh), "import_seconds": round(import_seconds, 2)}
            t0 = time.perf_counter()
            try:
                _run_variant(args, result, case["family"], model_name, case["hf_dir"], scan, hf_config, tokens,
                             reference, atol, make_loader, mesh_overrides(case.get("mesh", args.mesh)),
                             os.path.join(out_root, case["case"], variant),
                             jax=jax, np=np, nn=nn, pyconfig=pyconfig, models=models,
                             quantizations=quantizations, maxtext_utils=maxtext_utils,
                             MODEL_MODE_TRAIN=MODEL_MODE_TRAIN)
            except BaseException as e:  # reported, then the next variant
                if isinstance(e, KeyboardInterrupt):
                    raise
                result["error"] = f"{type(e).__name__}: {e}"
                result["traceback"] = traceback.format_exc()
            result["seconds"] = round(time.perf_counter() - t0, 2)
            result["ok"] = "error" not in result and not result.get("failures")
            failed |= not result["ok"]
            print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 1 if failed else 0


def _cases(args):
    if args.cases:
        with open(args.cases) as f:
            cases = json.load(f)
    elif args.hf_dir and args.reference:
        cases = [{"case": args.family, "family": args.family, "hf_dir": args.hf_dir, "reference": args.reference}]
    else:
        raise SystemExit("give --cases, or --hf-dir and --reference")
    names = [c["case"] for c in cases]
    if len(set(names)) != len(names):
        raise SystemExit(f"case names repeat: {names}")
    return cases


def maxtext_model_name(family, hf):
    """The MaxText model_name whose yml and converter tables stand for ``family``."""
    hf = _text(family, hf)
    if _num_experts(hf) > 1:
        if family not in MOE_MODEL:
            raise ValueError(f"{family}: no MaxText MoE model")
        return MOE_MODEL[family]
    if family == "mixtral":
        raise ValueError("mixtral without experts")
    full_rope = (_get(hf, "rope_parameters") or {}).get("full_attention", {})
    if family == "olmo3" and full_rope.get("rope_type") == "default":
        return "olmo3-7b-pt"  # its yml: the pretraining revisions' default RoPE (olmo3-7b's: YaRN)
    if family == "gemma4" and _gemma4_model(hf):
        return _gemma4_model(hf)  # per-layer inputs: MaxText's gemma4_small
    return MAXTEXT_MODEL[family]


def _num_experts(hf):
    return _get(hf, "num_experts") or _get(hf, "num_local_experts") or 0


def _loader_factory(spec):
    if spec == "ost":
        def make(family, hf_config, scan_layers):
            return _OstLoader(family, hf_config, scan_layers)
        return make
    if spec in DYNAMIC_LAYOUTS:
        return lambda family, hf_config, scan_layers: DynamicLoader(DYNAMIC_LAYOUTS[spec])
    if spec in CONVERTED_DTYPES:
        return lambda family, hf_config, scan_layers: ConvertedLoader(family, hf_config, scan_layers,
                                                                      CONVERTED_DTYPES[spec])
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("maxtext_child_loader", spec)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.make_loader


class _OstLoader:
    """The code under test: ost.load / ost.save through ost.mappings.maxtext."""

    def __init__(self, family, hf_config, scan_layers):
        import orbax_safetensors as ost

        self.ost = ost
        self.source = os.path.dirname(ost.__file__)  # this checkout's, see main()
        self.mapping = ost.mappings.maxtext(family, hf_config, scan_layers=scan_layers)

    def load(self, hf_dir, target, maxtext_config):
        del maxtext_config
        return self.ost.load(hf_dir, target, mapping=self.mapping)

    def save(self, out_dir, params):
        self.ost.save(out_dir, params, mapping=self.mapping, checksums=False)  # transformers' bytes


CONVERTED_DTYPES = {"converted": "float32", "converted-bf16": "bfloat16"}


class ConvertedLoader(_OstLoader):
    """``ost.convert`` writes MaxText's form of the checkpoint; MaxText's own
    ``checkpointing.load_params_from_path`` restores it into the abstract sharded params, as
    ``load_parameters_path=<dst>/0/items`` does (``maxtext_utils.setup_decode_state``)."""

    def __init__(self, family, hf_config, scan_layers, dtype):
        super().__init__(family, hf_config, scan_layers)
        self.dtype = dtype  # what the converted checkpoint stores; the converter check rounds to it
        if dtype != "float32":
            self.save = None  # the restored params are the rounded weights: no byte round trip

    def load(self, hf_dir, target, maxtext_config):
        from maxtext.common import checkpointing

        with tempfile.TemporaryDirectory(prefix="converted-") as tmp:  # the restore materializes
            dst = os.path.join(tmp, "maxtext")
            self.ost.convert(hf_dir, dst, mapping=self.mapping, dtype=self.dtype)
            restored = checkpointing.load_params_from_path(
                os.path.join(dst, "0", "items"), {"params": target}, maxtext_config.checkpoint_storage_concurrent_gb,
                use_ocdbt=True, use_zarr3=True)
        return restored["params"]


DYNAMIC_LAYOUTS = {"dynamic-ost": "ost", "dynamic-orbax": "orbax"}


class DynamicLoader:
    """MaxText's own ``safetensors_dynamic`` load, through Orbax's v1 entry points, with our
    layout installed (``layout="ost"``) or Orbax's (``"orbax"``)."""

    save = None  # MaxText's path loads only

    def __init__(self, layout):
        import orbax_safetensors as ost

        self.ost, self.layout = ost, layout
        self.source = os.path.dirname(ost.__file__)
        self.layout_loads = 0  # calls of ost.SafetensorsLayout.load: proof that Orbax used ours

    def load(self, hf_dir, target, maxtext_config):
        import transformers
        from maxtext.checkpoint_conversion.utils import hf_model_configs, load_dynamic

        # MaxText's table holds the real model's config; the checkpoint's is the one to map.
        hf_model_configs.HF_MODEL_CONFIGS[maxtext_config.model_name] = transformers.AutoConfig.from_pretrained(
            hf_dir)
        ours = self.ost.SafetensorsLayout
        original = ours.load

        async def counted(layout, *args, **kwargs):
            self.layout_loads += 1
            return await original(layout, *args, **kwargs)

        ours.load = counted
        self.ost.install_orbax_layout(self.layout == "ost")
        try:
            _, restored = load_dynamic.load_safetensors_dynamic_state(hf_dir, target, maxtext_config)
        finally:
            self.ost.install_orbax_layout(False)
            ours.load = original
        return restored["params"]


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def _text(family, hf):
    """The text decoder's config of a multimodal release (``TEXT_CONFIG``); ``hf`` otherwise."""
    for key in TEXT_CONFIG.get(family, ()):
        hf = _get(hf, key)
    return hf


def _qwen3_multimodal_overrides(hf, rope):
    """Qwen3-VL's and Qwen3-Omni's text decoder alone: no vision or audio encoder in the model
    (text tokens need none), and its MRoPE's sections (``layers/embeddings.py``'s
    ``Qwen3OmniMoeThinkerTextRotaryEmbedding``, interleaved; on text positions, where temporal,
    height and width positions are equal, it is the default RoPE transformers applies)."""
    section = rope.get("mrope_section")
    if section is None:
        raise ValueError(f"MaxText's Qwen3-VL/Omni RoPE: MRoPE with an mrope_section; got {rope}")
    # No deepstack indexes: MaxText's config refuses scan_layers with any (configs/types.py), vision
    # or not, and without a vision encoder there is nothing to inject.
    return dict(use_multimodal=False, use_audio=False, use_mrope=True, mrope_section=list(section),
                deepstack_visual_indexes_for_vit=[])


def maxtext_overrides(family, model_name, hf, scan_layers, seq_len, out_dir):
    """MaxText pyconfig overrides that build the model the HF config describes.

    Raises ValueError for what MaxText's ``family`` block cannot express (biases, other
    activations, RoPE scalings, sliding windows, dense layers among sparse ones, ...).
    """
    hf = _text(family, hf)
    heads = _get(hf, "num_attention_heads")
    rope = dict(_get(hf, "rope_parameters") or _get(hf, "rope_scaling") or {})
    theta = rope.get("rope_theta", _get(hf, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if family not in (*DEEPSEEK, "deepseek4", "gpt-oss", "olmo3", "qwen3-next", "qwen3.5"):  # their RoPE, biases, windows: _<family>_overrides
        _check_plain_block(family, model_name, hf, rope, rope_type)
    overrides = dict(
        run_name="ost-maxtext-mapping",
        base_output_directory=out_dir,
        model_name=model_name,
        override_model_config=True,  # the model yml's keys may be overridden
        base_emb_dim=_get(hf, "hidden_size"),
        base_num_query_heads=heads,
        base_num_kv_heads=_get(hf, "num_key_value_heads") or heads,
        head_dim=_get(hf, "head_dim") or _get(hf, "hidden_size") // heads,
        base_mlp_dim=_get(hf, "intermediate_size"),
        base_num_decoder_layers=_get(hf, "num_hidden_layers"),
        vocab_size=_get(hf, "vocab_size"),
        normalization_layer_epsilon=_get(hf, "rms_norm_eps"),
        rope_max_timescale=int(theta) if float(theta).is_integer() else theta,
        logits_via_embedding=bool(_get(hf, "tie_word_embeddings", False)),
        max_target_length=seq_len,
        max_prefill_predict_length=seq_len,
        per_device_batch_size=1,
        scan_layers=scan_layers,
        dtype="float32",
        weight_dtype="float32",
        matmul_precision="highest",
        attention="dot_product",
        hardware="cpu",
        skip_jax_distributed_system=True,
        enable_checkpointing=False,
        enable_dropout=False,
        dataset_type="synthetic",
        log_config=False,
    )
    if family == "llama3.1":
        overrides["rope_use_scale"] = rope_type == "llama3"
    if family == "gemma3":
        overrides.update(_gemma3_overrides(hf))
    if family == "gemma2":
        overrides.update(_gemma2_overrides(hf))
    if family == "gemma4":  # its MoE keys too (top_k_experts, the shared expert): not the generic ones below
        return {**overrides, **_gemma4_overrides(hf)}
    if family == "deepseek4":  # every layer's MoE and attention from its own keys
        return {**overrides, **_deepseek4_overrides(hf, scan_layers)}
    if family in DEEPSEEK:
        overrides.update(_deepseek3_overrides(hf, rope, family))
    if family == "gpt-oss":
        overrides.update(_gpt_oss_overrides(hf, rope))
    if family == "olmo3":
        overrides.update(_olmo3_overrides(hf))
    if family in ("qwen3-next", "qwen3.5"):
        overrides.update(_qwen3_next_overrides(hf, rope, rope_type))
    if family == "qwen3.5":  # text positions: every M-RoPE section the same position, i.e. plain RoPE
        overrides["use_mrope"] = False
    if family in TEXT_CONFIG:
        overrides.update(_qwen3_multimodal_overrides(hf, rope))
    experts = _num_experts(hf)
    if experts > 1:
        if family in ("qwen3", "qwen3-next", "qwen3.5", *TEXT_CONFIG):
            if _get(hf, "decoder_sparse_step", 1) != 1 or _get(hf, "mlp_only_layers"):
                raise ValueError("MaxText's qwen3 MoE block: every layer sparse (decoder_sparse_step 1, "
                                 "no mlp_only_layers)")
            if not _get(hf, "norm_topk_prob", family == "qwen3-vl"):  # Qwen3-VL-MoE's router always renormalises
                # MaxText softmaxes the top-k logits: HF's renormalised top-k probabilities.
                raise ValueError("MaxText's MoE routing is HF's with norm_topk_prob=True")
            moe_mlp = _get(hf, "moe_intermediate_size")
            overrides["norm_topk_prob"] = True
        else:  # mixtral: softmax over all, top-k, renormalised = softmax of the top-k logits
            moe_mlp = _get(hf, "intermediate_size")
        overrides.update(
            num_experts=experts,
            num_experts_per_tok=_get(hf, "num_experts_per_tok"),
            base_moe_mlp_dim=moe_mlp,
            base_mlp_dim=moe_mlp,  # MaxText: base_mlp_dim == base_moe_mlp_dim for a fully MoE model
            **DENSE_MATMUL,
        )
    return overrides


# The DeepSeek families (MLA, dense then MoE layers): _deepseek3_overrides.
DEEPSEEK = ("deepseek2", "deepseek3", "deepseek3.2")
# Every token to its top-k experts, no capacity, no kernels: the dense (one-hot dispatch)
# dense_matmul path, exact on CPU.
DENSE_MATMUL = dict(sparse_matmul=False, megablox=False, capacity_factor=-1.0, load_balance_loss_weight=0.0)


def _deepseek3_overrides(hf, rope, family="deepseek3"):
    """DeepSeek-V3's own keys: MLA's sizes, yarn RoPE on the interleaved layout, the first dense
    layers, sigmoid routing with the score-correction bias over groups, the shared experts.
    DeepSeek-V2 (``deepseek2``) routes by softmax, unbiased, its top-k weights not renormalised
    (MaxText takes a plain top-k for it: HF's ``topk_method`` greedy); DeepSeek-V3.2
    (``deepseek3.2``) adds the indexer."""
    if rope.get("rope_type") != "yarn" or not _get(hf, "rope_interleave", True):
        raise ValueError(f"MaxText's {family} block: yarn RoPE on the interleaved layout")
    if rope.get("mscale", 1.0) != rope.get("mscale_all_dim", 1.0):  # MaxText's mscale is both
        raise ValueError(f"MaxText's {family} block: yarn's mscale == mscale_all_dim")
    if _get(hf, "moe_layer_freq", 1) != 1:
        raise ValueError(f"MaxText's {family} block: every layer after the dense ones MoE")
    if family == "deepseek2":
        # MaxText takes a plain top-k for deepseek2 (moe.py get_topk), its groups unread: V2-236B's
        # group_limited_greedy runs, and routes otherwise (MAXTEXT_FORWARD_BUGS "deepseek2-236b").
        if _get(hf, "topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise ValueError("MaxText's deepseek2 block: top-k routing (HF's topk_method greedy)")
        routing = dict(routed_score_func="softmax", routed_bias=False, n_routing_groups=-1, topk_routing_group=-1)
    elif not _get(hf, "norm_topk_prob", True):
        raise ValueError(f"MaxText's {family} block: renormalised top-k")
    else:
        routing = dict(routed_score_func="sigmoid", routed_bias=True, n_routing_groups=_get(hf, "n_group"),
                       topk_routing_group=_get(hf, "topk_group"))
    if family == "deepseek3.2":
        routing.update(use_indexer=True, indexer_n_heads=_get(hf, "index_n_heads"),
                       indexer_head_dim=_get(hf, "index_head_dim"), indexer_topk=_get(hf, "index_topk"))
    return dict(
        first_num_dense_layers=_get(hf, "first_k_dense_replace"),
        q_lora_rank=_get(hf, "q_lora_rank") or 0, kv_lora_rank=_get(hf, "kv_lora_rank"),
        qk_nope_head_dim=_get(hf, "qk_nope_head_dim"), qk_rope_head_dim=_get(hf, "qk_rope_head_dim"),
        v_head_dim=_get(hf, "v_head_dim"),
        rope_type="yarn", rope_factor=rope["factor"], beta_fast=rope.get("beta_fast", 32),
        beta_slow=rope.get("beta_slow", 1), mscale=rope.get("mscale_all_dim", 1.0),
        original_max_position_embeddings=rope["original_max_position_embeddings"],
        max_position_embeddings=_get(hf, "max_position_embeddings"), rope_interleave=True,
        rope_truncate=rope.get("truncate", True), rope_attention_scaling=False,
        num_experts=_get(hf, "n_routed_experts"), num_experts_per_tok=_get(hf, "num_experts_per_tok"),
        base_moe_mlp_dim=_get(hf, "moe_intermediate_size"), shared_experts=_get(hf, "n_shared_experts"),
        routed_scaling_factor=_get(hf, "routed_scaling_factor"), mtp_num_layers=0, **routing, **DENSE_MATMUL,
    )


def _deepseek4_overrides(hf, scan_layers):
    """DeepSeek-V4's own keys (deepseek4-284b.yml; models/deepseek4.py, layers/attention_compressed.py,
    layers/mhc.py, layers/moe.py): mHC streams, hash-routed prefix layers, per-layer compression, the
    grouped output projection, the indexer, two RoPE thetas (default RoPE only: MaxText's
    DeepSeekV4RotaryEmbedding has no YaRN), sqrt-softplus routing with the clamped SwiGLU.
    Scanned, MaxText's DeepSeek4ScannableBlock hard-codes each block as HCA 128 then CSA 4."""
    rope = _get(hf, "rope_parameters") or {}
    main, compress = rope.get("main", {}), rope.get("compress", {})
    if main.get("rope_type", "default") != "default" or compress.get("rope_type", "default") != "default":
        raise ValueError("MaxText's deepseek4 block: default RoPE (its DeepSeekV4RotaryEmbedding has no YaRN)")
    if _get(hf, "hc_eps", 1e-6) != 1e-6 or _get(hf, "hidden_act", "silu") != "silu":
        raise ValueError("MaxText's deepseek4 block: mHC eps 1e-6 (mhc.py), SwiGLU")
    if _get(hf, "scoring_func") in ("sigmoid", "sqrtsoftplus") and not _get(hf, "norm_topk_prob"):
        raise ValueError("MaxText's deepseek4 routing renormalises sigmoid / sqrtsoftplus top-k weights "
                         "(moe.py deepseek_scale_weights)")
    # HF's layer types -> MaxText's per-layer compress_ratios (0: sliding window, 4: CSA with the
    # indexer, > 4: HCA; attention_compressed.py CompressedAttention).
    rates = _get(hf, "compress_rates") or {}
    ratios = [0 if t == "sliding_attention" else rates[t] for t in _get(hf, "layer_types")]
    if any(r not in (0, 4) and r <= 4 for r in ratios) or rates.get("compressed_sparse_attention", 4) != 4:
        raise ValueError(f"MaxText's deepseek4 block: CSA compresses by 4, HCA by more ({ratios})")
    mlp_types = _get(hf, "mlp_layer_types")
    hash_layers = mlp_types.count("hash_moe")
    if mlp_types != ["hash_moe"] * hash_layers + ["moe"] * (len(mlp_types) - hash_layers):
        raise ValueError(f"MaxText's deepseek4 block: hash-routed layers first ({mlp_types})")
    if scan_layers and (ratios[hash_layers:] != [128, 4] * ((len(ratios) - hash_layers) // 2)
                        or (len(ratios) - hash_layers) % 2):
        raise ValueError(f"MaxText's scanned deepseek4 blocks: HCA 128 then CSA 4 after the hash layers ({ratios})")
    head_dim = _get(hf, "head_dim")
    theta = lambda v: int(v) if float(v).is_integer() else v  # noqa: E731
    moe_mlp = _get(hf, "moe_intermediate_size")
    return dict(
        base_num_kv_heads=_get(hf, "num_key_value_heads"), head_dim=head_dim,
        qk_rope_head_dim=int(head_dim * _get(hf, "partial_rotary_factor")),
        mhc_expansion_rate=_get(hf, "hc_mult"), sinkhorn_iterations=_get(hf, "hc_sinkhorn_iters"),
        first_num_hash_layers=hash_layers, compress_ratios=ratios, attention_type="compressed",
        q_lora_rank=_get(hf, "q_lora_rank"), o_groups=_get(hf, "o_groups"), o_lora_rank=_get(hf, "o_lora_rank"),
        sliding_window_size=_get(hf, "sliding_window"), use_indexer=True,
        indexer_n_heads=_get(hf, "index_n_heads"), indexer_head_dim=_get(hf, "index_head_dim"),
        indexer_topk=_get(hf, "index_topk"),
        rope_type="default", rope_max_timescale=theta(main.get("rope_theta", _get(hf, "rope_theta"))),
        compressed_rope_max_timescale=theta(compress.get("rope_theta", _get(hf, "compress_rope_theta"))),
        max_position_embeddings=_get(hf, "max_position_embeddings"),
        num_experts=_get(hf, "n_routed_experts"), num_experts_per_tok=_get(hf, "num_experts_per_tok"),
        shared_experts=_get(hf, "n_shared_experts"), base_moe_mlp_dim=moe_mlp, base_mlp_dim=moe_mlp,
        mlp_activations=["silu", "linear"], mlp_activations_limit=_get(hf, "swiglu_limit"),
        routed_score_func=_get(hf, "scoring_func"), routed_bias=True, norm_topk_prob=_get(hf, "norm_topk_prob"),
        routed_scaling_factor=_get(hf, "routed_scaling_factor"), n_routing_groups=-1, topk_routing_group=-1,
        mtp_num_layers=0, **DENSE_MATMUL,
    )


def _check_plain_block(family, model_name, hf, rope, rope_type):
    """What the Llama-like blocks cannot express: other RoPEs, activations, biases, windows."""
    if family == "llama3.1" and rope_type == "llama3":
        wrong = {k: (rope.get(k), v) for k, v in MAXTEXT_LLAMA3_ROPE.items() if float(rope.get(k, -1)) != v}
        if wrong:
            raise ValueError(f"MaxText hard-codes llama3 RoPE scaling {MAXTEXT_LLAMA3_ROPE}; "
                             f"the checkpoint has {wrong}")
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r}: MaxText's {model_name} supports "
                         + ("llama3 or default" if family == "llama3.1" else "default"))
    if _get(hf, "hidden_act", "silu") != "silu" or _get(hf, "attention_bias") or _get(hf, "mlp_bias"):
        raise ValueError(f"MaxText's {model_name} block: silu MLP, no biases")
    if _get(hf, "sliding_window") and (family in ("mixtral", "mistral") or _get(hf, "use_sliding_window")):
        raise ValueError(f"MaxText's {model_name} block has no sliding window")


def _gpt_oss_overrides(hf, rope):
    """gpt-oss's own keys: yarn RoPE, the sliding window of every other layer, the clamped
    swiglu (MaxText hard-codes alpha 1.702), biases and sinks (its yml has them)."""
    if rope.get("rope_type") != "yarn":
        raise ValueError(f"MaxText's gpt-oss block: yarn RoPE; got {rope}")
    pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(_get(hf, "num_hidden_layers"))]
    if list(_get(hf, "layer_types") or pattern) != pattern:
        raise ValueError(f"MaxText's gpt-oss block: sliding then full attention; got {_get(hf, 'layer_types')}")
    if _get(hf, "swiglu_alpha", 1.702) != 1.702 or not _get(hf, "attention_bias", True):
        raise ValueError("MaxText's gpt-oss block: swiglu alpha 1.702, attention biases")
    return dict(sliding_window_size=_get(hf, "sliding_window"), mlp_activations_limit=_get(hf, "swiglu_limit"),
                rope_factor=int(rope["factor"]), beta_fast=int(rope["beta_fast"]), beta_slow=int(rope["beta_slow"]),
                original_max_position_embeddings=rope["original_max_position_embeddings"],
                max_position_embeddings=_get(hf, "max_position_embeddings"),
                rope_truncate=bool(rope.get("truncate", True)))


def _qwen3_next_overrides(hf, rope, rope_type):
    """Qwen3-Next's own keys: the gated delta net's sizes, linear-attention layers then one
    full-attention layer per ``full_attention_interval`` (inhomogeneous_layer_cycle_interval),
    partial RoPE, one shared expert (MaxText sizes it as a routed one: moe_mlp_dim)."""
    interval, layers = _get(hf, "full_attention_interval", 4), _get(hf, "num_hidden_layers")
    pattern = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if list(_get(hf, "layer_types") or pattern) != pattern:
        raise ValueError(f"MaxText's qwen3_next block: linear layers then a full one; got {_get(hf, 'layer_types')}")
    if rope_type != "default" or _get(hf, "hidden_act", "silu") != "silu" or _get(hf, "attention_bias"):
        raise ValueError("MaxText's qwen3_next block: default (partial) RoPE, silu, no attention biases")
    if _get(hf, "shared_expert_intermediate_size") != _get(hf, "moe_intermediate_size"):
        raise ValueError("MaxText's qwen3_next shared expert is moe_mlp_dim wide (moe_intermediate_size)")
    return dict(inhomogeneous_layer_cycle_interval=interval, gdn_conv_kernel_dim=_get(hf, "linear_conv_kernel_dim"),
                gdn_key_head_dim=_get(hf, "linear_key_head_dim"), gdn_value_head_dim=_get(hf, "linear_value_head_dim"),
                gdn_num_key_heads=_get(hf, "linear_num_key_heads"),
                gdn_num_value_heads=_get(hf, "linear_num_value_heads"),
                partial_rotary_factor=rope.get("partial_rotary_factor", _get(hf, "partial_rotary_factor", 0.25)),
                shared_experts=1)


def _olmo3_overrides(hf):
    """OLMo 3's own keys: 3 sliding-window layers then a global one, one RoPE theta, and a
    YaRN RoPE where the release has one. MaxText's olmo3 block applies its one RoPE to every
    layer (models/olmo3.py); transformers applies ``rope_parameters["full_attention"]`` to the
    global layers and the sliding layers' own (the default RoPE in every release)."""
    rope = _get(hf, "rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    if (local.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in ("default", "yarn")
            or full.get("rope_theta") != local.get("rope_theta")):
        raise ValueError(f"MaxText's olmo3 block: one theta, default RoPE on sliding layers; got {rope}")
    if {"attention_factor", "mscale", "mscale_all_dim"} & set(full):
        raise ValueError(f"MaxText's olmo3 YaRN scales attention by 0.1 * ln(factor) + 1; got {full}")
    if _get(hf, "hidden_act", "silu") != "silu" or _get(hf, "attention_bias"):
        raise ValueError("MaxText's olmo3 block: silu MLP, no biases")
    pattern = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(_get(hf, "num_hidden_layers"))]
    if list(_get(hf, "layer_types") or pattern) != pattern:
        raise ValueError(f"MaxText's olmo3 block: 3 sliding layers then 1 global; got {_get(hf, 'layer_types')}")
    theta = full["rope_theta"]
    overrides = dict(rope_max_timescale=int(theta) if float(theta).is_integer() else theta,
                     sliding_window_size=_get(hf, "sliding_window"),
                     max_position_embeddings=_get(hf, "max_position_embeddings"), rope_type="default")
    if full.get("rope_type") == "yarn":
        overrides.update(rope_type="yarn", rope_factor=float(full["factor"]), beta_fast=float(full.get("beta_fast", 32)),
                         beta_slow=float(full.get("beta_slow", 1)), rope_attention_scaling=True,
                         original_max_position_embeddings=full["original_max_position_embeddings"],
                         rope_truncate=bool(full.get("truncate", True)))
    return overrides


def _gemma4_model(hf):
    """gemma4-e2b (4 sliding-window layers then a global one) or gemma4-e4b (5 then one) for a
    checkpoint with per-layer inputs (MaxText's gemma4_small); None otherwise."""
    if not _get(hf, "hidden_size_per_layer_input"):
        return None
    types = list(_get(hf, "layer_types") or [])
    return "gemma4-e2b" if "full_attention" in types and types.index("full_attention") == 4 else "gemma4-e4b"


def _gemma4_overrides(hf):
    """Gemma 4's own keys (gemma4-31b / gemma4-26b's yml): its global layers' head size and kv
    heads, keys shared as values (attention_k_eq_v), the two RoPEs (the global one on a part of
    each head), the sliding window, the final soft cap; with experts, the routed MoE beside the
    dense MLP (MaxText's shared expert), top_k_experts renormalised; with per-layer inputs
    (gemma4_small), their sizes, the kv-shared layers and the double-wide MLP."""
    from orbax_safetensors.mappings.gemma4 import global_attention  # this checkout is on sys.path (main)

    layers, small = _get(hf, "num_hidden_layers"), bool(_get(hf, "hidden_size_per_layer_input"))
    period = 5 if _gemma4_model(hf) == "gemma4-e2b" else 6  # gemma4_small.get_attention_pattern
    pattern = ["full_attention" if i % period == period - 1 else "sliding_attention" for i in range(layers)]
    if list(_get(hf, "layer_types") or pattern) != pattern:
        raise ValueError(f"MaxText's gemma4 block: {period - 1} sliding layers then 1 global; got "
                         f"{_get(hf, 'layer_types')}")
    if _get(hf, "attention_bias"):
        raise ValueError("MaxText's gemma4 block: no biases")
    rope = _get(hf, "rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    if full.get("rope_type") != "proportional" or local.get("rope_type", "default") != "default":
        raise ValueError(f"MaxText's gemma4 block: default local RoPE, proportional global; got {rope}")
    kv_heads, head_dim = global_attention(hf)
    out = dict(global_head_dim=head_dim, global_num_kv_heads=kv_heads,
               share_kv_projections=bool(_get(hf, "attention_k_eq_v")), v_norm_with_scale=False,
               sliding_window_size=_get(hf, "sliding_window"),
               local_rope_max_timescale=int(local.get("rope_theta", 10_000)),
               global_rope_max_timescale=int(full["rope_theta"]), rope_max_timescale=int(full["rope_theta"]),
               local_rope_proportion=float(local.get("partial_rotary_factor", 1.0)),
               global_rope_proportion=float(full.get("partial_rotary_factor", 1.0)),
               final_logits_soft_cap=_get(hf, "final_logit_softcapping") or 0.0)
    if small:  # gemma4_small: per-layer inputs, the last layers reusing earlier layers' keys and values
        out.update(hidden_size_per_layer_input=_get(hf, "hidden_size_per_layer_input"),
                   vocab_size_per_layer_input=_get(hf, "vocab_size_per_layer_input"),
                   num_kv_shared_layers=_get(hf, "num_kv_shared_layers") or 0,
                   use_double_wide_mlp=bool(_get(hf, "use_double_wide_mlp")))
    if _get(hf, "enable_moe_block"):
        out.update(num_experts=_get(hf, "num_experts"), num_experts_per_tok=_get(hf, "top_k_experts"),
                   base_moe_mlp_dim=_get(hf, "moe_intermediate_size"), shared_experts=1, norm_topk_prob=True,
                   **DENSE_MATMUL)
    return out


def _gemma2_overrides(hf):
    """Gemma 2's own keys: MaxText's layer is a (sliding, global) pair of HF layers, so half as
    many; the sliding window and both soft caps (its yml's keys)."""
    layers = _get(hf, "num_hidden_layers")
    pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if layers % 2 or list(_get(hf, "layer_types") or pattern) != pattern:
        raise ValueError(f"MaxText's gemma2 layer: a sliding then a global layer; got {_get(hf, 'layer_types')}")
    if _get(hf, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError("MaxText's gemma2 block: tanh-approximated gelu")
    return dict(base_num_decoder_layers=layers // 2, sliding_window_size=_get(hf, "sliding_window"),
                attn_logits_soft_cap=_get(hf, "attn_logit_softcapping") or 0.0,
                final_logits_soft_cap=_get(hf, "final_logit_softcapping") or 0.0)


def _gemma3_overrides(hf):
    """Gemma 3's own keys: its two RoPEs (global and local), the sliding window. The generic
    checks above pass it (no hidden_act, no top-level rope_type): these check the rest."""
    rope = _get(hf, "rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    if local.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in ("default", "linear"):
        raise ValueError(f"MaxText's gemma3 block: default local RoPE, default or linear global; got {rope}")
    if _get(hf, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh" or _get(
            hf, "attn_logit_softcapping") or _get(hf, "final_logit_softcapping"):
        raise ValueError("MaxText's gemma3 block: tanh-approximated gelu, no soft caps")
    head_dim = _get(hf, "head_dim")
    if _get(hf, "query_pre_attn_scalar") != head_dim:  # gemma3.get_query_pre_attn_scalar (4b, 12b)
        raise ValueError("MaxText's gemma3-4b scales the query by head_dim**-0.5")
    pattern = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(_get(hf, "num_hidden_layers"))]
    if list(_get(hf, "layer_types") or pattern) != pattern:
        raise ValueError(f"MaxText's gemma3 block: 5 sliding layers then 1 global; got {_get(hf, 'layer_types')}")

    def theta(parameters, default):
        return int(parameters.get("rope_theta", default))

    return dict(rope_max_timescale=theta(full, 1_000_000), local_rope_max_timescale=theta(local, 10_000),
                rope_linear_scaling_factor=float(full.get("factor", 1.0)), sliding_window_size=_get(hf, "sliding_window"))


def _run_variant(args, result, family, model_name, hf_dir, scan, hf_config, tokens, reference, atol, make_loader,
                 mesh_overrides, out_dir, *, jax, np, nn, pyconfig, models, quantizations, maxtext_utils,
                 MODEL_MODE_TRAIN):
    from tests.support.trees import nest  # this checkout is on sys.path by now (main)

    failures = result.setdefault("failures", [])
    timings = result.setdefault("timings", {})
    tick = time.perf_counter()

    def lap(name):
        nonlocal tick
        now = time.perf_counter()
        timings[name] = round(now - tick, 2)
        tick = now

    overrides = maxtext_overrides(family, model_name, hf_config, scan, tokens.shape[1],
                                  os.path.join(out_dir, "mt-out"))
    overrides.update(mesh_overrides)
    base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    config = pyconfig.initialize(["", base_yml] + [f"{k}={v}" for k, v in overrides.items()])
    mesh = maxtext_utils.get_mesh_from_config(config)
    result["mesh_shape"] = {k: v for k, v in mesh.shape.items() if v > 1}
    # The path MaxText's own checkpoint conversion takes: the Linen-wrapped NNX Transformer.
    model = models.transformer_as_linen(config, mesh, quant=quantizations.configure_quantization(config),
                                        model_mode=MODEL_MODE_TRAIN)
    abstract = maxtext_utils.get_abstract_param(model, config)  # {"params": {... LogicallyPartitioned}}
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, config.logical_axis_rules)
    lap("config_and_abstract")

    # MaxText keeps DeepSeek's router bias in a collection of its own (MoEBiasVar); its converter
    # and checkpoints hold it under params (checkpointing._alias_legacy_collections reads it from
    # there): so does the target, and the forward gets it back in its collection.
    assert "params" in abstract, sorted(abstract)
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    # A param MaxText declares without logical axes (DeepSeek-V3.2's indexer k_norm, an
    # nnx.LayerNorm) is a bare ShapeDtypeStruct, replicated: boxed here, bare in the forward.
    abstract = jax.tree_util.tree_map(lambda x: x if is_box(x) else _Unboxed(x), abstract, is_leaf=is_box)
    is_box = lambda x: isinstance(x, (nn.LogicallyPartitioned, _Unboxed))
    boxes, named_shardings, collection = {}, {}, {}  # "decoder.layers.mlp.wi_0.kernel" -> box, ...
    for name in abstract:
        own = _flatten(abstract[name], is_box)
        assert not set(own) & set(boxes), sorted(set(own) & set(boxes))
        boxes.update(own)
        collection.update(dict.fromkeys(own, name))
        named_shardings.update(_flatten(shardings[name], lambda x: isinstance(x, jax.sharding.Sharding)))
    assert set(boxes) == set(named_shardings)
    for name, box in boxes.items():
        assert is_box(box) and isinstance(box.value, jax.ShapeDtypeStruct), (name, box)
    # Our dotted names are MaxText's own canonical names (its conversion tables' keys) with "." for "-".
    from maxtext.checkpoint_conversion.utils.utils import param_key_parts_from_path
    canonical = {"-".join(param_key_parts_from_path(path)) for path, _ in
                 jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_box)[0]}
    assert canonical == {f"{collection[n]}-" + n.replace(".", "-") for n in boxes}, canonical
    target = nest({n: jax.ShapeDtypeStruct(b.value.shape, b.value.dtype, sharding=named_shardings[n])
                         for n, b in boxes.items()})
    if args.print_tree:
        result["tree"] = {n: {"shape": list(b.value.shape), "dtype": str(b.value.dtype),
                              "logical": list(b.names), "spec": str(named_shardings[n].spec)}
                          for n, b in sorted(boxes.items())}

    loader = make_loader(family, hf_config, scan)
    result["orbax_safetensors"] = getattr(loader, "source", None)
    params = loader.load(hf_dir, target, config)
    jax.block_until_ready(params)
    if hasattr(loader, "layout_loads"):
        result["layout_loads"] = loader.layout_loads
    lap("load")
    loaded = _flatten(params, lambda x: not isinstance(x, dict))
    if set(loaded) != set(boxes):
        raise AssertionError(f"loaded names differ from MaxText's: missing {sorted(set(boxes) - set(loaded))}, "
                             f"extra {sorted(set(loaded) - set(boxes))}")
    bad_sharding = []
    for name, arr in loaded.items():
        want = boxes[name].value
        if arr.shape != want.shape or arr.dtype != want.dtype:
            failures.append(f"{name}: loaded {arr.shape} {arr.dtype}, MaxText wants {want.shape} {want.dtype}")
        elif not (isinstance(arr, jax.Array) and arr.sharding.is_equivalent_to(named_shardings[name], arr.ndim)):
            bad_sharding.append(name)
    result["shardings_match"] = not bad_sharding
    if bad_sharding:
        failures.append(f"not loaded with the target's sharding: {bad_sharding}")
    if failures:
        return

    # Each tensor against MaxText's own converter, where it has one.
    from maxtext.checkpoint_conversion.utils.param_mapping import PARAM_MAPPING

    result["converter"] = model_name in PARAM_MAPPING
    if result["converter"]:
        theirs, converter_errors, workarounds = _maxtext_converter(model_name, hf_config, config, hf_dir, boxes,
                                                                   np=np)
        result["converter_workarounds"] = workarounds
        stored = getattr(loader, "dtype", "float32")
        if stored != "float32":  # what to_maxtext.py --save_dtype makes of its tensors
            theirs = {n: a.astype(jax.numpy.dtype(stored)).astype(np.float64) for n, a in theirs.items()}
        diffs = {n: float(np.max(np.abs(np.asarray(jax.device_get(loaded[n]), np.float64) - theirs[n])))
                 for n in sorted(theirs)}
        result["converter_max_abs_diff"] = max(diffs.values()) if not converter_errors else None
        result["converter_diffs"] = {n: d for n, d in diffs.items() if d != 0.0}
        if result["converter_diffs"]:
            failures.append(f"differs from MaxText's own converter: {result['converter_diffs']}")
        if converter_errors:
            result["converter_errors"] = converter_errors
            failures.append(f"MaxText's own converter fails: {converter_errors}")
        lap("converter_check")

    # MaxText's forward on the loaded params, boxed back into its tree.
    variables = {name: nest({n: boxes[n].replace_boxed(loaded[n]) for n in boxes if collection[n] == name})
                 for name in abstract}
    batch, seq = tokens.shape

    def forward(variables, tokens):
        positions = jax.numpy.broadcast_to(jax.numpy.arange(seq, dtype=jax.numpy.int32), (batch, seq))
        return model.apply(variables, tokens, positions,
                           decoder_segment_ids=jax.numpy.ones((batch, seq), jax.numpy.int32),
                           enable_dropout=False, model_mode=MODEL_MODE_TRAIN)

    with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
        logits = np.asarray(jax.jit(forward)(variables, jax.numpy.asarray(tokens)))
    lap("forward")
    result["logits_shape"] = list(logits.shape)
    result["reference_max_abs"] = float(np.max(np.abs(reference)))
    if logits.shape != reference.shape:
        failures.append(f"logits {logits.shape} vs reference {reference.shape}")
    else:
        diff = np.abs(logits.astype(np.float64) - reference)
        result["logits_max_abs_diff"] = float(np.max(diff))
        # The worst logit's difference as a share of its own tolerance: <= 1 passes.
        result["logits_tolerance_used"] = ratio = float(np.max(diff / atol))
        if not ratio <= 1:
            failures.append(f"logits differ from the reference by up to {ratio:.3g}x their tolerance "
                            f"(max abs difference {np.max(diff):.3g})")

    # Save back through the mapping: the very tensors of the HF checkpoint.
    if loader.save is None:
        return
    save_dir = os.path.join(out_dir, "saved")
    loader.save(save_dir, params)
    lap("save")
    ours, theirs_hf = _read_safetensors(save_dir), _read_safetensors(hf_dir)
    theirs_hf = {n: t for n, t in theirs_hf.items() if not n.startswith(TOWERS.get(family, ()))}
    result["round_trip_tensors"] = len(theirs_hf)
    mismatched = sorted(set(ours) ^ set(theirs_hf)) + sorted(
        n for n in set(ours) & set(theirs_hf)
        if ours[n].dtype != theirs_hf[n].dtype or ours[n].shape != theirs_hf[n].shape
        or ours[n].tobytes() != theirs_hf[n].tobytes())
    result["round_trip_identical"] = not mismatched
    # Reported, not required: header, order and offsets too, as save_pretrained wrote them.
    result["round_trip_files_identical"] = _same_files(save_dir, hf_dir)
    if mismatched:
        failures.append(f"saved tensors differ from the HF checkpoint's: {mismatched}")
    lap("round_trip_check")


class _Unboxed:
    """A param without logical axes, with a box's ``value``, ``names`` and ``replace_boxed``."""

    def __init__(self, value):
        self.value, self.names = value, (None,) * value.ndim

    def replace_boxed(self, value):
        return value


def _flatten(tree, is_leaf, prefix=""):
    """Nested dicts -> {"a.b.c": leaf}."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if is_leaf(value):
            out[name] = value
        elif isinstance(value, dict) or hasattr(value, "items"):
            out.update(_flatten(value, is_leaf, name + "."))
        else:
            raise TypeError(f"{name}: unexpected {type(value).__name__}")
    return out


def _same_files(a, b):
    import filecmp
    import glob

    names = [sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "*.safetensors*"))) for d in (a, b)]
    return names[0] == names[1] and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names[0])


def _read_safetensors(directory):
    import glob

    from safetensors.numpy import load_file

    tensors = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def _maxtext_converter(model_name, hf_config, config, hf_dir, boxes, *, np):
    """HF tensors -> MaxText tree names, as maxtext/checkpoint_conversion/to_maxtext.py converts them.

    Its own tables (``PARAM_MAPPING``/``HOOK_FNS[model_name]``), its key filter and its own
    per-key loading functions (hooks at the slice shape; layers stacked at ``param_scan_axis``,
    experts at 0, scanned experts as (experts, layers, ...)), eagerly, in numpy.
    Returns ({name: float64 array}, {name: error}, {name: workaround}) -- the errors are MaxText's
    own; a workaround names a leaf where to_maxtext.py's stacking contradicts MaxText's own tree and
    the comparison used its hooks stacked at ``param_scan_axis`` instead.
    """
    import logging
    import re

    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING
    from maxtext.checkpoint_conversion.utils.tensor_handling import apply_hook_fns
    from maxtext.checkpoint_conversion.utils.utils import validate_and_filter_param_map_keys

    logging.getLogger("absl").setLevel(logging.WARNING)  # to_maxtext's import sets absl to INFO
    hf = dict(hf_config)
    if "hidden_size" in hf:  # a multimodal release's tables read its nested configs (TEXT_CONFIG)
        hf.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    weights = _read_safetensors(hf_dir)
    if model_name.startswith("gemma3"):  # its tables are Gemma3ForConditionalGeneration's: text and vision
        hf = {"text_config": hf, "vision_config": {"num_hidden_layers": 0}}
        weights = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    if model_name.startswith("qwen3.5") and "text_config" not in hf:  # its tables are the multimodal release's
        hf = {"text_config": hf}
        weights = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    mapping = PARAM_MAPPING[model_name](hf, config, config.scan_layers)
    hooks = HOOK_FNS[model_name](hf, config, config.scan_layers, saving_to_hf=False)
    # DeepSeek-V4's tables key its router bias and hash table by their own collections
    # (MoEBiasVar-…, Tid2EidVar-…; to_maxtext.py stacks those at axis 0 by that prefix); the leaves'
    # names here carry none (params-… stands for all).
    in_params = lambda k: re.sub(r"^(MoEBiasVar|Tid2EidVar)-", "params-", k)  # noqa: E731
    own = {in_params(k): k for k in mapping if isinstance(k, str) and in_params(k) != k}
    keys = validate_and_filter_param_map_keys(mapping.keys(),
                                              {own.get(k, k) for k in ("params-" + n.replace(".", "-") for n in boxes)})
    out, errors, workarounds = {}, {}, {}
    for key in keys:
        if isinstance(key, tuple):  # gpt-oss's (wi_0, wi_1) from one gate_up_proj: split as to_maxtext.py does
            out.update(_composite(key, mapping[key], hooks.get(key), weights, boxes, config, to_maxtext, np=np))
            continue
        name = in_params(key).removeprefix("params-").replace("-", ".")
        shape = tuple(boxes[name].value.shape)
        load = to_maxtext._get_hf_loading_function(mapping[key], weights.__getitem__, hooks.get(key), shape, config,
                                                   key)
        try:
            array = np.asarray(load())
        except Exception as e:  # noqa: BLE001 -- MaxText's converter failing is a finding, reported
            errors[name] = f"{type(e).__name__}: {e}"
            continue
        if array.shape != shape and config.scan_layers and _flat_key_list(mapping[key]):
            # to_maxtext.py raises here (_get_maxtext_weight). Known case: its single-axis stacking
            # takes every scanned key containing "MoeBlock" for an unscanned expert stack and stacks
            # the layers at axis 0 (Mixtral's scanned router, (layers, embed, experts) for an
            # (embed, layers, experts) leaf). Compare with its own hooks and the stacking it uses for
            # every other scanned key, at param_scan_axis; reported, and the test names the leaves.
            axis = config.param_scan_axis
            slice_shape = shape[:axis] + shape[axis + 1:]
            fixed = np.stack([np.asarray(apply_hook_fns(weights[k], slice_shape, hooks.get(key))) for k in mapping[key]],
                             axis)
            if fixed.shape == shape:
                workarounds[name] = (f"to_maxtext.py makes {array.shape} for the {shape} leaf (layers stacked at "
                                     f"axis 0); compared with its hooks' output stacked at param_scan_axis {axis}")
                array = fixed
        if array.shape != shape:  # to_maxtext.py raises this too (_get_maxtext_weight)
            errors[name] = f"MaxText's converter makes {array.shape}, its tree has {shape}"
            continue
        out[name] = array.astype(np.float64)
    if set(out) | set(errors) != set(boxes):
        raise AssertionError(f"MaxText's converter tables vs its tree: {sorted((set(out) | set(errors)) ^ set(boxes))}")
    return out, errors, workarounds


def _composite(key, hf_keys, hook, weights, boxes, config, to_maxtext, *, np):
    """The leaves of a composite MaxText key, as to_maxtext.py's eager ``_get_maxtext_weight`` makes
    them: the hook's output split on its last axis, one index per leaf."""
    names = [k.removeprefix("params-").replace("-", ".") for k in key]
    shapes = [tuple(boxes[n].value.shape) for n in names]
    both = np.asarray(to_maxtext._get_hf_loading_function(hf_keys, weights.__getitem__, hook, shapes, config, key)())
    return {n: both[..., i].astype(np.float64) for i, n in enumerate(names)}


def _flat_key_list(hf_keys):
    return isinstance(hf_keys, list) and all(isinstance(k, str) for k in hf_keys)


if __name__ == "__main__":
    sys.exit(main())
