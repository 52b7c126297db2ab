"""An abstract target built from a checkpoint's headers and a sharding rule.

``load`` is driven by its target: the shardings say which bytes each process
reads. Writing that target by hand for a checkpoint someone else made (a Hub
model, a colleague's run) means restating every name and shape the headers
already hold. ``target`` reads them (no tensor bytes) and asks the caller only
for what the checkpoint cannot know: how to lay each tensor over the devices,
as rules from name patterns to ``PartitionSpec``s (the form MaxText, EasyLM and
t5x use) or a function.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import fsspec
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from orbax_safetensors.engine.loading.load import CheckpointMetadata, metadata
from orbax_safetensors.engine.core.tree_names import nest as nest_names
from orbax_safetensors.errors import ArgumentError, ArgumentTypeError

Placement = Union[Sharding, PartitionSpec, None]  # a leaf's: a spec on ``mesh``; None: the host
Rules = Union[Mapping[str, Placement], Sequence[tuple[str, Placement]]]


def target(
    checkpoint: str | os.PathLike | CheckpointMetadata,
    sharding: Sharding | Rules | Callable[[str, jax.ShapeDtypeStruct], Placement] | None = None,
    *,
    mesh: Mesh | None = None,
    dtype: Any = None,
    nest: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> Any:
    """A tree of ``jax.ShapeDtypeStruct`` for every tensor of ``checkpoint``, to pass to ``load``.

    Args:
      checkpoint: a checkpoint path (any fsspec URL; only headers are read) or
        what ``ost.metadata`` returned.
      sharding: how each tensor is laid over the devices:
        a ``jax.sharding.Sharding`` for all of them; or rules, ``{pattern:
        spec}`` or ``[(pattern, spec), ...]``, where the first pattern that
        ``re.search`` finds in a tensor's name gives its ``PartitionSpec`` (on
        ``mesh``) or ``Sharding`` (end with ``(".*", P())`` to replicate the
        rest: a name no rule matches is an error, so none is left on the host
        by accident); or a function of ``(name, ShapeDtypeStruct)`` returning
        either. ``None`` (or a rule's ``None``) leaves the tensor a host numpy
        array (single process only).
      mesh: the mesh ``PartitionSpec``s refer to.
      dtype: the dtype floating-point tensors load as (e.g. ``jnp.bfloat16``);
        integer and bool tensors keep theirs.
      nest: nest by the dots of the names (``{"model": {"layers": {"0": ...}}}``),
        as ``load(..., nest=True)`` returns; ``False`` keeps them flat.
      storage_options, filesystem: as in ``load``.

    Raises ``ValueError`` naming every tensor no rule matches, every spec
    longer than its tensor's rank and every sharding that does not divide its
    tensor's dimensions evenly (JAX places only even shards), and every rule
    pattern that is not a valid regex, before anything is read.
    """
    info = checkpoint if isinstance(checkpoint, CheckpointMetadata) else metadata(
        checkpoint, storage_options=storage_options, filesystem=filesystem)
    placement = _placement_rule(sharding, mesh)
    abstract, unmatched, problems = {}, [], []
    for name, stored in info.tensors.items():
        try:
            placed = _placed(placement(name, stored), mesh, name, tuple(stored.shape))
        except _Unmatched:
            unmatched.append(name)
            continue
        except ValueError as e:
            problems.append(str(e))
            continue
        kind = np.dtype(dtype if dtype is not None and np.issubdtype(stored.dtype, np.inexact)
                        else stored.dtype)
        # What JAX will hold (int64 is int32 unless jax_enable_x64), so the load casts to it
        # under its casting policy rather than JAX truncating behind it.
        kind = kind if placed is None else jax.dtypes.canonicalize_dtype(kind)
        abstract[name] = jax.ShapeDtypeStruct(stored.shape, kind, sharding=placed)
    if unmatched:
        problems.insert(0, f"no rule matches {_listed(unmatched)} (end the rules with "
                           "('.*', P()) to replicate the rest)")
    if problems:
        raise ArgumentError("cannot place every tensor: " + "; ".join(problems[:20]))
    return nest_names(abstract) if nest else abstract


def _listed(names: list[str]) -> str:
    return ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")


class _Unmatched(LookupError):
    """A tensor name no rule's pattern matches."""


def _placement_rule(sharding: Any, mesh: Mesh | None) -> Callable[[str, jax.ShapeDtypeStruct], Placement]:
    if sharding is None or isinstance(sharding, (Sharding, PartitionSpec)):
        return lambda name, stored: sharding
    if callable(sharding):
        return sharding
    rules = list(sharding.items()) if isinstance(sharding, Mapping) else list(sharding)
    compiled = []
    for rule in rules:
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ArgumentTypeError(f"a sharding rule is (pattern, PartitionSpec | Sharding | None); got {rule!r}")
        try:
            pattern = re.compile(rule[0])
        except re.error as e:
            raise ArgumentError(f"sharding rule pattern {rule[0]!r} is not a valid regex: {e}") from None
        compiled.append((pattern, rule[1]))

    def first_match(name: str, stored: jax.ShapeDtypeStruct) -> Placement:
        for pattern, placement in compiled:
            if pattern.search(name):
                return placement
        raise _Unmatched(name)
    return first_match


def _placed(placement: Placement, mesh: Mesh | None, name: str, shape: tuple[int, ...]) -> Sharding | None:
    if isinstance(placement, PartitionSpec):
        if mesh is None:
            raise ArgumentError(f"{name}: a PartitionSpec needs a mesh (pass mesh=)")
        if len(placement) > len(shape):
            spec = ", ".join(map(repr, placement))  # as JAX 0.10+ prints it, whichever JAX this is
            raise ArgumentError(f"{name}: P({spec}) has {len(placement)} axes, the tensor {len(shape)}")
        placement = NamedSharding(mesh, placement)
    if placement is None:
        return None
    if not isinstance(placement, Sharding):
        raise ArgumentTypeError(f"{name}: the sharding rule gave a {type(placement).__name__}; expected a "
                        "PartitionSpec, a Sharding or None")
    _check_divides(placement, name, shape)
    return placement


def _check_divides(sharding: Sharding, name: str, shape: tuple[int, ...]) -> None:
    """JAX places only shards of equal size: a dimension its mesh axes do not divide would
    fail the load, so it fails here, naming the dimension and the axes."""
    try:
        sharding.shard_shape(shape)
        return
    except ValueError as e:
        reason = str(e)
    if isinstance(sharding, NamedSharding):
        for dim, axes in enumerate(sharding.spec):
            named = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            parts = int(np.prod([sharding.mesh.shape[a] for a in named], dtype=np.int64))
            if shape[dim] % parts:
                raise ArgumentError(f"{name}: dimension {dim} of shape {shape} has size {shape[dim]}, "
                                 f"which mesh axes {named} ({parts} shards) do not divide")
    raise ArgumentError(f"{name}: {sharding} does not divide shape {shape}: {reason}")
