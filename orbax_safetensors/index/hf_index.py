"""The Hugging Face ``model.safetensors.index.json`` and its file names.

transformers writes ``{"metadata": {"total_size": N}, "weight_map": {name: file}}``
with sorted keys and a 2-space indent; we write the same bytes so diffs and
hashes of checkpoints match. Every ``weight_map`` entry must be a plain file
name inside the checkpoint directory: an index is data from outside, and a
``../`` or an absolute URL in it must never make us read (or, worse, list or
delete) something else.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import re
import reprlib
from collections.abc import Iterable, Mapping

from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import is_encodable, reject_duplicate_keys

INDEX_NAME = "model.safetensors.index.json"
# Index metadata: file name → crc32c of the whole file. Other tools read and write the index's
# metadata too, so the key is named for this package; earlier versions wrote the bare one.
FILE_CRCS_KEY = "orbax_safetensors.crc32c"
LEGACY_FILE_CRCS_KEY = "crc32c"
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


def incomplete_shard_sets(names: Iterable[str], shown: int = 10) -> dict[int, tuple[int, list[str]]]:
    """For each count N of the ``model-0000i-of-0000N.safetensors`` among ``names`` that lacks
    some of its shards 1..N: how many are missing, and the names of the first ``shown`` of
    them. Without an index the set is what says a copy or download is whole."""
    present: dict[int, set[int]] = {}
    for name in names:
        match = _SHARD_NAME.match(name)
        if match:
            present.setdefault(int(match[2]), set()).add(int(match[1]))
    incomplete = {}
    for count, held in sorted(present.items()):
        missing = count - sum(1 for i in held if 1 <= i <= count)
        if missing:  # the first few names: at most len(held) + shown steps, whatever N claims
            first = itertools.islice((i for i in itertools.count(1) if i not in held), min(shown, missing))
            incomplete[count] = (missing, [shard_file_name(i - 1, count) for i in first])
    return incomplete


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlevel = 3


def short_repr(value: object) -> str:
    """``repr`` for messages about untrusted values: bounded in length and in depth.

    A hostile index value can be a megabyte string or a list nested hundreds
    deep; the message should say what is wrong, not reproduce it.
    """
    return _SHORT.repr(value)


def load_json(raw: bytes, *, file: str, what: str) -> object:
    """Decodes an index file: strict UTF-8 JSON, no duplicate keys, no NaN/Infinity.

    Every failure is a SafetensorsError naming ``file``: deep nesting
    (RecursionError), numbers past Python's digit limit (ValueError) and
    invalid bytes included.
    """
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=reject_duplicate_keys,
                          parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SafetensorsError(
            f"{what} is malformed: not valid UTF-8 JSON ({str(e)[:200]})", file=file) from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def check_file_name(name: object, *, file: str, tensor: str | None = None) -> str:
    """Returns ``name`` if it is a plain file name; raises otherwise.

    A lone surrogate is refused too: no OS call can encode it, so it would
    surface as a UnicodeEncodeError from deep inside the storage layer.
    """
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or ":" in name
        or "\x00" in name
        or not is_encodable(name)
    ):
        raise SafetensorsError(
            f"file name {short_repr(name)} is not a plain file name inside the checkpoint",
            file=file, tensor=tensor)
    return name


def encode_crc(crc: int) -> str:
    """A crc32c as GCS and S3 spell it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(int(crc).to_bytes(4, "big")).decode("ascii")


def decode_crc(text: object) -> int | None:
    """``encode_crc``'s inverse; ``None`` for anything that is not one."""
    if not isinstance(text, str) or len(text) != 8:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def listed_crcs(metadata: Mapping[str, object]) -> dict[str, object]:
    """Each file's whole crc32c that index ``metadata`` lists, as written (``decode_crc`` reads
    one): ours, or under the legacy key only what earlier versions wrote there (every value an
    ``encode_crc``), not another tool's use of the name."""
    listed = metadata.get(FILE_CRCS_KEY)
    if listed is None:
        legacy = metadata.get(LEGACY_FILE_CRCS_KEY)
        if isinstance(legacy, dict) and all(decode_crc(crc) is not None for crc in legacy.values()):
            listed = legacy
    return dict(listed) if isinstance(listed, dict) else {}


def parse_index(raw: bytes, *, file: str = INDEX_NAME) -> HFIndex:
    """Parses an index; the only error it raises is a SafetensorsError naming ``file``.

    ``metadata`` is kept as found (any JSON object): transformers reads only
    ``weight_map``, hub checkpoints carry assorted extra keys there, and we
    never act on them. One exception: a ``total_size`` that is a whole float
    (``1234.0``, which transformers wrote while its byte sizes were floats)
    becomes the int it means, so ``verify`` compares it like any other.
    """
    document = load_json(raw, file=file, what="index")
    if not isinstance(document, dict) or not isinstance(document.get("weight_map"), dict):
        raise SafetensorsError("index has no 'weight_map' object", file=file)
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict):
        raise SafetensorsError("index 'metadata' is not an object", file=file)
    weight_map = {}
    for name, target in document["weight_map"].items():
        if not is_encodable(name):
            raise SafetensorsError(
                f"tensor name {short_repr(name)} holds an unpaired surrogate", file=file)
        weight_map[name] = check_file_name(target, file=file, tensor=name)
    total = metadata.get("total_size")
    if isinstance(total, float) and total.is_integer() and total >= 0:
        metadata = {**metadata, "total_size": int(total)}
    return HFIndex(weight_map, metadata)


def serialize_index(weight_map: Mapping[str, str], total_size: int,
                    file_crcs: Mapping[str, int] | None = None) -> bytes:
    """The index bytes transformers' ``save_pretrained`` would write, plus (``file_crcs``) each
    file's whole-object crc32c under ``metadata["orbax_safetensors.crc32c"]``, base64 of the
    big-endian value as GCS reports it (transformers keeps the metadata it does not know, and
    reads none of it)."""
    metadata: dict[str, object] = {"total_size": int(total_size)}
    if file_crcs:
        metadata[FILE_CRCS_KEY] = {name: encode_crc(crc) for name, crc in sorted(file_crcs.items())}
    document = {"metadata": metadata, "weight_map": dict(weight_map)}
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8")
