"""Quantized checkpoints loaded by 2 real JAX processes × 4 CPU devices, with scale blocks
(FP8) and groups (MXFP4, INT4, NVFP4) cut between the processes.

* FP8 ``a.weight`` [576, 256], block 128, scales [5, 2] (DeepSeek-V3's kv_a_proj_with_mqa rows:
  a partial last block of 64 rows), rows over the 8 devices: 72 each, so process 0 holds rows
  0..287 and process 1 rows 288..575; scale block 2 (rows 256..383) is cut between them, and
  blocks are cut between devices too.
* MXFP4 ``e.w`` (gpt-oss layout: blocks [4, 24, 3, 16], twin [4, 96, 24]), the twin's axis 1
  over the 8 devices: 12 values each, process 0 values 0..47, process 1 48..95; group 1 (values
  32..63) is cut between them.
* INT4 (compressed-tensors ``pack-quantized``, asymmetric, group 32): ``i`` [64, 96] with its
  input axis over the devices (group 1, values 32..63, cut between the processes and between
  devices), and ``j`` [40, 64] with its rows over them (5 rows a device: the packed zero points'
  word 2, rows 16..23, is cut between the processes).
* NVFP4, both layouts (``n``: compressed-tensors, ``o``: ModelOpt) [16, 96], input axis over the
  devices: 12 values each, groups of 16 cut; DeepSeek-V4's MXFP4 experts (``v``, I8 bytes and
  E8M0 exponents per 32) the same way, groups of 32 cut.
* INT8 per channel, asymmetric (``k`` [40, 64], compressed-tensors ``int-quantized``), rows over
  the devices: each reads its rows' scales and zero points.

Each process checks its addressable shards bit for bit against the numpy reference
(``tests/support/quantized_reference.py``) and returns its ``ost.LoadStats``: each read only the
values of its own shards and the scales of the blocks (groups) they touch, nothing of the
other process's rows (the checkpoint is a plain safetensors file, as a Hub release is: no
checksums; ``max_overread=1.0``: no gaps read). A group of MXFP4 values is read whole, so a
group cut between two devices is read by both: with these tiny shards (12 values a device,
groups of 32) process 0 reads 4 group-rows' bytes for its 2 groups, 4/3 of the whole tensor;
gpt-oss's 2880 hidden values over 8 devices touch 12-13 groups for 11.25 a device.
"""

import dataclasses
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import orbax_safetensors as ost
from tests.support.quantized_reference import (
    BF16,
    bits,
    e2m1,
    fp8_reference,
    int_reference,
    mxfp4_reference,
    nvfp4_reference,
    pack_int,
    pack_nibbles,
    random_fp8,
    random_mxfp4,
)

pytestmark = pytest.mark.slow  # several JAX processes

_MODULE = "tests.multiprocess.test_quantized_multiprocess"
ROWS, COLS, BLOCK = 576, 256, 128
EXPERTS, OUT, GROUPS = 4, 24, 3


def _sources():
    """The stored tensors (deterministic: the parent saves them, each child recomputes them)."""
    weight, scales = random_fp8(np.random.default_rng(0), (ROWS, COLS), (-(-ROWS // BLOCK), -(-COLS // BLOCK)))
    blocks, exponents = random_mxfp4(np.random.default_rng(1), (EXPERTS, OUT), GROUPS)
    return {"a.weight": weight, "a.weight_scale_inv": scales, "e.w_blocks": blocks, "e.w_scales": exponents,
            **{name: value for name, (value, _) in _group_quantized().items()}}


def _group_quantized():
    """The INT4 and NVFP4 tensors: stored name → (value, its part of the twins)."""
    rng = np.random.default_rng(2)
    out = {}
    for module, shape in (("i", (64, 96)), ("j", (40, 64))):
        codes, groups = rng.integers(-8, 8, shape), (shape[0], shape[1] // 32)
        scales = rng.uniform(0.01, 0.1, groups).astype(np.float32)
        zeros = rng.integers(-8, 8, groups)
        twin = int_reference(codes, scales, zeros, (1, 32))
        out.update({f"{module}.weight_packed": (pack_int(codes, 4), twin), f"{module}.weight_scale": (scales, None),
                    f"{module}.weight_zero_point": (pack_int(zeros, 4, axis=-2), None),
                    f"{module}.weight_shape": (np.array(shape, np.int64), None)})
    nibbles = rng.integers(0, 16, (16, 96))
    scales = rng.uniform(0.01, 400, (16, 6)).astype(ml_dtypes.float8_e4m3fn)
    out.update({"n.weight_packed": (pack_nibbles(nibbles), nvfp4_reference(
                    nibbles, scales.astype(np.float32), 0.5, "compressed-tensors")),
                "n.weight_scale": (scales, None), "n.weight_global_scale": (np.array([0.5], np.float32), None),
                "o.weight": (pack_nibbles(nibbles), nvfp4_reference(nibbles, scales.astype(np.float32), 0.5,
                                                                     "modelopt")),
                "o.weight_scale": (scales, None), "o.weight_scale_2": (np.array(0.5, np.float32), None)})
    exponents = rng.integers(100, 140, (16, 3)).astype(np.uint8)
    out.update({"v.weight": (pack_nibbles(nibbles).view(np.int8), (e2m1(nibbles) * np.repeat(
                    np.exp2(exponents - 127.0), 32, -1)).astype(np.float32)),
                "v.scale": (exponents, None)})
    codes, scales, zeros = rng.integers(-128, 128, (40, 64)), rng.uniform(0.01, 0.1, (40, 1)).astype(np.float32), \
        rng.integers(-20, 20, (40, 1))
    out.update({"k.weight": (codes.astype(np.int8), int_reference(codes, scales, zeros, (1, 64))),
                "k.weight_scale": (scales, None), "k.weight_zero_point": (zeros.astype(np.int8), None)})
    return out


# One file, every scheme, as a mixed release (compressed-tensors' config groups) stores them:
# ``only`` parts the schemes that would read one another's tensors.
_SCHEMES = (ost.FP8((BLOCK, BLOCK), only="a"), ost.MXFP4(), ost.IntQuantized(4, 32, symmetric=False, only="[ij]"),
            ost.NVFP4(only="n"), ost.NVFP4("modelopt", only="o"), ost.MXFP4Packed(only="v"),
            ost.IntQuantized(8, symmetric=False, packed=False, only="k"))
_AXIS = {"a.weight": 0, "e.w": 1, "i.weight": 1, "j.weight": 0, "n.weight": 1, "o.weight": 1, "v.weight": 1,
         "k.weight": 0}


def _twins():
    s = _sources()
    return {"a.weight": fp8_reference(s["a.weight"], s["a.weight_scale_inv"], (BLOCK, BLOCK)).astype(BF16),
            "e.w": mxfp4_reference(s["e.w_blocks"], s["e.w_scales"]).astype(BF16),
            **{name.rsplit(".", 1)[0] + ".weight": twin.astype(BF16)
               for name, (_, twin) in _group_quantized().items() if twin is not None}}


def _child_load(args):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("x",))
    twins = _twins()
    name = args["tensor"]
    spec = PartitionSpec(*(None,) * _AXIS[name], "x")
    target = {name: jax.ShapeDtypeStruct(twins[name].shape, BF16, sharding=NamedSharding(mesh, spec))}
    stats = ost.LoadStats()
    loaded = ost.load(args["path"], target, mapping=ost.Mapping([ost.Rule(name, name)], quantization=_SCHEMES),
                      stats=stats, strict="target",  # the other tensor is left unread
                      options=ost.LoadOptions(max_overread=1.0))  # no gaps read: the bytes are the boxes'

    boxes = []
    for shard in loaded[name].addressable_shards:
        np.testing.assert_array_equal(bits(np.asarray(shard.data)), bits(twins[name][shard.index]))
        boxes.append([[s.start or 0, s.stop if s.stop is not None else n] for s, n in
                      zip(shard.index, twins[name].shape)])
    return {"stats": dataclasses.asdict(stats), "boxes": boxes}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("quantized_multiprocess")
    save_file(_sources(), os.path.join(directory, "model.safetensors"))
    return str(directory)


def _blocks_touched(a, c, block):
    return -(-c // block) - a // block


def _load(multiprocess, checkpoint, tensor, axis):
    """Each process's load of ``tensor``: the ranges of ``axis`` its devices hold, its stats."""
    results = multiprocess(f"{_MODULE}:_child_load", num_processes=2, devices_per_process=4,
                           args={"path": checkpoint, "tensor": tensor})
    return [(sorted(tuple(box[axis]) for box in r.value["boxes"]), r.value["stats"]) for r in results]


def test_fp8_scale_block_cut_between_processes(multiprocess, checkpoint):
    loads = _load(multiprocess, checkpoint, "a.weight", axis=0)
    assert [(r[0][0], r[-1][1]) for r, _ in loads] == [(0, 288), (288, 576)]  # block 2 (256..383) on both sides
    for ranges, stats in loads:
        # The process's devices hold consecutive row blocks, filled as one run: it needs its
        # rows of values (a byte each) and, once, the rows of scale blocks (2 float32 a row)
        # its span touches (a block two of its devices cut, once), and reads just those: never
        # a scale block its rows do not touch, nor other rows' values.
        once = sum((c - a) * COLS for a, c in ranges) + _blocks_touched(ranges[0][0], ranges[-1][1], BLOCK) * 2 * 4
        assert once < sum((c - a) * COLS + _blocks_touched(a, c, BLOCK) * 2 * 4 for a, c in ranges)  # a block cut
        assert stats["bytes_needed"] == once, (ranges, stats)
        assert stats["bytes_read"] == once, (ranges, stats)
        assert stats["bytes_read"] < 0.51 * ROWS * COLS


def test_mxfp4_group_cut_between_processes(multiprocess, checkpoint):
    loads = _load(multiprocess, checkpoint, "e.w", axis=1)
    assert [(v[0][0], v[-1][1]) for v, _ in loads] == [(0, 48), (48, 96)]  # group 1 (32..63) on both sides
    group_rows = EXPERTS * OUT * (16 + 1)  # a group's 16 bytes of nibbles and exponent byte, every row
    for ranges, stats in loads:
        # Each device needs the groups its values touch (a device's 12 values span 1 or 2 groups
        # of 32); the process reads at least the groups its span touches, at most each device's.
        needed = sum(group_rows * _blocks_touched(a, c, 32) for a, c in ranges)
        once = group_rows * _blocks_touched(ranges[0][0], ranges[-1][1], 32)
        assert stats["bytes_needed"] == needed, (ranges, stats)
        assert once <= stats["bytes_read"] <= needed, (ranges, stats)


@pytest.mark.parametrize("tensor", ["i.weight", "j.weight", "n.weight", "o.weight", "v.weight", "k.weight"])
def test_int4_and_nvfp4_groups_cut_between_processes(multiprocess, checkpoint, tensor):
    """Each process's shards are the reference bit for bit (in the child); each reads its own
    codes and only the scale and zero-point groups they touch: under its share of the whole."""
    axis = _AXIS[tensor]
    loads = _load(multiprocess, checkpoint, tensor, axis=axis)
    size = _twins()[tensor].shape[axis]
    assert [(r[0][0], r[-1][1]) for r, _ in loads] == [(0, size // 2), (size // 2, size)]
    stored = {n: v for n, (v, _) in _group_quantized().items() if n.startswith(tensor[0] + ".")}
    whole = sum(v.nbytes for v in stored.values())
    for _, stats in loads:
        assert 0 < stats["bytes_read"] <= stats["bytes_needed"], stats
        assert stats["bytes_read"] < 0.75 * whole, (stats, whole)
