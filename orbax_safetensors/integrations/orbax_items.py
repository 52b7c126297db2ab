"""What the Orbax v0 and v1 handlers share: their arguments and the item they read and write.

A checkpoint step's safetensors item is a directory written by ``ost.save``
(an HF index plus ``model-0000i-of-0000N.safetensors``, or the distributed
layout), so it loads in ``transformers`` and ``safetensors`` as it is. Both
Orbax generations read and write it through these functions; the handlers
only translate Orbax's calling conventions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Mapping
from typing import Any

import fsspec
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orbax_safetensors.engine import (
    async_load,
    LoadOptions,
    SaveOptions,
    WriteSession,
    check_tree,
    load,
    metadata,
    prepare_save,
    with_shorthand,
)
from orbax_safetensors.planning.rules import Mapping as NameMapping
from orbax_safetensors.storage import Location
from orbax_safetensors.integrations.orbax_version import check_orbax_version

check_orbax_version()  # before any Orbax import: a clear error instead of an odd one

from orbax.checkpoint import args as ocp_args  # noqa: E402


_SAVE_FIELDS = ("layout", "max_shard_size", "metadata", "mapping", "checksums", "config", "overwrite")


def _given(args: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """The option fields an Orbax argument was given (``None``: left to its ``options``)."""
    return {name: getattr(args, name) for name in fields if getattr(args, name) is not None}


@dataclasses.dataclass
class SafetensorsSave(ocp_args.CheckpointArgs):
    """Save ``item`` (a PyTree of arrays) as safetensors, as ``ost.save`` does: its options
    as ``options=ost.SaveOptions(...)``, or as the fields below (each ``None`` unless given,
    when it replaces that field of ``options``; not all of ``SaveOptions``' fields are here:
    the rest go through ``options``).

    In Orbax v1 the same object is the checkpointable that asks for
    safetensors: ``ocp.v1.save_checkpointables(path, {"params": SafetensorsSave(params)})``.
    """

    item: Any
    layout: str | None = None
    max_shard_size: int | str | None = None  # None: ost.save's default (one file for *.safetensors)
    metadata: Mapping[str, str] | None = None
    storage_options: Mapping[str, Any] | None = None
    filesystem: fsspec.AbstractFileSystem | None = None
    mapping: NameMapping | None = None
    checksums: bool | None = None
    config: Any = None
    """The model's Hugging Face config, written as ``config.json`` in the item's directory
    (``ost.save``'s ``config``): a step's item is then a model transformers loads."""
    overwrite: bool | None = None
    """Only where the path is the caller's (``SafetensorsLayout.save_checkpointables`` on a
    plain path): replace a checkpoint there, as ``ost.save(..., overwrite=True)`` does.
    Orbax's steps are fresh temporaries, which Orbax itself replaces."""
    options: SaveOptions | None = None
    save_options: SaveOptions = dataclasses.field(init=False, repr=False)
    """What the save is asked to do: ``options`` with the fields given here, resolved once."""

    def __post_init__(self) -> None:
        # Bad options or a bad item raise here, at the caller's line; from inside the handler
        # Orbax would already have started the step and be left waiting on it.
        self.save_options = with_shorthand(SaveOptions, self.options, _given(self, _SAVE_FIELDS))
        _, specs = check_tree(self.item, self.save_options.layout)
        if self.save_options.mapping is not None:
            self.save_options.mapping.map_specs(specs)


@dataclasses.dataclass
class SafetensorsRestore(ocp_args.CheckpointArgs):
    """Restore a safetensors item into the structure, dtypes and shardings of ``item``.

    ``item=None`` restores every tensor as a flat ``{name: array}`` (with a
    ``mapping``, every leaf it makes, by tree name): host numpy arrays in a
    single process; with several processes ``jax.Array``s
    replicated over all devices (a host array is not a global value there),
    which needs every device to fit the whole item, so pass a sharded
    ``item`` for large models. The other fields are those of ``ost.load``:
    ``strict`` and ``mapping`` (``None`` unless given) replace those fields of
    ``options``, an ``ost.LoadOptions``.
    """

    item: Any = None
    strict: bool | str | None = None
    options: LoadOptions | None = None
    storage_options: Mapping[str, Any] | None = None
    filesystem: fsspec.AbstractFileSystem | None = None
    mapping: NameMapping | None = None
    load_options: LoadOptions = dataclasses.field(init=False, repr=False)
    """What the restore is asked to do: ``options`` with the fields given here, resolved once."""

    def __post_init__(self) -> None:
        self.load_options = with_shorthand(LoadOptions, self.options, _given(self, ("strict", "mapping")))


def _url(path: Any) -> str:
    """Orbax hands over ``epath.Path``s; their ``str`` is the URL (``gs://...`` included)."""
    return str(path)


def prepare_item_save(directory: Any, args: SafetensorsSave, *, fresh: bool) -> WriteSession:
    """Plans the item and copies this process's shards to the host; ``start()`` writes.

    The copies make the caller's arrays free as soon as this returns, which is
    what an async Orbax save promises; the writes wait for ``start()`` because
    Orbax may still be creating ``directory`` (and clearing out an interrupted
    attempt at the same step, whose temporary name it reuses). ``fresh``: Orbax's
    temporary, which nothing else holds, so nothing in it is looked at here;
    otherwise the path is the caller's, and taken as ``ost.save`` takes it (a
    checkpoint there is refused unless ``args.overwrite``, then replaced whole).
    """
    return prepare_save(Location.resolve(_url(directory), args.storage_options, args.filesystem),
                        args.item, args.save_options, copy=True, new_directory=fresh)


def restore_item(directory: Any, args: SafetensorsRestore | None) -> Any:
    path, target, kwargs = _restore_call(directory, args)
    return load(path, target, **kwargs)


def start_restore_item(directory: Any, args: SafetensorsRestore | None) -> concurrent.futures.Future:
    """Plans the restore (errors raise here); the future gives the item once read."""
    path, target, kwargs = _restore_call(directory, args)
    return async_load(path, target, **kwargs)


def _restore_call(directory: Any, args: SafetensorsRestore | None) -> tuple[str, Any, dict[str, Any]]:
    """``load``'s arguments for restoring ``args`` from ``directory``."""
    args = args or SafetensorsRestore()
    path = _url(directory)
    target = args.item
    if target is None and jax.process_count() > 1:
        target = _replicated_target(path, args)
    return path, target, dict(options=args.load_options, storage_options=args.storage_options,
                              filesystem=args.filesystem)


def _replicated_target(path: str, args: SafetensorsRestore) -> dict[str, jax.ShapeDtypeStruct]:
    """Every leaf the item holds (through ``args.mapping``, the leaves it makes), replicated
    over all devices: a host array is not a global value when there are several processes."""
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), PartitionSpec())
    stored = metadata(path, storage_options=args.storage_options, filesystem=args.filesystem).tensors
    mapping = args.load_options.mapping
    if mapping is None:
        leaves = {name: (t.shape, t.dtype) for name, t in stored.items()}
    else:
        shapes = {name: t.shape for name, t in stored.items()}
        leaves = {}
        for leaf, shape in mapping.tree_shapes(shapes).items():
            assembly = mapping.assembly(leaf, stored_shapes=shapes)
            if assembly.constant is not None:
                leaves[leaf] = (shape, np.dtype(assembly.constant.dtype))
                continue
            first = assembly.pieces[0]
            leaves[leaf] = (shape, first.transform.tree_dtype(stored[first.stored].dtype))
    return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
            for name, (shape, dtype) in leaves.items()}


def item_tensors(directory: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """``{name: ShapeDtypeStruct}`` from the headers: the abstract form of a restored item."""
    return metadata(_url(directory)).tensors
