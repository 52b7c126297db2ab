"""An Orbax PyTree checkpoint as a block source (``OrbaxBlocks``): what ``convert`` reads.

TensorStore decodes whole storage chunks, and Orbax stores an unsharded array
as one chunk (it only splits arrays above its 2 GB OCDBT target file size),
so reading row blocks of it would decode the array once per block: the rows
one chunk row covers are decoded once and the blocks cut from them (reading
such a checkpoint needs about twice its largest chunk, compressed and
decoded, plus the blocks; glibc may keep some freed chunk buffers resident,
which shows as 3-5x the largest chunk in a process's peak RSS unless
``MALLOC_MMAP_THRESHOLD_`` is set). Checkpoints ``convert`` writes use
chunks of at most a block, so for them the bound is the blocks alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Mapping as MappingABC
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint import type_handlers

from orbax_safetensors.engine import flatten_with_names
from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.format import TensorInfo, dtype_for_numpy, to_bytes
from orbax_safetensors.index import natural_key
from orbax_safetensors.planning import Box, TensorSpec


_CHUNK_ROWS_IN_FLIGHT = 2  # rows of chunks decoded at once for a box that is not whole rows


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

    Only the arrays named ``prefix``… (or one of several) are read (MaxText's
    train state keeps its step and optimizer state beside the params).
    """

    def __init__(self, item_dir: str, *, prefix: str | tuple[str, ...] = "", cache_bytes: int = 0):
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
        # ``__metadata__`` is str → str: any other value (read from Orbax's JSON, so JSON it
        # is) goes as its JSON text rather than being lost on the way.
        self.metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (custom or {}).items()} \
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
            return to_bytes(self._by_chunk_rows(store, block))
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

    def _by_chunk_rows(self, store: Any, block: Box) -> np.ndarray:
        """``block`` of ``store`` (a box that is not whole rows: one layer of a scanned array,
        a band of layers) read a few rows of chunks at a time: TensorStore decodes every chunk
        a read touches at once, and a chunk holding every layer (MaxText's to_maxtext.py
        writes its arrays sliced 16 ways on axis 0) would otherwise have all of a leaf's
        chunks decoded together for one layer's box."""
        rows = store.chunk_layout.read_chunk.shape[0] or store.shape[0]
        (start, stop), rest = block[0], tuple(slice(a, b) for a, b in block[1:])
        out = np.empty(tuple(b - a for a, b in block), store.dtype.numpy_dtype)
        pending: list[tuple[int, int, Any]] = []
        for first in range(start - start % rows, stop, rows):
            a, b = max(first, start), min(first + rows, stop)
            pending.append((a, b, store[(slice(a, b),) + rest].read()))
            if len(pending) == _CHUNK_ROWS_IN_FLIGHT or b == stop:
                for a, b, read in pending:
                    out[a - start:b - start] = read.result()
                pending.clear()
        return out

def _read_spec(item_dir: str, param_name: str, use_ocdbt: bool, use_zarr3: bool) -> dict:
    """Orbax's own TensorStore read spec for one array of the checkpoint."""
    info = type_handlers.ParamInfo(name=param_name, parent_dir=epath.Path(item_dir),
                                   is_ocdbt_checkpoint=use_ocdbt, use_zarr3=use_zarr3)
    spec = type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)
    return spec
