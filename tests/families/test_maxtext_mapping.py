"""``ost.mappings.maxtext`` against MaxText 0.2.5 itself: same logits as transformers.

One tiny Hugging Face model per family the mapping supports, every weight random (norms, q/k
norms and routers included), untied head, saved with ``save_pretrained`` and run by transformers
in float32 (eager attention) for the reference logits:

* ``llama3.1``: ``LlamaForCausalLM``, llama3 RoPE scaling, GQA (MaxText ``llama3.1-8b``);
* ``qwen3``: ``Qwen3ForCausalLM``, q/k norms, ``head_dim`` != hidden/heads (``qwen3-0.6b``; the
  q/k RMSNorms undo a wrong query or key scale, so only the converter check catches one);
* ``qwen3-moe``: ``Qwen3MoeForCausalLM``, every layer sparse, 4 experts top-2, renormalised
  (``qwen3-30b-a3b``);
* ``mixtral``: ``MixtralForCausalLM``, 4 experts top-2 (``mixtral-8x7b``);
* ``mistral``: ``MistralForCausalLM``, GQA (``mistral-7b``: MaxText has the model but no
  converter, so its tensors are checked by the logits and the round trip alone);
* ``gemma3``: ``Gemma3ForCausalLM``, 14 layers (two 6-layer attention patterns, 5 sliding-window
  layers then a global one, scanned as ``layers_0..5``, and 2 left over in ``layers_remainder``),
  sliding window 4 of the 16 tokens, q/k norms, tied embedding, linear RoPE scaling on the global
  layers (``gemma3-4b``; MaxText's converter is ``Gemma3ForConditionalGeneration``'s, compared
  through its ``model.language_model.`` names). Its norm weights are bfloat16 values, for which
  MaxText's ``1 + w`` in float32 round-trips exactly;
* ``gemma2``: ``Gemma2ForCausalLM``, 4 layers (sliding window 4, then global; MaxText's two paired
  layers, ``…_local``/``…_global``), both soft caps, tied, bfloat16-valued norms (``gemma2-2b``);
  ``gemma2-27b``: the same with ``query_pre_attn_scalar`` (16) != ``head_dim`` (8), as the 27b's
  144 != 128: MaxText's converter scales the query by ``head_dim``'s root, the mapping by the
  scalar's, which gives transformers' logits (``MAXTEXT_CONVERTER_WRONG``: a strict xfail that
  only that difference, on the query kernels alone, satisfies);
* ``gemma4``: ``Gemma4ForCausalLM``, 12 layers (two blocks of 5 sliding-window layers and a global
  one whose heads are 32 wide, 2 kv heads, keys as values), proportional RoPE on a quarter of the
  global heads, final soft cap, tied (``gemma4-31b``; scanned as ``scanned_blocks.local_layers``
  (block, position) and ``scanned_blocks.global_layer``); ``gemma4-moe``: every layer's MLP beside
  4 routed experts top-2, their ``gate_up_proj`` fused (``gemma4-26b``; a save writes it from ``wi_0`` and ``wi_1``; its router
  input scale drawn wide so the top-k margins clear ``ROUTER_MARGIN``); ``gemma4-e2b``: MaxText's
  ``gemma4_small``, 10 layers (4 sliding-window then a global one), per-layer inputs, the last 4
  layers reusing earlier ones' keys and values, a double-wide MLP there (unscanned only: MaxText
  has no scanned form of it);
* ``deepseek3``: ``DeepseekV3ForCausalLM``, MLA with a low-rank query, 1 dense layer then 2 MoE
  layers (8 experts top-2, sigmoid scores with the random ``e_score_correction_bias``, one group,
  a shared expert), DeepSeek-V3's yarn RoPE (``deepseek3-671b``; scanned as MaxText's
  ``dense_layers`` and ``moe_layers`` stacks);
* ``deepseek2``: ``DeepseekV2ForCausalLM``, V2-Lite's MLA (one ``q_proj``), 1 dense layer then 2
  MoE layers (8 experts, softmax, greedy top-2 not renormalised, no router bias, 2 shared
  experts), yarn with V2's mscale 0.707 (``deepseek2-16b``);
* ``deepseek2-236b``: the same with V2-236B's low-rank query and group-limited routing (4 groups
  of 2 experts, top-2 within the best group), which MaxText does not do (``MAXTEXT_FORWARD_BUGS``);
* ``deepseek3.2``: ``DeepseekV32ForCausalLM``, the ``deepseek3`` case plus each attention's
  indexer (8 heads of 16, top 8 of the 16 tokens, so its weights change the logits; its k-th and
  (k+1)-th scores kept ``ROUTER_MARGIN`` apart) (``deepseek3.2-671b``);
* ``deepseek4``: ``DeepseekV4ForCausalLM``, 5 layers (2 sliding-window, then compressed sparse
  attention with its indexer, heavily compressed, compressed sparse), hyper-connections of 4
  streams, the first 3 layers' MoE routed by a token table, the others by sqrt-softplus scores
  with a bias, one kv head, the output in 2 groups, saved in the release's names
  (``RELEASE_FORM``; ``deepseek4-284b``, on ``CASE_MESH``'s mesh; scanned as 3 unrolled layers and
  one ``scanned_blocks`` pair);
* ``gpt-oss``: ``GptOssForCausalLM``, 4 layers (two sliding-window / global pairs, scanned as
  ``layers_0``, ``layers_1``), sliding window 4, yarn RoPE, q/k/v/o biases, attention sinks, 4
  experts top-2 with a router bias and fused, interleaved gate/up (``gpt-oss-20b``; ``wi_0``/``wi_1``
  are one stored ``gate_up_proj``, saved back from both);
* ``qwen2.5``: ``Qwen2ForCausalLM``, q/k/v biases, GQA (``qwen2.5-7b``);
* ``olmo3``: ``Olmo3ForCausalLM``, 8 layers (two blocks of 3 sliding-window layers, window 4, and
  a global one, scanned as ``layers_0..3``), post-norms only, q/k norms over the whole projection,
  default RoPE (``olmo3-7b-pt``, the pretraining revisions' yml);
* ``olmo3-yarn``: the same with the release's YaRN on the global layers (``olmo3-7b``): MaxText
  0.2.5 applies that YaRN to every layer, transformers to the global ones only, so its logits
  differ (``MAXTEXT_FORWARD_BUGS``: a strict xfail that only that difference satisfies; MaxText's
  logits equal transformers' run with YaRN on every layer). Its converter check and round trip hold.
* ``qwen3-vl``: ``Qwen3VLForConditionalGeneration`` with a 2-block vision tower, its text decoder
  Qwen3's with MRoPE (sections 4, 2, 2), tied (``qwen3-vl-2b``); ``qwen3-vl-moe``: the MoE release,
  4 experts top-2 stored fused in the release's layout (``RELEASE_FORM``; ``qwen3-vl-30b-a3b``; loads
  only, and MaxText's own converter fails scanned: ``MAXTEXT_CONVERTER_FAILS``); ``qwen3-omni``:
  ``Qwen3OmniMoeForConditionalGeneration`` without the talker, the thinker's MoE text decoder, its
  vision and audio towers (``qwen3-omni-30b-a3b``; the thinker's logits). MaxText runs the text
  decoder alone (``use_multimodal``/``use_audio`` off, no deepstack indexes, which MaxText's config
  refuses to scan with; on text tokens its MRoPE is the default RoPE), so the forward covers text
  tokens only, and the round trip compares the text tensors (the mapping leaves the towers out);
* ``qwen3-next``: ``Qwen3NextForCausalLM``, 8 layers (two blocks of 3 gated-delta-net layers then a
  gated full-attention one, scanned as MaxText's nested ``local_layers`` / ``global_layer``), partial
  RoPE, 4 experts top-2 and a gated shared expert (``qwen3-next-80b-a3b``);
* ``qwen3.5``: ``Qwen3_5MoeForCausalLM``, the same layers with the gated delta net's projections
  stored apart, its experts rewritten fused as the releases store them (``FUSED_EXPERTS``;
  ``qwen3.5-35b-a3b``, scanned as ``layer_0..3``; MaxText's M-RoPE off: on text tokens it is the
  default RoPE). Loads only (``in_proj_qkvz`` / ``in_proj_ba`` are per key head slices of two stored
  tensors each): no round trip.

MaxText needs Python 3.12 and its own pinned stack (JAX 0.12, Flax 0.12), so
``tests/support/maxtext_child.py`` runs in a separate venv, once for every family: MaxText's own model
(its model yml overridden to the tiny config; MoE through its dense, dropless ``dense_matmul``),
its abstract params sharded over a 4-device CPU mesh (fsdp 2 x tensor 2, MaxText's logical axis
rules), scanned and unscanned layers; ``ost.load`` through the mapping fills it, MaxText's
forward must give the reference logits, every tensor must equal what MaxText's own converter
(``checkpoint_conversion``'s tables and ``to_maxtext.py``'s stacking) makes of the checkpoint,
and ``ost.save`` through the mapping must write the checkpoint's tensors back byte for byte.
The tests are parametrized by (family, scan) so a failure names both.

The venv is ``$OST_MAXTEXT_VENV`` or ``~/.cache/orbax_safetensors/maxtext-0.2.5-venv``, built on
first use (about 1 min from local wheels): Python 3.12 (pyenv's, else ``python3.12``), ``pip
install --no-deps maxtext==0.2.5``, then the pinned requirements file
``tests/support/maxtext_requirements.txt`` (MaxText's model code pinned for CPU; or
``$OST_MAXTEXT_REQUIREMENTS``), then whatever of this project's runtime dependencies is missing;
``--no-compile`` (the child compiles only what it imports: about half the install time).
Skipped, with the reason, when there is no Python 3.12, the venv has to be built and the
requirements file is absent, or an install fails (offline). orbax_safetensors itself is not
installed there: the child imports this checkout (a venv shared by several checkouts would
otherwise test whichever was installed last).

    python -m pytest tests/families/test_maxtext_mapping.py -m slow -s

``OST_MAXTEXT_LOADER=path/to/module.py`` swaps the mapping for another loader (see the child's
``--loader``), to debug the harness itself.

``test_maxtext_load_dynamic_with_our_layout`` runs MaxText's own Hugging Face loader instead,
``source_checkpoint_layout="safetensors_dynamic"`` (``load_dynamic.load_safetensors_dynamic_state``:
Orbax's ``pytree_metadata``/``load_pytree`` under ``CheckpointLayout.SAFETENSORS``, then MaxText's
hooks), on the llama3.1 case with ``ost.install_orbax_layout()`` in force (child ``--loader
dynamic-ost``): the same logits, shardings and converter checks, and proof that Orbax called
our layout.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import time

import numpy as np
import pytest
from tests.support import REPO

pytestmark = pytest.mark.slow

REPO = str(REPO)
CHILD = os.path.join(REPO, "tests", "support", "maxtext_child.py")
MAXTEXT_VERSION = "0.2.5"
REQUIREMENTS = os.environ.get("OST_MAXTEXT_REQUIREMENTS") or os.path.join(REPO, "tests", "support", "maxtext_requirements.txt")
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "orbax_safetensors",
                            f"maxtext-{MAXTEXT_VERSION}-venv")
VARIANTS = ("scan", "unscan")  # scan_layers=True / False
DEVICES, MESH = 4, "fsdp=2,tensor=2"
# One maxtext_child.py runs every case: on a loaded 2-core machine with a fresh venv, MaxText's import took
# 81 s and each case and variant 18 s (a forward pass compiled), so the 60 of them about 1 200 s.
CHILD_TIMEOUT = 2100
PIP_TIMEOUT = 1800
TOKENS = np.random.default_rng(7).integers(0, 256, (2, 16), dtype=np.int32)
_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               tie_word_embeddings=False, hidden_act="silu", attention_bias=False)
LLAMA31 = dict(
    _COMMON, intermediate_size=128, head_dim=16, rms_norm_eps=1e-5, mlp_bias=False,
    max_position_embeddings=131072,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)
QWEN3 = dict(  # head_dim 32: 4 heads x 32 != hidden 64, as in the real Qwen3s
    _COMMON, intermediate_size=96, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=40960,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
)
QWEN3_MOE = dict(  # intermediate_size is for dense layers: there are none (decoder_sparse_step 1)
    _COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], head_dim=16, rms_norm_eps=1e-6,
    max_position_embeddings=40960, rope_parameters=dict(rope_type="default", rope_theta=10000000.0),
)
MIXTRAL = dict(
    _COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=16, rms_norm_eps=1e-5,
    sliding_window=None, router_jitter_noise=0.0, max_position_embeddings=32768,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
)
MISTRAL = dict(
    _COMMON, intermediate_size=128, head_dim=16, rms_norm_eps=1e-5, sliding_window=None,
    max_position_embeddings=32768, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
)
GEMMA3 = dict(  # 14 layers: two 6-layer attention patterns scanned, 2 left over (layers_remainder)
    {k: v for k, v in _COMMON.items() if k != "hidden_act"}, num_hidden_layers=14, intermediate_size=96, head_dim=16,
    query_pre_attn_scalar=16, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
    sliding_window=4,
    max_position_embeddings=32768, final_logit_softcapping=None, attn_logit_softcapping=None,
    rope_parameters=dict(full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
                         sliding_attention=dict(rope_type="default", rope_theta=10000.0)),
)
GEMMA2 = dict(  # 4 layers: sliding, global, sliding, global (MaxText's two paired layers)
    {k: v for k, v in _COMMON.items() if k != "hidden_act"}, num_hidden_layers=4, intermediate_size=96, head_dim=16,
    query_pre_attn_scalar=16, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
    sliding_window=4, max_position_embeddings=8192, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
GEMMA4 = dict(  # 12 layers: two blocks of 5 sliding-window layers then a global one (head_dim 32, 2 kv heads, keys
    # as values: attention_k_eq_v), proportional RoPE on a quarter of the global heads (gemma4-31b)
    {k: v for k, v in _COMMON.items() if k != "hidden_act"}, num_hidden_layers=12, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=2, attention_k_eq_v=True, intermediate_size=96, sliding_window=4,
    final_logit_softcapping=30.0, hidden_size_per_layer_input=0, tie_word_embeddings=True, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                         full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                             rope_theta=1000000.0)),
)
# gemma4-26b: every layer's dense MLP beside 4 routed experts, top 2 (MaxText's shared expert and MoeBlock_0)
GEMMA4_MOE = dict(GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
# gemma4-e2b (MaxText's gemma4_small): 10 layers, 4 sliding-window then a global one; per-layer inputs (16 wide);
# the last 4 layers reuse earlier layers' keys and values (no k/v) with a double-wide MLP; keys not values
GEMMA4_E2B = dict(GEMMA4, num_hidden_layers=10, attention_k_eq_v=False, num_global_key_value_heads=None,
                  hidden_size_per_layer_input=16, vocab_size_per_layer_input=256, num_kv_shared_layers=4,
                  use_double_wide_mlp=True,
                  layer_types=["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(10)])
# gemma2-27b: query_pre_attn_scalar (hidden / heads: 144 there) is not head_dim (128 there)
GEMMA2_27B = dict(GEMMA2, head_dim=8, query_pre_attn_scalar=16)
DEEPSEEK3 = dict(  # MLA with a low-rank query; 1 dense layer, then 2 MoE layers of 8 experts and a shared one;
    # DeepSeek-V3's own yarn RoPE; one expert group (so the router margin below is HF's choice)
    _COMMON, num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4, head_dim=8, intermediate_size=96,
    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=32,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=163840, rope_interleave=True,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                         beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
)
DEEPSEEK2 = dict(  # DeepSeek-V2-Lite's MLA (one q_proj, no query LoRA); 1 dense layer, then 2 MoE layers of
    # 8 experts (softmax, greedy top-2, not renormalised, no router bias) and 2 shared ones; its yarn mscale 0.707
    {k: v for k, v in DEEPSEEK3.items() if k not in ("rope_interleave", "n_group", "topk_group")},
    q_lora_rank=None, n_shared_experts=2, topk_method="greedy", norm_topk_prob=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                         beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
)
DEEPSEEK2_236B = dict(  # DeepSeek-V2-236B's: a low-rank query and group-limited routing (4 groups of 2
    # experts, each token's top-2 within its best group)
    DEEPSEEK2, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=1,
)
DEEPSEEK32 = dict(  # DeepSeek-V3's case plus the sparse attention's indexer: 8 heads of 16, each query
    # keeping its top 8 of the 16 tokens (so the indexer's weights change the logits)
    {k: v for k, v in DEEPSEEK3.items() if k != "rope_interleave"},
    index_n_heads=8, index_head_dim=16, index_topk=8,
)
DEEPSEEK4 = dict(  # 5 layers: 2 sliding-window, 1 compressed sparse (CSA), hash-routed MoE; then heavily
    # compressed (HCA), CSA, score-routed MoE (MaxText's scanned pair); one kv head, the output in 2 groups;
    # a window (8) and the indexer's top-k (2 of 4 compressed entries) that select. HCA compresses 128
    # tokens: at 16 its entries are empty, its tensors checked by MaxText's converter and the round trip.
    {k: v for k, v in _COMMON.items() if k not in ("num_hidden_layers", "num_key_value_heads", "attention_bias")},
    num_hidden_layers=5, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=16,
    o_groups=2, o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=8, index_n_heads=4, index_head_dim=32, index_topk=2, hc_mult=4, hc_sinkhorn_iters=20,
    swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0, rms_norm_eps=1e-6,
    max_position_embeddings=4096, num_nextn_predict_layers=0,
)
GPT_OSS = dict(  # 4 layers: sliding, full, sliding, full (scanned as two pairs)
    {k: v for k, v in _COMMON.items() if k not in ("hidden_act", "attention_bias")}, num_hidden_layers=4,
    intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                         original_max_position_embeddings=4096, truncate=False),
)
QWEN25 = dict(  # q/k/v biases (Qwen2's attention always has them: no attention_bias key)
    {k: v for k, v in _COMMON.items() if k != "attention_bias"}, intermediate_size=96, rms_norm_eps=1e-6,
    use_sliding_window=False, max_position_embeddings=32768,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
)
OLMO3 = dict(  # 8 layers: two blocks of 3 sliding-window layers and a global one (scanned as layers_0..3);
    # the pretraining revisions' default RoPE (MaxText olmo3-7b-pt)
    _COMMON, num_hidden_layers=8, intermediate_size=96, rms_norm_eps=1e-6, sliding_window=4,
    max_position_embeddings=8192,
    rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=500000.0),
                         sliding_attention=dict(rope_type="default", rope_theta=500000.0)),
)
OLMO3_YARN = dict(  # the release's YaRN on the global layers (MaxText olmo3-7b)
    OLMO3, max_position_embeddings=65536,
    rope_parameters=dict(full_attention=dict(rope_type="yarn", rope_theta=500000.0, factor=8.0, beta_fast=32.0,
                                             beta_slow=1.0, original_max_position_embeddings=8192),
                         sliding_attention=dict(rope_type="default", rope_theta=500000.0)),
)
QWEN3_NEXT = dict(  # 8 layers: two blocks of 3 gated-delta-net layers then a gated full-attention one
    _COMMON, num_hidden_layers=8, full_attention_interval=4, head_dim=16, intermediate_size=64,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
)
QWEN3_5 = dict(  # Qwen3-Next's layers, the gated delta net's projections stored apart; experts fused (FUSED_EXPERTS)
    {k: v for k, v in QWEN3_NEXT.items() if k not in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers")},
)
_QWEN3_VL_TEXT = dict(  # MRoPE's sections: head_dim / 2 frequencies (text tokens: the default RoPE)
    _COMMON, intermediate_size=96, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=128000,
    rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[4, 2, 2], mrope_interleaved=True),
)
_QWEN3_VL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                        deepstack_visual_indexes=[0])
# Tied, as the dense releases are (MaxText qwen3-vl-2b, -4b: logits_via_embedding); the MoE untied.
QWEN3_VL = dict(text_config=dict(_QWEN3_VL_TEXT, tie_word_embeddings=True), vision_config=_QWEN3_VL_VISION,
                tie_word_embeddings=True)
# moe_intermediate_size 24: neither hidden / 2 nor hidden, so transformers tells the release's
# expert layout from its own (the checkpoint is rewritten in the release's: RELEASE_FORM).
QWEN3_VL_MOE = dict(QWEN3_VL, tie_word_embeddings=False,
                    text_config=dict(_QWEN3_VL_TEXT, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                     decoder_sparse_step=1, mlp_only_layers=[]))
QWEN3_OMNI = dict(  # the thinker alone (no talker: enable_audio_output False), a 1-layer audio tower
    enable_audio_output=False,
    thinker_config=dict(
        text_config=dict(_QWEN3_VL_TEXT, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                         rope_parameters=dict(_QWEN3_VL_TEXT["rope_parameters"], rope_theta=1000000.0)),
        vision_config=_QWEN3_VL_VISION,
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                          downsample_hidden_size=8, output_dim=64, n_window=4, n_window_infer=8, conv_chunksize=4)),
)
# case -> (family for ost.mappings.maxtext, transformers model class, config class, config)
CASES = {
    "llama3.1": ("llama3.1", "LlamaForCausalLM", "LlamaConfig", LLAMA31),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", QWEN3),
    "qwen3-moe": ("qwen3", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE),
    "mixtral": ("mixtral", "MixtralForCausalLM", "MixtralConfig", MIXTRAL),
    "mistral": ("mistral", "MistralForCausalLM", "MistralConfig", MISTRAL),
    "gemma3": ("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", GEMMA2),
    "gemma4": ("gemma4", "Gemma4ForCausalLM", "Gemma4TextConfig", GEMMA4),
    "gemma4-moe": ("gemma4", "Gemma4ForCausalLM", "Gemma4TextConfig", GEMMA4_MOE),
    "gemma2-27b": ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", GEMMA2_27B),
    "gemma4-e2b": ("gemma4", "Gemma4ForCausalLM", "Gemma4TextConfig", GEMMA4_E2B),
    "deepseek3": ("deepseek3", "DeepseekV3ForCausalLM", "DeepseekV3Config", DEEPSEEK3),
    "deepseek2": ("deepseek2", "DeepseekV2ForCausalLM", "DeepseekV2Config", DEEPSEEK2),
    "deepseek2-236b": ("deepseek2", "DeepseekV2ForCausalLM", "DeepseekV2Config", DEEPSEEK2_236B),
    "deepseek3.2": ("deepseek3.2", "DeepseekV32ForCausalLM", "DeepseekV32Config", DEEPSEEK32),
    "deepseek4": ("deepseek4", "DeepseekV4ForCausalLM", "DeepseekV4Config", DEEPSEEK4),
    "gpt-oss": ("gpt-oss", "GptOssForCausalLM", "GptOssConfig", GPT_OSS),
    "qwen2.5": ("qwen2.5", "Qwen2ForCausalLM", "Qwen2Config", QWEN25),
    "olmo3": ("olmo3", "Olmo3ForCausalLM", "Olmo3Config", OLMO3),
    "olmo3-yarn": ("olmo3", "Olmo3ForCausalLM", "Olmo3Config", OLMO3_YARN),
    "qwen3-next": ("qwen3-next", "Qwen3NextForCausalLM", "Qwen3NextConfig", QWEN3_NEXT),
    "qwen3.5": ("qwen3.5", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", QWEN3_5),
    "qwen3-vl": ("qwen3-vl", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig", QWEN3_VL),
    "qwen3-vl-moe": ("qwen3-vl", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig", QWEN3_VL_MOE),
    "qwen3-omni": ("qwen3-omni", "Qwen3OmniMoeForConditionalGeneration", "Qwen3OmniMoeConfig", QWEN3_OMNI),
}
# Cases whose transformers model is a part of the saved one: Qwen3-Omni's thinker (the whole
# model has no forward); its logits are the reference.
SUBMODEL = {"qwen3-omni": "thinker"}
# case -> how the release stores what transformers' save_pretrained writes otherwise, (name,
# tensor) -> (name, tensor) (the checkpoint is rewritten so): Qwen3-VL-MoE's experts, [experts,
# embed, 2 * mlp] and [experts, mlp, embed] (transformers' conversion_mapping transposes them on
# load); DeepSeek-V4's names (deepseek4_release_name).
RELEASE_FORM = {"qwen3-vl-moe": lambda name, t: (name, t.transpose(0, 2, 1) if ".mlp.experts." in name else t),
                "deepseek4": lambda name, t: (deepseek4_release_name(name), t)}
# save_pretrained's DeepSeek-V4 names -> the release's, which MaxText's converter reads: transformers'
# conversion_mapping "deepseek_v4" renames the release as it loads, and writes back its module paths
# (model.), embed_tokens and hc_head.hc_*; undoing its rename of ".norm." to ".kv_norm." it also
# writes the attention's own kv_norm as "attn.norm". transformers loads either form alike.
_DEEPSEEK4_RELEASE = ((r"^model\.embed_tokens\.weight$", "embed.weight"),
                      (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
                      (r"^model\.", ""), (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"))


def deepseek4_release_name(name: str) -> str:
    for pattern, replacement in _DEEPSEEK4_RELEASE:  # in turn
        name = re.sub(pattern, replacement, name)
    return name


# case -> MaxText's mesh for it, where the common MESH cannot hold it: MaxText 0.2.5 shards
# DeepSeek-V4's wkv kernel's kv_heads axis over "tensor" (layers/attention_compressed.py: kernel_axes
# ("embed_attn", "kv_heads", "kv_head_dim"); base.yml: kv_heads -> tensor), and V4 has one kv head,
# which no tensor parallelism divides: its experts over "expert" instead.
CASE_MESH = {"deepseek4": "fsdp=2,expert=2"}
# Cases whose checkpoint is rewritten with each layer's experts fused, the release's form
# (transformers writes one tensor per expert; MaxText's converter reads the release's).
FUSED_EXPERTS = {"qwen3.5"}
# Cases whose MaxText model has no converter (no PARAM_MAPPING entry in MaxText 0.2.5), so the
# tensors are checked by the forward pass alone: Mistral's mapping is derived from MaxText's
# mistral block (models/mistral.py: Llama's layer, its unscaled Attention with rotate-half RoPE).
NO_CONVERTER = {"mistral"}
# Cases whose norm weights are bfloat16 values (stored as float32): the mapping adds 1 in float32
# (MaxText's 1 + w), exact for those, so the round trip stays byte for byte.
BF16_NORMS = {"gemma3", "gemma2", "gemma2-27b"}
# Routers' k-th and (k+1)-th logits at least this far apart for every token, so float32
# rounding (MaxText's vs transformers') cannot pick different experts; DeepSeek-V3.2's indexers'
# k-th and (k+1)-th index scores too (among the tokens a query may attend to), so neither rounding
# nor a tie's order (MaxText keeps the first) picks different tokens.
ROUTER_MARGIN = 1e-3
# Cases whose seed-0 weights route some token within ROUTER_MARGIN of a tie: another seed.
SEEDS = {"deepseek3": 1, "deepseek3.2": 5, "gemma4-moe": 1}
# case -> why MaxText 0.2.5's forward gives other logits than transformers' for it while every
# other check holds (shardings, MaxText's own converter, the round trip): a strict xfail that
# only a LogitsDiffer satisfies, in KNOWN below; a fixed MaxText flips it to a failure.
MAXTEXT_FORWARD_BUGS = {
    "olmo3-yarn": "MaxText 0.2.5's olmo3 block applies the release's YaRN RoPE (frequencies and attention "
                  "scaling) to every layer; transformers to the full-attention layers only, the sliding-window "
                  "layers keeping the default RoPE",
    "deepseek2-236b": "MaxText 0.2.5 routes deepseek2 by a plain top-k over every expert (moe.py get_topk: "
                      "only deepseek3/deepseek4/kimi-k2 names take its group routing); DeepSeek-V2-236B's "
                      "group_limited_greedy keeps each token's experts within its top groups",
}
# (case, variant) -> mark: known disagreements of the mapping with MaxText (strict xfail, flips
# to a failure when fixed) and families MaxText cannot run here (skip).
KNOWN: dict[tuple[str, str], tuple[str, str]] = {
    (case, v): ("xfail", reason) for case, reason in MAXTEXT_FORWARD_BUGS.items() for v in VARIANTS}
# case -> (why, leaves): MaxText 0.2.5's own converter makes other values of these leaves (name
# suffixes) than the mapping, and its are the wrong ones: with the mapping's, MaxText's forward
# gives transformers' logits. Every other check must hold; a strict xfail that only a
# ConverterWrong satisfies (in KNOWN), so a fixed converter flips it to a failure.
MAXTEXT_CONVERTER_WRONG = {
    "gemma2-27b": ("MaxText 0.2.5's Gemma 2 converter scales the query kernel by head_dim**-0.5 "
                   "(scale_query_layer); its attention does not scale and transformers' scales by "
                   "query_pre_attn_scalar**-0.5 (gemma2-27b: 144, head_dim 128)", (".query.kernel",)),
}
KNOWN.update({(case, v): ("xfail", reason) for case, (reason, _) in MAXTEXT_CONVERTER_WRONG.items() for v in VARIANTS})
KNOWN[("gemma4-e2b", "scan")] = ("skip", "MaxText 0.2.5's gemma4_small decoder (gemma4-e2b, gemma4-e4b) has no scanned "
                                         "form (nnx_decoders refuses scan_layers; its converter raises NotImplementedError)")
# (case, variant) -> leaves where MaxText 0.2.5's own converter contradicts MaxText's own tree, so
# the child compares them with its hooks stacked at param_scan_axis instead (its
# "converter_workarounds"). to_maxtext.py's _build_single_axis_stacked_tensor takes any scanned key
# containing "MoeBlock" for an unscanned expert stack and stacks its layers at axis 0: Mixtral's
# scanned router becomes (layers, embed, experts), the tree's leaf is (embed, layers, experts), and
# to_maxtext.py stops with "Shape mismatch" (so it cannot convert Mixtral with scan_layers=True).
MAXTEXT_CONVERTER_BUGS = {("mixtral", "scan"): {"decoder.layers.MoeBlock_0.gate.kernel"}}
# (case, variant) -> why MaxText 0.2.5's own converter cannot compute some leaves of its own tree,
# so there is nothing to compare them with (the forward pass still checks them): its DeepSeek
# hooks reshape a scanned moe_layers leaf to every layer's count, the dense ones included.
MAXTEXT_CONVERTER_FAILS = {(case, "scan"): "MaxText's DeepSeek hooks cannot reshape its scanned moe_layers"
                           for case in ("deepseek3", "deepseek2", "deepseek2-236b", "deepseek3.2")}
# QWEN3_VL_MAXTEXT_TO_HF_PARAM_MAPPING fuses the experts (gate_up_proj, down_proj) for unscanned
# layers only: scanned, it keeps Qwen3-MoE's per-expert names, which the release does not store.
MAXTEXT_CONVERTER_FAILS[("qwen3-vl-moe", "scan")] = ("MaxText's scanned Qwen3-VL-MoE mapping names per-expert "
                                                     "tensors (…mlp.experts.{e}.gate_proj.weight); the release "
                                                     "stores them fused")

# Run inside the venv: which of the requirements (argv[1], JSON) are not installed as asked.
_PROBE = r"""
import json, re, sys
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:
    Requirement = None
unmet = []
for line in json.loads(sys.argv[1]):
    name = re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0]
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        unmet.append(line)
        continue
    if Requirement is None:
        if "==" in line and line.split("==", 1)[1].strip() != version:
            unmet.append(line)
    elif not Requirement(line).specifier.contains(version, prereleases=True):
        unmet.append(line)
print(json.dumps({"python": sys.version.split()[0], "unmet": unmet}))
"""


def _clean_env(**extra):
    """The 3.11 test process's environment minus what would leak into the 3.12 venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "XLA_FLAGS", "PYTHONSTARTUP")}
    env.update(JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def _version_key(path):
    match = re.search(r"3\.12\.(\d+)", path)
    return int(match.group(1)) if match else -1


def _find_python312():
    candidates = [os.environ.get("OST_MAXTEXT_PYTHON")]
    roots = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        roots.append(subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30,
                                    check=False).stdout.strip())
    roots.append(os.path.expanduser("~/.pyenv"))
    for root in filter(None, roots):
        candidates += sorted(glob.glob(os.path.join(root, "versions", "3.12*", "bin", "python")),
                             key=_version_key, reverse=True)
    candidates.append(shutil.which("python3.12"))
    for python in filter(None, candidates):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([python, "-c", "import sys, venv; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=60, env=_clean_env(), check=False)
            if out.returncode == 0 and out.stdout.strip() == "(3, 12)":
                return python
    return None


def _requirements_file_lines():
    with open(REQUIREMENTS) as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


def _project_dependencies():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def _unmet(python, requirements):
    out = subprocess.run([python, "-c", _PROBE, json.dumps(requirements)], capture_output=True, text=True,
                         timeout=120, env=_clean_env(), check=False)
    if out.returncode != 0:
        return list(requirements)
    return json.loads(out.stdout.strip().splitlines()[-1])["unmet"]


def _run_or_skip(command, what, timings):
    start = time.perf_counter()
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT, env=_clean_env(),
                             check=False)
    except subprocess.TimeoutExpired:
        pytest.skip(f"MaxText venv: {what} timed out after {PIP_TIMEOUT} s")
    timings[what] = round(time.perf_counter() - start, 1)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-15:]
        pytest.skip(f"MaxText venv: {what} failed (offline?): " + "\n".join(tail))


@contextlib.contextmanager
def _locked(path):
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent sessions (xdist) build the venv once
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _venv_python(venv):
    return os.path.join(venv, "bin", "python")


def ensure_maxtext_venv(venv: str, timings: dict) -> str:
    """The venv's python, with MaxText 0.2.5, its pinned stack and our runtime dependencies.

    Idempotent: only what the probe finds missing is installed; nothing is ever deleted.
    """
    python = _venv_python(venv)
    have_requirements = os.path.isfile(REQUIREMENTS)
    stack = [f"maxtext=={MAXTEXT_VERSION}"] + (_requirements_file_lines() if have_requirements else [])
    ours = _project_dependencies()
    with _locked(venv.rstrip("/") + ".lock"):
        start = time.perf_counter()
        unmet = _unmet(python, stack + ours) if os.path.exists(python) else stack + ours
        timings["probe"] = round(time.perf_counter() - start, 1)
        if set(unmet) & set(stack):
            if not have_requirements:
                pytest.skip(f"no MaxText venv at {venv} ({sorted(set(unmet) & set(stack))} missing) "
                            f"and no requirements file to build it: {REQUIREMENTS}")
            if not os.path.exists(python):
                base = _find_python312()
                if base is None:
                    pytest.skip("MaxText 0.2.5 needs Python 3.12: none found (pyenv, python3.12, $OST_MAXTEXT_PYTHON)")
                _run_or_skip([base, "-m", "venv", venv], "create venv", timings)
            _run_or_skip([python, "-m", "pip", "install", "--no-compile", "--no-deps", f"maxtext=={MAXTEXT_VERSION}"],
                         "pip install maxtext", timings)
            _run_or_skip([python, "-m", "pip", "install", "--no-compile", "-r", REQUIREMENTS],
                         "pip install requirements", timings)
            unmet = _unmet(python, stack + ours)
        if unmet:  # e.g. orbax_safetensors' own runtime dependencies
            _run_or_skip([python, "-m", "pip", "install", "--no-compile", *unmet], "pip install missing", timings)
            unmet = _unmet(python, stack + ours)
        if unmet:
            pytest.skip(f"MaxText venv {venv}: still unmet after installing: {unmet}")
        timings["venv_total"] = round(time.perf_counter() - start, 1)
    return python


@pytest.fixture(scope="module")
def maxtext_python():
    timings: dict = {}
    python = ensure_maxtext_venv(os.environ.get("OST_MAXTEXT_VENV") or DEFAULT_VENV, timings)
    print(f"\nMaxText venv {python}: {timings}")
    return python


def write_checkpoint(case: str, directory: str, seed: int = 0, release: bool = True) -> str:
    """A tiny model of ``case`` with every weight random, saved by transformers (float32 safetensors);
    ``release``: rewritten in the release's form where it differs (``RELEASE_FORM``)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, model_class, config_class, config = CASES[case]
    from tests.support.hf_families import saved_tensors  # not at the top: this file also runs as a script

    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config)).eval()
    with torch.no_grad():
        for name, p in saved_tensors(model):
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash routing table: each token's k distinct experts
                experts = model.config.n_routed_experts
                p.copy_(torch.stack([torch.randperm(experts)[:p.shape[1]] for _ in range(p.shape[0])]))
                continue
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
            if name.endswith("router.scale"):  # Gemma 4's router input scale: wide, so its top-k margins
                p.mul_(5.0 / 0.15)  # clear ROUTER_MARGIN (its input is RMS-normalised and scaled by hidden**-0.5)
            if "norm" in name and case in BF16_NORMS:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    model.save_pretrained(directory)
    if case in RELEASE_FORM and release:
        from safetensors.numpy import load_file, save_file

        for path in glob.glob(os.path.join(directory, "*.safetensors")):
            tensors = dict(RELEASE_FORM[case](n, t) for n, t in load_file(path).items())
            tensors = {n: np.ascontiguousarray(t) for n, t in tensors.items()}
            save_file(tensors, path, metadata={"format": "pt"})
    if case in FUSED_EXPERTS:
        from safetensors.numpy import load_file, save_file

        for path in glob.glob(os.path.join(directory, "*.safetensors")):
            save_file(fused_experts(load_file(path)), path, metadata={"format": "pt"})
    return directory


def fused_experts(tensors: dict) -> dict:
    """Per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` as the Qwen3.5 releases store them:
    ``mlp.experts.gate_up_proj`` (experts, 2 * mlp, embed; gate rows first) and ``down_proj``."""
    out, layers = {}, {}
    for name, value in tensors.items():
        match = re.fullmatch(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if match is None:
            out[name] = value
        else:
            layers.setdefault(match.group(1), {}).setdefault(match.group(3), {})[int(match.group(2))] = value
    for prefix, projections in layers.items():
        stacked = {p: np.stack([e[k] for k in range(len(e))]) for p, e in projections.items()}
        out[f"{prefix}.gate_up_proj"] = np.concatenate([stacked["gate_proj"], stacked["up_proj"]], 1)
        out[f"{prefix}.down_proj"] = stacked["down_proj"]
    return out


def transformers_logits(directory: str, tokens: np.ndarray, case: str = "llama3.1"):
    """(logits, each logit's atol (``tests/support/tolerances.py``), the smallest gap between a router's k-th
    and (k+1)-th logit, or a DeepSeek-V3.2 indexer's k-th and (k+1)-th index score; inf without either)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.support.tolerances import causal_lm_reference  # not at the top: this file also runs as a script

    model = getattr(transformers, CASES[case][1]).from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()
    model = getattr(model, SUBMODEL[case]) if case in SUBMODEL else model
    text = model.config.get_text_config()  # a multimodal model's text decoder's; the config itself otherwise
    k = text.to_dict().get("num_experts_per_tok") or text.to_dict().get("top_k_experts")  # Gemma 4's
    gaps, handles = [], []

    def router(module):  # Mixtral's, Qwen3-MoE's and DeepSeek's gate, gpt-oss's router (with a bias)
        gate = getattr(module, "gate", None)
        return gate if gate is not None else getattr(module, "router", None)

    def record(module, inputs):  # the sparse block's input, through its router
        gate = router(module)
        logits = torch.nn.functional.linear(inputs[0].reshape(-1, inputs[0].shape[-1]), gate.weight,
                                            getattr(gate, "bias", None))
        bias = getattr(gate, "e_score_correction_bias", None)  # DeepSeek: its scores (sigmoid; V4's score_fn) + bias
        scores = logits if bias is None else getattr(gate, "score_fn", torch.sigmoid)(logits) + bias
        top = torch.topk(scores, k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    index_gaps, topk = [], torch.Tensor.topk

    def index_scored(scores, count, *args, **kwargs):  # an indexer's one top-k of its index scores
        if scores.shape[-1] > count:
            top = topk(scores, count + 1, dim=-1).values
            open_ = top[..., count] > torch.finfo(top.dtype).min / 2  # its (k+1)-th token is not masked
            if open_.any():
                index_gaps.append(float((top[..., count - 1] - top[..., count])[open_].min()))
        return topk(scores, count, *args, **kwargs)

    def record_index(forward):  # DeepSeek-V3.2's indexer, which keeps each query's top-k tokens
        def scoring(*args, **kwargs):
            torch.Tensor.topk = index_scored
            try:
                return forward(*args, **kwargs)
            finally:
                torch.Tensor.topk = topk
        return scoring

    for module in model.modules():
        gate = router(module)
        if k and getattr(gate, "weight", None) is not None and gate.weight.shape[0] > 1 and hasattr(module, "experts") \
                and not hasattr(gate, "tid2eid"):  # DeepSeek-V4's first layers route by a table: no margin
            handles.append(module.register_forward_pre_hook(record))
        if type(module).__name__ == "Gemma4TextRouter":  # normalises and scales its input first: its output's
            handles.append(module.register_forward_hook(  # log-probabilities, the logits less a per-token constant
                lambda module, inputs, output: gaps.append(float(
                    (lambda top: (top[:, k - 1] - top[:, k]).min())(torch.topk(output[0].log(), k + 1, dim=-1).values)))))
    indexers = [module for module in model.modules() if hasattr(module, "index_topk")]
    for module in indexers:
        module.forward = record_index(module.forward)
    # MaxText's tied head (logits_via_embedding: attend_on_embedding) casts the embedding to bfloat16.
    head_dtype = "bfloat16" if model.config.tie_word_embeddings else None
    try:
        logits, atol = causal_lm_reference(model, tokens, head_dtype=head_dtype)
    finally:
        for handle in handles:
            handle.remove()
        for module in indexers:
            del module.forward
    sparse = (text.num_hidden_layers - (getattr(text, "first_k_dense_replace", None) or 0)
              - list(getattr(text, "mlp_layer_types", None) or []).count("hash_moe"))
    if k and len(gaps) != sparse:
        raise AssertionError(f"{case}: found {len(gaps)} routers, expected one per sparse layer ({sparse})")
    return logits, atol, min(gaps + index_gaps, default=float("inf"))


def reference_checkpoint(case: str, root) -> tuple[str, np.ndarray, np.ndarray]:
    """(hf_dir, transformers' logits, their atol) of a tiny ``case`` model written under ``root``."""
    directory = write_checkpoint(case, str(root / case), seed=SEEDS.get(case, 0))
    logits, atol, router_gap = transformers_logits(directory, TOKENS, case)
    assert np.abs(logits).max() > 1.0, case  # large enough for a wrong layout to show
    assert router_gap > ROUTER_MARGIN, (case, router_gap)  # routing cannot flip on rounding
    return directory, logits, atol


class _Checkpoints(dict):
    """{case: reference_checkpoint(case)}, each written on first use: a session that selects
    some cases (``-k gemma3``) pays for theirs alone."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, case):
        self[case] = reference_checkpoint(case, self.root)
        return self[case]


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    return _Checkpoints(tmp_path_factory.mktemp("maxtext"))


def selected_cases(request, test, known=None) -> list[str]:
    """The cases the session's selected items of ``test`` (a test function of the requesting
    module) take (``-k`` deselects the others), in ``CASES`` order, less those ``known``
    (default ``KNOWN``) skips in every variant."""
    known = KNOWN if known is None else known
    chosen = {item.callspec.params["case"] for item in request.session.items
              if item.module is request.module and getattr(item, "originalname", None) == test
              and "case" in getattr(getattr(item, "callspec", None), "params", {})}
    return [case for case in CASES if case in chosen
            and not all(known.get((case, v), (None,))[0] == "skip" for v in VARIANTS)]


def run_child(python, checkpoints, work, loader="ost", variants=VARIANTS):
    """Runs tests/support/maxtext_child.py in the MaxText venv for every case of ``checkpoints`` ({case:
    (hf_dir, reference logits, their atol)}); {(case, variant): result}, wall seconds, output."""
    tokens_path, cases_path = os.path.join(work, "tokens.npy"), os.path.join(work, "cases.json")
    np.save(tokens_path, TOKENS)
    cases = []
    for case, (hf_dir, reference, atol) in checkpoints.items():
        reference_path, atol_path = (os.path.join(work, f"{what}-{case}.npy") for what in ("reference", "atol"))
        np.save(reference_path, reference)
        np.save(atol_path, atol)
        cases.append({"case": case, "family": CASES[case][0], "hf_dir": hf_dir, "reference": reference_path,
                      "atol": atol_path, **({"mesh": CASE_MESH[case]} if case in CASE_MESH else {})})
    with open(cases_path, "w") as f:
        json.dump(cases, f)
    command = [python, CHILD, "--cases", cases_path, "--tokens", tokens_path,
               "--variants", ",".join(variants), "--devices", str(DEVICES), "--mesh", MESH,
               "--out-dir", os.path.join(work, "out"), "--loader", loader]
    start = time.perf_counter()
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT, cwd=work,
                             env=_clean_env(), check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"maxtext_child.py timed out after {CHILD_TIMEOUT} s:\n{e.stdout}\n{e.stderr}")
    seconds = time.perf_counter() - start
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("MAXTEXT_RESULT "):
            result = json.loads(line[len("MAXTEXT_RESULT "):])
            results[result["case"], result["variant"]] = result
    return results, seconds, out


def complete_child_run(python, checkpoints, work, loader):
    """:func:`run_child` for every case of ``checkpoints`` and both variants, printing each result;
    fails the test unless every (case, variant) reported. ({(case, variant): result}, output)."""
    results, seconds, out = run_child(python, checkpoints, work, loader=loader)
    print(f"\nmaxtext_child.py ({loader}): {seconds:.1f} s, exit {out.returncode}")
    for result in results.values():
        print(json.dumps({k: v for k, v in result.items() if k != "traceback"}))
    expected = {(case, v) for case in checkpoints for v in VARIANTS}
    if set(results) != expected:
        pytest.fail(f"maxtext_child.py exited {out.returncode} with results for {sorted(results)} only:\n"
                    f"{out.stdout[-4000:]}\n{out.stderr[-6000:]}")
    return results, out


@pytest.fixture(scope="module")
def child_results(request, maxtext_python, hf_checkpoints, tmp_path_factory):
    checkpoints = {case: hf_checkpoints[case] for case in selected_cases(request, "test_maxtext_mapping")}
    return complete_child_run(maxtext_python, checkpoints, str(tmp_path_factory.mktemp("child")),
                              os.environ.get("OST_MAXTEXT_LOADER", "ost"))


class LogitsDiffer(AssertionError):
    """MaxText's logits are not transformers' (some logit outside its tolerance), every other
    check of :func:`assert_child_result` having passed."""


class ConverterWrong(AssertionError):
    """MaxText's own converter differs from the mapping on exactly the leaves
    ``MAXTEXT_CONVERTER_WRONG`` names, every other check (transformers' logits too) having passed."""


def assert_child_result(child_run, case, variant, *, round_trip=True):
    """One (case, variant) of a :func:`complete_child_run`: loaded with the target's shardings,
    equal to MaxText's own converter (its known bugs aside), transformers' logits, and (with
    ``round_trip``) saved back byte for byte."""
    results, out = child_run
    result = results[case, variant]
    assert "error" not in result, f"{result['error']}\n{result.get('traceback', '')}"
    failures = result["failures"]
    assert result.get("shardings_match"), failures
    converter_fails = (case, variant) in MAXTEXT_CONVERTER_FAILS
    assert bool(result.get("converter_errors")) == converter_fails, failures  # flips when MaxText is fixed
    if converter_fails:
        failures = [f for f in failures if not f.startswith("MaxText's own converter fails")]
    assert result.get("converter") == (case not in NO_CONVERTER), result.get("converter")
    wrong = []  # leaves where MaxText's converter's values are the wrong ones (MAXTEXT_CONVERTER_WRONG)
    if case not in NO_CONVERTER and not converter_fails:
        assert set(result.get("converter_workarounds", {})) == MAXTEXT_CONVERTER_BUGS.get((case, variant), set()), \
            result.get("converter_workarounds")
        diffs, suffixes = result.get("converter_diffs", {}), MAXTEXT_CONVERTER_WRONG.get(case, (None, ()))[1]
        wrong = sorted(n for n in diffs if n.endswith(suffixes))
        failures = [f for f in failures if not (wrong and f.startswith("differs from MaxText's own converter"))]
        assert set(diffs) == set(wrong) and (wrong or result.get("converter_max_abs_diff") == 0.0), \
            failures  # exact: float32
    if round_trip:
        assert result.get("round_trip_identical"), failures
    others = [f for f in failures if not f.startswith("logits differ from the reference")]
    assert not others, others
    if not result.get("logits_tolerance_used", np.inf) <= 1:  # last: MAXTEXT_FORWARD_BUGS expect this alone
        raise LogitsDiffer(f"{case} {variant}: {failures}")
    if wrong:  # MAXTEXT_CONVERTER_WRONG expect this alone
        raise ConverterWrong(f"{case} {variant}: MaxText's own converter differs on {wrong}")
    assert (result["ok"] or converter_fails) and not failures, failures
    if all(r["ok"] for r in results.values()):
        assert out.returncode == 0, out.stderr[-4000:]


def case_params(known_marks=None):
    """Every (case, variant), marked as ``known_marks`` (by default ``KNOWN``) says."""
    for case in CASES:
        for variant in VARIANTS:
            known = (KNOWN if known_marks is None else known_marks).get((case, variant))
            marks = ()
            if known is not None:
                kind, reason = known
                marks = (pytest.mark.skip(reason=reason) if kind == "skip"
                         else pytest.mark.xfail(strict=True, reason=reason,
                                                raises=None if not (known_marks is None or known_marks is KNOWN) else
                                                LogitsDiffer if case in MAXTEXT_FORWARD_BUGS else
                                                ConverterWrong if case in MAXTEXT_CONVERTER_WRONG else None))
            yield pytest.param(case, variant, marks=marks, id=f"{case}-{variant}")


@pytest.mark.timeout(PIP_TIMEOUT + CHILD_TIMEOUT)  # a first run builds the venv
@pytest.mark.parametrize(("case", "variant"), list(case_params()))
def test_maxtext_mapping(child_results, case, variant):
    assert_child_result(child_results, case, variant)


@pytest.fixture(scope="module")
def dynamic_results(maxtext_python, tmp_path_factory):
    """MaxText's own safetensors_dynamic load of the llama3.1 case with our layout installed."""
    checkpoints = {"llama3.1": reference_checkpoint("llama3.1", tmp_path_factory.mktemp("dynamic"))}
    results, _ = complete_child_run(maxtext_python, checkpoints, str(tmp_path_factory.mktemp("child")), "dynamic-ost")
    return results


@pytest.mark.timeout(PIP_TIMEOUT + CHILD_TIMEOUT)  # a first run builds the venv
@pytest.mark.parametrize("variant", VARIANTS)
def test_maxtext_load_dynamic_with_our_layout(dynamic_results, variant):
    """MaxText 0.2.5's ``source_checkpoint_layout="safetensors_dynamic"`` path
    (``checkpoint_conversion/utils/load_dynamic.py``: ``load_safetensors_dynamic_state``, which
    asks ``ocp.v1.pytree_metadata`` and ``ocp.v1.load_pytree`` under
    ``Context(checkpoint_layout=SAFETENSORS)`` and applies MaxText's hooks on device), run with
    ``ost.install_orbax_layout()`` in force: its params give transformers' logits, each within
    its tolerance (``tests/support/tolerances.py``), with the target's shardings, and equal MaxText's own
    converter's tensors."""
    result = dynamic_results["llama3.1", variant]
    assert "error" not in result, f"{result['error']}\n{result.get('traceback', '')}"
    assert result["orbax_safetensors"] == os.path.join(REPO, "orbax_safetensors")  # this checkout's
    assert result["layout_loads"] == 1  # Orbax's load_pytree went through ost.SafetensorsLayout
    failures = result["failures"]
    assert result.get("shardings_match"), failures
    assert result.get("converter_max_abs_diff") == 0.0, failures
    assert result.get("logits_tolerance_used", np.inf) <= 1, failures
    assert result["ok"] and not failures, failures


if __name__ == "__main__":  # .ci/run builds the venv in the background while the suite starts
    import sys

    try:
        print(ensure_maxtext_venv(os.environ.get("OST_MAXTEXT_VENV") or DEFAULT_VENV, {}))
    except pytest.skip.Exception as e:
        print(f"MaxText venv not built: {e}", file=sys.stderr)
