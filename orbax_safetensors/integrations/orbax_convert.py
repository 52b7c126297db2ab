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
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
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
    Checkpoint,
    CheckpointBlocks,
    Progress,
    StreamOptions,
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
from orbax_safetensors.index import natural_key
from orbax_safetensors.planning import Box, TensorSpec, box_shape, full_box, row_blocks
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
    bytes_written: int = 0  # tensor bytes (before Orbax's compression)
    files: int = 0  # safetensors files written (0 for an Orbax target)
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / max(self.seconds, 1e-9) / 1e9

    def to_json(self) -> dict[str, Any]:
        return {"source_format": self.source_format, "target_format": self.target_format,
                "tensors": self.tensors, "bytes_written": self.bytes_written, "files": self.files,
                "seconds": round(self.seconds, 3), "gb_per_s": round(self.gb_per_s, 3)}


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    block_bytes: int | str = DEFAULT_BLOCK_BYTES,
    nest: bool = True,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    checksums: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> ConvertStats:
    """Converts an Orbax PyTree checkpoint to safetensors, or safetensors to Orbax.

    The direction follows ``src``: a directory holding Orbax's ``_METADATA``
    (what ``StandardCheckpointer``/``PyTreeCheckpointer`` write; also a
    ``CheckpointManager`` step directory with a single item) becomes an HF
    checkpoint at ``dst``; anything ``ost.metadata`` opens becomes an Orbax
    PyTree checkpoint at ``dst``. See the module docstring for the memory
    bound and the tree shape.

    Args:
      src: the checkpoint to read.
      dst: the directory to write.
      max_shard_size: bytes per output file (safetensors output only).
      block_bytes: the most bytes of one tensor moved at once; peak memory is
        a few blocks (for an Orbax source, at least its largest storage chunk).
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
        something the other format cannot (strings; zero-size arrays for Orbax).
      OSError: writing failed; a full disk is ENOSPC naming ``dst`` (for an
        Orbax ``dst`` too, which TensorStore reports as a ``ValueError``). What
        the conversion staged is removed, and a directory it made for ``dst``.
    """
    started = time.perf_counter()
    options = StreamOptions(max_shard_size, metadata, overwrite, block_bytes, progress, checksums)
    fmt, item = detect_format(src, storage_options, filesystem)
    target = Location.resolve(dst, storage_options, filesystem)
    _check_destination(target, fmt, overwrite=options.overwrite)
    label = f"convert {os.fspath(src)} -> {target.url}"
    if fmt == ORBAX:
        return _orbax_to_safetensors(item, target, options, label=label, started=started)
    with open_checkpoint(Location.resolve(src, storage_options, filesystem)) as checkpoint:
        return _write_orbax(checkpoint, target, options, nest=nest, label=label, started=started)


def detect_format(
    src: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
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


def _check_destination(target: Location, source_format: str, *, overwrite: bool) -> None:
    """Refuses a ``target`` that holds anything, unless ``overwrite``; and, for an Orbax
    output (which replaces the whole directory), one that is not an Orbax checkpoint."""
    if not _occupied(target):
        return
    if not overwrite:
        raise LocationTakenError("already exists and is not empty; pass overwrite=True "
                                 "(--overwrite) to replace it", target.url)
    foreign = _not_orbax(target.url) if source_format == SAFETENSORS else []
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


def _not_orbax(path: str) -> list[str]:
    """The entries of directory ``path`` that are not an Orbax PyTree checkpoint's own (all of
    them where it is not one)."""
    root = epath.Path(path)
    if not root.is_dir():
        return [root.name]
    names = sorted(p.name for p in root.iterdir())
    if _TREE_METADATA_FILE not in names:
        return names
    return [n for n in names if not _ORBAX_ENTRY.match(n)]


def _exists(path: str) -> bool:
    try:
        return epath.Path(path).exists()
    except Exception:  # an fsspec-only URL epath cannot handle: let the reader's error stand
        return True




def _orbax_item_dir(path: str) -> str | None:
    """The Orbax PyTree item directory at ``path``: itself, or a step's only item."""
    if path.endswith(".safetensors"):
        return None
    try:
        root = epath.Path(path)
        if (root / _TREE_METADATA_FILE).exists():
            return os.fspath(root)
        if not root.is_dir():
            return None
        items = sorted(p for p in root.iterdir() if (p / _TREE_METADATA_FILE).exists())
    except Exception:  # not a path Orbax can open (an fsspec-only URL): not an Orbax checkpoint
        return None
    if len(items) > 1:
        raise ArgumentError(
            f"{path!r} is a checkpoint step with several Orbax items "
            f"({', '.join(p.name for p in items)}): convert one of them")
    return os.fspath(items[0]) if items else None


# ---------------------------------------------------------------- Orbax → safetensors


def _orbax_to_safetensors(item_dir: str, target: Location, options: StreamOptions, *,
                          label: str, started: float) -> ConvertStats:
    source = OrbaxBlocks(item_dir)
    stats = write_blocks(target, source, options, label=label, started=started)
    return ConvertStats(ORBAX, SAFETENSORS, len(source.specs), stats.bytes_written, stats.files,
                        stats.seconds)


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
    compressed bytes too.
    """

    def __init__(self, item_dir: str):
        item_dir = os.path.abspath(item_dir) if "://" not in item_dir else item_dir
        tree_metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item_dir))
        tree = getattr(tree_metadata, "tree", tree_metadata)
        names, leaves, _ = flatten_with_names(tree)
        arrays: dict[str, Any] = {}
        for name, leaf in zip(names, leaves):
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
        context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
                              "file_io_concurrency": {"limit": 32}})
        opened = {name: ts.open(_read_spec(item_dir, meta.name, use_ocdbt, use_zarr3), open=True,
                                context=context) for name, meta in arrays.items()}
        self._stores = {name: future.result() for name, future in opened.items()}
        custom = getattr(tree_metadata, "custom_metadata", None)
        self.metadata = {k: v for k, v in (custom or {}).items() if isinstance(v, str)} \
            if isinstance(custom, Mapping) else {}
        self._lock = threading.Lock()  # one band decoded at a time, across tensors
        self._bands: dict[str, _Band] = {}

    def read_block(self, info: TensorInfo, block: Box | None) -> memoryview:
        store = self._stores[info.name]
        if block is None or not block:
            return to_bytes(np.asarray(store.read().result()))
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


@dataclasses.dataclass(frozen=True, eq=False)
class _StreamedTensor:
    """A leaf of the tree handed to Orbax: a safetensors tensor, not yet read.

    Orbax asks a leaf for little more than its shape and dtype before handing
    it to its ``TypeHandler``; ``_StreamedTensorHandler`` then reads the bytes.
    """

    name: str
    blocks: CheckpointBlocks
    block_bytes: int
    report: Progress

    @property
    def source(self):
        return self.blocks.checkpoint.tensors[self.name]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.source.dtype.numpy

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.source.nbytes


class _StreamedTensorHandler(type_handlers.NumpyHandler):
    """Writes a ``_StreamedTensor`` as Orbax writes a numpy array, one row block at a time.

    The type string stays ``np.ndarray``, so the checkpoint's metadata is that
    of a plain numpy save and any Orbax restore reads it with its own handler.
    Chunks are row blocks of at most ``block_bytes`` (Orbax would make the
    whole array one chunk), so each block written completes whole chunks:
    nothing is read back and merged, and readers can stream them too.
    """

    async def serialize(self, values: Sequence[_StreamedTensor], infos: Sequence[Any],
                        args: Sequence[Any] | None = None) -> list[Any]:
        return [ocp_future.CommitFutureAwaitingContractedSignals(
            self._write_all(values, infos), name="orbax_safetensors_convert")]

    async def _write_all(self, values: Sequence[_StreamedTensor], infos: Sequence[Any]) -> None:
        for value, info in zip(values, infos):
            await info.await_path_creation()
            if jax.process_index() == 0:
                await self._write_one(value, info)

    async def _write_one(self, value: _StreamedTensor, info: Any) -> None:
        dtype = value.source.dtype
        if dtype.is_packed:
            raise ArgumentError(f"tensor {value.name!r}: Orbax cannot store {dtype.code} "
                             "(sub-byte) arrays")
        blocks = row_blocks(full_box(value.shape), dtype.bits // 8, value.block_bytes)
        spec = type_handlers.get_json_tspec_write(
            info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=value.shape,
            local_shape=value.shape, dtype=value.dtype,
            process_index=jax.process_index() if info.is_ocdbt_checkpoint else None)
        _set_chunk_shape(spec, box_shape(blocks[0]) if value.shape else ())
        store = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
        tensor = TensorInfo(value.name, dtype, value.shape, 0, value.nbytes)
        for block in blocks:
            raw = await asyncio.to_thread(value.blocks.read_block, tensor, block)
            array = from_bytes(raw, dtype, box_shape(block))
            await store[tuple(slice(a, b) for a, b in block)].write(array)
            value.report.advance(len(raw))
            del raw, array


def _set_chunk_shape(spec: dict, chunk: tuple[int, ...]) -> None:
    """Row-block chunks in Orbax's zarr metadata (zarr v2, or v3's sharding codec)."""
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


def _write_orbax(checkpoint: Checkpoint, dst: Location, options: StreamOptions, *, nest: bool,
                 label: str, started: float) -> ConvertStats:
    names = sorted(checkpoint.tensors, key=natural_key)
    for name in names:
        if 0 in checkpoint.tensors[name].shape:
            raise ArgumentError(f"tensor {name!r} has zero size, which Orbax cannot save")
    report = Progress(label, sum(checkpoint.tensors[n].nbytes for n in names),
                      enabled=options.progress).start()
    blocks = CheckpointBlocks(checkpoint)
    leaves = [_StreamedTensor(n, blocks, options.block_bytes, report) for n in names]
    tree = nest_names(dict(zip(names, leaves))) if nest else dict(zip(names, leaves))
    registry = type_handlers.create_type_handler_registry(
        (_StreamedTensor, _StreamedTensorHandler()))
    custom = {**checkpoint.metadata, **(options.metadata or {})}
    # Written beside the target and swapped in: a failure leaves an old checkpoint whole.
    swap = DirectorySwap(dst, uuid.uuid4().hex[:12])
    swap.acquire()
    try:
        def save(url: str) -> None:
            with _orbax_failures(dst.url), ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
                    type_handler_registry=registry)) as saver:
                saver.save(epath.Path(url),
                           args=ocp.args.PyTreeSave(tree, custom_metadata=custom or None))
        swap.replace(save)
    finally:
        swap.release()
    report.close()
    return ConvertStats(SAFETENSORS, ORBAX, len(names), report.done, 0,
                        time.perf_counter() - started)


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
    also log each error they pass on with its traceback (absl ``ERROR``):
    while the save runs, such records wait, and those of the error we raise
    are dropped, not printed; any other is logged once the save ends.
    """
    absl_logger = logging.getLogger("absl")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
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
        raise
    finally:
        absl_logger.removeFilter(hold)
        for record in held:
            if id(record.exc_info[1]) not in raised:
                absl_logger.handle(record)


def _chain(error: BaseException) -> set[int]:
    """The ids of ``error`` and the exceptions it was raised from or during."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return seen
