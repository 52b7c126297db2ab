"""Where a checkpoint is: a backend, a path in that backend's form, and the URL the user gave.

Resolved once, where a public function receives its path, so everything below
talks to one ``Storage`` and names files the way the user will recognise them.
A path ending in ``.safetensors`` names one file inside a directory (which may
hold other files of the user's); any other path is a checkpoint directory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from orbax_safetensors.storage.base import Storage
from orbax_safetensors.storage.fsspec_storage import FsspecStorage
from orbax_safetensors.storage.local import LocalStorage

SINGLE_FILE_SUFFIX = ".safetensors"


@dataclasses.dataclass(frozen=True)
class Location:
    """A checkpoint's place: ``storage`` reads and writes it, ``path`` is in the backend's form
    (absolute locally, without the protocol elsewhere), ``url`` is what the user passed."""

    storage: Storage
    path: str
    url: str

    @staticmethod
    def resolve(url: str | os.PathLike | Location,
                storage_options: Mapping[str, Any] | None = None,
                filesystem: fsspec.AbstractFileSystem | None = None) -> Location:
        """The backend for ``url`` and the path in its form.

        Local paths (plain or ``file://``) get the file-descriptor backend;
        every other protocol goes through fsspec, configured by
        ``storage_options`` (the filesystem's constructor arguments:
        credentials, ``endpoint_url``, ...) or given as an already configured
        ``filesystem``. A ``Location`` passes through unchanged.
        """
        if isinstance(url, Location):
            return url
        text = os.fspath(url)
        if filesystem is not None:
            if storage_options:
                raise ValueError("pass storage_options or a filesystem, not both")
            fs, path = filesystem, filesystem._strip_protocol(text)
        else:
            fs, path = fsspec.core.url_to_fs(text, **(storage_options or {}))
        if isinstance(fs, LocalFileSystem):
            return Location(LocalStorage(), os.path.abspath(path), text)
        return Location(FsspecStorage(fs), path.rstrip("/"), text)

    @property
    def is_single_file(self) -> bool:
        return self.url.endswith(SINGLE_FILE_SUFFIX)

    @property
    def directory(self) -> str:
        """The directory the checkpoint's files are in (the path itself for a directory)."""
        return self.storage.split(self.path)[0] if self.is_single_file else self.path

    @property
    def file_name(self) -> str | None:
        """The file's name for a single-file location; ``None`` for a directory."""
        return self.storage.split(self.path)[1] if self.is_single_file else None

    def join(self, name: str) -> str:
        """The path of the file ``name`` in the checkpoint's directory."""
        return self.storage.join(self.directory, name)

    def __str__(self) -> str:
        return self.url
