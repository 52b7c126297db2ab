"""The distributed layout: per-process files of local slices, and our index of them.

Each process writes only the slices it owns, as ordinary safetensors files
named and annotated the way torch DCP's ``HuggingFaceStorageWriter``
(``save_sharded=True``) does: ``shard-{process+1:05d}-model-{i:05d}-of-{N:05d}.safetensors``
with ``__metadata__["DCP_SHARDING_INFO"] = json({name: {"saved_offsets": [...]}})``.
A safetensors file cannot hold one name twice, so a file holds at most one
slice of a tensor.

Next to them goes ``orbax_safetensors.distributed.json``, written last (it is
the commit marker): every tensor's global dtype and shape and where each of
its slices lives, so a reader learns where every slice lies from one small file
and opens only the files whose slices it needs. A directory of torch DCP
output has no such index; the reader then rebuilds the same information from
the files' headers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import DTYPES, DType, is_encodable
from orbax_safetensors.index.hf_index import (
    check_file_name,
    decode_crc,
    encode_crc,
    load_json,
    short_repr,
)

DISTRIBUTED_INDEX_NAME = "orbax_safetensors.distributed.json"
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
DCP_VERSION = "DCP_VERSION"
DCP_VERSION_VALUE = "1.0"
_FORMAT = "orbax_safetensors.distributed"
_FILE_CRCS = "crc32c"  # file name → crc32c of the whole file (a document of ours alone: no namespace)
_SHARD_FILE = re.compile(r"^shard-(\d{5,})-model-(\d{5,})-of-(\d{5,})\.safetensors$")
_MAX_DIM = 2**63 - 1  # numpy's (and JAX's) largest dimension and element count
# check_slices marks grid cells while there are at most this many per slice (or
# this minimum): memory stays proportional to the index's size.
_GRID_CELLS_PER_SLICE = 16
_GRID_MIN_CELLS = 1 << 12
_PAIR_BATCH = 1 << 16  # slice pairs compared per vectorized step of the fallback sweep
# The sweep's work limit (about 3 s): only slices laid out to defeat it (no sharding cuts
# a tensor so) come near it, and they are refused rather than checked for minutes.
_MAX_PAIRS = 10**8


@dataclasses.dataclass(frozen=True)
class SliceEntry:
    """One slice of a tensor: which file holds it and where it sits in the global tensor."""

    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DistributedTensor:
    dtype: DType
    shape: tuple[int, ...]
    slices: tuple[SliceEntry, ...]


def distributed_file_name(process: int, i: int, count: int) -> str:
    """The name torch DCP gives file ``i`` (0-based) of ``count`` of a process (0-based)."""
    return f"shard-{process + 1:05d}-model-{i + 1:05d}-of-{count:05d}.safetensors"


def is_distributed_file_name(name: str) -> bool:
    return _SHARD_FILE.match(name) is not None


def dcp_metadata(offsets: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """The ``__metadata__`` entries torch DCP writes for a file of slices."""
    return {
        DCP_SHARDING_INFO: json.dumps(
            {name: {"saved_offsets": list(map(int, o))} for name, o in offsets.items()}),
        DCP_VERSION: DCP_VERSION_VALUE,
    }


def dcp_offsets(metadata: Mapping[str, str] | None, *, file: str) -> dict[str, tuple[int, ...]]:
    """The slice offsets a DCP file declares (empty when it declares none).

    Offsets must be JSON integers ≥ 0: ``int()`` would turn ``1.5`` into 1,
    ``true`` into 1 and ``"3"`` into 3, and a slice placed by a truncated
    number loads silently in the wrong place.
    """
    if not metadata or DCP_SHARDING_INFO not in metadata:
        return {}
    text = metadata[DCP_SHARDING_INFO]
    if not isinstance(text, str):
        raise SafetensorsError(f"{DCP_SHARDING_INFO} is malformed: not a string", file=file)
    info = load_json(text.encode("utf-8", "surrogatepass"), file=file, what=DCP_SHARDING_INFO)
    if not isinstance(info, dict):
        raise SafetensorsError(f"{DCP_SHARDING_INFO} is malformed: not a JSON object", file=file)
    offsets = {}
    for name, entry in info.items():
        saved = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(saved, list) or not all(map(_is_count, saved)):
            raise SafetensorsError(
                f"{DCP_SHARDING_INFO} is malformed: saved_offsets {short_repr(saved)} is not a "
                "list of integers ≥ 0", file=file, tensor=name)
        offsets[name] = tuple(saved)
    return offsets


def check_slices(name: str, shape: Sequence[int], slices: Iterable[SliceEntry], *, file: str) -> None:
    """Slices must lie inside the tensor, not overlap, and cover it exactly.

    Runs in about O(n log n) for the grid tilings shardings produce (a
    1000-host × 8-device checkpoint has 8000 slices of a tensor; a pairwise
    check would compare 32 million pairs in Python, about 20 s): slices are
    mapped to the cells of the grid their boundaries cut, and the cells are
    counted. Tilings whose grid would be much larger than the slice count
    fall back to a vectorized sweep that only compares slices whose extents
    meet along one dimension; tilings built so that even that means over
    ``_MAX_PAIRS`` comparisons are refused instead of checked for minutes.
    """
    shape = tuple(shape)
    slices = list(slices)
    if not all(map(_is_count, shape)) or any(d > _MAX_DIM for d in shape):
        raise SafetensorsError(
            f"shape {short_repr(list(shape))} is not a list of sizes below 2**63",
            file=file, tensor=name)
    total = math.prod(shape)
    if total > _MAX_DIM:
        raise SafetensorsError(f"shape {list(shape)} has 2**63 elements or more", file=file, tensor=name)
    for s in slices:
        if (len(s.offsets) != len(shape) or len(s.shape) != len(shape)
                or not all(map(_is_count, s.offsets)) or not all(map(_is_count, s.shape))
                or any(o + n > size for o, n, size in zip(s.offsets, s.shape, shape))):
            raise SafetensorsError(
                f"slice at {short_repr(list(s.offsets))} of shape {short_repr(list(s.shape))} "
                f"(in {s.file!r}) lies outside the tensor's shape {list(shape)}",
                file=file, tensor=name)
    covered = sum(math.prod(s.shape) for s in slices)
    # Zero-size slices hold no element: they can neither overlap nor fill a gap.
    filled = [s for s in slices if all(s.shape)]
    overlap, hole = _find_overlap(name, shape, filled, file) if filled else (None, None)
    if overlap is not None:
        a, b = filled[overlap[0]], filled[overlap[1]]
        raise SafetensorsError(
            f"slices at {list(a.offsets)} (in {a.file!r}) and {list(b.offsets)} "
            f"(in {b.file!r}) overlap", file=file, tensor=name)
    if covered != total or hole is not None:
        where = "" if hole is None else f"; nothing covers the element at {hole}"
        raise SafetensorsError(
            f"slices cover {covered} of the tensor's {total} elements{where}",
            file=file, tensor=name)


def _find_overlap(name: str, shape: tuple[int, ...], slices: list[SliceEntry], file: str) -> tuple[
        tuple[int, int] | None, list[int] | None]:
    """``(i, j)`` of two overlapping slices or None, and an uncovered element if one was seen.

    ``slices`` are non-empty and inside ``shape`` (so every number fits int64).
    """
    count, rank = len(slices), len(shape)
    if rank == 0:  # a scalar: one slice holds it all, a second one overlaps it
        return ((0, 1) if count > 1 else None), None
    if count == 1 and not any(slices[0].offsets) and tuple(slices[0].shape) == shape:
        return None, None  # one slice, all of the tensor (each process's own tensors): no grid
    lo = np.array([s.offsets for s in slices], dtype=np.int64).reshape(count, rank)
    hi = lo + np.array([s.shape for s in slices], dtype=np.int64).reshape(count, rank)
    cuts = [np.unique(np.concatenate([lo[:, k], hi[:, k], [0, shape[k]]])) for k in range(rank)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells <= max(_GRID_CELLS_PER_SLICE * count, _GRID_MIN_CELLS):
        return _grid_overlap(cuts, lo, hi)
    pairs, order = _sweep_order(lo, hi)
    if int(pairs.sum()) > _MAX_PAIRS:
        raise SafetensorsError(
            f"{count} slices that neither form a grid ({cells} cells) nor can be checked for "
            f"overlaps in reasonable time ({int(pairs.sum())} candidate pairs): no sharding "
            "lays slices out like this", file=file, tensor=name)
    return _sweep_overlap(lo[order], hi[order], pairs, order), None


def _grid_overlap(cuts: list[np.ndarray], lo: np.ndarray, hi: np.ndarray) -> tuple[
        tuple[int, int] | None, list[int] | None]:
    """Marks the grid cells each slice covers; a cell marked twice is an overlap."""
    dims = tuple(len(c) - 1 for c in cuts)
    first = np.stack([np.searchsorted(c, lo[:, k]) for k, c in enumerate(cuts)], axis=1)
    last = np.stack([np.searchsorted(c, hi[:, k]) for k, c in enumerate(cuts)], axis=1)
    if np.all(last - first == 1):  # the usual case: one slice per cell, fully vectorized
        flat = np.ravel_multi_index(tuple(first.T), dims)
        counts = np.bincount(flat, minlength=math.prod(dims))
        twice = np.flatnonzero(counts > 1)
        if twice.size:
            i, j = np.flatnonzero(flat == twice[0])[:2]
            return (int(i), int(j)), None
        covered = counts.reshape(dims) > 0
    else:
        covered = np.zeros(dims, dtype=bool)
        for i in range(len(lo)):
            block = tuple(slice(a, b) for a, b in zip(first[i], last[i]))
            marked = covered[block]
            if marked.any():
                cell = np.argwhere(marked)[0] + first[i]
                j = int(np.flatnonzero(np.all((first[:i] <= cell) & (cell < last[:i]), axis=1))[0])
                return (j, i), None
            covered[block] = True
    if covered.all():
        return None, None
    cell = np.unravel_index(int(np.argmin(covered)), dims)
    return None, [int(c[k]) for c, k in zip(cuts, cell)]


def _sweep_order(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The dimension whose extents meet least: per slice (in its sorted order) the candidates.

    After sorting by start along dimension ``k``, the slices meeting slice
    ``i`` there are the run that starts before ``i`` ends. Returns the run
    lengths and the sort order for the dimension with the fewest pairs.
    """
    count = len(lo)
    best = None
    for k in range(lo.shape[1]):
        order = np.argsort(lo[:, k], kind="stable")
        ends = np.searchsorted(lo[order, k], hi[order, k], side="left")
        runs = ends - np.arange(count) - 1
        if best is None or runs.sum() < best[0].sum():
            best = (runs, order)
    return best


def _sweep_overlap(lo: np.ndarray, hi: np.ndarray, runs: np.ndarray, order: np.ndarray) -> tuple[
        int, int] | None:
    """Compares each slice (``lo``/``hi`` sorted as ``_sweep_order`` says) with its run.

    Runs are compared in batches of bounded size, so memory stays flat.
    """
    count = len(lo)
    done = np.cumsum(runs)
    start = 0
    while start < count:
        before = done[start - 1] if start else 0
        stop = max(start + 1, int(np.searchsorted(done, before + _PAIR_BATCH, side="right")))
        lengths = runs[start:stop]
        rows = np.repeat(np.arange(start, stop), lengths)
        within = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        cols = rows + 1 + within
        meet = np.all(np.maximum(lo[rows], lo[cols]) < np.minimum(hi[rows], hi[cols]), axis=1)
        if meet.any():
            pair = int(np.argmax(meet))
            return tuple(sorted((int(order[rows[pair]]), int(order[cols[pair]]))))
        start = stop
    return None


def serialize_distributed_index(
    tensors: Mapping[str, DistributedTensor], metadata: Mapping[str, str],
    file_crcs: Mapping[str, int] | None = None,
) -> bytes:
    """Our index; ``file_crcs``: each file's whole-object crc32c (``encode_crc``), as the HF
    index stores them."""
    document: dict[str, object] = {
        "format": _FORMAT,
        "version": 1,
        "metadata": dict(metadata),
        "tensors": {
            name: {
                "dtype": t.dtype.code,
                "shape": list(t.shape),
                "slices": [{"file": s.file, "offsets": list(s.offsets), "shape": list(s.shape)}
                           for s in t.slices],
            }
            for name, t in sorted(tensors.items())
        },
    }
    if file_crcs:
        document[_FILE_CRCS] = {name: encode_crc(crc) for name, crc in sorted(file_crcs.items())}
    return (json.dumps(document, indent=1, sort_keys=True) + "\n").encode("utf-8")


def parse_distributed_index(raw: bytes, *, file: str = DISTRIBUTED_INDEX_NAME) -> tuple[
        dict[str, DistributedTensor], dict[str, str], dict[str, str]]:
    """Parses and validates our index: its tensors, its metadata and each file's whole crc32c
    (as written, ``decode_crc`` reads one; empty for a save without checksums). The only error
    it raises is a SafetensorsError.

    Every field is type-checked rather than coerced, and every slice set is
    checked to tile its tensor, so a reader never plans reads from a tiling
    that cannot be right.
    """
    document = load_json(raw, file=file, what="distributed index")
    if not isinstance(document, dict):
        raise SafetensorsError("distributed index is malformed: not a JSON object", file=file)
    if document.get("format") != _FORMAT:
        raise SafetensorsError(
            f"distributed index is malformed: 'format' is {short_repr(document.get('format'))}, "
            f"not {_FORMAT!r}", file=file)
    version = document.get("version")
    if version != 1 or isinstance(version, bool):
        raise SafetensorsError(
            f"distributed index version {short_repr(version)} is not supported (only 1)", file=file)
    entries = document.get("tensors")
    if not isinstance(entries, dict):
        raise SafetensorsError("distributed index is malformed: 'tensors' is not an object", file=file)
    tensors = {}
    for name, entry in entries.items():
        _text(name, "tensor name", file=file)
        if not isinstance(entry, dict):
            raise SafetensorsError("entry is not a JSON object", file=file, tensor=name)
        code = entry.get("dtype")
        if not isinstance(code, str) or code not in DTYPES:
            raise SafetensorsError(f"unknown dtype {short_repr(code)}", file=file, tensor=name)
        shape = _sizes(entry.get("shape"), "shape", None, file=file, tensor=name)
        if not isinstance(entry.get("slices"), list):
            raise SafetensorsError(
                f"slices {short_repr(entry.get('slices'))} is not a list", file=file, tensor=name)
        slices = []
        holder: dict[str, SliceEntry] = {}
        for s in entry["slices"]:
            if not isinstance(s, dict):
                raise SafetensorsError(
                    f"slice {short_repr(s)} is not a JSON object", file=file, tensor=name)
            listed = SliceEntry(
                check_file_name(s.get("file"), file=file, tensor=name),
                _sizes(s.get("offsets"), "slice offsets", len(shape), file=file, tensor=name),
                _sizes(s.get("shape"), "slice shape", len(shape), file=file, tensor=name))
            if listed.file in holder:  # the file has one header entry for the name: one slice
                raise SafetensorsError(
                    f"slices at {list(holder[listed.file].offsets)} and {list(listed.offsets)} "
                    f"are both placed in {listed.file!r}, which can hold only one slice of a tensor",
                    file=file, tensor=name)
            holder[listed.file] = listed
            slices.append(listed)
        check_slices(name, shape, slices, file=file)
        tensors[name] = DistributedTensor(DTYPES[code], shape, tuple(slices))
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict):
        raise SafetensorsError("distributed index 'metadata' is not an object", file=file)
    for key, value in metadata.items():
        _text(key, "metadata key", file=file)
        _text(value, f"metadata[{short_repr(key)}]", file=file)
    crcs = document.get(_FILE_CRCS, {})
    if not isinstance(crcs, dict) or not all(
            isinstance(name, str) and decode_crc(crc) is not None for name, crc in crcs.items()):
        raise SafetensorsError(f"distributed index is malformed: {_FILE_CRCS!r} is not an object "
                               "of file names and base64 crc32c values", file=file)
    return tensors, metadata, crcs


def _is_count(value: object) -> bool:
    """A JSON integer ≥ 0; not a bool, not a float (``int(1.5)`` would silently make it 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text(value: object, what: str, *, file: str, tensor: str | None = None) -> str:
    if not isinstance(value, str) or not is_encodable(value):
        raise SafetensorsError(
            f"{what} {short_repr(value)} is not a string (of encodable text)", file=file, tensor=tensor)
    return value


def _sizes(value: object, what: str, rank: int | None, *, file: str, tensor: str) -> tuple[int, ...]:
    """A list of JSON integers ≥ 0 (of length ``rank`` when given)."""
    if (not isinstance(value, list) or not all(map(_is_count, value))
            or (rank is not None and len(value) != rank)):
        rank_text = "" if rank is None else f" of length {rank}"
        raise SafetensorsError(
            f"{what} {short_repr(value)} is not a list{rank_text} of integers ≥ 0",
            file=file, tensor=tensor)
    return tuple(value)
