"""Finding a checkpoint's tensors: which files, which headers, which byte ranges.

A path ending in ``.safetensors`` is one file. Anything else is a directory:
its ``model.safetensors.index.json`` when present (and then only the files the
index names are opened), else its ``model.safetensors``. A directory holding
shard files but no index is an interrupted save, since the index is written
last, and is reported as such rather than half-loaded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import PREFIX_SIZE, Header, TensorInfo, header_size, parse_header
from orbax_safetensors.index import INDEX_NAME, SINGLE_FILE_NAME, is_shard_file_name, parse_index
from orbax_safetensors.storage import Storage, storage_for

_FIRST_READ = 1 << 16  # one request usually covers the whole header
_HEADER_THREADS = 16


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A tensor's place in storage: ``file`` and absolute byte ``offset``."""

    info: TensorInfo
    file: str
    offset: int

    @property
    def nbytes(self) -> int:
        return self.info.nbytes


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    storage: Storage
    tensors: dict[str, StoredTensor]
    headers: dict[str, Header]  # file path → header, in file order

    @property
    def metadata(self) -> dict[str, str]:
        """``__metadata__`` of all files merged (they agree in what we write)."""
        merged: dict[str, str] = {}
        for header in self.headers.values():
            for key, value in (header.metadata or {}).items():
                merged.setdefault(key, value)
        return merged


def is_single_file(url: str | os.PathLike) -> bool:
    return os.fspath(url).endswith(".safetensors")


def read_header(storage: Storage, path: str) -> Header:
    """Reads and validates one file's header, in one request when it is small."""
    try:
        size = storage.size(path)
    except FileNotFoundError:
        raise SafetensorsError("file does not exist", file=path) from None
    first = storage.read(path, 0, min(size, _FIRST_READ))
    n = header_size(first, size, file=path)
    raw = first[PREFIX_SIZE:PREFIX_SIZE + n]
    if len(raw) < n:
        raw += storage.read(path, len(first), PREFIX_SIZE + n - len(first))
    return parse_header(raw, size, file=path)


def open_checkpoint(url: str | os.PathLike) -> Checkpoint:
    storage, path = storage_for(url)
    if is_single_file(url):
        files, weight_map = [path], None
    else:
        files, weight_map = _resolve_directory(storage, path, os.fspath(url))
    with concurrent.futures.ThreadPoolExecutor(min(_HEADER_THREADS, len(files))) as pool:
        headers = dict(zip(files, pool.map(lambda f: read_header(storage, f), files)))
    tensors: dict[str, StoredTensor] = {}
    for file, header in headers.items():
        for name, info in header.tensors.items():
            if weight_map is not None and weight_map.get(name) != file:
                continue  # the index decides which file's copy is the tensor
            tensors[name] = StoredTensor(info, file, header.data_start + info.begin)
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise SafetensorsError(
                    f"the index says this tensor is in {file!r}, which does not hold it",
                    file=file, tensor=name)
    return Checkpoint(storage, tensors, headers)


def _resolve_directory(
    storage: Storage, path: str, url: str
) -> tuple[list[str], dict[str, str] | None]:
    index_path = storage.join(path, INDEX_NAME)
    if storage.exists(index_path):
        index = parse_index(storage.read(index_path, 0, storage.size(index_path)), file=index_path)
        files = {name: storage.join(path, name) for name in index.files}
        return list(files.values()), {t: files[f] for t, f in index.weight_map.items()}
    single = storage.join(path, SINGLE_FILE_NAME)
    if storage.exists(single):
        return [single], None
    if not storage.isdir(path):
        raise FileNotFoundError(f"no safetensors checkpoint at {url!r}: it does not exist")
    if any(is_shard_file_name(n) for n in storage.listdir(path)):
        raise SafetensorsError(
            f"holds shard files but no {INDEX_NAME}: an interrupted save? "
            "(the index is written last, so this checkpoint was never committed)",
            file=url)
    raise SafetensorsError(
        f"no {INDEX_NAME} and no {SINGLE_FILE_NAME} in this directory", file=url)
