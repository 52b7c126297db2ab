"""The safetensors header: parse, validate, serialize. Bytes in, bytes out.

A file is ``u64 little-endian N``, then ``N`` bytes of UTF-8 JSON (padded with
spaces to a multiple of 8 so the data that follows is aligned), then the data
buffer. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets"}``
and may hold ``"__metadata__"``, a str→str map.

Validation mirrors the Rust crate so that a file we accept is a file every
other reader accepts, and one it rejects we reject too: header over 100 MB,
header or data longer than the file (a truncated file), bad UTF-8 or JSON (by serde_json's rules:
``-0``, out-of-range numbers, lone surrogates, nesting over 127), unknown dtype, offsets that overlap or leave gaps, a data buffer that
does not end exactly at the end of the file, and byte lengths that differ from
shape × dtype width. JSON whitespace (space, tab, CR, LF) may pad the header on both
sides, as the crate reads it since its #686 (2026-04-13: a writer may pad the
front to page-align the data); any other leading byte is refused, as there. We
are stricter in two places, each where two readers could otherwise disagree
about a file: duplicate JSON keys (serde keeps the last) and a tensor entry
written as a JSON array (a serde quirk).

Nothing here allocates in proportion to what a header *claims*: sizes are
checked as Python integers against the real file size before anyone reads a
tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from json.encoder import encode_basestring

from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format.dtypes import DTYPES, DType

MAX_HEADER_SIZE = 100_000_000
PREFIX_SIZE = 8
METADATA_KEY = "__metadata__"
_HEADER_ALIGNMENT = 8
_MAX_NBITS = 2**64  # the crate computes sizes in usize and rejects overflow
_MAX_DEPTH = 127  # serde_json refuses a 128th nested array/object
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_DATA_ORDER = operator.attrgetter("begin", "end")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: offsets are relative to the start of the data buffer."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class Header:
    """A validated header. ``tensors`` is in data-offset order."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    header_size: int

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data buffer."""
        return PREFIX_SIZE + self.header_size

    @property
    def file_size(self) -> int:
        last = max((t.end for t in self.tensors.values()), default=0)
        return self.data_start + last


def header_size(prefix: bytes, file_size: int, *, file: str) -> int:
    """Validates the 8-byte prefix and returns N, the JSON header's length."""
    if len(prefix) < PREFIX_SIZE or file_size < PREFIX_SIZE:
        raise SafetensorsError(
            f"is {file_size} bytes, too short for the 8-byte header length a safetensors file "
            "starts with: truncated, or not safetensors? fetch it again", file=file)
    (n,) = struct.unpack("<Q", prefix[:PREFIX_SIZE])
    if n > MAX_HEADER_SIZE:
        raise SafetensorsError(
            f"header claims {n} bytes, over the {MAX_HEADER_SIZE}-byte limit", file=file
        )
    if PREFIX_SIZE + n > file_size:
        raise truncated(file_size, PREFIX_SIZE + n, file)
    return n


def truncated(file_size: int, needed: int, file: str) -> SafetensorsError:
    """A file shorter than its header says it is: cut short in a download or a copy."""
    return SafetensorsError(f"is truncated: it has {file_size} bytes, its header needs {needed} "
                            "(an interrupted download or copy? fetch it again)", file=file)


def parse_header(raw: bytes, file_size: int, *, file: str) -> Header:
    """Parses and validates the N header bytes of a file of ``file_size`` bytes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"header is not valid UTF-8 ({e})", file=file) from None
    try:
        document = json.loads(
            text, object_pairs_hook=reject_duplicate_keys, parse_constant=_reject_constant,
            parse_int=_serde_int, parse_float=_serde_float,
        )
    except (ValueError, RecursionError) as e:
        raise SafetensorsError(f"header is not valid JSON ({e})", file=file) from None
    if not isinstance(document, dict):
        raise SafetensorsError("header is not a JSON object", file=file)

    # A lone surrogate (no UTF-8 holds one) can only come from a \ud800-\udfff escape: in a
    # header without one, which is nearly every header, no string needs checking for it.
    escapes = _SURROGATE_ESCAPE.search(text) is not None
    metadata = _parse_metadata(document.pop(METADATA_KEY, None), file, escapes)
    tensors = sorted(
        (_parse_entry(name, entry, file, escapes) for name, entry in document.items()),
        key=_DATA_ORDER,
    )
    # What serde refuses anywhere, checked after the checks with more specific messages, in
    # the fields no entry check read (those checked every string and nesting level they hold).
    _check_serde_rules([({k: v for k, v in entry.items() if k not in _ENTRY_FIELDS}, 2)
                        for entry in document.values() if len(entry) > len(_ENTRY_FIELDS)],
                       file, escapes)
    expected_begin = 0
    for info in tensors:
        if info.begin != expected_begin or info.end < info.begin:
            problem = "overlaps the previous tensor" if info.begin < expected_begin else (
                "leaves a gap after the previous tensor" if info.begin > expected_begin
                else "ends before it begins")
            raise SafetensorsError(
                f"data_offsets [{info.begin}, {info.end}] {problem}",
                file=file, tensor=info.name,
            )
        expected_begin = info.end
    data_size = file_size - PREFIX_SIZE - len(raw)
    if expected_begin > data_size:  # the tensors are back to back: the last one ends past the file
        raise truncated(file_size, PREFIX_SIZE + len(raw) + expected_begin, file)
    if expected_begin != data_size:
        raise SafetensorsError(
            f"tensors cover {expected_begin} data bytes but the file holds {data_size}",
            file=file,
        )
    return Header({t.name: t for t in tensors}, metadata, len(raw))


def parse_file_bytes(data: bytes, *, file: str = "<bytes>") -> Header:
    """Parses the header of a whole file held in memory."""
    n = header_size(data[:PREFIX_SIZE], len(data), file=file)
    return parse_header(data[PREFIX_SIZE:PREFIX_SIZE + n], len(data), file=file)


def serialize_header(
    tensors: Iterable[tuple[str, DType, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, dict[str, TensorInfo]]:
    """Lays tensors out back to back in the given order.

    Returns the bytes that precede the data buffer (length prefix and padded
    JSON) and each tensor's resulting ``TensorInfo``.
    """
    # The JSON is written entry by entry, exactly as json.dumps(separators=(",", ":"),
    # ensure_ascii=False) writes the document (a dict per tensor cost 0.3 s at 100 000).
    items = []
    if metadata is not None:
        items.append(f'"{METADATA_KEY}":' + json.dumps(
            check_metadata(metadata), separators=(",", ":"), ensure_ascii=False))
    infos: dict[str, TensorInfo] = {}
    offset = 0
    for name, dtype, shape in tensors:
        if name in infos or name == METADATA_KEY:
            raise SafetensorsError("name used twice or reserved", tensor=name)
        check_name(name)
        shape = tuple(map(int, shape))
        try:
            size = dtype.nbytes(shape)
        except ValueError as e:
            raise SafetensorsError(str(e), tensor=name) from None
        infos[name] = TensorInfo(name, dtype, shape, offset, offset + size)
        items.append(f'{encode_basestring(name)}:{{"dtype":"{dtype.code}","shape":['
                     f'{",".join(map(str, shape))}],"data_offsets":[{offset},{offset + size}]}}')
        offset += size
    body = ("{" + ",".join(items) + "}").encode("utf-8")
    body += b" " * (-len(body) % _HEADER_ALIGNMENT)
    if len(body) > MAX_HEADER_SIZE:
        raise SafetensorsError(
            f"the header of {len(infos)} tensors would be {len(body):,} bytes, over the "
            f"{MAX_HEADER_SIZE:,}-byte limit every reader enforces (a smaller max_shard_size "
            "puts fewer tensors in a file; metadata is repeated in every file)")
    return struct.pack("<Q", len(body)) + body, infos


def check_metadata(metadata: Mapping[object, object]) -> dict[str, str]:
    """``__metadata__`` as every reader requires it: string keys and values, valid UTF-8, and
    small enough for a header; checked before a save writes anything, so that it never
    writes a file no reader (ours included) can open."""
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise SafetensorsError(f"metadata key {key!r} is {type(key).__name__}; metadata keys "
                                   "must be strings")
        if not isinstance(value, str):
            raise SafetensorsError(f"metadata[{key!r}] is {type(value).__name__}; metadata values "
                                   "must be strings (json.dumps structured values)")
        for text, what in ((key, "metadata key"), (value, f"metadata[{key!r}]")):
            if not is_encodable(text):
                raise SafetensorsError(f"{what} holds an unpaired surrogate (not valid UTF-8)")
    size = len(json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    if size > MAX_HEADER_SIZE:
        raise SafetensorsError(f"metadata is {size:,} bytes as JSON, over the {MAX_HEADER_SIZE:,}-byte "
                               "limit every reader enforces on a file's whole header")
    return dict(metadata)  # type: ignore[arg-type]


def check_name(name: str) -> None:
    """A tensor name every reader can read back: valid UTF-8."""
    if not is_encodable(name):
        raise SafetensorsError("the name holds an unpaired surrogate (not valid UTF-8)", tensor=name)


def is_encodable(text: str) -> bool:
    """Whether ``text`` has no lone surrogate (Python's JSON accepts them, UTF-8 and the OS do not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads`` object hook: a key given twice is an error, not "last wins"."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {duplicate!r}")
    return result


def _serde_int(text: str) -> int | float:
    """Integers as serde_json reads them: ``-0`` and beyond-64-bit ones are floats."""
    if text == "-0":
        return -0.0
    value = int(text)
    if -(2**63) <= value < 2**64:
        return value
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"number {text[:20]}... out of range") from None


def _serde_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:20]} out of range")
    return value


def _check_serde_rules(roots: list[tuple[object, int]], file: str, escapes: bool = True) -> None:
    """What serde_json refuses anywhere, even in fields nobody reads: nesting deeper than
    ``_MAX_DEPTH`` and (where the text has ``escapes`` that could make one) lone surrogates,
    below each ``(value, depth)`` of ``roots``."""
    stack = list(roots)
    while stack:
        value, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise SafetensorsError(f"header nests deeper than {_MAX_DEPTH} levels", file=file)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if escapes and isinstance(key, str):
                _check_text(key, "a header key", file)
            if isinstance(item, str):
                if escapes:
                    _check_text(item, "a header string", file)
            elif isinstance(item, (dict, list)):
                stack.append((item, depth + 1))


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _check_text(value: str, what: str, file: str) -> None:
    if not is_encodable(value):
        raise SafetensorsError(f"{what} holds an unpaired surrogate", file=file)


def _parse_metadata(value: object, file: str, escapes: bool = True) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SafetensorsError("__metadata__ is not a JSON object", file=file)
    for key, item in value.items():
        if not isinstance(item, str) or not isinstance(key, str):
            raise SafetensorsError(
                f"__metadata__[{key!r}] is {type(item).__name__}, metadata values must be strings",
                file=file,
            )
        if escapes:
            _check_text(key, "__metadata__ key", file)
            _check_text(item, "__metadata__ value", file)
    return value


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # JSON gives ints, floats and bools (an int subclass)


def _parse_entry(name: str, entry: object, file: str, escapes: bool = True) -> TensorInfo:
    if escapes:
        _check_text(name, "a tensor name", file)
    if not isinstance(entry, dict):
        raise SafetensorsError("entry is not a JSON object", file=file, tensor=name)
    code = entry.get("dtype")
    dtype = DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise SafetensorsError(f"unknown dtype {code!r}", file=file, tensor=name)
    shape = entry.get("shape")
    if type(shape) is not list or not all(map(_is_count, shape)):
        raise SafetensorsError(f"shape {shape!r} is not a list of sizes", file=file, tensor=name)
    offsets = entry.get("data_offsets")
    if not (type(offsets) is list and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise SafetensorsError(
            f"data_offsets {offsets!r} is not a [begin, end] pair", file=file, tensor=name)
    count = 1
    for d in shape:  # the crate's try_fold(checked_mul): every partial product must fit
        count *= d
        if count >= _MAX_NBITS:
            raise SafetensorsError(f"shape {shape} overflows", file=file, tensor=name)
    nbits = count * dtype.bits
    if nbits >= _MAX_NBITS:
        raise SafetensorsError(f"shape {shape} overflows", file=file, tensor=name)
    if nbits % 8:
        raise SafetensorsError(
            f"{dtype.code} of shape {shape} is not a whole number of bytes",
            file=file, tensor=name)
    begin, end = offsets
    if end >= begin and end - begin != nbits // 8:
        raise SafetensorsError(
            f"data_offsets span {end - begin} bytes, but {dtype.code} of shape {shape} "
            f"needs {nbits // 8}", file=file, tensor=name)
    return TensorInfo(name, dtype, tuple(shape), begin, end)
