"""Name mappings and arrangement transforms: pure rules and boxes (hypothesis), then load/save.

The property tests check the box algebra against numpy itself: reading the
stored box a transform asks for and transforming it must equal slicing the
transformed array, and the stored pieces a tree shard becomes must tile
exactly the stored elements that shard holds. The engine tests check that a
mapped load on 8 devices reads each device's stored box once (no
whole-tensor reads), and that a mapped save writes the stored arrangement.
"""

import itertools
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.engine import open_checkpoint
from orbax_safetensors.engine.loading.jobs import sharded_job
from orbax_safetensors.engine.loading.options import ReadPolicy
from orbax_safetensors.storage import Location
from orbax_safetensors.planning import ReadProfile, box_size, normalize_index
from orbax_safetensors.errors import MappingError
from orbax_safetensors.planning.rules import Mapping, Rule
from orbax_safetensors.planning.transforms import Transform

_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None)

Q = Rule("layers.{i}.q.weight", "layers_{i}.q.kernel", transpose=(1, 0), split={1: ("heads", "head_dim")})
O = Rule("layers.{i}.o.weight", "layers_{i}.o.kernel", transpose=(1, 0), split={0: ("heads", "head_dim")})
W = Rule("layers.{i}.w.weight", "layers_{i}.w.kernel", transpose=(1, 0))


def _slices(box):
    return tuple(slice(a, b) for a, b in box)


# --- names -------------------------------------------------------------------------------


def test_names_map_both_ways():
    m = Mapping([Q, O, W, Rule("embed.weight", "embed.embedding")])
    assert m.stored_name("layers_12.q.kernel") == "layers.12.q.weight"
    assert m.tree_name("layers.3.o.weight") == "layers_3.o.kernel"
    assert m.tree_name("embed.weight") == "embed.embedding"
    assert m.stored_rule("layers_0.w.kernel") == ("layers.0.w.weight", W)


def test_placeholders_match_one_segment_and_literals_are_literal():
    m = Mapping([Rule("a.{x}.b", "a_{x}.b")])
    with pytest.raises(MappingError, match="no rule maps the stored name 'a.1.2.b'"):
        m.tree_name("a.1.2.b")
    with pytest.raises(MappingError, match="no rule"):
        m.tree_name("aX1.b")  # the '.' is not a regex wildcard
    assert m.unmapped(["a.1.b", "a.1.2.b", "c"], "stored") == ["a.1.2.b", "c"]


def test_ambiguous_names_are_errors():
    m = Mapping([Rule("{a}.weight", "{a}.kernel"), Rule("lm_head.weight", "lm_head.kernel")])
    with pytest.raises(MappingError, match="'lm_head.weight' is mapped by several rules: '{a}.weight'"):
        m.tree_name("lm_head.weight")
    assert m.tree_name("other.weight") == "other.kernel"


def test_bad_rules_are_rejected_on_construction():
    with pytest.raises(MappingError, match="same placeholders"):
        Rule("a.{i}", "a.{j}")
    with pytest.raises(MappingError, match="repeats"):
        Rule("a.{i}.{i}", "b.{i}")
    with pytest.raises(MappingError, match="not a permutation"):
        Rule("a", "b", transpose=(0, 0))
    with pytest.raises(MappingError, match="use axes >= 0"):
        Rule("a", "b", split={-1: (2, 2)})
    with pytest.raises(MappingError, match="overlap"):
        Rule("a", "b", split={0: (2, 2)}, merge={0: (2, 2)})


# --- shapes --------------------------------------------------------------------------------


def test_shapes_resolve_from_either_side_and_are_checked():
    t = Q.resolve(stored_shape=(32, 16), dims={"heads": 4})
    assert t.tree_shape == (16, 4, 8) and t.stored_shape == (32, 16)
    assert Q.resolve(tree_shape=(16, 4, 8)) == t
    assert O.resolve(tree_shape=(4, 8, 16)).stored_shape == (16, 32)
    assert Q.resolve(stored_shape=(32, 16), tree_shape=(16, 4, 8), dims={"heads": 4}) == t
    with pytest.raises(MappingError, match="cannot infer"):
        Q.resolve(stored_shape=(32, 16))  # heads and head_dim both unknown
    with pytest.raises(MappingError, match=r"declared sizes .* do not match the shape's \(2, 16\)"):
        Q.resolve(stored_shape=(32, 16), tree_shape=(16, 2, 16), dims={"heads": 4})
    with pytest.raises(MappingError, match=r"sizes \(4, 4\) do not multiply to 32"):
        Q.resolve(stored_shape=(32, 16), tree_shape=(16, 4, 4))
    with pytest.raises(MappingError, match=r"maps to \(16, 4, 8\), not the tree's \(8, 4, 8\)"):
        Q.resolve(stored_shape=(32, 16), tree_shape=(8, 4, 8))
    with pytest.raises(MappingError, match="does not fit stored shape"):
        W.resolve(stored_shape=(2, 3, 4))
    merge = Rule("a", "b", transpose=(2, 0, 1), merge={1: (-1, 5)})
    t = merge.resolve(stored_shape=(3, 5, 7))
    assert t.tree_shape == (7, 15) and merge.resolve(tree_shape=(7, 15)).stored_shape == (3, 5, 7)


def test_map_specs_renames_and_reshapes_and_rejects_collisions():
    from orbax_safetensors.format import dtype_for_numpy
    from orbax_safetensors.planning import TensorSpec

    f32 = dtype_for_numpy(np.dtype(np.float32))
    m = Mapping([Q, O], dims={"heads": 4})
    specs, transforms = m.map_specs([TensorSpec("layers_0.q.kernel", f32, (16, 4, 8)),
                                     TensorSpec("layers_0.o.kernel", f32, (4, 8, 16))])
    assert [(s.name, s.shape) for s in specs] == [("layers.0.q.weight", (32, 16)), ("layers.0.o.weight", (16, 32))]
    assert [p.stored for p in transforms["layers_0.q.kernel"].pieces] == ["layers.0.q.weight"]
    with pytest.raises(MappingError, match="no rule maps the tree name 'x'.*unmapped or ambiguous: x, y"):
        m.map_specs([TensorSpec("x", f32, (1,)), TensorSpec("y", f32, (1,))])
    clash = Mapping([Rule("w", "a"), Rule("w", "b")])
    with pytest.raises(MappingError, match="both map to 'w'"):
        clash.map_specs([TensorSpec("a", f32, (1,)), TensorSpec("b", f32, (1,))])


# --- boxes: the Llama cases by hand --------------------------------------------------------


def test_head_sharded_attention_boxes_are_exact():
    q = Q.resolve(tree_shape=(16, 4, 8))  # stored (32, 16)
    assert q.stored_box(((0, 16), (1, 2), (0, 8))) == ((8, 16), (0, 16))  # head 1: rows 8..16
    assert q.stored_box(((4, 8), (0, 4), (0, 8))) == ((0, 32), (4, 8))  # hidden-sharded: columns
    o = O.resolve(tree_shape=(4, 8, 16))  # stored (16, 32)
    assert o.stored_box(((2, 4), (0, 8), (0, 16))) == ((0, 16), (16, 32))
    # head_dim sharded: the enclosing whole heads' rows, cut after reshaping
    assert q.stored_box(((0, 16), (0, 4), (0, 4))) == ((0, 32), (0, 16))
    assert q.stored_box(((0, 16), (2, 3), (4, 8))) == ((20, 24), (0, 16))


def test_save_pieces_of_a_head_dim_shard_are_split_per_head():
    q = Q.resolve(tree_shape=(16, 4, 8))
    stored = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
    tree = q.apply(stored)
    box = ((0, 16), (1, 3), (2, 6))
    pieces = q.to_stored(box, tree[_slices(box)])
    assert [b for b, _ in pieces] == [((10, 14), (0, 16)), ((18, 22), (0, 16))]
    for b, data in pieces:
        np.testing.assert_array_equal(data, stored[_slices(b)])
        assert data.flags.c_contiguous


# --- boxes: properties ---------------------------------------------------------------------


@st.composite
def transforms(draw) -> Transform:
    """Random transpose + split/merge groups over 1-4 stored axes, then the tree piece's axes
    in some order (``tree_perm``) or as they are."""
    groups, count = [], 0
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["same", "split", "merge"]))
        sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=2, max_size=3)))
        if kind == "same":
            groups.append(((sizes[0],), (sizes[0],)))
            count += 1
        elif kind == "split":
            groups.append(((math.prod(sizes),), sizes))
            count += 1
        else:
            groups.append((sizes, (math.prod(sizes),)))
            count += len(sizes)
    perm = tuple(draw(st.permutations(range(count))))
    tree_axes = sum(len(tree) for _, tree in groups)
    return Transform(perm, tuple(groups), tree_perm=tuple(draw(st.one_of(
        st.just(()), st.permutations(range(tree_axes))))))


@st.composite
def box_in(draw, shape):
    box = []
    for size in shape:
        start = draw(st.integers(0, size - 1))
        box.append((start, draw(st.integers(start + 1, size))))
    return tuple(box)


@st.composite
def transform_and_tiles(draw):
    """A transform and the tree boxes of an even sharding (some axes split, some not)."""
    t = draw(transforms())
    ranges = []
    for size in t.tree_shape:
        parts = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
        step = size // parts
        ranges.append([(k * step, (k + 1) * step) for k in range(parts)])
    return t, list(itertools.product(*ranges))


@_SETTINGS
@given(st.data())
def test_read_mapped_box_then_transform_equals_slicing_the_tree_value(data):
    t = data.draw(transforms())
    stored = np.arange(math.prod(t.stored_shape)).reshape(t.stored_shape)
    tree = t.apply(stored)
    assert tree.shape == t.tree_shape
    box = data.draw(box_in(t.tree_shape))
    read = t.stored_box(box)
    assert box_size(read) >= box_size(box)
    np.testing.assert_array_equal(t.to_tree(stored[_slices(read)], read, box), tree[_slices(box)])


@_SETTINGS
@given(transform_and_tiles())
def test_sharded_reads_are_exact_unless_an_inner_axis_is_cut(case):
    t, tiles = case
    stored = np.arange(math.prod(t.stored_shape)).reshape(t.stored_shape)
    tree = t.apply(stored)
    for box in tiles:
        read = t.stored_box(box)
        np.testing.assert_array_equal(t.to_tree(stored[_slices(read)], read, box), tree[_slices(box)])
        # exact iff, in every split/merge group, the box is one contiguous flat range
        # that is also one box of the other side: check by counting the elements
        flat = np.zeros(stored.size, bool)
        flat[t.apply(np.arange(stored.size).reshape(t.stored_shape))[_slices(box)].ravel()] = True
        covered = np.zeros(t.stored_shape, bool)
        covered[_slices(read)] = True
        holds_exactly = np.array_equal(covered.ravel(), flat)
        assert (box_size(read) == box_size(box)) == holds_exactly


@_SETTINGS
@given(st.data())
def test_save_pieces_tile_exactly_the_stored_elements_of_a_shard(data):
    t = data.draw(transforms())
    stored = np.arange(math.prod(t.stored_shape)).reshape(t.stored_shape)
    tree = t.apply(stored)
    box = data.draw(box_in(t.tree_shape))
    count = np.zeros(t.stored_shape, int)
    for piece_box, piece in t.to_stored(box, tree[_slices(box)]):
        assert piece.flags.c_contiguous and piece.shape == tuple(b - a for a, b in piece_box)
        np.testing.assert_array_equal(piece, stored[_slices(piece_box)])
        count[_slices(piece_box)] += 1
    expected = np.zeros(stored.size, int)
    expected[tree[_slices(box)].ravel()] = 1
    np.testing.assert_array_equal(count.ravel(), expected)


# --- engine: load and save through a mapping, 8 devices -----------------------------------

HEADS, HEAD_DIM, HIDDEN, OUT = 8, 4, 16, 24


def _stored_values():
    rng = np.random.default_rng(0)
    return {
        "layers.0.q.weight": rng.standard_normal((HEADS * HEAD_DIM, HIDDEN), np.float32),
        "layers.0.o.weight": rng.standard_normal((HIDDEN, HEADS * HEAD_DIM), np.float32),
        "layers.0.w.weight": rng.standard_normal((OUT, HIDDEN * 2), np.float32),
    }


def _mapping():
    return Mapping([Q, O, W], dims={"heads": HEADS})


def _target(specs, mesh=None):
    mesh = mesh or Mesh(np.array(jax.devices()[:8]), ("x",))
    shapes = {"q": (HIDDEN, HEADS, HEAD_DIM), "o": (HEADS, HEAD_DIM, HIDDEN), "w": (HIDDEN * 2, OUT)}
    return {"layers_0": {
        k: {"kernel": jax.ShapeDtypeStruct(shapes[k], np.float32, sharding=NamedSharding(mesh, specs[k]))}
        for k in shapes}}


CASES = {
    # Flax kernel sharded by output column: stored rows, contiguous
    "column": {"q": P(None, "x", None), "o": P(None, None, "x"), "w": P(None, "x")},
    # by input row: stored columns, strided
    "row": {"q": P("x", None, None), "o": P("x", None, None), "w": P("x", None)},
}


@pytest.fixture(scope="module")
def stored_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mapping") / "ckpt"
    ost.save(path, _stored_values())
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_mapped_load_reads_each_device_box_once(stored_checkpoint, case):
    values, mapping, target = _stored_values(), _mapping(), _target(CASES[case])
    stats = ost.LoadStats()
    loaded = ost.load(stored_checkpoint, target, mapping=mapping, stats=stats,
                      options=ost.LoadOptions(max_overread=1.0, max_gap=0))
    for stored_name, value in values.items():
        tree_name = mapping.tree_name(stored_name)
        leaf = loaded["layers_0"][tree_name.split(".")[1]]["kernel"]
        transform = mapping.transform(tree_name, stored_shape=value.shape)
        expected = transform.apply(value)
        assert leaf.sharding == target["layers_0"][tree_name.split(".")[1]]["kernel"].sharding
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
    total = sum(v.nbytes for v in values.values())
    assert stats.bytes_needed == total and stats.bytes_read == total, stats


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_device_reads_only_its_stored_box(stored_checkpoint, case):
    """One job per tensor, reading exactly the 8 distinct 1/8 stored boxes; they tile the
    tensor, so they are staged as one run (the transform takes views), not 8 strided reads."""
    checkpoint = open_checkpoint(Location.resolve(stored_checkpoint))
    mapping, target = _mapping(), _target(CASES[case])
    policy = ReadPolicy(ReadProfile(chunk_bytes=1 << 20, max_gap=0, max_overread=1.0, memory_budget=1 << 30),
                        threads=1, bounce_bytes=1 << 20, read_once=False, reshard_below=0,
                        casting="same_kind", checksums={})
    for tree_name, leaf in [(f"layers_0.{k}.kernel", v["kernel"]) for k, v in target["layers_0"].items()]:
        stored_name = mapping.stored_name(tree_name)
        source = checkpoint.tensors[stored_name]
        transform = mapping.transform(tree_name, stored_shape=source.shape, tree_shape=leaf.shape)
        job = sharded_job(stored_name, source, np.dtype(np.float32), leaf.sharding, policy, transform)
        reads = job.reads
        assert reads.shards == (tuple((0, n) for n in source.shape),)
        assert reads.nbytes == reads.needed == source.nbytes
        boxes = {transform.stored_box(normalize_index(index, leaf.shape))
                 for index in leaf.sharding.devices_indices_map(leaf.shape).values()}
        assert len(boxes) == 8 and {box_size(b) for b in boxes} == {math.prod(source.shape) // 8}


def test_head_dim_sharding_reads_enclosing_heads_and_still_matches(stored_checkpoint):
    """Sharding inside head_dim cannot be read exactly (the enclosing heads' rows are read)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    sharding = NamedSharding(mesh, P(None, "b", "a"))  # heads over 4, head_dim over 2
    target = {"layers_0": {"q": {"kernel": jax.ShapeDtypeStruct((HIDDEN, HEADS, HEAD_DIM), np.float32,
                                                               sharding=sharding)}}}
    stats = ost.LoadStats()
    loaded = ost.load(stored_checkpoint, target, mapping=_mapping(), strict=False, stats=stats)
    expected = _mapping().transform("layers_0.q.kernel", stored_shape=(32, 16)).apply(
        _stored_values()["layers.0.q.weight"])
    np.testing.assert_array_equal(np.asarray(loaded["layers_0"]["q"]["kernel"]), expected)
    assert stats.bytes_needed == expected.nbytes  # 8 devices hold 8 distinct boxes
    assert stats.bytes_read == expected.nbytes  # the 4 row blocks of 2 heads, read once each


def test_load_without_target_is_keyed_by_tree_names(stored_checkpoint):
    loaded = ost.load(stored_checkpoint, mapping=_mapping())
    values = _stored_values()
    assert sorted(loaded) == ["layers_0.o.kernel", "layers_0.q.kernel", "layers_0.w.kernel"]
    np.testing.assert_array_equal(loaded["layers_0.w.kernel"], values["layers.0.w.weight"].T)
    assert loaded["layers_0.q.kernel"].shape == (HIDDEN, HEADS, HEAD_DIM)
    assert loaded["layers_0.q.kernel"].flags.c_contiguous


def test_load_reports_unmapped_and_unfit_leaves(stored_checkpoint):
    target = _target(CASES["column"])
    target["extra"] = {"bias": jax.ShapeDtypeStruct((3,), np.float32)}
    with pytest.raises(ost.SafetensorsError, match="no single rule maps the tree names: extra.bias"):
        ost.load(stored_checkpoint, target, mapping=_mapping())
    del target["extra"]
    target["layers_0"]["q"]["kernel"] = jax.ShapeDtypeStruct((HIDDEN, 4, 8), np.float32)
    with pytest.raises(ost.SafetensorsError, match=r"layers_0.q.kernel: .*declared sizes"):
        ost.load(stored_checkpoint, target, mapping=_mapping())
    with pytest.warns(ost.SkippedLeavesWarning, match="layers_0.q.kernel"):
        loaded = ost.load(stored_checkpoint, target, mapping=_mapping(), strict=False)
    assert loaded["layers_0"]["q"]["kernel"] is None  # skipped: an abstract leaf returns None
    assert isinstance(loaded["layers_0"]["o"]["kernel"], jax.Array)


@pytest.mark.parametrize("case", ["column", "row", "head_dim"])
def test_sharded_mapped_save_writes_the_stored_arrangement(tmp_path, stored_checkpoint, case):
    from safetensors.numpy import load_file

    mapping, values = _mapping(), _stored_values()
    if case == "head_dim":  # shards cut inside head_dim: each becomes one stored box per head
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
        target = _target({"q": P(None, "a", "b"), "o": P("a", "b", None), "w": P("a", "b")}, mesh)
    else:
        target = _target(CASES[case])
    tree = ost.load(stored_checkpoint, target, mapping=mapping)
    stats = ost.save(tmp_path / "out", tree, mapping=mapping)
    assert stats.bytes_written == sum(v.nbytes for v in values.values())
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(written) == sorted(values)
    for name, value in values.items():
        np.testing.assert_array_equal(written[name], value)


def test_distributed_layout_stores_mapped_slices(tmp_path, stored_checkpoint):
    mapping, values, target = _mapping(), _stored_values(), _target(CASES["column"])
    tree = ost.load(stored_checkpoint, target, mapping=mapping)
    ost.save(tmp_path / "d", tree, layout="distributed", mapping=mapping)
    assert ost.metadata(tmp_path / "d").tensors["layers.0.o.weight"].shape == (HIDDEN, HEADS * HEAD_DIM)
    for name, value in ost.load(tmp_path / "d").items():  # stored arrangement, unmapped
        np.testing.assert_array_equal(value, values[name])
    again = ost.load(tmp_path / "d", target, mapping=mapping)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), tree, again))


def test_mapped_shards_never_view_the_callers_array_when_copying():
    from orbax_safetensors.engine.saving.host_shards import HostShard, _map_shards

    assembly = Mapping([Rule("w", "w", split={0: (2, 3)})]).assembly("w", tree_shape=(2, 3, 2))  # a reshape
    value = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    shard = HostShard("w", ((0, 2), (0, 3), (0, 2)), value)
    [copied] = _map_shards([shard], {"w": assembly}, copy=True)
    [viewed] = _map_shards([shard], {"w": assembly}, copy=False)
    assert copied.box == viewed.box == ((0, 6), (0, 2))
    assert not np.shares_memory(copied.data, value) and np.shares_memory(viewed.data, value)
    np.testing.assert_array_equal(copied.data, value.reshape(6, 2))


def _child_mapped_load(args):
    """In each of 2 processes × 4 devices: a mapped load over all 8; its shards and stats."""
    values, mapping, target = _stored_values(), _mapping(), _target(CASES[args["case"]])
    stats = ost.LoadStats()
    loaded = ost.load(args["path"], target, mapping=mapping, stats=stats,
                      options=ost.LoadOptions(max_overread=1.0, max_gap=0))
    for stored_name, value in values.items():
        tree_name = mapping.tree_name(stored_name)
        leaf = loaded["layers_0"][tree_name.split(".")[1]]["kernel"]
        expected = mapping.transform(tree_name, stored_shape=value.shape).apply(value)
        assert len(leaf.addressable_shards) == 4
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
    # Without what completes checksum blocks (tests/engine/test_checksums_load.py bounds that).
    return {"bytes_read": stats.bytes_read - stats.checksum_overread, "bytes_needed": stats.bytes_needed}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_process_reads_only_its_half_through_the_mapping(multiprocess, stored_checkpoint, case):
    results = multiprocess("tests.planning.test_mapping:_child_mapped_load", num_processes=2,
                           devices_per_process=4, args={"path": str(stored_checkpoint), "case": case})
    half = sum(v.nbytes for v in _stored_values().values()) // 2
    assert [r.value for r in results] == [{"bytes_read": half, "bytes_needed": half}] * 2
