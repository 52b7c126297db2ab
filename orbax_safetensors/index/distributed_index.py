"""The distributed layout: per-process files of local slices, and our index of them.

Each process writes only the slices it owns, as ordinary safetensors files
named and annotated the way torch DCP's ``HuggingFaceStorageWriter``
(``save_sharded=True``) does: ``shard-{process+1:05d}-model-{i:05d}-of-{N:05d}.safetensors``
with ``__metadata__["DCP_SHARDING_INFO"] = json({name: {"saved_offsets": [...]}})``.
A safetensors file cannot hold one name twice, so a file holds at most one
slice of a tensor.

Next to them goes ``orbax_safetensors.distributed.json``, written last (it is
the commit marker): every tensor's global dtype and shape and where each of
its slices lives, so a reader learns the whole layout from one small file
and opens only the files whose slices it needs. A directory of torch DCP
output has no such index; the reader then rebuilds the same information from
the files' headers.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence

from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import DTYPES, DType, reject_duplicate_keys
from orbax_safetensors.index.hf_index import check_file_name

DISTRIBUTED_INDEX_NAME = "orbax_safetensors.distributed.json"
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
DCP_VERSION = "DCP_VERSION"
DCP_VERSION_VALUE = "1.0"
_FORMAT = "orbax_safetensors.distributed"
_SHARD_FILE = re.compile(r"^shard-(\d{5,})-model-(\d{5,})-of-(\d{5,})\.safetensors$")


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
    """The slice offsets a DCP file declares (empty when it declares none)."""
    if not metadata or DCP_SHARDING_INFO not in metadata:
        return {}
    try:
        info = json.loads(metadata[DCP_SHARDING_INFO], object_pairs_hook=reject_duplicate_keys)
        return {name: tuple(int(o) for o in entry["saved_offsets"]) for name, entry in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise SafetensorsError(f"{DCP_SHARDING_INFO} is malformed ({e})", file=file) from None


def check_slices(name: str, shape: Sequence[int], slices: Iterable[SliceEntry], *, file: str) -> None:
    """Slices must lie inside the tensor, not overlap, and cover it exactly."""
    total = 1
    for size in shape:
        total *= size
    covered = 0
    boxes = []
    for s in slices:
        if len(s.offsets) != len(shape) or len(s.shape) != len(shape) or any(
                o < 0 or n < 0 or o + n > size for o, n, size in zip(s.offsets, s.shape, shape)):
            raise SafetensorsError(
                f"slice at {list(s.offsets)} of shape {list(s.shape)} lies outside the tensor's "
                f"shape {list(shape)}", file=file, tensor=name)
        box = tuple(zip(s.offsets, (o + n for o, n in zip(s.offsets, s.shape))))
        for other in boxes:
            if all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(box, other)):
                raise SafetensorsError(
                    f"slices at {[b[0] for b in box]} and {[b[0] for b in other]} overlap",
                    file=file, tensor=name)
        boxes.append(box)
        volume = 1
        for n in s.shape:
            volume *= n
        covered += volume
    if covered != total:
        raise SafetensorsError(
            f"slices cover {covered} of the tensor's {total} elements", file=file, tensor=name)


def serialize_distributed_index(
    tensors: Mapping[str, DistributedTensor], metadata: Mapping[str, str]
) -> bytes:
    document = {
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
    return (json.dumps(document, indent=1, sort_keys=True) + "\n").encode("utf-8")


def parse_distributed_index(raw: bytes, *, file: str = DISTRIBUTED_INDEX_NAME) -> tuple[
        dict[str, DistributedTensor], dict[str, str]]:
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=reject_duplicate_keys)
        if document.get("format") != _FORMAT:
            raise ValueError(f"'format' is not {_FORMAT!r}")
        tensors = {}
        for name, entry in document["tensors"].items():
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            slices = tuple(
                SliceEntry(check_file_name(s["file"], file=file, tensor=name),
                           tuple(int(o) for o in s["offsets"]), tuple(int(n) for n in s["shape"]))
                for s in entry["slices"])
            check_slices(name, shape, slices, file=file)
            tensors[name] = DistributedTensor(dtype, shape, slices)
        metadata = {str(k): str(v) for k, v in document.get("metadata", {}).items()}
    except SafetensorsError:
        raise
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise SafetensorsError(f"distributed index is malformed ({e!r})", file=file) from None
    return tensors, metadata
