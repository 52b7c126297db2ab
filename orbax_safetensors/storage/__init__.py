"""Layer 4: byte I/O behind one interface, chosen from the path's URL."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from orbax_safetensors.storage.base import Storage
from orbax_safetensors.storage.fsspec_storage import FsspecStorage
from orbax_safetensors.storage.local import LocalStorage
from orbax_safetensors.storage.retry import RetryPolicy, StorageError


def storage_for(
    url: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> tuple[Storage, str]:
    """The backend for ``url`` and the path in that backend's own form.

    Local paths (plain or ``file://``) get the file-descriptor fast path;
    every other protocol goes through fsspec, configured by
    ``storage_options`` (the filesystem's constructor arguments: credentials,
    ``endpoint_url``, ...) or given as an already configured ``filesystem``.
    """
    if filesystem is not None:
        if storage_options:
            raise ValueError("pass storage_options or a filesystem, not both")
        fs, path = filesystem, filesystem._strip_protocol(os.fspath(url))
    else:
        fs, path = fsspec.core.url_to_fs(os.fspath(url), **(storage_options or {}))
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(), os.path.abspath(path)
    return FsspecStorage(fs), path.rstrip("/")


__all__ = ["Storage", "FsspecStorage", "LocalStorage", "RetryPolicy", "StorageError",
           "storage_for"]
