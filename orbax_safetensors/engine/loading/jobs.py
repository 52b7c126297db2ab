"""Job construction: each wanted tensor as a *job*, what to read and how its bytes become the result.

A ``Job`` pairs the tensor's ``TensorReads`` (pure: the boxes to fill and the
reads that fill them, from ``planning``) with a ``finish`` that turns the
filled buffers into the result. Every builder takes the load's ``ReadPolicy``
whole and decides the tensor's ``Cast`` once (``casting.cast_rule``):

* ``host_job``: the whole tensor as a numpy array;
* ``group_jobs``: many small tensors of one file as few jobs (``groupable``);
* ``sharded_job``: this process's shards of a global ``jax.Array``, read in
  one of five ways: once per cluster and all-gathered (replicated across
  processes), in row blocks and resharded on device (strips too thin to read
  well), packed sub-byte values cut in memory, shards read directly, or
  stored boxes transformed by a mapping rule (staged in recycled scratch).

A leaf made of several stored tensors is an ``AssembledLeaf``
(``assembled_leaf``), whose jobs are built from the same pieces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from orbax_safetensors.engine.loading.casting import Cast, apply_cast, cast_rule, device_dtype
from orbax_safetensors.engine.loading.device_assembly import bitcastable, bytes_to_array, device_array, off_staging
from orbax_safetensors.engine.loading.host_work import host_arrays, host_map, view
from orbax_safetensors.engine.loading.options import ReadPolicy
from orbax_safetensors.engine.core.resharding import (
    device_boxes,
    resharding,
    row_sharding,
    shared_across_processes,
)
from orbax_safetensors.errors import ArgumentError, SafetensorsError
from orbax_safetensors.planning import (
    Box,
    StoredSlice,
    TensorReads,
    TensorSource,
    WholeReads,
    bounding_box,
    box_shape,
    box_size,
    full_box,
    plan_byte_reads,
    plan_tensor_reads,
    plan_whole_reads,
    read_once_boxes,
    relative_slices,
)
from orbax_safetensors.planning.transforms import Transform


@dataclasses.dataclass(frozen=True)
class Job:
    """One tensor: what to read (planned) and how its filled buffers become the result.

    ``scratch``: the result is a copy (transformed by a mapping, or on devices that copy
    out of host memory: ``ReadPolicy.pooled``), so the buffers are only staging and come
    from memory recycled between batches (``staging``) rather than fresh pages (which
    cost most of a load here; see ``host_buffers``).
    ``refused``: the cast to the result's dtype ``LoadOptions.casting`` refuses (float →
    int), described; ``casting.refuse_casts`` raises them all before anything is read.
    ``collective``: ``finish`` runs a device collective (an all-gather of a tensor read
    once, an all-to-all of row blocks) that every process must enter.
    ``tensors``: how many tensors it reads (a ``group_job``'s members, else one).
    ``prepare``: run as its batch's reads start, on another thread than ``finish``: the
    result's buffers allocated and faulted in while earlier batches finish.
    """

    reads: TensorReads
    finish: Callable[[list[np.ndarray]], Any]
    scratch: bool = False
    refused: str | None = None
    collective: bool = False
    tensors: int = 1
    prepare: Callable[[], None] | None = None


def planned_reads(source: TensorSource, boxes: Sequence[Box], needed: int, policy: ReadPolicy) -> TensorReads:
    """The reads filling ``boxes`` of ``source`` under ``policy`` (bounce buffers, slices read
    by region where checksums are checked)."""
    return plan_tensor_reads(source, boxes, needed, policy.bounce_bytes,
                             slices_by_region=policy.slices_by_region)


def whole_slice(name: str, source: TensorSource, why: str) -> StoredSlice:
    """The one slice holding all of ``source``; ``why`` says who needs it."""
    if source.whole is None:
        raise SafetensorsError(
            f"{why} needs the tensor stored whole, not in {len(source.slices)} slices", tensor=name)
    return source.whole


def local_boxes(name: str, shape: tuple[int, ...], sharding: jax.sharding.Sharding
                ) -> dict[Box, list[jax.Device]]:
    """This process's boxes of a ``shape`` array of ``sharding``, with the devices holding each."""
    try:
        return device_boxes(sharding, shape)[0]
    except Exception as e:  # jax raises several types for shardings that do not fit
        raise ArgumentError(f"tensor {name!r} of shape {shape}: target sharding does not fit: {e}") from None


def host_job(name: str, source: TensorSource, dtype: np.dtype | None, policy: ReadPolicy,
             transform: Transform | None = None) -> Job:
    """The whole tensor as a numpy array (of ``dtype``, if given; mapped by ``transform``)."""
    cast = cast_rule(name, source, transform, dtype, policy.casting)

    def convert(host: np.ndarray) -> np.ndarray:
        if transform is not None:
            host = np.ascontiguousarray(transform.apply(host))
        return apply_cast(host, cast)

    if source.dtype.is_packed:
        stored = whole_slice(name, source, f"a {source.dtype.code} tensor")
        return Job(plan_byte_reads(stored, [((0, stored.info.nbytes),)], stored.info.nbytes),
                   lambda buffers: convert(view(buffers[0], stored, name, source.shape)),
                   refused=cast.refused)
    return Job(planned_reads(source, [full_box(source.shape)], source.nbytes, policy),
               lambda buffers: convert(view(buffers[0], source.slices[0], name, source.shape)),
               scratch=transform is not None, refused=cast.refused)


# Whole tensors under this size, loaded as stored, are read in groups of about ``GROUP_BYTES``
# of one file (``group_jobs``: under it plus one member); a group's arrays view a few buffers.
GROUPED_BELOW = 64 << 10
GROUP_BYTES = 1 << 20


def groupable(source: TensorSource, dtype: np.dtype | None,
              sharding: jax.sharding.Sharding | None = None) -> bool:
    """Whether this tensor (without a transform) can be one of a ``group_job``'s: small,
    stored whole and loaded as stored (no cast), into a host array or onto devices of this
    process that each hold all of it (replicated: ``device_put`` of the host array does it)."""
    if len(source.slices) != 1:  # ``source.whole``, its size and width, at a few attribute reads
        return False
    info = source.slices[0].info
    if info.shape != source.shape or info.dtype.bits < 8 or info.end - info.begin >= GROUPED_BELOW:
        return False
    if sharding is None:
        return dtype is None or dtype == source.dtype.numpy
    if device_dtype(dtype) != source.dtype.numpy or not sharding.is_fully_addressable:
        return False
    try:
        local, _ = device_boxes(sharding, source.shape)
    except Exception:  # a sharding that does not fit: sharded_job says so
        return False
    return list(local) == [full_box(source.shape)]


def group_job(members: Sequence[tuple[str, TensorSource, jax.sharding.Sharding | None]],
              staged: bool = False) -> Job:
    """Several ``groupable`` tensors of one file as one job: their reads planned as one
    (``plan_whole_reads``), their arrays made by one ``finish``, which returns them in order
    (host arrays, or, with shardings, ``jax.Array``s put on their devices by one
    ``device_put``). A job of its own per tensor costs more than its read: 100 000 tiny
    tensors spent most of a load planning and finishing jobs, and a ``device_put`` per
    tensor costs more than one for many. ``staged``: device arrays stage in the recycled
    pool (``ReadPolicy.pooled``), copied out of it."""
    slices = [source.slices[0] for _, source, _ in members]  # each whole (groupable)
    shardings = [sharding for _, _, sharding in members]
    planned = plan_whole_reads(slices)

    def finish(buffers: list[np.ndarray]) -> list[Any]:
        arrays = _member_arrays(buffers, planned, slices, members)
        if shardings[0] is None:
            return arrays
        if staged:
            arrays = [off_staging(a, s.device_set) for a, s in zip(arrays, shardings)]
        return jax.block_until_ready(jax.device_put(arrays, shardings))  # host buffers go once copied

    on_devices = staged and shardings[0] is not None
    return Job(planned.reads, finish, tensors=len(members), scratch=on_devices)


def _member_arrays(buffers: list[np.ndarray], planned: WholeReads, slices: Sequence[StoredSlice],
                   members: Sequence[tuple[str, TensorSource, Any]]) -> list[np.ndarray]:
    """A group's arrays, in its buffers: each buffer viewed once per dtype and sliced, since a
    ``view`` of each tiny tensor costs more than reading it. A member off a multiple of its item
    size in its buffer (a file whose offsets are not), or stored in another byte order than
    this machine's, goes through ``view``."""
    typed: dict[tuple[int, str], np.ndarray | None] = {}  # (buffer, dtype code): its values
    arrays = []
    for k, start, stored, (name, source, _) in zip(planned.buffers, planned.starts, slices, members):
        dtype, nbytes = source.dtype, stored.info.nbytes
        size = dtype.bits >> 3
        key = (k, dtype.code)
        if key not in typed:
            raw = buffers[k]
            typed[key] = raw[:raw.size - raw.size % size].view(dtype.numpy) if dtype.little == dtype.numpy else None
        values = typed[key]
        if values is not None and start % size == 0:
            try:
                arrays.append(values[start // size:(start + nbytes) // size].reshape(source.shape))
                continue
            except ValueError:  # a shape numpy cannot hold: ``view`` names the tensor
                pass
        arrays.append(view(buffers[k][start:start + nbytes], stored, name, source.shape))
    return arrays


def group_jobs(members: Sequence[tuple[str, TensorSource, jax.sharding.Sharding | None]],
               staged: bool = False) -> list[tuple[Job, list[int]]]:
    """``groupable`` tensors, as few ``group_job``s as they make (per file, host arrays and
    device arrays apart, in file order, cut where their bytes so far pass a multiple of
    ``GROUP_BYTES``), each with the indices into ``members`` of its members. Sorted and cut
    by numpy: a Python step per member is most of what grouping 100 000 of them costs."""
    count = len(members)
    if not count:
        return []
    stored = [source.slices[0] for _, source, _ in members]  # each whole (groupable)
    file_of = {name: i for i, name in enumerate(sorted({s.file for s in stored}))}
    kinds = (2 * np.fromiter([file_of[s.file] for s in stored], np.int64, count)
             + np.fromiter([sharding is None for _, _, sharding in members], np.int64, count))
    order = np.lexsort((np.fromiter([s.offset for s in stored], np.int64, count), kinds))
    kinds, sizes = kinds[order], np.fromiter([s.info.nbytes for s in stored], np.int64, count)[order]
    opens = np.ones(count, bool)  # where a group starts: a new file or kind of array...
    opens[1:] = kinds[1:] != kinds[:-1]
    before = np.cumsum(sizes) - sizes  # ...or where its bytes pass the next GROUP_BYTES
    parts = (before - np.maximum.accumulate(np.where(opens, before, 0))) // GROUP_BYTES
    opens[1:] |= parts[1:] != parts[:-1]
    bounds, order = [*np.flatnonzero(opens).tolist(), count], order.tolist()
    groups = [order[a:b] for a, b in zip(bounds, bounds[1:])]
    return [(group_job([members[k] for k in group], staged), group) for group in groups]


class _Shards(NamedTuple):
    """One tensor as this process's shards of a global array: what every way of reading it
    needs (a tuple: one is made per sharded tensor)."""

    name: str
    source: TensorSource
    transform: Transform | None
    cast: Cast  # to the dtype JAX gives the array
    shape: tuple[int, ...]  # the array's: the tree's, with a transform
    sharding: jax.sharding.Sharding
    local: dict[Box, list[jax.Device]]  # this process's boxes, with the devices holding each
    needed: int  # the bytes of the local boxes
    staged: bool  # read into the recycled pool, copied out of it (``ReadPolicy.pooled``)

    @property
    def itemsize(self) -> int:
        return self.source.dtype.bits // 8


def sharded_job(name: str, source: TensorSource, dtype: np.dtype, sharding: jax.sharding.Sharding,
                policy: ReadPolicy, transform: Transform | None = None) -> Job:
    """This process's shards of a tensor, assembled into a global ``jax.Array``.

    The boxes come from the target sharding (``devices_indices_map``, kept to
    the devices of this process); the reads from the planner. With a
    ``transform`` (a mapping rule) the array has the tree's shape: each device
    box is read as the stored box holding it and transformed on the host, so
    a transposed or head-split shard still costs only its own bytes. A tensor
    whose shards across processes have runs under ``policy.reshard_below`` bytes is
    read in row blocks and resharded on device (``planning.reshard_parts``).
    The cast is to the dtype JAX gives the array (int32 for int64 unless
    ``jax_enable_x64``); a narrowing one checks each shard read.
    """
    cast = cast_rule(name, source, transform, device_dtype(dtype), policy.casting)
    shape = source.shape if transform is None else transform.tree_shape
    local = local_boxes(name, shape, sharding)
    needed = sum(box_size(b) for b in local) * source.dtype.bits // 8
    job = _sharded_job(_Shards(name, source, transform, cast, shape, sharding, local, needed, policy.pooled),
                       policy)
    return job if cast.refused is None else dataclasses.replace(job, refused=cast.refused)


def _sharded_job(tensor: _Shards, policy: ReadPolicy) -> Job:
    """The way to read ``tensor`` (see ``sharded_job``): the first that applies."""
    source, stored_as_is = tensor.source, tensor.transform is None and tensor.source.whole is not None
    if (policy.read_once and stored_as_is and source.nbytes > 0 and bitcastable(source.dtype.numpy)
            and shared_across_processes(tensor.sharding, tensor.shape)):
        return _read_once_job(tensor)
    if policy.reshard_below and stored_as_is and not source.dtype.is_packed:
        rows = row_sharding(tensor.sharding, tensor.shape, tensor.itemsize, policy.reshard_below)
        if rows is not None:
            return _resharded_job(tensor, rows, policy)
    if source.dtype.is_packed:
        return _packed_job(tensor)
    if tensor.transform is None:
        return _direct_job(tensor, policy)
    return _mapped_job(tensor, policy)


def _read_once_job(tensor: _Shards) -> Job:
    """Each process reads 1/N of the bytes; XLA all-gathers them into the sharding. A checked
    cast checks the tensor's smallest and largest value (found on device)."""
    stored, check = tensor.source.whole, tensor.cast.check
    info = stored.info
    devices = sorted(tensor.sharding.device_set, key=lambda d: d.id)
    chunk = math.ceil(info.nbytes / len(devices))
    byte_boxes = read_once_boxes(info.nbytes, len(devices))
    mine = [k for k, d in enumerate(devices) if d.process_index == jax.process_index()]
    byte_mesh = jax.sharding.Mesh(np.array(devices), ("bytes",))
    byte_sharding = jax.sharding.NamedSharding(byte_mesh, jax.sharding.PartitionSpec("bytes"))

    def finish(buffers: list[np.ndarray]) -> jax.Array:
        parts = []
        for k, buffer in zip(mine, buffers):
            padded = np.zeros(chunk, np.uint8)
            padded[:len(buffer)] = buffer
            parts.append(jax.device_put(padded, devices[k]))
        flat = jax.make_array_from_single_device_arrays(
            (chunk * len(devices),), byte_sharding, parts)
        convert = bytes_to_array(info.nbytes, info.shape, info.dtype.numpy, tensor.cast.to, tensor.sharding,
                                 bounds=check is not None)
        if check is None:
            return convert(flat)
        result, *bounds = convert(flat)  # every process sees the same bounds, and fails alike
        lo, hi, nan, only_nan = (np.asarray(b.addressable_data(0)) for b in bounds)
        check(np.array(([] if only_nan else [lo, hi]) + ([np.nan] if nan else []), info.dtype.numpy))
        return result

    return Job(plan_byte_reads(stored, [byte_boxes[k] for k in mine], tensor.needed, read_once=True),
               finish, collective=True, scratch=tensor.staged)


def _resharded_job(tensor: _Shards, rows: jax.sharding.Sharding, policy: ReadPolicy) -> Job:
    """Read in the row blocks of ``rows`` (one contiguous range per process), moved to the
    target sharding on device (an all-to-all)."""
    inner = _direct_job(tensor._replace(sharding=rows, local=device_boxes(rows, tensor.shape)[0]), policy)
    move = resharding(rows, tensor.sharding)
    return Job(dataclasses.replace(inner.reads, needed=tensor.needed, resharded=True),
               lambda buffers: move(inner.finish(buffers)), collective=True, scratch=inner.scratch)


def _packed_job(tensor: _Shards) -> Job:
    """Sub-byte values: the whole tensor's bytes read, unpacked, the shards cut in memory."""
    name, source, transform = tensor.name, tensor.source, tensor.transform
    stored = whole_slice(name, source, f"a {source.dtype.code} tensor")

    def finish(buffers: list[np.ndarray]) -> jax.Array:
        host = view(buffers[0], stored, name, source.shape)
        host = host if transform is None else transform.apply(host)
        return device_array(tensor.shape, tensor.sharding, tensor.cast, tensor.local,
                            lambda box: host[tuple(slice(a, b) for a, b in box)], staged=tensor.staged)

    return Job(plan_byte_reads(stored, [((0, stored.info.nbytes),)], tensor.needed), finish,
               scratch=tensor.staged)


def _direct_job(tensor: _Shards, policy: ReadPolicy) -> Job:
    """Each local box read as stored, into its own buffer (``planning`` merges what it can)."""
    shards = tuple(tensor.local)
    stored = tensor.source.slices[0]

    def finish(buffers: list[np.ndarray]) -> jax.Array:
        views = {box: view(buf, stored, tensor.name, box_shape(box)) for box, buf in zip(shards, buffers)}
        return device_array(tensor.shape, tensor.sharding, tensor.cast, tensor.local, views.__getitem__,
                            staged=tensor.staged)

    return Job(planned_reads(tensor.source, shards, tensor.needed, policy), finish, scratch=tensor.staged)


def _mapped_job(tensor: _Shards, policy: ReadPolicy) -> Job:
    """Each local box read as the stored box behind it (staged), transformed on the host."""
    transform, cast = tensor.transform, tensor.cast
    staged = Staging(tensor.source, tensor.name, [transform.stored_box(box) for box in tensor.local])

    def finish(buffers: list[np.ndarray]) -> jax.Array:
        views = staged.views(buffers, cast.check)
        boxes = list(tensor.local)
        shards = dict(zip(boxes, host_map(lambda box: transform.to_tree(
            views(transform.stored_box(box)), transform.stored_box(box), box,
            out=host_arrays([box_shape(box)], cast.to)[0]), boxes)))
        return device_array(tensor.shape, tensor.sharding, cast, tensor.local, shards.__getitem__)

    return Job(planned_reads(tensor.source, staged.boxes, tensor.needed, policy), finish, scratch=True)


class Staging:
    """Where the stored boxes a mapped tensor's shards need are staged: one buffer for
    the box that holds them all, when it is no larger than they are together (they tile it,
    or overlap where a quantized block is cut between devices: read as one run instead of
    strips cut apart through a bounce buffer; the transform takes views), else one each."""

    def __init__(self, source: TensorSource, name: str, wanted: Sequence[Box]):
        self.source, self.name = source, name
        wanted = tuple(dict.fromkeys(wanted))
        region = bounding_box(wanted) if wanted else ()
        whole = 1 < len(wanted) <= 64 and box_size(region) <= sum(box_size(b) for b in wanted)
        self.boxes = (region,) if whole else wanted

    def views(self, buffers: list[np.ndarray],
              check: Callable[[np.ndarray], None] | None = None) -> Callable[[Box], np.ndarray]:
        """The staged values of each wanted box, all passed to ``check`` first (if given)."""
        held = {box: view(buf, self.source.slices[0], self.name, box_shape(box))
                for box, buf in zip(self.boxes, buffers)}
        if check is not None:
            host_map(check, list(held.values()))
        if len(self.boxes) != 1 or len(held) == 0:
            return held.__getitem__
        (region, values), = held.items()
        return lambda box: values[relative_slices(box, region)]
