"""DeepSeek-V4 (``model_type`` ``deepseek_v4``, DeepSeek-V4-Flash) ↔ MaxText 0.2.5's
``deepseek4`` tree (``maxtext("deepseek4", ...)``) and ↔ a Flax-style tree (``deepseek_v4``).

Re-derived from MaxText 0.2.5's ``DEEPSEEK_V4_MAXTEXT_TO_HF_PARAM_MAPPING`` and its hooks
(``checkpoint_conversion/utils/param_mapping.py``) and transformers' ``deepseek_v4`` model.
The release names its tensors as DeepSeek's own inference code does
(``layers.{i}.attn.wq_a.weight``, ``embed.weight``, ``head.weight``, ``hc_head_fn``), which
MaxText's converter reads and transformers renames as it loads. transformers' ``save_pretrained``
writes another form: ``model.`` before each name but the head's, ``model.embed_tokens.weight``,
``model.hc_head.hc_fn``, and the attention's ``kv_norm`` as ``norm``. ``names="transformers"``
maps that form; the default is the release's.

Each layer has

* attention, ``attn.``: the query through ``wq_a`` (low rank, ``q_norm``) and ``wq_b`` (the
  heads), one key-value head ``wkv`` (``kv_norm``), a sink per head (``attn_sink``) and the output
  in groups, ``wo_a`` ``[o_groups * o_lora_rank, heads * head_dim / o_groups]`` then ``wo_b``.
  MaxText's ``o_a_proj`` is ``[o_groups, heads * head_dim / o_groups, o_lora_rank]``: the split
  rows' two parts apart (``Rule.transpose_after``), as its hook reshapes and transposes them;
* a compressor by the layer's attention (``layer_types`` with ``compress_rates``, or the
  release's ``compress_ratios``: 0 a sliding window alone, 4 compressed sparse attention (CSA),
  more heavily compressed attention (HCA)): ``attn.compressor.{wgate,wkv,norm,ape}`` and, for
  CSA, an indexer with a compressor of its own, ``attn.indexer.{compressor.*,weights_proj,wq_b}``.
  MaxText holds them as ``self_attention.csa_compressor`` (its ``indexer`` inside) or
  ``hca_compressor``, so a rule maps a layer's by what its attention is (``Rule.only``);
* the hyper-connections (mHC) around the attention and the MoE, ``hc_attn_*`` and ``hc_ffn_*``
  with ``k = hc_mult`` streams: ``fn`` ``[(2 + k) * k, k * hidden]`` holds the pre, post and
  residual mixing weights, ``base`` their biases, ``scale`` their three scales. MaxText holds
  each as a leaf of its own (``pre_alpha`` ``[k * hidden, k]``, ``res_alpha``
  ``[k * hidden, k * k]``, ``res_beta`` ``[k, k]``, ``pre_alpha_scale`` ``[1]``...: ``Rule.order``
  slices of the stored tensor, saved back from all three), and an ``mhc_norm`` scale the
  release lacks (it normalises there without a weight): ones, a ``Constant`` no save writes;
* the MoE: routed experts ``ffn.experts.{e}.w1/w3/w2``, one shared expert, the router
  ``ffn.gate.weight``. The first ``num_hash_layers`` route each token by a table,
  ``ffn.gate.tid2eid`` (``[vocab, top_k]``, int64; float32 in MaxText's ``Tid2EidVar``
  collection, and int64 again when saved), the others by score with a bias, ``ffn.gate.bias``
  (MaxText's ``MoEBiasVar`` collection);
* norms ``attn_norm`` and ``ffn_norm``;

then ``embed``, ``norm``, ``head`` and the last hyper-connection, ``hc_head_{fn,base,scale}``.

MaxText's tree holds layer ``i`` as ``decoder.layers_{i}.…`` unscanned. Scanned, the
``num_hash_layers`` first stay unrolled and the rest are scanned in pairs (layers at axis 1,
experts at 0, the router bias at 0): ``decoder.scanned_blocks.layers_0`` holds the HCA layers
``h, h + 2, …`` and ``layers_1`` the CSA ones ``h + 1, …``; a config whose later layers do not
alternate so has no scanned tree (an ``ArgumentError``). No value changes on the way, so a save
gives back the release's bytes.

The Flax-style tree keeps the release's module paths with Flax's leaf names
(``layers_{i}.attn.wq_b.kernel`` ``[q_lora_rank, heads, head_dim]``, ``attn.wo_a.kernel`` as
MaxText's ``o_a_proj``, ``attn_norm.scale``, experts stacked at axis 0 in
``ffn.experts.w1.kernel``), the hyper-connection tensors, the sinks, the positional biases and
the routing tables as stored.

The multi-token-prediction tensors (``mtp.``) are left out (``Mapping.ignore``), as
transformers leaves them out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings._config import config_value
from orbax_safetensors.mappings._quantized import quantized_mapping
from orbax_safetensors.planning.assembly import Constant
from orbax_safetensors.planning.rules import ConfigSize, Mapping, Rule, Strided

_LINEAR = {"transpose": (1, 0)}
# Every layer's tensors: (release name after "layers.{i}.", MaxText's, the Flax-style tree's, transform).
_EVERY_LAYER = (
    ("attn.wq_a.weight", "self_attention.wq_a.kernel", "attn.wq_a.kernel", _LINEAR),
    ("attn.wq_b.weight", "self_attention.wq_b.kernel", "attn.wq_b.kernel", {**_LINEAR, "split": {1: ("heads", "head_dim")}}),
    ("attn.wkv.weight", "self_attention.wkv.kernel", "attn.wkv.kernel", {**_LINEAR, "split": {1: ("kv_heads", "head_dim")}}),
    ("attn.q_norm.weight", "self_attention.q_norm.scale", "attn.q_norm.scale", {}),
    ("attn.kv_norm.weight", "self_attention.kv_norm.scale", "attn.kv_norm.scale", {}),
    ("attn.attn_sink", "self_attention.sinks", "attn.attn_sink", {}),
    ("attn.wo_a.weight", "self_attention.o_a_proj.kernel", "attn.wo_a.kernel",
     {"split": {0: ("o_groups", "o_lora_rank")}, "transpose_after": (0, 2, 1)}),
    ("attn.wo_b.weight", "self_attention.o_b_proj.kernel", "attn.wo_b.kernel", _LINEAR),
    ("attn_norm.weight", "pre_self_attention_layer_norm.scale", "attn_norm.scale", {}),
    ("ffn_norm.weight", "post_self_attention_layer_norm.scale", "ffn_norm.scale", {}),
    ("ffn.gate.weight", "mlp.MoeBlock_0.gate.kernel", "ffn.gate.kernel", _LINEAR),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.wi_0.kernel", "ffn.shared_experts.w1.kernel", _LINEAR),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.wi_1.kernel", "ffn.shared_experts.w3.kernel", _LINEAR),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.wo.kernel", "ffn.shared_experts.w2.kernel", _LINEAR),
)
_EXPERTS = (("w1", "wi_0"), ("w3", "wi_1"), ("w2", "wo"))
# A compressor's tensors: (release name after "compressor.", MaxText's, transform).
_COMPRESSOR = (("wgate.weight", "gate_proj.kernel", _LINEAR), ("wkv.weight", "kv_proj.kernel", _LINEAR),
               ("norm.weight", "kv_norm.scale", {}), ("ape", "position_bias", {}))
# The CSA indexer's own projections: (release name after "attn.indexer.", MaxText's after "indexer.").
_INDEXER = (("weights_proj.weight", "weights_proj.kernel"), ("wq_b.weight", "q_proj.kernel"))
_MHC = (("hc_attn", "mhc_attention"), ("hc_ffn", "mhc_mlp"))
CSA, HCA = "csa", "hca"


@dataclasses.dataclass(frozen=True)
class _Model:
    """What places a layer's tensors: its attention (``None``: a sliding window alone), which
    layers route by table, and the sizes the rules split by."""

    attention: tuple[str | None, ...]  # per layer: CSA, HCA or None
    hash_layers: int
    streams: int  # hc_mult
    hidden: int
    dims: dict[str, int]

    @property
    def layers(self) -> int:
        return len(self.attention)

    def where(self, kind: str | None) -> frozenset[int]:
        """The layers whose attention is ``kind``."""
        return frozenset(i for i, a in enumerate(self.attention) if a == kind)


def _model(config: Any, where: str) -> _Model:
    """The layers' kinds and sizes ``config`` gives (transformers' ``layer_types``,
    ``compress_rates`` and ``mlp_layer_types``, or the release's ``compress_ratios`` and
    ``num_hash_layers``)."""
    if config is None:
        raise ArgumentError(f"{where}: config is None; pass the checkpoint's Hugging Face config (its layer "
                            "types, hc_mult and attention sizes place and split each layer's tensors)")
    keys = ("num_hidden_layers", "hidden_size", "hc_mult", "num_attention_heads", "head_dim", "o_groups",
            "o_lora_rank")
    sizes = {key: config_value(config, key) for key in keys}
    missing = [key for key, value in sizes.items() if value is None]
    if missing:
        raise ArgumentError(f"{where}: the config has no {', '.join(missing)}")
    layers = int(sizes["num_hidden_layers"])
    ratios = config_value(config, "compress_ratios")
    if ratios is None:
        types, rates = config_value(config, "layer_types"), config_value(config, "compress_rates", {})
        if types is None:
            raise ArgumentError(f"{where}: the config has neither layer_types nor compress_ratios, which say "
                                "each layer's attention")
        ratios = [0 if kind == "sliding_attention" else rates.get(kind) for kind in types]
        if None in ratios:
            raise ArgumentError(f"{where}: layer_types {types} name kinds compress_rates {rates} has no rate for")
    if len(ratios) < layers:
        raise ArgumentError(f"{where}: {len(ratios)} layers' attention given for {layers} layers")
    # MaxText's converter: ratio 4 is compressed sparse attention, a larger one heavily compressed.
    attention = tuple(None if r == 0 else CSA if r == 4 else HCA for r in ratios[:layers])
    hashed = config_value(config, "num_hash_layers")
    if hashed is None:
        kinds = config_value(config, "mlp_layer_types")
        if kinds is None:
            raise ArgumentError(f"{where}: the config has neither mlp_layer_types nor num_hash_layers, which say "
                                "the layers that route by token table")
        hashed = next((i for i, kind in enumerate(kinds) if kind != "hash_moe"), len(kinds))
        if "hash_moe" in kinds[hashed:]:
            raise ArgumentError(f"{where}: mlp_layer_types {list(kinds)}: the hash-routed layers come first")
    dims = {"heads": int(sizes["num_attention_heads"]), "head_dim": int(sizes["head_dim"]),
            "kv_heads": int(config_value(config, "num_key_value_heads", 1)), "o_groups": int(sizes["o_groups"]),
            "o_lora_rank": int(sizes["o_lora_rank"])}
    return _Model(attention, int(hashed), int(sizes["hc_mult"]), int(sizes["hidden_size"]), dims)


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where some layers go in the tree: ``tree`` the prefix of their leaves, ``layers`` which,
    ``stacked`` how (``None``: one leaf per layer, ``{i}`` in ``tree``; else ``(Strided, axis)``,
    the layers stacked at ``axis`` of one leaf)."""

    tree: str
    layers: frozenset[int]
    stacked: tuple[Strided, int] | None = None

    def rule(self, stored: str, tree: str, *, of: frozenset[int] | None = None, axis: int | None = None,
             experts: bool = False, **transform: Any) -> list[Rule]:
        """The rule of ``stored`` (after ``layers.{i}.``) ↔ ``tree`` (after the prefix) for
        this place's layers among ``of``; none where there are none. ``axis``: the stack axis,
        where it is not this place's."""
        layers = self.layers if of is None else self.layers & of
        if not layers:
            return []
        stack = {"e": 0} if experts else {}
        if self.stacked is None:
            return [Rule(f"layers.{{i}}.{stored}", f"{self.tree}{tree}", stack=stack, only={"i": layers},
                         **transform)]
        if layers != self.layers:
            raise ArgumentError(f"{self.tree}: MaxText stacks these layers, which are not all alike")
        strided, scan_axis = self.stacked
        return [Rule(f"layers.{{i}}.{stored}", f"{self.tree}{tree}", stack={**stack, "i": scan_axis if axis is None
                                                                             else axis},
                     strided={"i": strided}, **transform)]

    def shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """A leaf of ``shape`` per layer: its prefix (``{i}`` filled) → its shape, stacked."""
        if self.stacked is None:
            return {self.tree.format(i=i): shape for i in sorted(self.layers)}
        return {self.tree: shape[:self.stacked[1]] + (len(self.layers),) + shape[self.stacked[1]:]}


def _places(model: _Model, scan_layers: bool, where: str) -> list[_Place]:
    """MaxText's places of the layers: ``decoder.layers_{i}``, or, scanned, the hash-routed
    layers there and the rest in two scanned blocks, HCA then CSA."""
    every = frozenset(range(model.layers))
    if not scan_layers:
        return [_Place("decoder.layers_{i}.", every)]
    first = model.hash_layers
    blocks = [(HCA, frozenset(range(first, model.layers, 2))), (CSA, frozenset(range(first + 1, model.layers, 2)))]
    wrong = [i for kind, layers in blocks for i in layers if model.attention[i] != kind]
    if wrong or len(blocks[0][1]) != len(blocks[1][1]):
        raise ArgumentError(f"{where}, scan_layers=True: MaxText scans the layers after the {first} hash-routed "
                            f"ones in pairs, heavily compressed then compressed sparse attention; this config's "
                            f"are {list(model.attention[first:])}: scan_layers=False maps them")
    return [_Place("decoder.layers_{i}.", frozenset(range(first))),
            *(_Place(f"decoder.scanned_blocks.layers_{b}.", layers, (Strided(None, 2, start=first + b), 1))
              for b, (_, layers) in enumerate(blocks))]


def _mhc_rules(place: _Place, module: str, tree: str, streams: int, scanned: bool, dtype: Any) -> list[Rule]:
    """MaxText's mHC leaves of one module from its three stored tensors, slice by slice."""
    width = (2 + streams) * streams
    alpha_axis = 2 if scanned else 1  # after the layers' axis where they are stacked
    rules = []
    for index, (part, slices) in enumerate((("pre", (0,)), ("post", (1,)), ("res", tuple(range(2, 2 + streams))))):
        rules += place.rule(f"{module}_fn", f"{tree}.{part}_alpha", transpose=(1, 0), concat={alpha_axis: (width,)},
                            order=tuple((0, j) for j in slices), chunk=streams, dtype=dtype)
        rules += place.rule(f"{module}_base", f"{tree}.{part}_beta", concat={0: (width,)},
                            order=tuple((0, j) for j in slices), chunk=(1, streams) if part == "res" else streams,
                            dtype=dtype)  # res_beta [k, k]: its slices as rows
        rules += place.rule(f"{module}_scale", f"{tree}.{part}_alpha_scale", concat={0: (3,)}, order=((0, index),),
                            chunk=1, dtype=dtype)
    return rules


def _maxtext_rules(model: _Model, places: list[_Place], dtype: Any) -> tuple[list[Rule], dict[str, Constant]]:
    linear = {**_LINEAR, "dtype": dtype}
    rules = [Rule("embed.weight", "token_embedder.embedding", dtype=dtype),
             Rule("norm.weight", "decoder.decoder_norm.scale", dtype=dtype),
             Rule("head.weight", "decoder.logits_dense.kernel", **linear),
             Rule("hc_head_fn", "decoder.hc_head.hc_fn", **linear),
             Rule("hc_head_base", "decoder.hc_head.hc_base", dtype=dtype),
             Rule("hc_head_scale", "decoder.hc_head.hc_scale", dtype=dtype)]
    constants: dict[str, Constant] = {}
    hashed = frozenset(range(model.hash_layers))
    for place in places:
        scanned = place.stacked is not None
        for stored, tree, _, transform in _EVERY_LAYER:
            rules += place.rule(stored, tree, **transform, dtype=dtype)
        for stored, tree in _EXPERTS:
            rules += place.rule(f"ffn.experts.{{e}}.{stored}.weight", f"mlp.MoeBlock_0.{tree}", experts=True, **linear)
        rules += place.rule("ffn.gate.tid2eid", "mlp.MoeBlock_0.tid2eid", of=hashed, dtype="int64")
        rules += place.rule("ffn.gate.bias", "mlp.MoeBlock_0.gate.bias", of=frozenset(range(model.hash_layers,
                                                                                             model.layers)),
                            axis=0, dtype=dtype)  # MoEBiasVar: nn.scan stacks it at axis 0
        for kind in (CSA, HCA):
            for stored, tree, transform in _COMPRESSOR:
                rules += place.rule(f"attn.compressor.{stored}", f"self_attention.{kind}_compressor.{tree}",
                                    of=model.where(kind), **transform, dtype=dtype)
        for stored, tree, transform in _COMPRESSOR:
            rules += place.rule(f"attn.indexer.compressor.{stored}", f"self_attention.csa_compressor.indexer.{tree}",
                                of=model.where(CSA), **transform, dtype=dtype)
        for stored, tree in _INDEXER:
            rules += place.rule(f"attn.indexer.{stored}", f"self_attention.csa_compressor.indexer.{tree}",
                                of=model.where(CSA), **linear)
        for module, tree in _MHC:
            rules += _mhc_rules(place, module, tree, model.streams, scanned, dtype)
            for prefix, shape in place.shapes((model.streams * model.hidden,)).items():
                constants[f"{prefix}{tree}.mhc_norm.scale"] = Constant(shape, 1.0)
    return rules, constants


def _leaf(stored: str, leaf: str) -> str:
    """A stored ``.weight``'s Flax leaf name (``.kernel``, ``.scale``); another name as it is."""
    return stored.removesuffix(".weight") + leaf if stored.endswith(".weight") else stored


def _flax_rules(dtype: Any) -> list[Rule]:
    """The Flax-style tree: the release's paths, Flax's leaf names, the rest as stored."""
    linear = {**_LINEAR, "dtype": dtype}
    rules = [Rule("embed.weight", "embed.embedding", dtype=dtype), Rule("norm.weight", "norm.scale", dtype=dtype),
             Rule("head.weight", "head.kernel", **linear)]
    rules += [Rule(f"hc_head_{part}", f"hc_head_{part}", dtype=dtype) for part in ("fn", "base", "scale")]
    every = [(stored, flax, transform) for stored, _, flax, transform in _EVERY_LAYER]
    every += [(f"{c}compressor.{stored}", f"{c}compressor.{_leaf(stored, '.kernel' if t else '.scale')}", t)
              for c in ("attn.", "attn.indexer.") for stored, _, t in _COMPRESSOR]
    every += [(f"attn.indexer.{stored}", f"attn.indexer.{_leaf(stored, '.kernel')}", _LINEAR) for stored, _ in _INDEXER]
    every += [(stored, stored, {}) for stored in ("ffn.gate.bias", "ffn.gate.tid2eid")]
    every += [(f"{module}_{part}", f"{module}_{part}", {}) for module, _ in _MHC for part in ("fn", "base", "scale")]
    for stored, flax, transform in every:
        rules.append(Rule(f"layers.{{i}}.{stored}", f"layers_{{i}}.{flax}", **transform,
                          dtype="int64" if stored.endswith("tid2eid") else dtype))
    rules += [Rule(f"layers.{{i}}.ffn.experts.{{e}}.{stored}.weight", f"layers_{{i}}.ffn.experts.{stored}.kernel",
                   stack={"e": 0}, **linear) for stored, _ in _EXPERTS]
    return rules


def _sizes(config: Any, model: _Model) -> list[ConfigSize]:
    """What the config says the release holds: layers, vocabulary, hidden size, experts."""
    sizes = [ConfigSize("num_hidden_layers", model.layers, "layers.{i}."),
             ConfigSize("hidden_size", model.hidden, "embed.weight", 1)]
    for field, stored, axis in (("vocab_size", "embed.weight", 0), ("n_routed_experts", "layers.{i}.ffn.gate.weight", 0),
                                ("moe_intermediate_size", "layers.{i}.ffn.experts.{e}.w1.weight", 0)):
        value = config_value(config, field)
        if isinstance(value, int):
            sizes.append(ConfigSize(field, value, stored, axis))
    return sizes


_NAMES = ("release", "transformers")


def _renamed(names: str, where: str) -> Callable[[str], str]:
    """The stored name of a release's name in the form ``names`` says."""
    if names not in _NAMES:
        raise ArgumentError(f"{where}: names={names!r}; one of {', '.join(map(repr, _NAMES))}")
    if names == "release":
        return lambda name: name

    def transformers_name(name: str) -> str:  # save_pretrained's: its renames on load, undone as it undoes them
        if name == "embed.weight":
            return "model.embed_tokens.weight"
        if name.startswith("hc_head_"):
            return "model.hc_head.hc_" + name.removeprefix("hc_head_")
        if name == "head.weight":
            return name
        return "model." + name.replace(".attn.kv_norm.", ".attn.norm.")

    return transformers_name


def _mapping(rules: list[Rule], config: Any, model: _Model, names: str, where: str, dequantize: bool,
             **mapping: Any) -> Mapping:
    rename = _renamed(names, where)
    renamed = [dataclasses.replace(rule, stored=rename(rule.stored)) for rule in rules]
    sizes = [dataclasses.replace(size, stored=rename(size.stored)) for size in _sizes(config, model)]
    return quantized_mapping(renamed, config, dequantize=dequantize, dims=model.dims, sizes=sizes,
                             ignore=(rename("mtp."),), **mapping)


def deepseek_v4(config: Any = None, *, scan_layers: bool = False, dtype: Any = None, dequantize: bool = True,
                names: str = "release") -> Mapping:
    """``DeepseekV4ForCausalLM`` (DeepSeek-V4) ↔ ``mappings.deepseek_v4``'s Flax-style tree,
    unscanned. ``config`` pins the head sizes; ``names``: the stored names' form, the
    release's or ``"transformers"`` (what its ``save_pretrained`` writes)."""
    where = "ost.mappings.deepseek_v4"
    if scan_layers:
        raise ArgumentError(f"{where}: scan_layers=True has no Flax-style tree; maxtext('deepseek4', config, "
                            "scan_layers=True) maps MaxText's scanned one")
    return _mapping(_flax_rules(dtype), config, _model(config, where), names, where, dequantize)


def maxtext_deepseek4(config: Any, scan_layers: bool, *, dtype: Any, dequantize: bool,
                      names: str = "release") -> Mapping:
    """HF DeepSeek-V4 ↔ MaxText's ``deepseek4-284b`` tree, for ``mappings.maxtext``."""
    where = "maxtext('deepseek4')"
    model = _model(config, where)
    rules, constants = _maxtext_rules(model, _places(model, scan_layers, where), dtype)
    return _mapping(rules, config, model, names, where, dequantize, checkpoint_form="maxtext", constants=constants)
