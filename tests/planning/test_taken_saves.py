"""Saves through rules that ``take``: one stored tensor written from all the leaves that take
a part of it, each leaf's values put back at its index of the taken axis.

The property tests check the inverse against numpy: the stored boxes every piece's shards
become tile the stored tensor exactly once and hold its values, and a stored box asked of
each piece (a streamed conversion) is covered by what those pieces give for it. Then the
planning: ``map_specs`` plans one stored tensor from the leaves, refuses a save that lacks a
part, and an ``order``ed rule (Qwen3.5's ``in_proj_qkvz``) saves back its stored tensors,
sharded over 8 devices. gpt-oss's MaxText tree, saved and converted back byte for byte, is
``tests/families/test_gpt_oss_mapping.py``.
"""

import dataclasses
import itertools
import math

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.errors import MappingError
from orbax_safetensors.planning import TensorSpec
from orbax_safetensors.planning.rules import Mapping, Rule
from orbax_safetensors.format import dtype_for_numpy
from tests.planning.test_mapping import _SETTINGS, _slices, box_in, transforms


def _pieces(data):
    """A transform, a taken axis of its reshaped piece, and one piece per index of it (the axes
    left in some order, or as they are)."""
    t = dataclasses.replace(data.draw(transforms()), tree_perm=())
    reshaped = t.tree_shape
    axis = data.draw(st.integers(0, len(reshaped) - 1))
    order = data.draw(st.one_of(st.just(()), st.permutations(range(len(reshaped) - 1))))
    return t, [dataclasses.replace(t, takes=((axis, k),), tree_perm=tuple(order)) for k in range(reshaped[axis])]


def _tiles(data, shape):
    ranges = []
    for size in shape:
        parts = data.draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
        ranges.append([(k * (size // parts), (k + 1) * (size // parts)) for k in range(parts)])
    return list(itertools.product(*ranges))


@_SETTINGS
@given(st.data())
def test_the_pieces_shards_tile_the_stored_tensor_once_with_its_values(data):
    t, pieces = _pieces(data)
    stored = np.arange(math.prod(t.stored_shape)).reshape(t.stored_shape)
    written = np.zeros(t.stored_shape, int)
    out = np.full(t.stored_shape, -1)
    for piece in pieces:
        tree = piece.apply(stored)
        for box in _tiles(data, piece.tree_shape):
            for stored_box, values in piece.to_stored(box, tree[_slices(box)]):
                written[_slices(stored_box)] += 1
                out[_slices(stored_box)] = values
    assert (written == 1).all()
    np.testing.assert_array_equal(out, stored)


@_SETTINGS
@given(st.data())
def test_a_stored_box_is_covered_by_what_each_piece_gives_for_it(data):
    t, pieces = _pieces(data)
    stored = np.arange(math.prod(t.stored_shape)).reshape(t.stored_shape)
    block = data.draw(box_in(t.stored_shape))
    out = np.full(t.stored_shape, -1)
    for piece in pieces:
        own = piece.tree_box(block)
        if own is None:
            continue
        for stored_box, values in piece.to_stored(own, piece.apply(stored)[_slices(own)]):
            out[_slices(stored_box)] = values
    np.testing.assert_array_equal(out[_slices(block)], stored[_slices(block)])


def test_a_piece_holds_none_of_a_box_of_other_pieces_indices():
    t = Rule("gu", "wi", split={2: (-1, 2)}, take={3: 1}).resolve(tree_shape=(3, 4, 5))
    assert t.stored_shape == (3, 4, 10)
    assert t.tree_box(((0, 3), (0, 4), (2, 3))) is None  # an even column: the other piece's
    assert t.tree_box(((0, 3), (1, 2), (2, 7))) == ((0, 3), (1, 2), (1, 4))


def test_a_taking_rule_resolves_from_the_tree_shape_where_the_taken_size_is_declared():
    for rule, stored, tree in ((Rule("gu", "wi", split={2: (-1, 2)}, take={3: 1}), (3, 4, 10), (3, 4, 5)),
                               (Rule("gu", "wi", split={2: (2, -1)}, take={2: 0}), (3, 4, 10), (3, 4, 5)),
                               (Rule("gu", "wi", split={0: ("two", -1)}, take={0: 1}), (8, 3), (4, 3))):
        assert rule.resolve(tree_shape=tree, dims={"two": 2}) == rule.resolve(stored_shape=stored, dims={"two": 2})
    with pytest.raises(MappingError, match="the taken axis's size is not declared"):
        Rule("gu", "wi", split={0: ("two", -1)}, take={0: 1}).resolve(tree_shape=(4, 3))


GATE_UP = [Rule("l.{i}.gu", "l_{i}.wi_0", split={1: (-1, 2)}, take={2: 0}),
           Rule("l.{i}.gu", "l_{i}.wi_1", split={1: (-1, 2)}, take={2: 1})]


def _spec(name, shape, dtype=np.float32):
    return TensorSpec(name, dtype_for_numpy(np.dtype(dtype)), shape)


def test_the_leaves_that_take_parts_plan_one_stored_tensor():
    stored, _ = Mapping(GATE_UP).map_specs([_spec("l_0.wi_0", (4, 3)), _spec("l_0.wi_1", (4, 3))])
    assert stored == [_spec("l.0.gu", (4, 6))]


def test_a_save_lacking_a_part_or_giving_one_twice_is_refused():
    with pytest.raises(MappingError, match=r"'l.0.gu' cannot be written: no tree leaf holds its part\(s\) "
                                           r"index 1 of axis 2"):
        Mapping(GATE_UP).map_specs([_spec("l_0.wi_0", (4, 3)), _spec("l_1.wi_0", (4, 3)), _spec("l_1.wi_1", (4, 3))])
    twice = Mapping([*GATE_UP, Rule("l.{i}.gu", "l_{i}.again", split={1: (-1, 2)}, take={2: 0})])
    with pytest.raises(MappingError, match="both map to 'l.0.gu'"):
        twice.map_specs([_spec("l_0.wi_0", (4, 3)), _spec("l_0.again", (4, 3)), _spec("l_0.wi_1", (4, 3))])
    with pytest.raises(MappingError, match="both map to 'l.0.gu'"):  # the parts of tensors of two shapes
        Mapping(GATE_UP).map_specs([_spec("l_0.wi_0", (4, 3)), _spec("l_0.wi_1", (4, 2))])


def test_an_ordered_rule_saves_back_its_stored_tensors_from_a_sharded_leaf(tmp_path):
    """Qwen3.5's ``in_proj_qkvz`` in small: per key head, its slices of ``qkv`` and of ``z``."""
    rule = Rule(("l.{i}.qkv", "l.{i}.z"), "l.qkvz", stack={"i": 0}, transpose=(1, 0), concat={2: (8, 4)},
                order=((0, 0), (0, 1), (1, 0), (0, 2), (0, 3), (1, 1)), chunk=2)
    rng = np.random.default_rng(0)
    stored = {f"l.{i}.{n}": rng.standard_normal(shape).astype(np.float32)
              for i in range(2) for n, shape in (("qkv", (8, 4)), ("z", (4, 4)))}
    ost.save(str(tmp_path / "in"), stored)
    mapping = Mapping([rule])
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    target = {"l": {"qkvz": jax.ShapeDtypeStruct((2, 4, 12), np.float32,
                                                  sharding=NamedSharding(mesh, P("a", None, "b")))}}
    tree = ost.load(str(tmp_path / "in"), target, mapping=mapping)
    qkvz = np.asarray(tree["l"]["qkvz"])
    np.testing.assert_array_equal(qkvz[1][:, 4:6], stored["l.1.z"].T[:, :2])
    ost.save(str(tmp_path / "out"), tree, mapping=mapping)
    back = ost.load(str(tmp_path / "out"))
    assert set(back) == set(stored)
    for name, value in stored.items():
        np.testing.assert_array_equal(np.asarray(back[name]), value, err_msg=name)
