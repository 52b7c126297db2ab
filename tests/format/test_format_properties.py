"""Property tests of the format and index layers (hypothesis).

(a) ``serialize_header`` -> ``parse_file_bytes`` round trips, and the Rust
    crate accepts what we write.
(b) Fuzz: ``parse_file_bytes`` either parses or raises ``SafetensorsError``,
    never anything else, on arbitrary bytes and on arbitrary JSON headers.
(c) ``pack_shards`` follows the huggingface_hub greedy rule (re-implemented
    here independently of the library).
(d) Differential: on header-shaped fuzz, we accept exactly the files the Rust
    crate accepts (no duplicate keys can arise here: headers come from dicts).

Every test is derandomized (the same examples on every run) so a failure is a
failure, not a flake.
"""

from __future__ import annotations

import json
import math
import struct

import safetensors
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orbax_safetensors import SafetensorsError
from orbax_safetensors.format import (
    DTYPES,
    METADATA_KEY,
    check_names,
    is_encodable,
    parse_file_bytes,
    parse_header,
    serialize_header,
)
from orbax_safetensors.format import header as header_module
from orbax_safetensors.index import pack_shards, parse_size
from tests.support.hf_reference import reference_split

SETTINGS = settings(
    max_examples=200, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow])

CODES = sorted(DTYPES)
# Text that UTF-8 can encode (no lone surrogates), non-ASCII very much included.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
NAMES = TEXT.filter(lambda s: s != METADATA_KEY)


def whole_bytes_shape(code: str, shape: list[int]) -> tuple[int, ...]:
    """``shape``, extended so a sub-byte dtype fills whole bytes (F4: even, F6: x4)."""
    if math.prod(shape) * DTYPES[code].bits % 8:
        shape = shape + [4]
    return tuple(shape)


TENSORS = st.lists(
    st.tuples(NAMES, st.sampled_from(CODES), st.lists(st.integers(0, 5), max_size=4)),
    max_size=8, unique_by=lambda t: t[0],
).map(lambda ts: [(n, c, whole_bytes_shape(c, s)) for n, c, s in ts])
METADATA = st.none() | st.dictionaries(TEXT, TEXT, max_size=5)


# --------------------------------------------------------------------------- (a) round trip


@SETTINGS
@given(TENSORS, METADATA)
def test_serialize_then_parse_round_trips(tensors, metadata):
    prefix, infos = serialize_header(((n, DTYPES[c], s) for n, c, s in tensors), metadata)
    (n,) = struct.unpack("<Q", prefix[:8])
    assert len(prefix) == 8 + n
    assert n % 8 == 0
    data_size = sum(DTYPES[c].nbytes(s) for _, c, s in tensors)
    content = prefix + bytes(data_size)

    header = parse_file_bytes(content)
    assert header.metadata == metadata
    assert header.header_size == n
    assert header.file_size == len(content)
    assert set(header.tensors) == {name for name, _, _ in tensors}
    offset = 0
    for name, code, shape in tensors:  # laid out back to back in the given order
        info = header.tensors[name]
        assert info.dtype.code == code
        assert info.shape == shape
        assert (info.begin, info.end) == (offset, offset + DTYPES[code].nbytes(shape))
        assert infos[name] == info
        offset = info.end

    # The reference implementation reads the same tensors from the same bytes.
    theirs = dict(safetensors.deserialize(content))
    assert set(theirs) == set(header.tensors)
    for name, info in header.tensors.items():
        assert theirs[name]["dtype"] == info.dtype.code
        assert tuple(theirs[name]["shape"]) == info.shape
        assert len(theirs[name]["data"]) == info.nbytes


@SETTINGS
@given(st.dictionaries(TEXT, TEXT, max_size=3), st.sampled_from(["\ud800", "a\udfff", "\udc00b"]),
       st.booleans())
def test_serialize_rejects_unencodable_metadata(metadata, bad, as_key):
    metadata = dict(metadata)
    if as_key:
        metadata[bad] = "v"
    else:
        metadata["k"] = bad
    try:
        serialize_header([], metadata)
    except SafetensorsError:
        return
    raise AssertionError("a lone surrogate reached the header")


@SETTINGS
@given(st.lists(TEXT, min_size=1, max_size=6, unique=True), st.sampled_from(["\ud800", "a\udfff", "\udc00b"]),
       st.integers(0, 6), st.booleans())
def test_serialize_and_check_names_reject_a_lone_surrogate_naming_its_tensor(names, bad, at, paired):
    """A name no UTF-8 reader reads back is refused, by ``serialize_header`` and by
    ``check_names`` alike, naming it; a high surrogate ending one name and a low one starting
    the next are still two lone surrogates, not a pair."""
    names = [n for n in names if n != METADATA_KEY]
    if paired:
        names = [*names, "x\ud800", "\udc00y"]
        bad = "x\ud800"
    elif bad not in names:
        names.insert(min(at, len(names)), bad)
    for check in (lambda: serialize_header([(n, DTYPES["U8"], (1,)) for n in names]),
                  lambda: check_names(names)):
        try:
            check()
        except SafetensorsError as e:
            assert repr(bad) in str(e) and "unpaired surrogate" in str(e), str(e)
            continue
        raise AssertionError("a lone surrogate reached the header")
    check_names([n for n in names if is_encodable(n)])


# --------------------------------------------------------------------------- (b) fuzz


def parses_or_rejects(content: bytes):
    """The only allowed outcomes: a Header, or SafetensorsError."""
    try:
        return parse_file_bytes(content, file="fuzz.safetensors")
    except SafetensorsError as e:
        assert "fuzz.safetensors" in str(e)
        return None


@SETTINGS
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_bytes(content):
    parses_or_rejects(content)


@SETTINGS
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_fuzz_arbitrary_header_bytes_with_valid_prefix(header, data):
    parses_or_rejects(struct.pack("<Q", len(header)) + header + data)


# Text including lone surrogates (json.dumps escapes them as \\udXXX, which
# Python's json accepts and serde_json refuses), boosted since they are rare.
ANY_TEXT = (st.text(st.characters(codec=None, categories=None), max_size=6)
            | st.sampled_from(["\ud800", "a\udfff", "\udc00\ud800"]))
JSON_SCALARS = (
    st.none() | st.booleans() | st.integers() | st.integers(-4, 2**64 + 4)
    | st.floats(allow_nan=True, allow_infinity=True) | ANY_TEXT
    | st.sampled_from([10**400, -(10**400)])  # beyond f64: serde says "number out of range"
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=20,
)
SIZES = st.one_of(
    st.integers(0, 6), st.sampled_from([-1, 2**32, 2**40, 2**62, 2**63, 2**64, 2**64 + 1]),
    st.booleans(), st.floats(0, 4), st.text(max_size=2), st.none(),
)
FUZZ_ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(CODES) | JSON_SCALARS,
        "shape": st.lists(SIZES, max_size=4) | JSON,
        "data_offsets": st.lists(SIZES, min_size=0, max_size=3) | JSON,
        "extra": JSON,
    },
) | JSON


@st.composite
def plausible_headers(draw) -> tuple[dict, int]:
    """Valid-looking headers (tensors laid out back to back), then a few mutations.

    Returns the header and the data size that would make it exactly valid
    before mutation; most examples stay close to valid so deep checks run.
    """
    tensors = draw(st.lists(
        st.tuples(NAMES | ANY_TEXT, st.sampled_from(CODES), st.lists(st.integers(0, 4), max_size=3)),
        max_size=4, unique_by=lambda t: t[0]))
    header: dict = {}
    layout: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, code, shape in tensors:
        shape = list(whole_bytes_shape(code, shape))
        size = DTYPES[code].nbytes(shape)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        layout[name] = (offset, offset + size)
        offset += size
    if draw(st.booleans()):
        header[METADATA_KEY] = draw(
            st.dictionaries(TEXT, TEXT, max_size=3) | st.dictionaries(ANY_TEXT, ANY_TEXT, max_size=3)
            | JSON, label="metadata")
    for _ in range(draw(st.integers(0, 3), label="mutations")):
        if not tensors:
            break
        name = draw(st.sampled_from([t[0] for t in tensors]))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "entry"]))
        if field == "entry":
            header[name] = draw(FUZZ_ENTRY)
        elif not isinstance(header[name], dict):
            continue
        elif field == "shape":
            header[name]["shape"] = draw(st.lists(SIZES, max_size=4) | JSON)
        elif field == "data_offsets":
            begin, end = layout[name]
            header[name]["data_offsets"] = draw(
                st.tuples(st.integers(-2, 2), st.integers(-2, 2)).map(
                    lambda d: [begin + d[0], end + d[1]]) | st.lists(SIZES, max_size=3) | JSON)
        elif field == "extra":  # a field nobody reads: only the JSON rules apply
            header[name]["extra"] = draw(ANY_TEXT | JSON)
        else:
            header[name]["dtype"] = draw(JSON_SCALARS | st.sampled_from(CODES) | JSON)
    data_size = offset + draw(st.sampled_from([0, 0, 0, -1, 1, 8]))
    return header, max(data_size, 0)


def header_file(header: dict, data_size: int, pad: int) -> bytes:
    text = json.dumps(header).encode("utf-8") + b" " * pad
    return struct.pack("<Q", len(text)) + text + bytes(data_size)


HEADER_FILES = st.builds(
    lambda hd, pad: header_file(hd[0], hd[1], pad), plausible_headers(), st.integers(0, 7))


@SETTINGS
@given(HEADER_FILES)
def test_fuzz_json_headers(content):
    parses_or_rejects(content)


def outcome(parse):
    """What ``parse()`` gives: ("ok", its Header) or ("error", its message)."""
    try:
        return "ok", parse()
    except SafetensorsError as e:
        return "error", str(e)


@SETTINGS
@given(plausible_headers(), st.integers(0, 7), st.booleans())
@example(({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 3]}}, 3), 0, True)  # span != size
@example(({"x": {"dtype": "U8", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}}, 0), 0, True)
def test_the_plain_decoder_decides_as_the_exact_one(header_and_size, pad, ascii_only):
    """A header without escapes is decoded without serde's per-value hooks, its entries checked
    column by column: what it returns, or the error it raises, is the exact decoder's."""
    header, data_size = header_and_size
    try:
        text = json.dumps(header, ensure_ascii=ascii_only).encode("utf-8") + b" " * pad
    except UnicodeEncodeError:  # a lone surrogate: only an escape writes it
        text = json.dumps(header).encode("utf-8") + b" " * pad
    file_size = 8 + len(text) + data_size
    exact = outcome(lambda: header_module._parse_exact(text.decode(), len(text), file_size, "f"))
    assert outcome(lambda: parse_header(text, file_size, file="f")) == exact


@SETTINGS
@given(JSON, st.integers(0, 16))
def test_fuzz_any_json_document(document, data_size):
    text = json.dumps(document).encode("utf-8")
    parses_or_rejects(struct.pack("<Q", len(text)) + text + bytes(data_size))


# --------------------------------------------------------------------------- (d) differential


def crate_accepts(content: bytes) -> bool:
    try:
        safetensors.deserialize(content)
    except Exception as e:  # noqa: BLE001
        assert type(e).__name__ == "SafetensorError", repr(e)
        return False
    return True


@settings(SETTINGS, max_examples=300)
@given(HEADER_FILES)
def test_we_accept_exactly_what_the_crate_accepts(content):
    ours = parses_or_rejects(content)
    assert (ours is not None) == crate_accepts(content), (
        f"ours {'accepts' if ours is not None else 'rejects'}, the crate disagrees: {content!r}")
    if ours is not None:
        theirs = dict(safetensors.deserialize(content))
        assert {n: (t.dtype.code, list(t.shape)) for n, t in ours.tensors.items()} == {
            n: (t["dtype"], list(t["shape"])) for n, t in theirs.items()}


# --------------------------------------------------------------------------- (c) pack_shards


SIZED = st.lists(
    st.tuples(st.text(max_size=5), st.integers(0, 120)), max_size=30, unique_by=lambda t: t[0])


@SETTINGS
@given(SIZED, st.integers(1, 200))
def test_pack_shards_properties(sizes, limit):
    groups = pack_shards(sizes, limit)
    size_of = dict(sizes)
    if not sizes:
        assert groups == [[]]  # one (empty) file: a checkpoint always has one
        return
    assert groups == reference_split(sizes, limit)
    flat = [name for group in groups for name in group]
    assert sorted(flat) == sorted(size_of) and len(flat) == len(set(flat))  # each exactly once
    position = {name: i for i, (name, _) in enumerate(sizes)}
    for group in groups:
        assert group, "no empty shard"
        assert [position[n] for n in group] == sorted(position[n] for n in group)
        total = sum(size_of[n] for n in group)
        assert total <= limit or (len(group) == 1 and total > limit)
    if all(size <= limit for _, size in sizes):
        assert flat == [name for name, _ in sizes]  # no oversized tensor: order kept overall
        # Greedy: a shard is only closed when the next tensor does not fit.
        for group, following in zip(groups, groups[1:]):
            assert sum(size_of[n] for n in group) + size_of[following[0]] > limit


@SETTINGS
@given(SIZED, st.integers(1, 200), st.sampled_from(["", "B", "KB", "KiB"]))
def test_size_strings_parse_to_the_bytes_pack_shards_packs_by(sizes, limit, unit):
    scale = {"": 1, "B": 1, "KB": 1000, "KiB": 1024}[unit]
    scaled = [(n, s * scale) for n, s in sizes]
    assert pack_shards(scaled, parse_size(f"{limit}{unit}")) == pack_shards(scaled, limit * scale)
