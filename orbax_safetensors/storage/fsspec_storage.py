"""Any fsspec filesystem (``memory://``, ``gs://``, ``s3://``, ...).

Object stores have no writes at offsets and no rename; this backend maps the
interface onto what fsspec offers (ranged ``cat_file``, streaming ``open``,
``mv``). A checkpoint on such a store is committed by writing its commit
marker last, which the engine does for every backend alike.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Sequence

import fsspec

from orbax_safetensors.storage.base import Storage


class FsspecStorage(Storage):

    default_max_gap = 1 << 20  # a request costs milliseconds; a MiB of transfer about as much

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self.fs = fs

    def join(self, directory: str, name: str) -> str:
        return posixpath.join(directory, name)

    def split(self, path: str) -> tuple[str, str]:
        return posixpath.split(path)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def read(self, path: str, offset: int, length: int) -> bytes:
        return self.fs.cat_file(path, start=offset, end=offset + length)

    def read_scatter(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        wanted = sum(len(v) for v in views)
        data = memoryview(self.read(path, offset, wanted))
        if len(data) != wanted:
            raise EOFError(f"{path}: got {len(data)} bytes at offset {offset}, expected {wanted}")
        position = 0
        for view in views:
            view[:] = data[position:position + len(view)]
            position += len(view)

    def write(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        with self.fs.open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def listdir(self, path: str) -> list[str]:
        return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def rename(self, source: str, destination: str) -> None:
        self.fs.mv(source, destination)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path)
