"""Leaves DeepSeek-V4's MaxText tree makes of its release, in small, through the public API.

* ``transpose_after``: ``wo_a`` ``[G * r, X]`` is MaxText's ``o_a_proj`` ``[G, X, r]``, an axis
  order no transpose before the split gives;
* ``order``ed rules that leave slices to other leaves: ``hc_attn_fn`` ``[(2 + k) * k, k * D]``
  is MaxText's ``pre_alpha``, ``post_alpha`` and ``res_alpha`` (its first, second and last ``k``
  slices), ``hc_attn_base`` ``[(2 + k) * k]`` its ``pre_beta``, ``post_beta`` and ``res_beta``
  (``[k, k]``: slices shaped ``(1, k)``), each saved back from all three;
* ``Constant``: MaxText's ``mhc_norm`` scale, ones, which the release has no tensor for.

Each is loaded into a sharded target and saved back byte for byte. The box arithmetic of
``transpose_after`` is in the property tests of ``tests/planning/test_mapping.py`` (its
``transforms`` strategy draws a ``tree_perm``).
"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.errors import ArgumentError, MappingError

G, R, X, LAYERS = 4, 6, 8, 2  # output groups, their rank, the input width, layers
K, D = 4, 8  # hyper-connection streams, hidden size
WO_A = ost.Rule("l.{i}.wo_a", "o_a_proj", split={0: (G, R)}, transpose_after=(0, 2, 1), stack={"i": 1})
HC = [ost.Rule("l.hc_fn", "pre_alpha", transpose=(1, 0), split={1: (2 + K, K)}, take={1: 0}),
      ost.Rule("l.hc_fn", "post_alpha", transpose=(1, 0), split={1: (2 + K, K)}, take={1: 1}),
      ost.Rule("l.hc_fn", "res_alpha", transpose=(1, 0), concat={1: ((2 + K) * K,)},
               order=tuple((0, 2 + j) for j in range(K)), chunk=K),
      *(ost.Rule("l.hc_base", f"{part}_beta", concat={0: ((2 + K) * K,)}, order=((0, j),), chunk=K)
        for j, part in enumerate(("pre", "post"))),
      ost.Rule("l.hc_base", "res_beta", concat={0: ((2 + K) * K,)}, order=tuple((0, 2 + j) for j in range(K)),
               chunk=(1, K))]


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))


def _round_trip(tmp_path, stored, target, mapping):
    """The stored tensors loaded into ``target``, and saved back: the same bytes."""
    ost.save(str(tmp_path / "in"), stored)
    tree = ost.load(str(tmp_path / "in"), target, mapping=mapping)
    ost.save(str(tmp_path / "out"), tree, mapping=mapping)
    back = ost.load(str(tmp_path / "out"))
    assert set(back) == set(stored)
    for name, value in stored.items():
        assert np.asarray(back[name]).tobytes() == value.tobytes(), name
    return tree


@pytest.mark.parametrize("spec", [P(), P("a", None, "b", "c"), P(None, "a", "b"), P("b", None, "a", "c")])
def test_a_split_then_transposed_leaf_loads_sharded_and_saves_back(tmp_path, spec):
    rng = np.random.default_rng(0)
    stored = {f"l.{i}.wo_a": rng.standard_normal((G * R, X)).astype(np.float32) for i in range(LAYERS)}
    target = {"o_a_proj": jax.ShapeDtypeStruct((G, LAYERS, X, R), np.float32,
                                               sharding=NamedSharding(_mesh(), spec))}
    tree = _round_trip(tmp_path, stored, target, ost.Mapping([WO_A]))
    want = np.stack([stored[f"l.{i}.wo_a"].reshape(G, R, X).transpose(0, 2, 1) for i in range(LAYERS)], 1)
    np.testing.assert_array_equal(np.asarray(tree["o_a_proj"]), want)
    assert tree["o_a_proj"].sharding == target["o_a_proj"].sharding


def test_transpose_after_resolves_from_either_side_and_is_checked():
    rule = ost.Rule("wo_a", "o", split={0: (G, R)}, transpose_after=(0, 2, 1))
    assert rule.resolve(stored_shape=(G * R, X)) == rule.resolve(tree_shape=(G, X, R))
    assert rule.resolve(stored_shape=(G * R, X)).tree_shape == (G, X, R)
    with pytest.raises(MappingError, match=r"split 0: declared sizes \(4, 6\) .* do not match the shape's \(4, 8\)"):
        rule.resolve(stored_shape=(G * R, X), tree_shape=(G, R, X))  # (G, R, X) before it is (G, X, R)
    with pytest.raises(MappingError, match="transpose_after .* does not fit the tree shape"):
        rule.resolve(tree_shape=(G * R, X))
    with pytest.raises(MappingError, match=r"transpose_after \(0, 2, 2\) is not a permutation"):
        ost.Rule("wo_a", "o", split={0: (G, R)}, transpose_after=(0, 2, 2))


def test_an_order_leaving_slices_to_other_leaves_loads_and_saves_back_from_all_of_them(tmp_path):
    rng = np.random.default_rng(1)
    fn = rng.standard_normal(((2 + K) * K, K * D)).astype(np.float32)
    base = rng.standard_normal(((2 + K) * K,)).astype(np.float32)
    sharded = NamedSharding(_mesh(), P(("a", "b"), "c"))
    target = {"pre_alpha": jax.ShapeDtypeStruct((K * D, K), np.float32, sharding=sharded),
              "post_alpha": jax.ShapeDtypeStruct((K * D, K), np.float32, sharding=sharded),
              "res_alpha": jax.ShapeDtypeStruct((K * D, K * K), np.float32, sharding=sharded),
              "pre_beta": jax.ShapeDtypeStruct((K,), np.float32),
              "post_beta": jax.ShapeDtypeStruct((K,), np.float32, sharding=NamedSharding(_mesh(), P("a"))),
              "res_beta": jax.ShapeDtypeStruct((K, K), np.float32, sharding=NamedSharding(_mesh(), P("b", "c")))}
    tree = _round_trip(tmp_path, {"l.hc_fn": fn, "l.hc_base": base}, target, ost.Mapping(HC))
    np.testing.assert_array_equal(np.asarray(tree["pre_alpha"]), fn.T[:, :K])
    np.testing.assert_array_equal(np.asarray(tree["post_alpha"]), fn.T[:, K:2 * K])
    np.testing.assert_array_equal(np.asarray(tree["res_alpha"]), fn.T[:, 2 * K:])
    np.testing.assert_array_equal(np.asarray(tree["pre_beta"]), base[:K])
    np.testing.assert_array_equal(np.asarray(tree["post_beta"]), base[K:2 * K])
    np.testing.assert_array_equal(np.asarray(tree["res_beta"]), base[2 * K:].reshape(K, K))
    # Without a target, the leaves' shapes come from the stored one's.
    assert {n: v.shape for n, v in ost.load(str(tmp_path / "in"), mapping=ost.Mapping(HC)).items()} == {
        n: t.shape for n, t in target.items()}
    with pytest.raises(MappingError, match=r"'l.hc_fn' cannot be written: no tree leaf holds its part\(s\) "
                                           r"index 2 of axis 1"):
        ost.save(str(tmp_path / "partial"), {n: tree[n] for n in ("pre_alpha", "post_alpha")},
                 mapping=ost.Mapping(HC[:3]))


def test_an_ordered_concat_size_that_is_not_whole_slices_is_refused():
    rule = ost.Rule("l.hc_fn", "res", transpose=(1, 0), concat={1: (10,)}, order=((0, 1),), chunk=4)
    with pytest.raises(MappingError, match="concat size 10 is not a multiple of the chunk 4"):
        ost.Mapping([rule]).assembly("res", tree_shape=(8, 4))


NORM = "mhc_norm.scale"


def _constant_mapping():
    return ost.Mapping([ost.Rule("w", "kernel")], constants={NORM: ost.Constant((K * D,), 1.0)})


def test_a_constant_leaf_loads_sharded_without_a_tensor_and_a_save_writes_none(tmp_path):
    stored = {"w": np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)}
    target = {"kernel": jax.ShapeDtypeStruct((4, 8), np.float32),
              NORM: jax.ShapeDtypeStruct((K * D,), np.float32, sharding=NamedSharding(_mesh(), P(("a", "b")))),}
    tree = _round_trip(tmp_path, stored, target, _constant_mapping())
    np.testing.assert_array_equal(np.asarray(tree[NORM]), np.ones(K * D, np.float32))
    assert tree[NORM].sharding == target[NORM].sharding
    untargeted = ost.load(str(tmp_path / "in"), mapping=_constant_mapping())
    assert {n: (v.shape, v.dtype) for n, v in untargeted.items()} == {
        "kernel": ((4, 8), np.float32), NORM: ((K * D,), np.float32)}
    with pytest.raises(ost.SafetensorsError, match=r"a constant of shape \(32,\), not \(16,\)"):
        ost.load(str(tmp_path / "in"), {**target, NORM: jax.ShapeDtypeStruct((16,), np.float32)},
                 mapping=_constant_mapping())


def test_a_save_of_a_constant_leaf_holding_other_values_is_refused_and_writes_nothing(tmp_path):
    tree = {"kernel": np.zeros((4, 8), np.float32), NORM: np.full(K * D, 2.0, np.float32)}
    with pytest.raises(ArgumentError, match=f"tree leaf '{NORM}' is a constant of the mapping"):
        ost.save(str(tmp_path / "out"), tree, mapping=_constant_mapping())
    assert not (tmp_path / "out").exists()


def test_a_conversion_writes_the_constant_leaf_and_converts_back_without_it(tmp_path):
    stored = {"w": np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)}
    ost.save(str(tmp_path / "hf"), stored)
    ost.convert(str(tmp_path / "hf"), str(tmp_path / "tree"), mapping=_constant_mapping())
    ost.convert(str(tmp_path / "tree"), str(tmp_path / "back"), mapping=_constant_mapping())
    back = ost.load(str(tmp_path / "back"))
    assert set(back) == {"w"} and np.asarray(back["w"]).tobytes() == stored["w"].tobytes()


def test_only_limits_a_rule_to_some_layers_on_both_sides():
    csa = ost.Rule("layers.{i}.attn.compressor.wkv.weight", "layers_{i}.csa_compressor.kv_proj.kernel",
                   transpose=(1, 0), only={"i": (2, 4)})
    hca = ost.Rule("layers.{i}.attn.compressor.wkv.weight", "layers_{i}.hca_compressor.kv_proj.kernel",
                   transpose=(1, 0), only={"i": [3]})
    mapping = ost.Mapping([csa, hca])
    assert [mapping.tree_name(f"layers.{i}.attn.compressor.wkv.weight") for i in (2, 3, 4)] == [
        "layers_2.csa_compressor.kv_proj.kernel", "layers_3.hca_compressor.kv_proj.kernel",
        "layers_4.csa_compressor.kv_proj.kernel"]
    assert mapping.stored_name("layers_3.hca_compressor.kv_proj.kernel") == "layers.3.attn.compressor.wkv.weight"
    assert mapping.unmapped(["layers.0.attn.compressor.wkv.weight", "layers.02.attn.compressor.wkv.weight"],
                            "stored") == ["layers.0.attn.compressor.wkv.weight", "layers.02.attn.compressor.wkv.weight"]
    assert mapping.unmapped(["layers_3.csa_compressor.kv_proj.kernel"]) == ["layers_3.csa_compressor.kv_proj.kernel"]
    with pytest.raises(MappingError, match="only .* must name placeholders both sides have"):
        ost.Rule("layers.{i}.w", "stack.w", stack={"i": 0}, only={"i": (1,)})
