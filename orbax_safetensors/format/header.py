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
from itertools import chain
from typing import NamedTuple
from json.encoder import encode_basestring

import numpy as np

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
_NEGATIVE_ZERO = re.compile(r"-0(?![.eE])")  # serde reads it as a float
_DATA_ORDER = operator.attrgetter("begin", "end")
_INT = frozenset({int})


class TensorInfo(NamedTuple):
    """Where one tensor lives: offsets are relative to the start of the data buffer. A named
    tuple (made in a third of a frozen dataclass's time): a header can hold 100 000."""

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
    """Parses and validates the N header bytes of a file of ``file_size`` bytes.

    Nearly every header holds no backslash and no ``-0``. There JSON's own decoder, with no
    hook called per object and per integer, reads the document the serde-exact one does,
    provided no key was given twice, and its entries are checked column by column: 2-3x
    faster on 100 000 tensors (``_parse_plain``). Any doubt, or any error, and the header is
    read again the exact way (``_parse_exact``), which raises the precise error.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"header is not valid UTF-8 ({e})", file=file) from None
    header = _parse_plain(text, len(raw), file_size, file)  # its document freed before the next
    return header if header is not None else _parse_exact(text, len(raw), file_size, file)


def _parse_plain(text: str, header_size: int, file_size: int, file: str) -> Header | None:
    """``_parse_exact``'s header, where ``text`` is plain and valid; else None. A duplicate key
    is found by counting strings: the text's quotes against the keys and string values the
    document kept (without a backslash, every quote starts or ends a string)."""
    if "\\" in text or _NEGATIVE_ZERO.search(text) is not None:
        return None
    try:
        document = json.loads(text, parse_constant=_reject_constant, parse_float=_serde_float)
        header, strings = _validated(document, header_size, file_size, file, plain=True)
    except (ValueError, RecursionError, SafetensorsError, _NotPlain):
        return None
    return header if 2 * strings == text.count('"') else None


def _parse_exact(text: str, header_size: int, file_size: int, file: str) -> Header:
    """``parse_header`` by serde_json's rules throughout: a hook per object (duplicate keys)
    and per integer (``-0`` and those past 64 bits are floats)."""
    try:
        document = json.loads(
            text, object_pairs_hook=reject_duplicate_keys, parse_constant=_reject_constant,
            parse_int=_serde_int, parse_float=_serde_float,
        )
    except (ValueError, RecursionError) as e:
        raise SafetensorsError(f"header is not valid JSON ({e})", file=file) from None
    # A lone surrogate (no UTF-8 holds one) can only come from a \ud800-\udfff escape: in a
    # header without one, which is nearly every header, no string needs checking for it.
    escapes = _SURROGATE_ESCAPE.search(text) is not None
    return _validated(document, header_size, file_size, file, plain=False, escapes=escapes)[0]


class _NotPlain(Exception):
    """The plain decoder's document may differ from serde's: an integer serde reads as a float."""


def _validated(document: object, header_size: int, file_size: int, file: str, *, plain: bool,
               escapes: bool = False) -> tuple[Header, int]:
    """The header ``document`` describes, checked, and the number of strings (keys and string
    values) it holds. ``plain``: the entries are checked column by column (``_plain_entries``)
    where they can be; otherwise one by one, as the exact decoder always does."""
    if not isinstance(document, dict):
        raise SafetensorsError("header is not a JSON object", file=file)
    strings = len(document)
    metadata = _parse_metadata(document.pop(METADATA_KEY, None), file, escapes)
    columns = _plain_entries(document) if plain else None
    tensors = sorted(
        columns if columns is not None else
        (_parse_entry(name, entry, file, escapes) for name, entry in document.items()),
        key=_DATA_ORDER,
    )
    # What serde refuses anywhere, checked after the checks with more specific messages, in
    # the fields no entry check read (those checked every string and nesting level they hold).
    strings += 2 * len(metadata or ()) + 4 * len(tensors) + _check_serde_rules(
        [({k: v for k, v in entry.items() if k not in _ENTRY_FIELDS}, 2)
         for entry in document.values() if len(entry) > len(_ENTRY_FIELDS)], file, escapes)
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
    data_size = file_size - PREFIX_SIZE - header_size
    if expected_begin > data_size:  # the tensors are back to back: the last one ends past the file
        raise truncated(file_size, PREFIX_SIZE + header_size + expected_begin, file)
    if expected_begin != data_size:
        raise SafetensorsError(
            f"tensors cover {expected_begin} data bytes but the file holds {data_size}",
            file=file,
        )
    return Header({t.name: t for t in tensors}, metadata, header_size), strings


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
    # ensure_ascii=False) writes the document (a dict per tensor cost 0.3 s at 100 000);
    # what an entry says besides its name and offsets is made once per dtype and shape.
    items = []
    if metadata is not None:
        items.append(f'"{METADATA_KEY}":' + json.dumps(
            check_metadata(metadata), separators=(",", ":"), ensure_ascii=False))
    infos: dict[str, TensorInfo] = {}
    kinds: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], int, str]] = {}  # by code and shape
    offset = 0
    for name, dtype, shape in tensors:
        if name in infos or name == METADATA_KEY:
            raise SafetensorsError("name used twice or reserved", tensor=name)
        kind = kinds.get((dtype.code, shape)) if type(shape) is tuple else None
        if kind is None:
            ints = tuple(map(int, shape))
            try:
                size = dtype.nbytes(ints)
            except ValueError as e:
                raise SafetensorsError(str(e), tensor=name) from None
            kind = (ints, size, f':{{"dtype":"{dtype.code}","shape":[{",".join(map(str, ints))}],"data_offsets":[')
            if type(shape) is tuple:
                kinds[dtype.code, shape] = kind
        ints, size, entry = kind
        infos[name] = TensorInfo(name, dtype, ints, offset, offset + size)
        items.append(f'{encode_basestring(name)}{entry}{offset},{offset + size}]}}')
        offset += size
    text = "{" + ",".join(items) + "}"
    try:
        body = text.encode("utf-8")
    except UnicodeEncodeError:  # metadata was checked: a name, which the crate's writer refuses too
        check_names(list(infos))
        raise
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


def check_names(names: Sequence[str]) -> None:
    """``check_name`` of each name, in one encode of them all where every one is valid (no
    two names can pair their surrogates: Python's UTF-8 refuses every surrogate code point)."""
    if not is_encodable("".join(names)):
        for name in names:
            check_name(name)


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


def _check_serde_rules(roots: list[tuple[object, int]], file: str, escapes: bool = True) -> int:
    """What serde_json refuses anywhere, even in fields nobody reads: nesting deeper than
    ``_MAX_DEPTH`` and (where the text has ``escapes`` that could make one) lone surrogates,
    below each ``(value, depth)`` of ``roots``. Returns how many strings (keys and values)
    they hold; raises ``_NotPlain`` at an integer serde would have read as a float."""
    stack, strings = list(roots), 0
    while stack:
        value, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise SafetensorsError(f"header nests deeper than {_MAX_DEPTH} levels", file=file)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                strings += 1
                if escapes:
                    _check_text(key, "a header key", file)
            if isinstance(item, str):
                strings += 1
                if escapes:
                    _check_text(item, "a header string", file)
            elif isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
            elif type(item) is int and not -(2**63) <= item < 2**64:
                raise _NotPlain
    return strings


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


def _are_counts(values: object) -> bool:
    """Whether ``values`` is a JSON list of sizes: ints in [0, 2**64), serde's usize (JSON also
    gives floats and bools, an int subclass). Per type, not per element: a header can hold
    100 000 of these lists."""
    return type(values) is list and {*map(type, values)} <= _INT and (
        not values or (min(values) >= 0 and max(values) < _MAX_NBITS))


_FIELDS = operator.itemgetter("dtype", "shape", "data_offsets")
_CODES = frozenset(DTYPES)
_BITS = operator.attrgetter("bits")


def _plain_entries(entries: dict[str, object]) -> list[TensorInfo] | None:
    """``_parse_entry`` of every entry at once, column by column (a header can hold 100 000,
    and a call per entry was most of its parse), where each is plain: the three fields, no
    empty tensor, sizes that agree. None where any is not: ``_parse_entry`` then finds which
    and says why."""
    values = list(entries.values())
    if {*map(type, values)} != {dict} or {*map(len, values)} != {3}:
        return None
    try:
        codes, shapes, offsets = zip(*map(_FIELDS, values))
        if not {*codes} <= _CODES:
            return None
    except (KeyError, TypeError):  # a field missing, an unhashable dtype
        return None
    if not ({*map(type, shapes)} == {*map(type, offsets)} == {list} and {*map(len, offsets)} == {2}):
        return None
    bounds = list(chain.from_iterable(offsets))
    if not (_are_counts(bounds) and _are_counts(list(chain.from_iterable(shapes)))):
        return None
    counts = list(map(math.prod, shapes))
    if min(counts) == 0 or max(counts) >= _MAX_NBITS // 64:  # else the partial products need checking
        return None  # (and below 2**58 values, the bits fit in uint64)
    dtypes = list(map(DTYPES.__getitem__, codes))
    nbits = np.array(counts, np.uint64) * np.array(list(map(_BITS, dtypes)), np.uint64)
    spans = np.diff(np.array(bounds, np.uint64))[::2]  # end - begin (wrapped where end < begin)
    if (nbits % 8).any() or (spans != nbits // 8).any():
        return None
    return list(map(TensorInfo, entries, dtypes, map(tuple, shapes), bounds[::2], bounds[1::2]))


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
    if not _are_counts(shape):
        raise SafetensorsError(f"shape {shape!r} is not a list of sizes", file=file, tensor=name)
    offsets = entry.get("data_offsets")
    if not (_are_counts(offsets) and len(offsets) == 2):
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
