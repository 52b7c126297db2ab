"""``save``: a PyTree of arrays → an HF-compatible safetensors checkpoint.

Commit protocol, the same on every backend: each data file is written under a
temporary name and renamed into place, and the index (for sharded
checkpoints) is written last. A reader therefore sees either the previous
committed checkpoint or the new one, never a half-written file under a final
name. The one exception is a crash in the short window of an *overwrite*
after the old index is removed: then no checkpoint is visible, which the
reader reports as an interrupted save rather than mixing old and new shards.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from orbax_safetensors.engine.checkpoint_reader import is_single_file
from orbax_safetensors.engine.tree_names import flatten_with_names
from orbax_safetensors.format import dtype_for_numpy, to_bytes
from orbax_safetensors.index import INDEX_NAME, SINGLE_FILE_NAME, parse_index
from orbax_safetensors.planning import (
    FilePlan,
    SavePlan,
    TensorSpec,
    plan_hf_checkpoint,
    plan_single_file,
)
from orbax_safetensors.storage import Storage, storage_for

LAYOUTS = ("hf",)
_TEMPORARY = re.compile(r"^\.(.+\.safetensors|.+\.index\.json)\.tmp-[0-9a-f]{12}$")


def save(
    path: str | os.PathLike,
    tree: Any,
    *,
    layout: str = "hf",
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> None:
    """Saves the arrays of ``tree`` as safetensors, named by their key paths.

    Args:
      path: ``.../name.safetensors`` writes exactly that one file; any other
        path is a checkpoint directory (``model.safetensors``, or
        ``model-0000i-of-0000N.safetensors`` plus the index when the tensors
        exceed ``max_shard_size``). Any fsspec URL.
      tree: a PyTree of ``jax.Array`` or numpy arrays.
      layout: ``"hf"``, whole tensors in the Hugging Face layout.
      max_shard_size: bytes per file, as an int or a string like ``"5GB"``.
      metadata: str→str stored in every file's ``__metadata__`` (next to
        ``"format": "pt"``, which transformers requires).
      overwrite: replace a checkpoint already at ``path`` instead of refusing.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    names, leaves, _ = flatten_with_names(tree)
    arrays = dict(zip(names, (_checked_array(n, leaf) for n, leaf in zip(names, leaves))))
    specs = [_spec(name, array) for name, array in arrays.items()]
    storage, target = storage_for(path)
    if is_single_file(path):
        directory, file_name = storage.split(target)
        plan = plan_single_file(file_name, specs, metadata)
        previous = {target} if storage.exists(target) else set()
    else:
        directory = target
        plan = plan_hf_checkpoint(specs, max_shard_size=max_shard_size, metadata=metadata)
        previous = _committed_directory_files(storage, directory, plan)
    if previous and not overwrite:
        raise FileExistsError(
            f"{os.fspath(path)!r} already holds a checkpoint; pass overwrite=True to replace it")
    _commit(storage, directory, plan, arrays, previous)


def _checked_array(name: str, leaf: Any) -> jax.Array | np.ndarray:
    if isinstance(leaf, jax.Array):
        if not leaf.is_fully_addressable:
            raise ValueError(
                f"leaf {name!r} spans several processes; this version saves arrays "
                "held by a single process only")
        return leaf
    if isinstance(leaf, (np.ndarray, np.generic)):
        return np.asarray(leaf)
    raise TypeError(
        f"leaf {name!r} is a {type(leaf).__name__}, not an array; safetensors stores "
        "arrays only (convert scalars with np.asarray, or drop the leaf)")


def _spec(name: str, array: jax.Array | np.ndarray) -> TensorSpec:
    try:
        dtype = dtype_for_numpy(array.dtype)
    except ValueError as e:
        raise ValueError(f"leaf {name!r}: {e}") from None
    spec = TensorSpec(name, dtype, tuple(array.shape))
    try:
        spec.nbytes
    except ValueError as e:
        raise ValueError(f"leaf {name!r}: {e}") from None
    return spec


def _file_chunks(plan: FilePlan, arrays: Mapping[str, Any]) -> Iterator[memoryview | bytes]:
    """The file's bytes in order, one tensor on the host at a time."""
    yield plan.header
    for info in plan.tensors:
        yield to_bytes(np.asarray(arrays[info.name]))


def _commit(
    storage: Storage,
    directory: str,
    plan: SavePlan,
    arrays: Mapping[str, Any],
    previous: set[str],
) -> None:
    """Writes ``plan`` and makes it the committed checkpoint, replacing ``previous``."""
    storage.makedirs(directory)
    final = {f.name: storage.join(directory, f.name) for f in plan.files}
    index_path = storage.join(directory, INDEX_NAME)
    token = uuid.uuid4().hex[:12]
    temporary = {name: storage.join(directory, f".{name}.tmp-{token}") for name in final}
    try:
        for file_plan in plan.files:
            storage.write(temporary[file_plan.name], _file_chunks(file_plan, arrays))
    except BaseException:
        for path in temporary.values():
            storage.remove(path)
        raise
    if index_path in previous:
        storage.remove(index_path)  # uncommit the old checkpoint before its files change
    for name, path in final.items():
        storage.rename(temporary[name], path)
    if plan.index is not None:
        index_temporary = storage.join(directory, f".{INDEX_NAME}.tmp-{token}")
        storage.write(index_temporary, [plan.index])
        storage.rename(index_temporary, index_path)
    leftovers = {  # temporaries of earlier saves into this directory that crashed
        storage.join(directory, name)
        for name in storage.listdir(directory) if _TEMPORARY.match(name)}
    kept = set(final.values()) | ({index_path} if plan.index is not None else set())
    for stale in (previous - kept) | leftovers:
        storage.remove(stale)


def _committed_directory_files(storage: Storage, directory: str, plan: SavePlan) -> set[str]:
    """Files of the checkpoint this save would replace (empty if there is none)."""
    index_path = storage.join(directory, INDEX_NAME)
    if storage.exists(index_path):
        index = parse_index(storage.read(index_path, 0, storage.size(index_path)), file=index_path)
        return {storage.join(directory, name) for name in index.files} | {index_path}
    names = {f.name for f in plan.files} | {SINGLE_FILE_NAME}
    return {p for p in (storage.join(directory, n) for n in names) if storage.exists(p)}
