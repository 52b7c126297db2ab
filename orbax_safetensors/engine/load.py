"""``load`` and ``metadata``: from storage to host arrays or sharded ``jax.Array``s.

The target tree decides everything about the result: its structure, each
leaf's dtype (conversion happens on the host, after the read) and each leaf's
sharding. Without a target the result is a flat ``{name: numpy array}``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any

import jax
import numpy as np

from orbax_safetensors.engine.checkpoint_reader import Checkpoint, StoredTensor, open_checkpoint
from orbax_safetensors.engine.tree_names import flatten_with_names
from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import from_bytes

_READ_THREADS = 16


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a checkpoint holds, read from headers only (no tensor bytes)."""

    tensors: dict[str, jax.ShapeDtypeStruct]
    metadata: dict[str, str]
    files: dict[str, str]  # tensor name → file name inside the checkpoint


@dataclasses.dataclass(frozen=True)
class _Request:
    """What the caller wants for one leaf: dtype, shape, and where to put it."""

    dtype: np.dtype | None
    shape: tuple[int, ...] | None
    sharding: jax.sharding.Sharding | None


def metadata(path: str | os.PathLike) -> CheckpointMetadata:
    """Names → ``jax.ShapeDtypeStruct``, plus ``__metadata__`` and file of each tensor."""
    checkpoint = open_checkpoint(path)
    return CheckpointMetadata(
        tensors={
            name: jax.ShapeDtypeStruct(t.info.shape, t.info.dtype.numpy)
            for name, t in sorted(checkpoint.tensors.items())
        },
        metadata=checkpoint.metadata,
        files={
            name: checkpoint.storage.split(t.file)[1]
            for name, t in sorted(checkpoint.tensors.items())
        },
    )


def load(path: str | os.PathLike, target: Any = None, *, strict: bool = True) -> Any:
    """Loads a checkpoint into the structure, dtypes and shardings of ``target``.

    Args:
      path: a ``.safetensors`` file or a checkpoint directory (any fsspec URL).
      target: a PyTree whose leaves are ``jax.Array``s or ``jax.ShapeDtypeStruct``s
        (with ``.sharding`` for device arrays), numpy arrays or ``None`` (host
        arrays of the stored dtype). ``None`` loads every tensor into a flat
        ``{name: numpy array}``.
      strict: raise if the target and the checkpoint differ in names or shapes
        (the error lists every offending tensor). With ``strict=False`` only
        tensors present in both with equal shapes are loaded; every other
        target leaf is returned unchanged.
    """
    checkpoint = open_checkpoint(path)
    if target is None:
        names = sorted(checkpoint.tensors)
        requests = [_Request(None, None, None)] * len(names)
        treedef = None
    else:
        names, leaves, treedef = flatten_with_names(target, is_leaf=lambda x: x is None)
        requests = [_request_for(name, leaf) for name, leaf in zip(names, leaves)]
    wanted = _match(checkpoint, names, requests, strict)
    values = _read_all(checkpoint, [(names[i], requests[i]) for i in wanted])
    if treedef is None:
        return dict(zip(names, values))
    result = list(leaves)
    for i, value in zip(wanted, values):
        result[i] = value
    return jax.tree_util.tree_unflatten(treedef, result)


def _request_for(name: str, leaf: Any) -> _Request:
    if leaf is None:
        return _Request(None, None, None)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return _Request(np.dtype(leaf.dtype), tuple(leaf.shape), getattr(leaf, "sharding", None))
    if isinstance(leaf, (np.ndarray, np.generic)):
        return _Request(leaf.dtype, tuple(leaf.shape), None)
    raise TypeError(
        f"target leaf {name!r} is a {type(leaf).__name__}; use a jax.Array, a "
        "jax.ShapeDtypeStruct, a numpy array or None")


def _match(checkpoint: Checkpoint, names: list[str], requests: list[_Request], strict: bool) -> list[int]:
    """Indices of the target leaves to load; in strict mode, every mismatch at once."""
    missing = [n for n in names if n not in checkpoint.tensors]
    unexpected = sorted(set(checkpoint.tensors) - set(names))
    mismatched = [
        f"{n}: checkpoint {checkpoint.tensors[n].info.shape}, target {r.shape}"
        for n, r in zip(names, requests)
        if n in checkpoint.tensors and r.shape is not None
        and r.shape != checkpoint.tensors[n].info.shape
    ]
    if strict and (missing or unexpected or mismatched):
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            problems.append(f"in the checkpoint but not the target: {', '.join(unexpected)}")
        if mismatched:
            problems.append("shape mismatch: " + "; ".join(mismatched))
        raise SafetensorsError(
            "target does not match the checkpoint (pass strict=False to load the "
            "intersection): " + " | ".join(problems))
    return [
        i for i, (n, r) in enumerate(zip(names, requests))
        if n in checkpoint.tensors
        and (r.shape is None or r.shape == checkpoint.tensors[n].info.shape)
    ]


def _read_all(checkpoint: Checkpoint, items: list[tuple[str, _Request]]) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(_READ_THREADS) as pool:
        return list(pool.map(lambda item: _read_one(checkpoint, *item), items))


def _read_one(checkpoint: Checkpoint, name: str, request: _Request) -> Any:
    stored: StoredTensor = checkpoint.tensors[name]
    buffer = np.empty(stored.nbytes, dtype=np.uint8)
    checkpoint.storage.read_into(stored.file, stored.offset, memoryview(buffer))
    try:
        host = from_bytes(buffer, stored.info.dtype, stored.info.shape)
    except ValueError as e:
        raise SafetensorsError(
            f"cannot hold shape {stored.info.shape} in an array: {e}",
            file=stored.file, tensor=name) from None
    if request.dtype is not None and request.dtype != host.dtype:
        host = host.astype(request.dtype)
    if request.sharding is None:
        return host
    return jax.make_array_from_callback(host.shape, request.sharding, lambda index: host[index])
