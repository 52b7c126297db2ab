"""Many stored tensors ↔ one leaf: stacked layers and experts, fused projections, value
transforms, applied per shard both ways.

The checkpoint is a tiny Hugging Face style state dict (per-layer, per-expert
tensors); the tree is MaxText style (layers stacked at axis 1, experts at
axis 1 after layers at 0, query scaled, RoPE halves interleaved). Expected
values are built with plain numpy, independently of the mapping code. Every
sharded load must read exactly the bytes its devices hold (layer-, row-,
column- and expert-sharded, one process and two), and a save from the
sharded tree must give back the very file it was loaded from.
"""

import dataclasses
import math
import os
from fractions import Fraction

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from tests.support.trees import flat, nest
from orbax_safetensors.errors import MappingError
from orbax_safetensors.planning.rules import Mapping, Rule, Strided
from orbax_safetensors.planning.transforms import halves_to_interleaved

L, D, H, K, HD, F, E, V = 8, 8, 4, 2, 4, 16, 4, 16
SCALE = 0.25  # a power of two: float32 values round-trip bit for bit


def _stored(dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    values = {"embed.weight": rng.standard_normal((V, D))}
    for i in range(L):
        values[f"layers.{i}.q.weight"] = rng.standard_normal((H * HD, D))
        values[f"layers.{i}.k.weight"] = rng.standard_normal((K * HD, D))
        values[f"layers.{i}.norm.weight"] = rng.standard_normal(D)
        for e in range(E):
            values[f"layers.{i}.experts.{e}.w1.weight"] = rng.standard_normal((F, D))
    return {name: value.astype(dtype) for name, value in values.items()}


def _mapping(scale: float = SCALE, dtype=None) -> Mapping:
    heads = {"transpose": (1, 0), "split": {1: (-1, "head_dim")}, "permute": {-1: "halves_to_interleaved"},
             "stack": {"i": 1}, "dtype": dtype}
    return Mapping([
        Rule("embed.weight", "embed.embedding", dtype=dtype),
        Rule("layers.{i}.q.weight", "layers.q.kernel", scale=scale, **heads),
        Rule("layers.{i}.k.weight", "layers.k.kernel", **heads),
        Rule("layers.{i}.norm.weight", "layers.norm.scale", stack={"i": 1}, dtype=dtype),
        Rule("layers.{i}.experts.{e}.w1.weight", "layers.experts.w1.kernel", transpose=(1, 0),
             stack={"i": 0, "e": 1}, dtype=dtype),
    ], dims={"head_dim": HD})


def _interleave(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.stack([x[..., :half], x[..., half:]], -1).reshape(x.shape)


def _expected(stored: dict[str, np.ndarray], scale: float = SCALE) -> dict[str, np.ndarray]:
    """The tree by hand: what MaxText's converter computes, in float32."""
    f32 = {n: v.astype(np.float32) for n, v in stored.items()}

    def heads(name, n, factor=None):
        per_layer = [_interleave(f32[f"layers.{i}.{name}.weight"].T.reshape(D, n, HD)) for i in range(L)]
        stacked = np.stack(per_layer, axis=1)
        return stacked if factor is None else stacked * np.float32(factor)

    return {
        "embed.embedding": f32["embed.weight"],
        "layers.q.kernel": heads("q", H, scale),
        "layers.k.kernel": heads("k", K),
        "layers.norm.scale": np.stack([f32[f"layers.{i}.norm.weight"] for i in range(L)], axis=1),
        "layers.experts.w1.kernel": np.stack([np.stack(
            [f32[f"layers.{i}.experts.{e}.w1.weight"].T for e in range(E)]) for i in range(L)]),
    }


SPECS = {  # leaf → PartitionSpec, per case; mesh ("a", "b") = (2, 4)
    "layer": {"layers.q.kernel": P(None, ("a", "b")), "layers.k.kernel": P(None, ("a", "b")),
              "layers.norm.scale": P(None, ("a", "b")), "layers.experts.w1.kernel": P(("a", "b"))},
    "row": {"layers.q.kernel": P(("a", "b")), "layers.k.kernel": P("a"), "layers.norm.scale": P("b"),
            "layers.experts.w1.kernel": P(None, None, ("a", "b")), "embed.embedding": P("a")},
    "column": {"layers.q.kernel": P(None, None, "b"), "layers.k.kernel": P(None, "b", "a"),
               "layers.experts.w1.kernel": P(None, None, None, ("a", "b")), "embed.embedding": P(None, "b")},
    "expert": {"layers.experts.w1.kernel": P("a", "b"), "layers.q.kernel": P("b", "a")},
}


def _target(case: str, dtype=np.float32) -> dict:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    shapes = {name: value.shape for name, value in _expected(_stored()).items()}
    return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, SPECS[case].get(name, P())))
            for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("stacked") / "hf")
    ost.save(path, _stored())
    return path


# --- planning: the assembly of a leaf -----------------------------------------------------


def test_a_stacked_leaf_is_one_piece_per_layer_in_place():
    assembly = _mapping().assembly("layers.q.kernel", tree_shape=(D, L, H, HD))
    assert [p.stored for p in assembly.pieces] == [f"layers.{i}.q.weight" for i in range(L)]
    assert assembly.pieces[3].region == ((0, D), (3, 4), (0, H), (0, HD))
    assert assembly.pieces[3].stacked == (1,)
    assert assembly.pieces[3].transform.stored_shape == (H * HD, D)
    assert assembly.transform is None
    # a device holding rows 2..4 of layers 2..5 meets layers 2..5, each a column strip
    assert assembly.pieces[1].part(((2, 4), (2, 6), (0, H), (0, HD))) is None
    inside, own = assembly.pieces[3].part(((2, 4), (2, 6), (0, H), (0, HD)))
    assert inside == ((2, 4), (3, 4), (0, H), (0, HD)) and own == ((2, 4), (0, H), (0, HD))
    assert assembly.pieces[3].transform.stored_box(own) == ((0, H * HD), (2, 4))


def test_experts_stack_under_layers_and_counts_come_from_the_names():
    names = {f"layers.{i}.experts.{e}.w1.weight": (F, D) for i in range(3) for e in range(5)}
    assembly = _mapping().assembly("layers.experts.w1.kernel", stored_shapes=names)
    assert assembly.shape == (3, 5, D, F)
    assert assembly.pieces[7].stored == "layers.1.experts.2.w1.weight"
    assert assembly.pieces[7].region == ((1, 2), (2, 3), (0, D), (0, F))
    assert _mapping().tree_name("layers.2.experts.4.w1.weight") == "layers.experts.w1.kernel"
    del names["layers.1.experts.3.w1.weight"]
    with pytest.raises(MappingError, match="'layers.1.experts.3.w1.weight' is missing"):
        _mapping().assembly("layers.experts.w1.kernel", stored_shapes=names)
    gap = {f"layers.{i}.norm.weight": (D,) for i in (0, 1, 3)}
    with pytest.raises(MappingError, match=r"\['0', '1', '3'\], not 0..n-1"):
        _mapping().assembly("layers.norm.scale", stored_shapes=gap)
    with pytest.raises(MappingError, match="several stored tensors"):
        _mapping().stored_name("layers.norm.scale")
    shapes = {name: value.shape for name, value in _stored().items()}
    assert _mapping().tree_shapes(shapes) == {name: value.shape for name, value in _expected(_stored()).items()}
    with pytest.raises(MappingError, match="no single rule maps the stored names: extra"):
        _mapping().tree_shapes({**shapes, "extra": (1,)})


def test_stack_axes_follow_their_numbers_not_the_order_they_are_written_in():
    written_backwards = Mapping([Rule("l.{i}.e.{e}.w", "l.w", stack={"e": 1, "i": 0})])
    names = {f"l.{i}.e.{e}.w": (D,) for i in range(2) for e in range(3)}
    assert written_backwards.tree_shapes(names) == {"l.w": (2, 3, D)}
    assert written_backwards.assembly("l.w", stored_shapes=names).pieces[4].stored == "l.1.e.1.w"


def test_rules_are_checked_when_written():
    with pytest.raises(MappingError, match="same placeholders"):
        Rule("layers.{i}.w", "layers.w")  # {i} neither in the tree nor stacked
    with pytest.raises(MappingError, match="same placeholders"):
        Rule("layers.{i}.w", "layers_{i}.w", stack={"i": 0})
    with pytest.raises(MappingError, match="need concat"):
        Rule(("a.{i}", "b.{i}"), "ab.{i}")
    with pytest.raises(MappingError, match="unknown permutation"):
        Rule("a", "a", permute={0: "reversed"})
    with pytest.raises(MappingError, match="no inverse"):
        Rule("a", "a", scale=0.0)
    with pytest.raises(MappingError, match="odd size"):
        Rule("a", "a", permute={0: "halves_to_interleaved"}).resolve(stored_shape=(5,))


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_permuted_scaled_boxes_read_and_write_exactly_their_values(data):
    half = data.draw(st.integers(1, 4))
    rows = data.draw(st.integers(1, 5))
    rule = Rule("w", "w", transpose=(1, 0), permute={1: "halves_to_interleaved"}, scale=0.5)
    stored = np.arange(2 * half * rows, dtype=np.float32).reshape(2 * half, rows)
    transform = rule.resolve(stored_shape=stored.shape)
    whole = transform.apply(stored)
    np.testing.assert_array_equal(whole, _interleave(stored.T) * np.float32(0.5))
    box = tuple((a, b) for n in whole.shape for a in [data.draw(st.integers(0, n - 1))]
                for b in [data.draw(st.integers(a + 1, n))])
    slices = tuple(slice(a, b) for a, b in box)
    stored_box = transform.stored_box(box)
    read = stored[tuple(slice(a, b) for a, b in stored_box)]
    np.testing.assert_array_equal(transform.to_tree(read, stored_box, box), whole[slices])
    rebuilt = np.full(stored.shape, np.nan, np.float32)
    for piece_box, values in transform.to_stored(box, whole[slices]):
        target = rebuilt[tuple(slice(a, b) for a, b in piece_box)]
        assert np.isnan(target).all()  # the pieces do not overlap
        rebuilt[tuple(slice(a, b) for a, b in piece_box)] = values
    held = ~np.isnan(rebuilt)
    np.testing.assert_array_equal(rebuilt[held], stored[held])
    assert held.sum() == np.prod([b - a for a, b in box])  # every value of the shard, once
    assert halves_to_interleaved(4) == (0, 2, 1, 3)


# --- load and save through the engine ------------------------------------------------------


@pytest.mark.parametrize("case", sorted(SPECS))
def test_sharded_load_reads_exactly_each_devices_layers_rows_columns_or_experts(checkpoint, case):
    stats = ost.LoadStats()
    loaded = ost.load(checkpoint, nest(_target(case)), mapping=_mapping(), stats=stats,
                      options=ost.LoadOptions(max_gap=0, max_overread=1.0))
    expected = _expected(_stored())
    for name, leaf in flat(loaded).items():
        assert leaf.sharding == _target(case)[name].sharding
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[name][shard.index], err_msg=name)
    assert stats.bytes_read == stats.bytes_needed
    assert stats.tensors == len(_stored())  # one read job per stored tensor


def test_save_from_shards_gives_back_the_same_file(checkpoint, tmp_path):
    loaded = ost.load(checkpoint, nest(_target("layer")), mapping=_mapping())
    ost.save(str(tmp_path / "out"), loaded, mapping=_mapping())
    with open(os.path.join(checkpoint, "model.safetensors"), "rb") as a, \
            open(tmp_path / "out" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def test_bfloat16_checkpoint_round_trips_through_a_float32_tree_and_an_inexact_scale(tmp_path):
    """1/sqrt(12) is no power of two: float32 products are rounded, yet each bfloat16
    value is the nearest one to its round trip, so the file comes back bit for bit."""
    scale = float(1 / np.sqrt(12))
    stored = _stored(ml_dtypes.bfloat16)
    ost.save(str(tmp_path / "bf16"), stored)
    mapping = _mapping(scale, dtype="bfloat16")
    loaded = ost.load(str(tmp_path / "bf16"), nest(_target("row")), mapping=mapping)
    expected = _expected(stored, scale)
    for name, leaf in flat(loaded).items():
        assert leaf.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(leaf), expected[name], err_msg=name)
    ost.save(str(tmp_path / "back"), loaded, mapping=mapping)
    with open(tmp_path / "bf16" / "model.safetensors", "rb") as a, \
            open(tmp_path / "back" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def test_load_without_a_target_stacks_what_the_checkpoint_holds(checkpoint):
    loaded = ost.load(checkpoint, mapping=_mapping())
    expected = _expected(_stored())
    assert sorted(loaded) == sorted(expected)
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_a_target_with_more_layers_than_the_checkpoint_names_what_is_missing(checkpoint):
    target = {"layers": {"norm": {"scale": jax.ShapeDtypeStruct((D, L + 1), np.float32)}}}
    with pytest.raises(ost.SafetensorsError, match=f"missing from the checkpoint: layers.{L}.norm.weight"):
        ost.load(checkpoint, target, mapping=_mapping())
    stats = ost.LoadStats()
    with pytest.warns(ost.SkippedLeavesWarning):
        partial = ost.load(checkpoint, target, mapping=_mapping(), strict=False, stats=stats)
    assert partial["layers"]["norm"]["scale"] is None and stats.skipped == ["layers.norm.scale"]


def test_fused_projections_concatenate_per_shard_both_ways(checkpoint, tmp_path):
    fused = Mapping([
        Rule(("layers.{i}.q.weight", "layers.{i}.k.weight"), "layers_{i}.qk.kernel", transpose=(1, 0),
             split={1: (-1, HD)}, concat={1: ("heads", "kv_heads")}),
        Rule("layers.{i}.norm.weight", "layers_{i}.norm.scale"),
        Rule("layers.{i}.experts.{e}.w1.weight", "layers_{i}.w1.kernel", transpose=(1, 0), stack={"e": 0}),
        Rule("embed.weight", "embed.embedding"),
    ], dims={"heads": H, "kv_heads": K})
    stored = _stored()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    target = {}
    for i in range(L):
        target[f"layers_{i}.qk.kernel"] = jax.ShapeDtypeStruct(  # heads over "b" cut q and k apart
            (D, H + K, HD), np.float32, sharding=NamedSharding(mesh, P("a", None, "b")))
        target[f"layers_{i}.norm.scale"] = jax.ShapeDtypeStruct((D,), np.float32)
        target[f"layers_{i}.w1.kernel"] = jax.ShapeDtypeStruct((E, D, F), np.float32,
                                                              sharding=NamedSharding(mesh, P("b", "a")))
    target["embed.embedding"] = jax.ShapeDtypeStruct((V, D), np.float32)
    stats = ost.LoadStats()
    loaded = flat(ost.load(checkpoint, nest(target), mapping=fused, stats=stats,
                            options=ost.LoadOptions(max_gap=0, max_overread=1.0)))
    assert stats.bytes_read == stats.bytes_needed
    for i in range(L):
        qk = np.concatenate([stored[f"layers.{i}.q.weight"].T.reshape(D, H, HD),
                             stored[f"layers.{i}.k.weight"].T.reshape(D, K, HD)], axis=1)
        np.testing.assert_array_equal(np.asarray(loaded[f"layers_{i}.qk.kernel"]), qk)
    untargeted = ost.load(checkpoint, mapping=fused)
    assert untargeted["layers_0.qk.kernel"].shape == (D, H + K, HD)  # sizes from the stored shapes
    ost.save(str(tmp_path / "fused"), nest(loaded), mapping=fused)
    with open(os.path.join(checkpoint, "model.safetensors"), "rb") as a, \
            open(tmp_path / "fused" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


# --- strided stacks (every 6th layer in one leaf) and offsets (Gemma's 1 + w) -------------------

N = 13  # two 6-layer patterns and one layer left over


def _strided() -> Mapping:
    """Gemma 3 in MaxText: layer 6n + k at index n of blocks.layers_{k}, layer 12 left over."""
    scanned = 6 * (N // 6)
    return Mapping([
        Rule("layers.{i}.norm.weight", "blocks.layers_{k}.norm.scale", stack={"i": 1}, offset=1.0,
             strided={"i": Strided("k", 6, stop=scanned)}),
        Rule("layers.{i}.norm.weight", "remainder.layers_{k}.norm.scale", offset=1.0,
             strided={"i": Strided("k", 6, start=scanned, stop=N)}),
        Rule("layers.{i}.experts.{e}.w1.weight", "blocks.layers_{k}.w1.kernel", transpose=(1, 0),
             stack={"e": 0, "i": 1}, strided={"i": Strided("k", 6, stop=scanned)}),
        Rule("layers.{i}.experts.{e}.w1.weight", "remainder.layers_{k}.w1.kernel", transpose=(1, 0),
             stack={"e": 0}, strided={"i": Strided("k", 6, start=scanned, stop=N)}),
    ])


def test_every_sixth_layer_stacks_into_one_leaf_and_the_rest_into_a_remainder():
    mapping = _strided()
    assembly = mapping.assembly("blocks.layers_2.norm.scale", tree_shape=(D, 2))
    assert [p.stored for p in assembly.pieces] == ["layers.2.norm.weight", "layers.8.norm.weight"]
    assert assembly.pieces[1].region == ((0, D), (1, 2))
    experts = mapping.assembly("blocks.layers_5.w1.kernel", tree_shape=(E, 2, D, F)).pieces
    assert experts[2 * 1 + 1].stored == "layers.11.experts.1.w1.weight"  # expert 1, n = 1
    assert mapping.stored_name("remainder.layers_0.norm.scale") == "layers.12.norm.weight"
    assert [mapping.tree_name(f"layers.{i}.norm.weight") for i in (0, 7, 11, 12)] == [
        "blocks.layers_0.norm.scale", "blocks.layers_1.norm.scale", "blocks.layers_5.norm.scale",
        "remainder.layers_0.norm.scale"]
    # Out of range on either side: no rule, never a neighbour's.
    assert mapping.unmapped(["layers.13.norm.weight", "layers.012.norm.weight"], "stored") == [
        "layers.13.norm.weight", "layers.012.norm.weight"]
    assert mapping.unmapped(["blocks.layers_6.norm.scale", "remainder.layers_1.norm.scale",
                             "blocks.layers_5.norm.scale"]) == ["blocks.layers_6.norm.scale",
                                                                "remainder.layers_1.norm.scale"]
    names = {f"layers.{i}.norm.weight": (D,) for i in range(N)}
    shapes = mapping.tree_shapes(names)
    assert shapes == {**{f"blocks.layers_{k}.norm.scale": (D, 2) for k in range(6)},
                      "remainder.layers_0.norm.scale": (D,)}
    del names["layers.9.norm.weight"]
    with pytest.raises(MappingError, match=r"\['0'\], not 0..n-1 \(n = 2\)"):
        mapping.assembly("blocks.layers_3.norm.scale", stored_shapes=names)


def test_strided_rules_are_checked_when_written():
    with pytest.raises(MappingError, match="same placeholders"):  # {k} is not in the tree
        Rule("layers.{i}.w", "blocks.w", stack={"i": 1}, strided={"i": Strided("k", 6)})
    with pytest.raises(MappingError, match="same placeholders"):  # {k} also on the stored side
        Rule("layers.{i}.{k}.w", "blocks.layers_{k}.w", stack={"i": 1}, strided={"i": Strided("k", 6)})
    with pytest.raises(MappingError, match="step >= 1"):
        Strided("k", 0)
    with pytest.raises(MappingError, match="no inverse"):
        Rule("a", "a", offset=float("inf"))


def test_strided_stacks_and_offsets_load_and_save_back_the_same_file(tmp_path):
    rng = np.random.default_rng(1)
    stored = {f"layers.{i}.norm.weight": rng.standard_normal(D).astype(ml_dtypes.bfloat16) for i in range(N)}
    stored.update({f"layers.{i}.experts.{e}.w1.weight": rng.standard_normal((F, D)).astype(ml_dtypes.bfloat16)
                   for i in range(N) for e in range(E)})
    ost.save(str(tmp_path / "hf"), stored)
    mapping = _strided()
    loaded = ost.load(str(tmp_path / "hf"), mapping=mapping)
    f32 = {n: v.astype(np.float32) for n, v in stored.items()}
    np.testing.assert_array_equal(loaded["blocks.layers_4.norm.scale"],
                                  np.stack([f32["layers.4.norm.weight"], f32["layers.10.norm.weight"]], 1) + 1)
    np.testing.assert_array_equal(loaded["blocks.layers_4.w1.kernel"][3, 1], f32["layers.10.experts.3.w1.weight"].T)
    np.testing.assert_array_equal(loaded["remainder.layers_0.w1.kernel"][2], f32["layers.12.experts.2.w1.weight"].T)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    layers_axis = {"norm.scale": 1, "w1.kernel": 1}  # each device one of the 2 blocks (n over "a")
    target = {n: jax.ShapeDtypeStruct(v.shape, np.float32, sharding=NamedSharding(mesh, P(
        *[None] * layers_axis[n.split(".", 2)[2]], "a") if n.startswith("blocks") else P()))
        for n, v in loaded.items()}
    sharded = ost.load(str(tmp_path / "hf"), nest(target), mapping=mapping)
    for name, leaf in flat(sharded).items():
        np.testing.assert_array_equal(np.asarray(leaf), loaded[name], err_msg=name)
    ost.save(str(tmp_path / "back"), sharded, mapping=_strided_saving_bfloat16())
    with open(tmp_path / "hf" / "model.safetensors", "rb") as a, open(tmp_path / "back" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def _strided_saving_bfloat16() -> Mapping:
    return Mapping([dataclasses.replace(rule, dtype=np.dtype(ml_dtypes.bfloat16)) for rule in _strided().rules])


@pytest.mark.parametrize("dtype, smallest", [(ml_dtypes.bfloat16, 2.0**-16), (np.float16, 2.0**-13)])
def test_plus_one_in_float32_gives_back_each_16_bit_value_where_planning_transforms_says(dtype, smallest):
    """Every bfloat16 (float16) value through ``w + 1`` in float32 and back: exact wherever
    ``w + 1`` is exact in float32, and for every ``|w| >= smallest``; a smaller ``w`` loses its
    bits below 2**-24, ``-0.0`` comes back ``+0.0``, a NaN a NaN."""
    transform = Rule("w", "w", offset=1.0, dtype=dtype).resolve(stored_shape=(1 << 16,))
    w = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    with np.errstate(invalid="ignore"):  # NaNs
        tree = transform.to_tree(w, ((0, 1 << 16),), ((0, 1 << 16),))
        [(_, back)] = transform.to_stored(((0, 1 << 16),), tree)
        wide = w.astype(np.float64)
        plus_one = w.astype(np.float32) + np.float32(1)
    assert tree.dtype == np.float32
    finite = np.isfinite(wide)
    np.testing.assert_array_equal(tree[finite], plus_one[finite])
    same = back.view(np.uint16) == w.view(np.uint16)
    negative_zero = (wide == 0) & np.signbit(wide)
    exact = np.array([math.isfinite(a) and Fraction(float(b)) == Fraction(a) + 1 for a, b in zip(wide, plus_one)])
    assert same[exact & ~negative_zero].all() and same[np.isinf(wide)].all()
    assert np.isnan(back[np.isnan(wide)].astype(np.float32)).all()
    assert same[finite & (np.abs(wide) >= smallest)].all()
    assert not same[finite & (np.abs(wide) < smallest) & ~exact].any()  # the rest all move
    assert not same[negative_zero].any() and (back[negative_zero] == 0).all()


def test_maxtext_gemma3_and_mistral_trees():
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 2560,
              "num_hidden_layers": 14, "tie_word_embeddings": True}
    mapping = ost.mappings.maxtext("gemma3-4b", config)
    assert mapping.tree_name("model.layers.13.pre_feedforward_layernorm.weight") == \
        "decoder.layers_remainder.layers_1.pre_ffw_norm.scale"
    assert mapping.tree_name("model.layers.9.self_attn.q_norm.weight") == \
        "decoder.layers.layers_3.self_attention.query_norm.scale"
    assert mapping.transform("decoder.decoder_norm.scale", stored_shape=(2560,)).offset == 1.0
    assert mapping.transform("token_embedder.embedding", stored_shape=(8, 2560)).scale == 50.5  # bfloat16(sqrt(2560))
    assert mapping.unmapped(["lm_head.weight"], "stored") == ["lm_head.weight"]  # tied
    unscanned = ost.mappings.maxtext("gemma3", config, scan_layers=False)
    assert unscanned.tree_name("model.layers.13.mlp.down_proj.weight") == "decoder.layers_13.mlp.wo.kernel"
    multimodal = ost.mappings.maxtext("gemma3-4b", {"text_config": config, "vision_config": {}})
    assert multimodal.tree_name("model.language_model.layers.6.mlp.up_proj.weight") == \
        "decoder.layers.layers_0.mlp.wi_1.kernel"
    with pytest.raises(ost.ArgumentError, match="num_hidden_layers"):
        ost.mappings.maxtext("gemma3", {k: v for k, v in config.items() if k != "num_hidden_layers"})
    mistral = ost.mappings.maxtext("mistral-7b", {**config, "tie_word_embeddings": False})
    q = mistral.assembly("decoder.layers.self_attention.query.kernel", tree_shape=(2560, 14, 4, 16))
    assert q.pieces[0].transform.scale == 0.25 and not q.pieces[0].transform.permutes  # rotate-half
    assert mistral.tree_name("model.layers.3.input_layernorm.weight") == \
        "decoder.layers.pre_self_attention_layer_norm.scale"


# --- two processes ----------------------------------------------------------------------------


def _child_layers_per_process(args):
    """Each of 2 processes holds half the layers (and experts); it reads only those and
    writes only those rows back."""
    stats = ost.LoadStats()
    target = nest(_target(args["case"]))
    loaded = ost.load(args["path"], target, mapping=_mapping(), stats=stats,  # each reads embed whole
                      options=ost.LoadOptions(max_gap=0, max_overread=1.0, replicated_read_once=False))
    expected = _expected(_stored())
    for name, leaf in flat(loaded).items():
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[name][shard.index], err_msg=name)
    save_stats = ost.save(args["out"], loaded, mapping=_mapping())
    # Without what completes checksum blocks (tests/engine/test_checksums_load.py bounds that).
    return {"bytes_read": stats.bytes_read - stats.checksum_overread, "bytes_needed": stats.bytes_needed,
            "bytes_written": save_stats.bytes_written}


@pytest.mark.parametrize("case", sorted(SPECS))
def test_two_processes_read_their_own_layers_and_write_their_own_rows(multiprocess, checkpoint, tmp_path, case):
    out = str(tmp_path / "out")
    results = multiprocess("tests.planning.test_stacked_mapping:_child_layers_per_process", num_processes=2,
                           args={"path": checkpoint, "out": out, "case": case})
    replicated = _stored()["embed.weight"].nbytes  # embed is P() in "layer": both read it
    stacked = sum(v.nbytes for v in _stored().values()) - replicated
    values = [r.value for r in results]
    for value in values:
        assert value["bytes_read"] == value["bytes_needed"]
    if case == "layer":
        assert [v["bytes_needed"] for v in values] == [stacked // 2 + replicated] * 2
    assert sum(v["bytes_written"] for v in values) == stacked + replicated  # each byte once
    with open(os.path.join(checkpoint, "model.safetensors"), "rb") as a, \
            open(os.path.join(out, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()


def test_ignored_stored_names_are_left_out(tmp_path):
    """DeepSeek-V3 stores a multi-token-prediction layer after its last layer; a mapping that
    ``ignore``s it stacks the real layers only, and no load calls it unmapped or unexpected."""
    layers = {f"model.layers.{i}.w": np.full((2, 3), i, np.float32) for i in range(3)}
    layers["model.layers.2.eh_proj"] = np.zeros((2, 2), np.float32)  # only the MTP layer has it
    ost.save(tmp_path / "ckpt", layers)
    mapping = ost.Mapping([ost.Rule("model.layers.{i}.w", "layers.w", stack={"i": 0})], ignore=("model.layers.2.",))
    assert mapping.tree_shapes({n: t.shape for n, t in ost.metadata(tmp_path / "ckpt").tensors.items()}) == {
        "layers.w": (2, 2, 3)}
    loaded = ost.load(tmp_path / "ckpt", mapping=mapping)
    np.testing.assert_array_equal(loaded["layers.w"], np.stack([layers["model.layers.0.w"], layers["model.layers.1.w"]]))
    strict = ost.load(tmp_path / "ckpt", {"layers.w": np.zeros((2, 2, 3), np.float32)}, mapping=mapping, strict=True)
    np.testing.assert_array_equal(strict["layers.w"], loaded["layers.w"])
    with pytest.raises(ost.SafetensorsError, match="no single rule maps the stored names: model.layers.2.eh_proj"):
        ost.load(tmp_path / "ckpt", mapping=ost.Mapping(mapping.rules))
