"""The Hugging Face ``model.safetensors.index.json`` and its file names.

transformers writes ``{"metadata": {"total_size": N}, "weight_map": {name: file}}``
with sorted keys and a 2-space indent; we write the same bytes so diffs and
hashes of checkpoints match. Every ``weight_map`` entry must be a plain file
name inside the checkpoint directory: an index is data from outside, and a
``../`` or an absolute URL in it must never make us read (or, worse, list or
delete) something else.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping

from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import reject_duplicate_keys

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
_SHARD_NAME = re.compile(r"^model-(\d{5,})-of-(\d{5,})\.safetensors$")


@dataclasses.dataclass(frozen=True)
class HFIndex:
    """A parsed index: which file holds each tensor, and the index metadata."""

    weight_map: dict[str, str]
    metadata: dict[str, object]

    @property
    def files(self) -> list[str]:
        """The distinct files the index names, in first-seen order."""
        return list(dict.fromkeys(self.weight_map.values()))


def shard_file_name(i: int, count: int) -> str:
    """``model-0000i-of-0000N.safetensors`` (1-based), as transformers names shards."""
    return f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def is_shard_file_name(name: str) -> bool:
    return _SHARD_NAME.match(name) is not None


def check_file_name(name: object, *, file: str, tensor: str | None = None) -> str:
    """Returns ``name`` if it is a plain file name; raises otherwise."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or ":" in name
        or "\x00" in name
    ):
        raise SafetensorsError(
            f"weight_map entry {name!r} is not a plain file name inside the checkpoint",
            file=file, tensor=tensor)
    return name


def parse_index(raw: bytes, *, file: str = INDEX_NAME) -> HFIndex:
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SafetensorsError(f"index is not valid UTF-8 JSON ({e})", file=file) from None
    if not isinstance(document, dict) or not isinstance(document.get("weight_map"), dict):
        raise SafetensorsError("index has no 'weight_map' object", file=file)
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict):
        raise SafetensorsError("index 'metadata' is not an object", file=file)
    weight_map = {
        name: check_file_name(target, file=file, tensor=name)
        for name, target in document["weight_map"].items()
    }
    return HFIndex(weight_map, metadata)


def serialize_index(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """The index bytes transformers' ``save_pretrained`` would write."""
    document = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(weight_map)}
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8")
