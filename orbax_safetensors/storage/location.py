"""Where a checkpoint is: a backend, a path in that backend's form, and the URL the user gave.

Resolved once, where a public function receives its path, so everything below
talks to one ``Storage`` and names files the way the user will recognise them.
A path ending in ``.safetensors`` names one file inside a directory (which may
hold other files of the user's); any other path is a checkpoint directory.

``hf://ORG/NAME[@REVISION][/PATH]`` names a commit of a Hugging Face Hub repository:
read in place through ``HfFileSystem``, or offline from the local Hub cache's snapshot
directory with the local backend, and never written (``storage/hf_hub.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from orbax_safetensors.errors import ArgumentError, MissingDependencyError
from orbax_safetensors.storage import hf_hub
from orbax_safetensors.storage.base import Storage
from orbax_safetensors.storage.fsspec_storage import FsspecStorage
from orbax_safetensors.storage.local import LocalStorage

SINGLE_FILE_SUFFIX = ".safetensors"
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # protocol → our extra naming its backend


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

        ``hf://`` URLs (or an ``HfFileSystem`` as ``filesystem``) resolve here,
        once, to one commit of the repository: offline (``HF_HUB_OFFLINE=1`` or
        ``storage_options={"local_files_only": True}``) its snapshot directory
        in the local Hub cache, read with the local backend; online the commit
        on the Hub, read with ranged GETs. ``storage_options`` take a
        ``revision`` and a ``cache_dir`` besides ``HfFileSystem``'s own
        (``token``, ...). Both storages are read-only. A repository or revision
        that is not there raises ``FileNotFoundError`` naming ``url``.
        """
        if isinstance(url, Location):
            return url
        text = os.fspath(url)
        if (hf_hub.is_hub_filesystem(filesystem) if filesystem is not None
                else hf_hub.is_hub_url(text)):
            if filesystem is not None and storage_options:
                raise ArgumentError("pass storage_options or a filesystem, not both")
            return Location(*hf_hub.resolve(text, storage_options, filesystem), text)
        if filesystem is not None:
            if storage_options:
                raise ArgumentError("pass storage_options or a filesystem, not both")
            fs, path = filesystem, filesystem._strip_protocol(text)
        else:
            try:
                fs, path = fsspec.core.url_to_fs(text, **(storage_options or {}))
            except ImportError as e:  # fsspec knows the protocol; its backend is not installed
                protocol = text.split("::")[-1].split("://", 1)[0].lower()
                extra = _EXTRAS.get(protocol)
                hint = (f"pip install 'orbax-safetensors[{extra}]'" if extra
                        else "install the fsspec backend for it")
                raise MissingDependencyError(f"{text!r}: {e}; {hint}") from e
            except ValueError as e:  # a protocol fsspec does not know, options its backend refuses
                raise ArgumentError(f"{text!r}: {e}") from None
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
