"""Layer 4: byte I/O behind one interface, chosen from the path's URL."""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

from orbax_safetensors.storage.base import Storage
from orbax_safetensors.storage.fsspec_storage import FsspecStorage
from orbax_safetensors.storage.local import LocalStorage


def storage_for(url: str | os.PathLike) -> tuple[Storage, str]:
    """The backend for ``url`` and the path in that backend's own form.

    Local paths (plain or ``file://``) get the file-descriptor fast path;
    every other protocol goes through fsspec.
    """
    fs, path = fsspec.core.url_to_fs(os.fspath(url))
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(), os.path.abspath(path)
    return FsspecStorage(fs), path.rstrip("/")


__all__ = ["Storage", "FsspecStorage", "LocalStorage", "storage_for"]
