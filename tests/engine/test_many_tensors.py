"""Checkpoints of many small tensors: what each costs, and that the paths made for them load
exactly what was saved (``bench/tiny_tensors.py`` times 100 000 of them against
``safetensors.numpy``).

Costs are counted, not timed, as in ``test_scale_planning.py``: the Python function calls a
call makes in every thread (``sys.setprofile``/``threading.setprofile``) and its peak of
traced memory (``tracemalloc``, which sees NumPy's buffers too), each per tensor. A planner
object, a page, or a header parse per tensor blows these bounds; on the code before small
tensors were grouped a load made 142 calls and held 7.4 KB per 64-byte tensor.
"""

import sys
import threading
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import orbax_safetensors as ost

COUNT = 4000  # tiny tensors of the cost checks


def _mixed(rng=np.random.default_rng(11)):
    """Small tensors of every kind a group meets (empty, scalar, bool, sub-byte, 16-bit), some
    above the grouping size, and enough 32 KiB ones to make several groups per file."""
    tensors = {}
    for i in range(60):
        shape = [(), (0,), (1,), (3, 5), (16,), (8, 4)][i % 6]
        dtype = [np.float32, np.int8, np.bool_, ml_dtypes.bfloat16, np.uint16, np.float16][i % 6]
        tensors[f"small.{i}"] = rng.integers(0, 2 if dtype is np.bool_ else 100, shape).astype(dtype)
    for i in range(40):
        tensors[f"mid.{i}"] = rng.standard_normal((64, 128)).astype(np.float32)  # 32 KiB each
    tensors["big.0"] = rng.standard_normal((256, 128)).astype(np.float32)  # 128 KiB: read alone
    tensors["packed"] = rng.choice([0.5, 1.0, -2.0], (8, 4)).astype(ml_dtypes.float4_e2m1fn)
    return tensors


def _same(got, want):
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tensors = _mixed()
    path = tmp_path_factory.mktemp("many") / "ckpt"
    ost.save(path, tensors, max_shard_size="1MB")  # three files, each with groups to make
    return str(path), tensors


def test_small_tensors_load_exactly_in_every_form(mixed):
    """No target, host arrays (some cast, which are read alone), numpy leaves, replicated and
    row-sharded device arrays, and a ``strict=False`` target missing one: bit for bit, and
    ``LoadStats`` counts every tensor once."""
    path, tensors = mixed
    stats = ost.LoadStats()
    loaded = ost.load(path, stats=stats)
    assert sorted(loaded) == sorted(tensors) and stats.tensors == len(tensors)
    for name, want in tensors.items():
        _same(loaded[name], want)

    mesh = Mesh(np.array(jax.devices()), ("x",))
    target = {}
    for k, (name, x) in enumerate(tensors.items()):
        if k % 4 == 0:
            target[name] = jax.ShapeDtypeStruct(x.shape, x.dtype)
        elif k % 4 == 1:
            target[name] = np.zeros(x.shape, x.dtype)
        elif x.ndim and x.shape[0] % 8 == 0 and x.dtype != ml_dtypes.float4_e2m1fn:
            target[name] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("x")))
        else:
            target[name] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
    target["mid.1"] = jax.ShapeDtypeStruct((64, 128), np.float16)  # a cast: read on its own
    stats = ost.LoadStats()
    loaded = ost.load(path, target, stats=stats)
    assert stats.tensors == len(tensors)
    for name, want in tensors.items():
        if name == "mid.1":
            want = want.astype(np.float16)
        got = loaded[name]
        sharding = getattr(target[name], "sharding", None)
        if sharding is not None:
            assert isinstance(got, jax.Array) and got.sharding == sharding, name
        else:
            assert isinstance(got, np.ndarray), name
        _same(got, want)

    partial = {name: target[name] for name in list(tensors)[:30]}
    partial["absent"] = jax.ShapeDtypeStruct((2,), np.float32)
    with pytest.warns(ost.SkippedLeavesWarning):
        loaded = ost.load(path, partial, strict=False)
    assert loaded["absent"] is None
    for name in list(tensors)[:30]:
        _same(loaded[name], tensors[name])


def test_small_tensors_two_leaves_ask_for_load_into_both(mixed):
    """Mapped onto two leaves, one stored tensor is one slice inside another of its group: both
    leaves get its bytes, as do their neighbours in the file."""
    path, tensors = mixed
    names = [f"small.{i}" for i in range(12)]
    rules = [ost.Rule(name, f"copy.{name}") for name in names] + [ost.Rule(name, name) for name in names]
    target = {leaf: jax.ShapeDtypeStruct(tensors[leaf.removeprefix("copy.")].shape,
                                         tensors[leaf.removeprefix("copy.")].dtype)
              for leaf in names + [f"copy.{name}" for name in names]}
    loaded = ost.load(path, target, mapping=ost.Mapping(rules), strict="target")
    for leaf in target:
        _same(loaded[leaf], tensors[leaf.removeprefix("copy.")])


def test_small_tensors_off_their_alignment_load_exactly(tmp_path):
    """Another writer may pack tensors with no regard for alignment: a float32 three bytes into a
    group's buffer is viewed at its bytes all the same, as host arrays and on devices."""
    import json
    import struct

    values = {"a": np.array([1, 2, 3], np.uint8), "b": np.array([1.5, -2.25], np.float32),
              "c": np.array([1, -1, 3], ml_dtypes.bfloat16), "d": np.array([-(2**30)], np.int32),
              "e": np.array([True, False]), "f": np.array([[7, 8]], np.uint16)}
    codes = {"a": "U8", "b": "F32", "c": "BF16", "d": "I32", "e": "BOOL", "f": "U16"}
    header, data = {}, b""
    for name, value in values.items():
        header[name] = {"dtype": codes[name], "shape": list(value.shape),
                        "data_offsets": [len(data), len(data) + value.nbytes]}
        data += value.tobytes()
    text = json.dumps(header).encode()
    path = tmp_path / "packed.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    for name, value in ost.load(path).items():
        _same(value, values[name])
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P())
    target = {name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for name, v in values.items()}
    for name, value in ost.load(path, target).items():
        assert value.sharding == replicated
        _same(value, values[name])


def test_a_damaged_small_tensor_fails_its_load_naming_it(mixed, tmp_path):
    """Small tensors are read and checked many to a request: a flipped byte in one of them
    names that tensor, not a neighbour."""
    import shutil

    path, tensors = mixed
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    meta = ost.metadata(copy)
    victim = "small.27"  # (3, 5) bfloat16
    file = copy / meta.files[victim][0]
    from orbax_safetensors.format import parse_file_bytes

    data = bytearray(file.read_bytes())
    header = parse_file_bytes(bytes(data))
    info = header.tensors[victim]
    data[header.data_start + info.begin + 3] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(ost.ChecksumError, match=victim.replace(".", r"\.")):
        ost.load(copy)


def _calls(operation) -> int:
    """Python calls (every thread) that ``operation()`` makes."""
    calls = [0]

    def count(frame, event, arg):
        if event == "call":
            calls[0] += 1

    threading.setprofile(count)
    sys.setprofile(count)
    try:
        operation()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return calls[0]


def _costs(operation) -> tuple[float, float]:
    """Python calls (every thread) and tracemalloc's peak, per tensor, of ``operation()``."""
    operation()  # warm: imports, compiled functions, caches
    calls = _calls(operation)
    tracemalloc.start()
    try:
        operation()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return calls / COUNT, peak / COUNT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tree = {f"layers.{i}.w": np.full(16, i, np.float32) for i in range(COUNT)}
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    ost.save(path, tree)
    return str(path), tree


# operation → (Python calls, bytes of traced peak) per tensor allowed; measured with 4000
# tensors of 64 bytes on CPython 3.11: save 48 / 1.8 KB, load 45 / 1.7 KB, into host arrays
# 58 / 1.9 KB, replicated on 8 devices 151 / 3.8 KB (JAX's device_put is most of it),
# metadata 20 / 1.0 KB. Before small tensors were grouped: 98 / 2.9 KB, 142 / 7.4 KB,
# 156 / 7.5 KB, 603 / 8.6 KB and 41 / 1.0 KB.
COST_BOUNDS = {
    "save": (64, 2400),
    "load": (64, 2400),
    "load_host": (72, 2400),
    "load_replicated": (220, 4800),
    "metadata": (30, 1400),
}


@pytest.mark.parametrize("operation", list(COST_BOUNDS))
def test_a_tiny_tensor_costs_a_few_calls_and_no_page(tiny, tmp_path, operation):
    path, tree = tiny
    mesh = Mesh(np.array(jax.devices()), ("x",))
    replicated = NamedSharding(mesh, P())
    operations = {
        "save": lambda: ost.save(tmp_path / "saved", tree, overwrite=True),
        "load": lambda: ost.load(path),
        "load_host": lambda: ost.load(path, {n: jax.ShapeDtypeStruct((16,), np.float32) for n in tree}),
        "load_replicated": lambda: ost.load(path, {n: jax.ShapeDtypeStruct(
            (16,), np.float32, sharding=replicated) for n in tree}),
        "metadata": lambda: ost.metadata(path),
    }
    calls, peak = _costs(operations[operation])
    most_calls, most_bytes = COST_BOUNDS[operation]
    print(f"{operation}: {calls:.1f} calls and {peak:.0f} B of traced peak per tensor")
    assert calls <= most_calls, f"{calls:.1f} Python calls per tensor (bound {most_calls})"
    assert peak <= most_bytes, f"{peak:.0f} B of traced peak memory per tensor (bound {most_bytes})"


def test_a_distributed_checkpoint_of_many_slices_opens_in_linear_time(tmp_path):
    """Each file's ``DCP_SHARDING_INFO`` (every slice's offsets) is parsed once, not once per
    slice it holds: 2000 slices took 19 s, 20 000 minutes. Counted: calls per slice stay
    flat from 200 to 1000 slices (69 and 68; when each slice parsed all of them, 545 and
    2147)."""
    per_slice = []
    for count in (200, 1000):
        tree = {f"layers.{i}.w": np.full(4, i, np.float32) for i in range(count)}
        path = tmp_path / f"d{count}"
        ost.save(path, tree, layout="distributed")
        ost.metadata(path)
        opened = []
        calls = _calls(lambda: opened.append(ost.metadata(path)))
        meta = opened[0]
        assert len(meta.tensors) == count
        per_slice.append(calls / count)
        loaded = ost.load(path)
        for name in ("layers.0.w", f"layers.{count - 1}.w"):
            _same(loaded[name], tree[name])
    print(f"calls per slice: {per_slice}")
    assert per_slice[1] <= 1.2 * per_slice[0] + 5, per_slice


def test_small_tensors_are_grouped_per_file_and_kind_in_file_order():
    """``group_jobs`` on tensors of three files, some for host arrays and some for devices, in
    no order: each member in one group; a group holds one file's tensors of one kind in file
    order, under ``GROUP_BYTES`` plus one member; a file's kind is cut only where that bound
    needs it."""
    from orbax_safetensors.engine.loading.jobs import GROUP_BYTES, GROUPED_BELOW, group_jobs
    from orbax_safetensors.format import DTYPES, TensorInfo
    from orbax_safetensors.planning import StoredSlice, TensorSource

    rng = np.random.default_rng(5)
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P())
    members, offsets = [], {"f0": 0, "f1": 0, "f2": 0}
    for i in range(3000):
        file, size = f"f{rng.integers(3)}", int(rng.integers(0, GROUPED_BELOW))
        info = TensorInfo(f"t{i}", DTYPES["U8"], (size,), 0, size)
        stored = StoredSlice(info, file, offsets[file], (0,))
        offsets[file] += size
        members.append((f"t{i}", TensorSource(info.dtype, info.shape, (stored,)), replicated if i % 3 else None))
    order = rng.permutation(len(members))
    members = [members[k] for k in order]
    groups = [group for _, group in group_jobs(members)]
    assert sorted(k for group in groups for k in group) == list(range(len(members)))
    kinds = []
    for group in groups:
        where = [(members[k][1].slices[0].file, members[k][2] is None) for k in group]
        assert len(set(where)) == 1
        starts = [members[k][1].slices[0].offset for k in group]
        assert starts == sorted(starts)
        sizes = [members[k][1].nbytes for k in group]
        assert sum(sizes) - sizes[-1] < GROUP_BYTES
        kinds.append(where[0])
    for kind in set(kinds):  # as few as the bound allows: each but the last holds at least GROUP_BYTES less a member
        held = [sum(members[k][1].nbytes for k in g) for g, w in zip(groups, kinds) if w == kind]
        assert all(size > GROUP_BYTES - GROUPED_BELOW for size in held[:-1]), held
