"""``convert``: an Orbax PyTree checkpoint ↔ an HF safetensors checkpoint, streamed.

Both directions move one row block of one tensor at a time, so memory stays
at a few blocks (``block_bytes``) whatever the model size, with one caveat
for Orbax sources, below.

Orbax → safetensors. The Orbax tree metadata (``_METADATA``) gives every
array's key path, shape, dtype and storage chunk; each array is opened on its
own through TensorStore, with the read spec Orbax itself uses, and read in row
blocks: the TensorStore arrays are one more *block source* (``OrbaxBlocks``)
for the writer ``consolidate`` uses (``write_blocks``: same planning,
``max_shard_size`` packing, lock and commit).
Tensor names are key paths joined with ``.``, which is both what ``ost.save``
names a leaf and Orbax's own parameter name. TensorStore decodes whole
storage chunks, and Orbax stores an unsharded array as a single chunk (it only
splits arrays above its 2 GB OCDBT target file size). So when a chunk spans
more rows than a block, the rows it covers are decoded once and the blocks
cut from them (``OrbaxBlocks``): reading such a checkpoint needs about twice
its largest chunk (compressed and decoded bytes) plus the blocks, however
big the checkpoint. (glibc may keep some freed chunk buffers resident, which
shows as 3-5x the largest chunk in a process's peak RSS unless
``MALLOC_MMAP_THRESHOLD_`` is set.) Checkpoints this module writes use
row-block chunks, so for them the bound is the blocks alone.

safetensors → Orbax. Orbax's save takes a tree of in-memory arrays, so the
tree handed to it holds placeholders (``_StreamedTensor``: shape, dtype and
where the bytes are) and a ``TypeHandler`` for them that writes each array
with the TensorStore spec Orbax's ``NumpyHandler`` would use, block by block,
with chunks of at most ``block_bytes`` rows. It reports the type
``np.ndarray``, so the result is an ordinary Orbax checkpoint (tree metadata,
OCDBT, zarr) that ``ocp.StandardCheckpointer().restore(dst)`` reads as numpy
arrays, with no knowledge of this module. The safetensors ``__metadata__``
becomes the Orbax ``custom_metadata`` and comes back on the way out.

Tree shape. Names are split on ``.`` into nested dicts
(``model.layers.0.mlp.weight`` → ``tree["model"]["layers"]["0"]["mlp"]["weight"]``),
which is what a Flax-style restore wants; sequence indices stay string keys,
since a safetensors name cannot say whether ``0`` was a list index. Either
way Orbax names each array by its key path joined with ``.``, so a
conversion round trip gives back exactly the names (and bytes) it started
with. ``nest=False`` keeps the flat names as top-level keys instead, and is
needed when one name is a prefix of another (``a`` and ``a.b``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from collections.abc import Mapping as MappingABC
from typing import Any

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint import future as ocp_future
from orbax.checkpoint import type_handlers

from orbax_safetensors.engine import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_MEMORY_BUDGET,
    BlockSource,
    CheckpointBlocks,
    Operation,
    Peers,
    Progress,
    StoredBlocks,
    StreamOptions,
    TreeBlocks,
    detect_layout,
    flatten_with_names,
    nest as nest_names,
    open_checkpoint,
    write_blocks,
)
from orbax_safetensors.errors import (
    ArgumentError,
    LocationTakenError,
    MissingFileError,
    SafetensorsError,
)
from orbax_safetensors.format import TensorInfo, dtype_for_numpy, from_bytes, to_bytes
from orbax_safetensors.index import natural_key, parse_size
from orbax_safetensors.planning import Box, Mapping, TensorSpec, box_shape, chunk_boxes, chunk_shape
from orbax_safetensors.storage import Location, StorageError
from orbax_safetensors.storage.commit import DirectorySwap

ORBAX = "orbax"
SAFETENSORS = "safetensors"
_TREE_METADATA_FILE = "_METADATA"  # what an Orbax PyTree item directory always holds
# What Orbax writes in a PyTree item directory: its metadata files, the OCDBT manifest and data.
_ORBAX_ENTRY = re.compile(r"^(_[A-Za-z_]+|manifest\.ocdbt|commit_success\.txt|d|"
                          r"ocdbt\.process_\d+|array_metadatas|descriptor)$")


@dataclasses.dataclass
class ConvertStats:
    """What ``convert`` did: the direction, how much it wrote and how long it took."""

    source_format: str  # "orbax" or "safetensors"
    target_format: str
    tensors: int = 0
    bytes_written: int = 0  # tensor bytes (before Orbax's compression), by this process
    files: int = 0  # safetensors files written (0 for an Orbax target)
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / max(self.seconds, 1e-9) / 1e9

    def to_json(self) -> dict[str, Any]:
        return {"source_format": self.source_format, "target_format": self.target_format,
                "tensors": self.tensors, "bytes_written": self.bytes_written, "files": self.files,
                "seconds": round(self.seconds, 3), "gb_per_s": round(self.gb_per_s, 3)}



@dataclasses.dataclass(frozen=True)
class OrbaxForm:
    """Where a converted tree sits in an Orbax checkpoint directory.

    ``item``: the PyTree item's directory under it; ``root``: the keys above
    the tree inside the item; ``extra``: the item's other leaves;
    ``handler``: the item's handler, as the checkpoint's metadata names it;
    ``zarr3``: its arrays' format.
    """

    item: tuple[str, ...] = ()
    root: tuple[str, ...] = ()
    extra: tuple[tuple[str, Any], ...] = ()
    handler: str = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
    zarr3: bool = False

    @property
    def prefix(self) -> str:
        """The tree's names inside the item start with this."""
        return "".join(f"{key}." for key in self.root)

    def tree(self, leaves: dict[str, Any], *, nest: bool) -> dict[str, Any]:
        tree: dict[str, Any] = nest_names(leaves) if nest else dict(leaves)
        for key in reversed(self.root):
            tree = {key: tree}
        return {**dict(self.extra), **tree}

    def write_step_files(self, item: epath.Path) -> None:
        """The checkpoint's files around the item, as Orbax's ``Checkpointer`` leaves them: its
        ``_CHECKPOINT_METADATA`` (which Orbax v1's loaders read) naming the item's handler,
        and commit markers. A lone item is the checkpoint itself."""
        step, handlers = (item.parent, {item.name: self.handler}) if self.item else (item, self.handler)
        now = time.time_ns()
        (step / "_CHECKPOINT_METADATA").write_text(json.dumps({
            "item_handlers": handlers, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}))
        for directory in {item, step}:
            (directory / "commit_success.txt").write_text(
                f"Checkpoint commit was successful to {directory}")


# What MaxText 0.2.5's to_maxtext.py writes (a TrainState of step 0 through Orbax v1's
# training Checkpointer), and what its load_parameters_path (load_params_from_path) reads.
FORMS = {
    None: OrbaxForm(),
    "maxtext": OrbaxForm(item=("0", "items"), root=("params", "params"),
                         extra=(("step", 0), ("opt_state", {})),
                         handler="orbax.checkpoint.experimental.v1._src.handlers."
                                 "pytree_handler.PyTreeHandler", zarr3=True),
}


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """``convert``'s arguments, checked and resolved once.

    The memory budget sets the unit of work: Orbax output chunks and
    safetensors output blocks of ``block_bytes``, at most 64 MB and a 32nd of
    the budget. A few blocks are in flight (the writer's read-ahead), each
    with the boxes read for it in the other side's dtype (float32 for a
    bfloat16 block: twice its bytes) and a transformed copy: about four times
    its bytes. With a mapping an Orbax source also keeps a cache of decoded
    chunks, an eighth of the budget, and bands of its stacked leaves, a
    quarter (``StoredBlocks``).
    """

    stream: StreamOptions
    mapping: Mapping | None
    dtype: np.dtype | None
    memory_budget: int
    nest: bool

    @property
    def form(self) -> OrbaxForm:
        kind = None if self.mapping is None else self.mapping.checkpoint_form
        if kind not in FORMS:
            raise ArgumentError(f"the mapping's checkpoint_form {kind!r} is not one convert writes "
                                f"({', '.join(repr(k) for k in FORMS)})")
        return FORMS[kind]

    @property
    def cache_bytes(self) -> int:
        """An Orbax source's decoded-chunk cache: only a mapping reads boxes that are not
        whole chunks (a column band of an unstacked kernel), which the next boxes would decode
        again."""
        return 0 if self.mapping is None else self.memory_budget // 8

    @property
    def band_bytes(self) -> int:
        """The bands of stacked leaves a mapped Orbax source keeps (``StoredBlocks``)."""
        return self.memory_budget // 4


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    mapping: Mapping | None = None,
    dtype: Any = None,
    memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    block_bytes: int | str | None = None,
    nest: bool = True,
    metadata: MappingABC[str, str] | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    checksums: bool = True,
    storage_options: MappingABC[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> ConvertStats:
    """Converts an Orbax PyTree checkpoint to safetensors, or safetensors to Orbax.

    The direction follows ``src``: a directory holding Orbax's ``_METADATA``
    (what ``StandardCheckpointer``/``PyTreeCheckpointer`` write; also a
    ``CheckpointManager`` step directory with a single item, or a root with a
    single step) becomes an HF checkpoint at ``dst``; anything ``ost.metadata``
    opens becomes an Orbax PyTree checkpoint at ``dst``. See the module
    docstring for the memory bound and the tree shape.

    With a ``mapping`` the Orbax side holds the mapped tree: a Hugging Face
    checkpoint becomes, e.g., MaxText's params (``ost.mappings.maxtext``:
    written as MaxText's ``to_maxtext.py`` writes it, ``dst/0/items``, which
    MaxText restores with ``load_parameters_path=dst/0/items``), and such a
    checkpoint becomes the Hugging Face tensors again. Every output chunk or
    block is assembled from the boxes of the inputs it needs, so memory stays
    within ``memory_budget`` whatever the model size (for an Orbax source,
    plus its largest storage chunk, which TensorStore decodes whole).

    Under ``jax.distributed`` every process calls ``convert`` with the same
    arguments: each reads and writes its share of the chunks (Orbax output) or
    files (safetensors output), and process 0 commits the checkpoint once all
    have written theirs; a failure on any process fails all of them and
    leaves no checkpoint.

    Args:
      src: the checkpoint to read.
      dst: the directory to write.
      mapping: an ``ost.Mapping`` between the safetensors names and layouts
        and the Orbax tree (``ost.mappings.maxtext(...)``, ``ost.mappings.llama(...)``).
      dtype: the output's floating-point dtype (``"float32"``, ``"bfloat16"``);
        ``None`` keeps the input's (float32 where the mapping scales a tensor).
        Integer tensors keep theirs.
      memory_budget: the memory the conversion's buffers may take (bytes or
        ``"1GB"``); it sizes the chunks and blocks, see ``ConvertOptions``.
      max_shard_size: bytes per output file (safetensors output only).
      block_bytes: the most bytes of one tensor moved at once (default: from
        ``memory_budget``); also the Orbax output's chunk size.
      nest: safetensors → Orbax: split names on ``.`` into nested dicts;
        ``False`` keeps the flat names as keys.
      metadata: extra str→str for the output (``__metadata__``, or the Orbax
        ``custom_metadata``), over the source's own.
      overwrite: replace the checkpoint at ``dst``; without it an existing
        ``dst`` is an error. An HF ``dst`` keeps its other files (config.json,
        tokenizer files); an Orbax ``dst`` is replaced whole, so it must hold an
        Orbax checkpoint and nothing else (a directory of your own is refused
        even with ``overwrite``). The new Orbax checkpoint is written beside it
        and swapped in, so a failure leaves the old one.
      progress: a progress line on stderr; ``None`` shows it on a terminal.
      checksums: safetensors output: write block checksums as ``ost.save``
        does. A safetensors source's own are checked as its bytes are read.
      storage_options / filesystem: for a safetensors ``src``/``dst`` given
        as an fsspec URL, as in ``ost.load``. The Orbax side goes through
        Orbax's own paths (local or ``gs://``).

    Returns:
      ``ConvertStats``.

    Raises:
      FileNotFoundError: ``src`` does not exist.
      FileExistsError: ``dst`` exists and ``overwrite`` is false, or it is not
        an Orbax checkpoint convert may replace.
      SafetensorsError / ValueError: ``src`` is neither format, or holds
        something the other format cannot (strings; zero-size arrays for Orbax);
        a ``MappingError`` where the mapping does not fit the checkpoint.
      OSError: writing failed; a full disk is ENOSPC naming ``dst`` (for an
        Orbax ``dst`` too, which TensorStore reports as a ``ValueError``). What
        the conversion staged is removed, and a directory it made for ``dst``.
    """
    started = time.perf_counter()
    try:
        budget = parse_size(memory_budget)
    except ArgumentError as e:
        raise ArgumentError(f"memory_budget={memory_budget!r}: {e}") from None
    if block_bytes is None:
        block_bytes = max(1, min(parse_size(DEFAULT_BLOCK_BYTES), budget // 32))
    options = ConvertOptions(
        StreamOptions(max_shard_size, metadata, overwrite, block_bytes, progress, checksums),
        mapping, None if dtype is None else np.dtype(dtype), budget, nest)
    form = options.form
    target = Location.resolve(dst, storage_options, filesystem)
    label = f"convert {os.fspath(src)} -> {target.url}"
    with contextlib.ExitStack() as opened:
        # Each process opens the source and checks the destination; one that fails here fails
        # them all, rather than leaving the others waiting at the first step they share.
        fmt, source = Operation(Peers.collective("convert-open", target.url)).run(
            "open", functools.partial(_open_source, src, target, options, opened, storage_options,
                                      filesystem))
        if fmt == ORBAX:
            stats = write_blocks(target, source, options.stream, label=label, started=started)
            return ConvertStats(ORBAX, SAFETENSORS, len(source.specs), stats.bytes_written,
                                stats.files, stats.seconds)
        return _write_orbax(source, target, options, form, label=label, started=started)


def _open_source(src: str | os.PathLike, target: Location, options: ConvertOptions,
                 opened: contextlib.ExitStack, storage_options: MappingABC[str, Any] | None,
                 filesystem: fsspec.AbstractFileSystem | None) -> tuple[str, BlockSource]:
    """The source's format and its tensors as the output wants them (through the mapping),
    once the destination is known to be one this conversion may write."""
    fmt, item = detect_format(src, storage_options, filesystem)
    _check_destination(target, fmt, options.form, overwrite=options.stream.overwrite)
    if options.dtype is not None and options.mapping is None:
        raise ArgumentError("dtype= needs a mapping (without one the tensors are copied as they are)")
    prefix = options.form.prefix
    if fmt == ORBAX:
        orbax = OrbaxBlocks(item, prefix=prefix, cache_bytes=options.cache_bytes)
        if options.mapping is None:
            return fmt, orbax
        return fmt, StoredBlocks(orbax, options.mapping, prefix=prefix, dtype=options.dtype,
                                 band_bytes=options.band_bytes)
    checkpoint = opened.enter_context(open_checkpoint(Location.resolve(src, storage_options, filesystem)))
    if options.mapping is None:
        return fmt, CheckpointBlocks(checkpoint)
    return fmt, TreeBlocks(CheckpointBlocks(checkpoint), options.mapping, options.dtype)


def detect_format(
    src: str | os.PathLike,
    storage_options: MappingABC[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> tuple[str, str]:
    """``("orbax", item directory)`` or ``("safetensors", src)``; raises for anything else.
    An Orbax item is recognised here (the engine knows nothing of Orbax); a safetensors
    checkpoint by the catalog, which alone knows their layouts."""
    text = os.fspath(src)
    item = _orbax_item_dir(text)
    if item is not None:
        return ORBAX, item
    try:
        detect_layout(Location.resolve(src, storage_options, filesystem))
    except (FileNotFoundError, SafetensorsError) as e:
        if not _exists(text):
            raise MissingFileError("does not exist", file=text) from None
        detail = ("neither a directory nor a .safetensors file"
                  if isinstance(e, FileNotFoundError) else str(e))
        raise SafetensorsError(
            f"{text!r} is neither an Orbax PyTree checkpoint (no {_TREE_METADATA_FILE}) "
            f"nor a safetensors checkpoint ({detail})") from None
    return SAFETENSORS, text


def _check_destination(target: Location, source_format: str, form: OrbaxForm, *, overwrite: bool) -> None:
    """Refuses a ``target`` that holds anything, unless ``overwrite``; and, for an Orbax
    output (which replaces the whole directory), one that is not an Orbax checkpoint."""
    if not _occupied(target):
        return
    if not overwrite:
        raise LocationTakenError("already exists and is not empty; pass overwrite=True "
                                 "(--overwrite) to replace it", target.url)
    foreign = _not_orbax(target.url, form.item) if source_format == SAFETENSORS else []
    if foreign:  # replacing an Orbax checkpoint replaces the directory: only if it is one
        raise LocationTakenError(
            f"is not an Orbax checkpoint (it holds "
            f"{', '.join(repr(n) for n in foreign[:5])}{', ...' if len(foreign) > 5 else ''}); "
            "convert replaces only an Orbax checkpoint, even with overwrite: choose another "
            "destination", target.url)


def _occupied(location: Location) -> bool:
    """Whether ``location`` is a file or a non-empty directory (an empty one may be written into)."""
    storage = location.storage
    if not storage.exists(location.path):
        return False
    return not storage.isdir(location.path) or bool(storage.listdir(location.path))


# Beside an item in a step directory: what Orbax's Checkpointer writes there.
_STEP_ENTRY = re.compile(r"^(_CHECKPOINT_METADATA|commit_success\.txt)$")


def _not_orbax(path: str, item: tuple[str, ...] = ()) -> list[str]:
    """The entries of directory ``path`` that are not an Orbax PyTree checkpoint's own (all of
    them where it is not one), the checkpoint being at ``path``/``item`` (MaxText's ``0/items``)."""
    root = epath.Path(path)
    if not root.is_dir():
        return [root.name]
    names = sorted(p.name for p in root.iterdir())
    if item:
        inner = item[0]
        foreign = [n for n in names if n != inner and not (len(item) == 1 and _STEP_ENTRY.match(n))]
        return foreign + ([inner] if inner not in names else
                          [f"{inner}/{n}" for n in _not_orbax(os.fspath(root / inner), item[1:])])
    if _TREE_METADATA_FILE not in names:
        return names
    return [n for n in names if not _ORBAX_ENTRY.match(n)]


def _exists(path: str) -> bool:
    try:
        return epath.Path(path).exists()
    except Exception:  # an fsspec-only URL epath cannot handle: let the reader's error stand
        return True




def _orbax_item_dir(path: str) -> str | None:
    """The Orbax PyTree item directory at ``path``: itself, a step's only item, or the only
    item of a root's only step (MaxText's ``base_output_directory``)."""
    if path.endswith(".safetensors"):
        return None
    try:
        root = epath.Path(path)
        if (root / _TREE_METADATA_FILE).exists():
            return os.fspath(root)
        if not root.is_dir():
            return None
        items = _items(root)
        if not items:
            steps = [p for p in root.iterdir() if p.name.isdigit() and p.is_dir()]
            items = _items(steps[0]) if len(steps) == 1 else []
    except Exception:  # not a path Orbax can open (an fsspec-only URL): not an Orbax checkpoint
        return None
    if len(items) > 1:
        raise ArgumentError(
            f"{path!r} is a checkpoint step with several Orbax items "
            f"({', '.join(p.name for p in items)}): convert one of them")
    return os.fspath(items[0]) if items else None


def _items(step: epath.Path) -> list[epath.Path]:
    return sorted(p for p in step.iterdir() if (p / _TREE_METADATA_FILE).exists())


# ---------------------------------------------------------------- Orbax → safetensors


@dataclasses.dataclass
class _Band:
    """The decoded rows of one chunk band of a tensor, from row ``start``; ``left`` of them
    have not been handed out in a block yet."""

    start: int
    left: int
    rows: np.ndarray


class OrbaxBlocks:
    """An Orbax PyTree checkpoint's arrays as a block source, each storage chunk decoded once.

    Every array is opened on its own through TensorStore, with the read spec
    Orbax itself uses. TensorStore decodes whole chunks, and Orbax stores an
    unsharded array as one chunk: reading a row block of it on its own would
    decode the whole array once per block. So when a tensor's chunks span
    more rows than a block, the band of rows one chunk row covers is read
    once, serves the blocks inside it (from the writer's few threads), and is
    dropped as soon as all its rows have been served. Bands are decoded one at
    a time, also across tensors, since decoding one briefly needs its
    compressed bytes too. Other boxes (a mapping's: one layer of a scanned
    array) are read as they are, through a cache of decoded chunks of
    ``cache_bytes``, so the next boxes of the same chunks do not decode them
    again.

    Only the arrays named ``prefix``… are read (MaxText's train state keeps
    its step and optimizer state beside the params).
    """

    def __init__(self, item_dir: str, *, prefix: str = "", cache_bytes: int = 0):
        item_dir = os.path.abspath(item_dir) if "://" not in item_dir else item_dir
        tree_metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item_dir))
        tree = getattr(tree_metadata, "tree", tree_metadata)
        names, leaves, _ = flatten_with_names(tree)
        arrays: dict[str, Any] = {}
        for name, leaf in zip(names, leaves):
            if not name.startswith(prefix):
                continue
            if not isinstance(leaf, ocp.metadata.ArrayMetadata):
                raise ArgumentError(
                    f"{name!r} is a {type(leaf).__name__.removesuffix('Metadata').lower()}: "
                    "safetensors holds only arrays")
            arrays[name] = leaf
        # Numbers in names as numbers (layers.2 before layers.10): this decides the shards.
        self.specs = [TensorSpec(n, dtype_for_numpy(arrays[n].dtype), tuple(arrays[n].shape))
                      for n in sorted(arrays, key=natural_key)]
        use_ocdbt = type_handlers.is_ocdbt_checkpoint(epath.Path(item_dir))
        use_zarr3 = bool(getattr(tree_metadata, "use_zarr3", False))
        context = ts.Context({"cache_pool": {"total_bytes_limit": cache_bytes},
                              "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
                              "file_io_concurrency": {"limit": 32}})
        opened = {name: ts.open(_read_spec(item_dir, meta.name, use_ocdbt, use_zarr3), open=True,
                                context=context) for name, meta in arrays.items()}
        self._stores = {name: future.result() for name, future in opened.items()}
        custom = getattr(tree_metadata, "custom_metadata", None)
        self.metadata = {k: v for k, v in (custom or {}).items() if isinstance(v, str)} \
            if isinstance(custom, MappingABC) else {}
        self._lock = threading.Lock()  # one band decoded at a time, across tensors
        self._bands: dict[str, _Band] = {}

    def chunks(self, name: str) -> tuple[int, ...]:
        """The storage chunk of array ``name`` (what TensorStore decodes at once)."""
        store = self._stores[name]
        return tuple(c or s for c, s in zip(store.chunk_layout.read_chunk.shape, store.shape))

    def read_block(self, info: TensorInfo, block: Box | None) -> memoryview:
        store = self._stores[info.name]
        if block is None or not block:
            return to_bytes(np.asarray(store.read().result()))
        if any(box != (0, size) for box, size in zip(block[1:], store.shape[1:])):
            return to_bytes(np.asarray(store[tuple(slice(a, b) for a, b in block)].read().result()))
        start, stop = block[0]
        band_rows = store.chunk_layout.read_chunk.shape[0] or store.shape[0]
        band_start = start // band_rows * band_rows
        band_stop = min(band_start + band_rows, store.shape[0])
        if band_rows <= stop - start or stop > band_stop:  # whole chunks, or across two bands
            return to_bytes(np.asarray(store[start:stop].read().result()))
        with self._lock:
            band = self._bands.get(info.name)
            if band is None or band.start != band_start:
                self._bands.pop(info.name, None)  # freed before the next one is read
                band = _Band(band_start, band_stop - band_start,
                             np.asarray(store[band_start:band_stop].read().result()))
                self._bands[info.name] = band
            rows = band.rows[start - band_start:stop - band_start]
            band.left -= stop - start
            if band.left <= 0:
                del self._bands[info.name]
            return to_bytes(rows.copy())


def _read_spec(item_dir: str, param_name: str, use_ocdbt: bool, use_zarr3: bool) -> dict:
    """Orbax's own TensorStore read spec for one array of the checkpoint."""
    info = type_handlers.ParamInfo(name=param_name, parent_dir=epath.Path(item_dir),
                                   is_ocdbt_checkpoint=use_ocdbt, use_zarr3=use_zarr3)
    spec = type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)
    return spec


# ---------------------------------------------------------------- safetensors → Orbax


_IN_FLIGHT = 3  # chunks read, transformed or written at once (each about 3 chunks of memory)


async def _all(coroutines: Iterator[Any]) -> None:
    """Awaits all; every one has finished before a failure is raised (the caller then removes
    the staged directory, which TensorStore must no longer be writing into)."""
    outcomes = await asyncio.gather(*coroutines, return_exceptions=True)
    failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
    if failure is not None:
        raise failure


class _Cancelled(Exception):
    """The conversion was interrupted; a chunk not written yet is not written."""


@dataclasses.dataclass(frozen=True, eq=False)
class _OrbaxWrite:
    """One conversion's Orbax output: where each leaf's bytes come from, its chunks, which
    of them this process writes, and the operation the processes share."""

    source: BlockSource
    specs: dict[str, TensorSpec]  # by tree name (the form's root left out)
    chunks: dict[str, tuple[int, ...]]
    mine: dict[str, list[Box]]
    op: Operation
    zarr3: bool

    @classmethod
    def plan(cls, source: BlockSource, op: Operation, chunk_bytes: int, zarr3: bool) -> _OrbaxWrite:
        """Every leaf's chunks, shared out round-robin in a fixed order, so each process knows
        its own without asking. A mapped tree's are tiles, one layer / expert each where the
        mapping stacks them (restored sharded: MaxText); a copied checkpoint's are rows (read
        back as row blocks, ``planning.chunking``)."""
        mapped = isinstance(source, TreeBlocks)
        specs = {spec.name: spec for spec in source.specs}
        chunks = {name: chunk_shape(spec.shape, spec.dtype.bits // 8, chunk_bytes,
                                    source.stacked(name) if mapped else (), tiles=mapped)
                  for name, spec in specs.items()}
        every = [(name, box) for name, spec in specs.items() for box in chunk_boxes(spec.shape, chunks[name])]
        mine: dict[str, list[Box]] = {name: [] for name in specs}
        for name, box in every[jax.process_index()::jax.process_count()]:
            mine[name].append(box)
        return cls(source, specs, chunks, mine, op, zarr3)

    @property
    def nbytes(self) -> int:
        """The bytes this process writes."""
        return sum(self.specs[name].dtype.nbytes(box_shape(box)) for name, boxes in self.mine.items()
                   for box in boxes)

    async def write_leaves(self, infos: MappingABC[str, Any], *, create: bool) -> None:
        """This process's chunks of every leaf, Orbax's ``infos`` giving their specs: all
        leaves at once, ``_IN_FLIGHT`` chunks at a time (read and transformed on threads while
        TensorStore compresses and writes the others)."""
        gate = asyncio.Semaphore(_IN_FLIGHT)
        await _all(self._write_leaf(name, info, gate, create=create) for name, info in infos.items())

    async def _write_leaf(self, name: str, info: Any, gate: asyncio.Semaphore, *, create: bool) -> None:
        spec = self.specs[name]
        if spec.dtype.is_packed:
            raise ArgumentError(f"tensor {name!r}: Orbax cannot store {spec.dtype.code} (sub-byte) arrays")
        tspec = type_handlers.get_json_tspec_write(
            info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=spec.shape, local_shape=spec.shape,
            dtype=spec.dtype.numpy,
            process_index=jax.process_index() if info.is_ocdbt_checkpoint else None)
        _set_chunk_shape(tspec, self.chunks[name])
        store = await ts.open(ts.Spec(tspec), create=create, open=True, assume_metadata=not create,
                              context=info.ts_context)
        tensor = TensorInfo(name, spec.dtype, spec.shape, 0, spec.dtype.nbytes(spec.shape))

        async def one(box: Box) -> None:
            async with gate:
                if self.op.cancelled.is_set():  # a Ctrl-C: the rest is not written
                    raise _Cancelled(name)
                raw = await asyncio.to_thread(self.source.read_block, tensor, box)
                await store[tuple(slice(a, b) for a, b in box)].write(
                    from_bytes(raw, spec.dtype, box_shape(box)))
                self.op.wrote(len(raw))

        await _all(one(box) for box in self.mine[name])


@dataclasses.dataclass(frozen=True, eq=False)
class _StreamedTensor:
    """A leaf of the tree handed to Orbax: a tensor of a block source, not yet read.

    Orbax asks a leaf for little more than its shape and dtype before handing
    it to its ``TypeHandler``; ``_StreamedTensorHandler`` then writes it.
    """

    name: str
    write: _OrbaxWrite

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.write.specs[self.name].shape)

    @property
    def dtype(self) -> np.dtype:
        return self.write.specs[self.name].dtype.numpy

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.write.specs[self.name].dtype.nbytes(self.shape)


class _StreamedTensorHandler(type_handlers.NumpyHandler):
    """Writes ``_StreamedTensor``s as Orbax writes numpy arrays, one chunk at a time.

    The type string stays ``np.ndarray``, so the checkpoint's metadata is that
    of a plain numpy save and any Orbax restore reads it with its own handler.
    Chunks are ``planning.chunking``'s (Orbax would make each array one
    chunk), and each is written whole: nothing is read back and merged, and
    readers can stream them too. This is process 0's half of the write: it
    creates the arrays and writes its share of the chunks, and returns (so
    Orbax merges the processes' OCDBT files and commits) only once every
    process has written its share.
    """

    async def serialize(self, values: Sequence[_StreamedTensor], infos: Sequence[Any],
                        args: Sequence[Any] | None = None) -> list[Any]:
        return [ocp_future.CommitFutureAwaitingContractedSignals(
            self._write_all(values, infos), name="orbax_safetensors_convert")]

    async def _write_all(self, values: Sequence[_StreamedTensor], infos: Sequence[Any]) -> None:
        for info in infos:
            await info.await_path_creation()
        if values:
            await values[0].write.write_leaves({v.name: i for v, i in zip(values, infos)}, create=True)
        if values:
            await asyncio.to_thread(values[0].write.op.exchange, "written", "")


def _set_chunk_shape(spec: dict, chunk: tuple[int, ...]) -> None:
    """Our chunks in Orbax's zarr metadata (zarr v2, or v3's sharding codec)."""
    while "metadata" not in spec and "base" in spec:  # through a ``cast`` driver
        spec = spec["base"]
    metadata = spec["metadata"]
    if "chunks" in metadata:  # zarr v2
        metadata["chunks"] = list(chunk)
    else:  # zarr v3: the storage chunk is the shard; its inner chunks follow
        metadata["chunk_grid"]["configuration"]["chunk_shape"] = list(chunk)
        for codec in metadata.get("codecs", []):
            if codec.get("name") == "sharding_indexed":
                codec["configuration"]["chunk_shape"] = list(chunk)


def _write_orbax(source: BlockSource, dst: Location, options: ConvertOptions, form: OrbaxForm, *,
                 label: str, started: float) -> ConvertStats:
    for spec in source.specs:
        if 0 in spec.shape:
            raise ArgumentError(f"tensor {spec.name!r} has zero size, which Orbax cannot save")
    peers = Peers.collective("convert", dst.url)
    op = Operation(peers)
    write = _OrbaxWrite.plan(source, op, options.stream.block_bytes, form.zarr3)
    op.progress = report = Progress(label, write.nbytes, enabled=options.stream.progress).start()
    # Written beside the target and swapped in: a failure leaves an old checkpoint whole.
    swap = DirectorySwap(dst, peers.share("token", uuid.uuid4().hex[:12]))
    op.on_primary("lock", swap.acquire)
    try:
        if op.is_primary:
            error = None
            try:
                swap.replace(functools.partial(_save_item, write, form, options, source.metadata, dst.url))
            except BaseException as e:
                error = e
            op.agree("committed", error)
        else:
            item = os.path.join(swap.storage.url(swap.staged), *form.item)
            op.run("written", functools.partial(_write_share, write, item, form, dst.url))
            op.agree("committed", None)
    finally:
        if op.is_primary:
            swap.release()
    report.close()
    return ConvertStats(SAFETENSORS, ORBAX, len(write.specs), report.done, 0,
                        time.perf_counter() - started)


def _save_item(write: _OrbaxWrite, form: OrbaxForm, options: ConvertOptions,
               source_metadata: MappingABC[str, str], destination: str, url: str) -> None:
    """Process 0: the Orbax checkpoint at ``url`` (the tree through Orbax's own handler, then
    the step's files of ``form``), staged there for ``destination`` (which errors name)."""
    leaves = {name: _StreamedTensor(name, write) for name in write.specs}
    registry = type_handlers.create_type_handler_registry(  # jax.Array's: Orbax warns without one
        (_StreamedTensor, _StreamedTensorHandler()), (int, type_handlers.ScalarHandler()),
        (jax.Array, type_handlers.ArrayHandler()))
    custom = {**source_metadata, **(options.stream.metadata or {})}
    item = epath.Path(url).joinpath(*form.item)
    item.mkdir(parents=True, exist_ok=True)
    handler = ocp.PyTreeCheckpointHandler(
        use_zarr3=form.zarr3, type_handler_registry=registry,
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0}))
    args = ocp.args.PyTreeSave(form.tree(leaves, nest=options.nest), custom_metadata=custom or None)
    with _orbax_failures(destination):
        before = set(threading.enumerate())
        try:
            handler.save(item, args=args)
            handler.finalize(item)
        except BaseException:
            # Orbax's threads may still be writing (a Ctrl-C reaches only this one): ours stop
            # at their next chunk, which fails Orbax's metadata write after them, and all of
            # the save's threads are waited for before the staged directory goes.
            write.op.cancel()
            for thread in set(threading.enumerate()) - before:
                if type(thread).__name__ == "_SignalingThread":  # Orbax's commit threads
                    with contextlib.suppress(Exception):  # its join re-raises what it raised
                        thread.join()
            with contextlib.suppress(Exception):
                handler.close()
            raise
        handler.close()
    form.write_step_files(item)


def _write_share(write: _OrbaxWrite, item: str, form: OrbaxForm, destination: str) -> None:
    """Processes other than 0: their chunks, into their own OCDBT files of the item that process
    0 is writing (it merges them before committing)."""
    root = tuple(form.root)

    async def run() -> None:
        context = type_handlers.get_ts_context(use_ocdbt=True)
        await write.write_leaves({name: type_handlers.ParamInfo(
            name=".".join(root + (name,)), parent_dir=epath.Path(item), is_ocdbt_checkpoint=True,
            use_zarr3=write.zarr3, ts_context=context) for name in write.specs}, create=False)

    with _orbax_failures(destination):
        asyncio.run(run())


# TensorStore's words for a full disk, which it reports as a ValueError.
_DISK_FULL = re.compile(r"RESOURCE_EXHAUSTED.*(No space left on device|os_error_code='%d')"
                        % errno.ENOSPC, re.DOTALL)


@contextlib.contextmanager
def _orbax_failures(destination: str) -> Iterator[None]:
    """Orbax's failures, as the caller should see them: once, and of the type they are.

    A full disk reaches us as TensorStore reports it, ``ValueError:
    RESOURCE_EXHAUSTED ... No space left on device [os_error_code='28']``: it
    is raised as an ``OSError`` (ENOSPC) naming the destination, as a full disk
    is everywhere else, with TensorStore's error as its cause. Orbax's threads
    also log each error they pass on (absl ``ERROR``, with its traceback):
    while the save runs, such records wait, and those of the error we raise
    are dropped, not printed (all of them after a Ctrl-C: writes still in
    flight fail on the staged directory being removed); any other is logged
    once the save ends.
    """
    absl_logger = logging.getLogger("absl")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or (record.exc_info and record.exc_info[1] is not None):
            held.append(record)
            return False
        return True

    absl_logger.addFilter(hold)
    raised: set[int] = set()
    try:
        yield
    except ValueError as e:
        raised = _chain(e)
        if _DISK_FULL.search(str(e)):
            raise StorageError("no space left on device writing the Orbax checkpoint",
                               url=destination, code=errno.ENOSPC) from e
        raise
    except BaseException as e:
        raised = _chain(e)
        if isinstance(e, KeyboardInterrupt):  # what the writes in flight then hit is ours, not news
            held.clear()
        raise
    finally:
        absl_logger.removeFilter(hold)
        for record in held:
            if not record.exc_info or id(record.exc_info[1]) not in raised:
                absl_logger.handle(record)


def _chain(error: BaseException) -> set[int]:
    """The ids of ``error`` and the exceptions it was raised from or during."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return seen
