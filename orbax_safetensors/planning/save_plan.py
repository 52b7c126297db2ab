"""Which tensor goes to which file, at which offset: the hf layout, computed purely.

Every process of a multi-process save must reach the same answer without
talking to the others, so the plan depends only on names, dtypes and shapes
(in the caller's order) and the options, never on devices or timing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from orbax_safetensors.format import DType, TensorInfo, serialize_header
from orbax_safetensors.index import pack_shards, serialize_index, shard_file_name
from orbax_safetensors.index.hf_index import SINGLE_FILE_NAME

HF_METADATA = {"format": "pt"}  # transformers refuses files without it


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)


@dataclasses.dataclass(frozen=True)
class FilePlan:
    """One output file: the bytes before its data and where each tensor goes."""

    name: str
    header: bytes
    tensors: tuple[TensorInfo, ...]

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def size(self) -> int:
        return self.data_start + sum(t.nbytes for t in self.tensors)


@dataclasses.dataclass(frozen=True)
class SavePlan:
    files: tuple[FilePlan, ...]
    index: bytes | None  # None when one file holds everything


def plan_file(name: str, specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> FilePlan:
    """One file with ``specs`` ordered as the Rust crate orders them.

    Widest dtype first, then by name: every tensor starts at an offset aligned
    to its own width, which lets readers view the data without copying.
    """
    ordered = sorted(specs, key=lambda s: (-s.dtype.bits, s.name))
    header, infos = serialize_header(((s.name, s.dtype, s.shape) for s in ordered), metadata)
    return FilePlan(name, header, tuple(infos.values()))


def plan_hf_checkpoint(
    specs: Sequence[TensorSpec],
    *,
    max_shard_size: int | str,
    metadata: Mapping[str, str] | None = None,
) -> SavePlan:
    """Shards ``specs`` like transformers: one ``model.safetensors`` or indexed shards."""
    header_metadata = {**HF_METADATA, **(metadata or {})}
    by_name = {s.name: s for s in specs}
    groups = pack_shards([(s.name, s.nbytes) for s in specs], max_shard_size)
    if len(groups) == 1:
        return SavePlan((plan_file(SINGLE_FILE_NAME, specs, header_metadata),), None)
    files = tuple(
        plan_file(shard_file_name(i, len(groups)), [by_name[n] for n in group], header_metadata)
        for i, group in enumerate(groups)
    )
    weight_map = {t.name: f.name for f in files for t in f.tensors}
    return SavePlan(files, serialize_index(weight_map, sum(s.nbytes for s in specs)))


def plan_single_file(
    name: str, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
) -> SavePlan:
    """Everything in one named file, whatever its size (the caller asked for it)."""
    return SavePlan((plan_file(name, specs, {**HF_METADATA, **(metadata or {})}),), None)
