"""A load's target matched against a checkpoint: which leaves load, from which stored tensors.

1. ``LoadTarget``: what the call asks for (the target tree, ``strict``, the
   mapping, ``nest``), checked once where the call is made.
2. ``select``: the target flattened into named leaves, each a ``LeafRequest``
   (dtype, shape, a concrete sharding; leaves alike share one), matched by
   name and shape (``match``), or through a mapping (``map_leaves``: each leaf
   an ``Assembly`` of stored pieces). Every mismatch is reported at once,
   unless ``strict=False`` leaves it out.

Pure but for the shardings' devices: nothing is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from orbax_safetensors.engine.core.catalog import Checkpoint
from orbax_safetensors.engine.core.tree_names import flatten_with_names
from orbax_safetensors.errors import (ArgumentError, ArgumentTypeError, MappingError, MissingTensorError,
                                      SafetensorsError)
from orbax_safetensors.planning import rules as mapping_rules
from orbax_safetensors.planning.assembly import Assembly

# What a caller who hit a mismatch may pass instead, per strictness.
_LOOSER = {True: 'pass strict="target" to leave other checkpoint tensors unread, strict=False '
                 "to load the intersection",
           "target": "pass strict=False to load the intersection"}


@dataclasses.dataclass(frozen=True)
class LoadTarget:
    """What a load call asks for: ``ost.load``'s ``target``, and the ``strict``, ``mapping`` and
    ``nest`` of its ``LoadOptions`` (which checked them), checked against the target."""

    tree: Any
    strict: bool | str = True
    mapping: mapping_rules.Mapping | None = None
    nest: bool = False

    def __post_init__(self):
        if self.nest and self.tree is not None:
            raise ArgumentError("nest=True shapes a load without a target; a target gives its own structure")


@dataclasses.dataclass(frozen=True)
class LeafRequest:
    """What the caller wants for one leaf: dtype, shape, and where to put it."""

    dtype: np.dtype | None
    shape: tuple[int, ...] | None
    sharding: jax.sharding.Sharding | None


_ANY = LeafRequest(None, None, None)  # a leaf of no target: as stored, on the host


@dataclasses.dataclass(frozen=True)
class Selection:
    """The target's leaves against a checkpoint. ``names``: the tree leaves' names (without a
    target, the stored tensors'; with a mapping, the tree leaves they make), ``requests``
    beside them; ``assemblies`` (with a mapping): how each is made of stored tensors;
    ``wanted``: the indices of those to load. ``leaves``/``treedef``: the target's."""

    names: list[str]
    requests: list[LeafRequest]
    assemblies: list[Assembly | None] | None
    wanted: list[int]
    leaves: list[Any]
    treedef: Any


def select(checkpoint: Checkpoint, target: LoadTarget) -> Selection:
    """Matches ``target`` against ``checkpoint``; raises every mismatch ``strict`` refuses."""
    if target.tree is None:
        names, leaves, treedef = sorted(checkpoint.tensors), [], None
        requests = [_ANY] * len(names)
    else:
        names, leaves, treedef = flatten_with_names(target.tree)
        seen: dict[tuple[Any, ...], LeafRequest] = {}  # leaves alike share one (100 000 tiny ones)
        requests = [leaf_request(name, leaf, seen) for name, leaf in zip(names, leaves)]
    if target.mapping is None:
        return Selection(names, requests, None, match(checkpoint, names, requests, target.strict),
                         leaves, treedef)
    names, requests, assemblies = map_leaves(checkpoint, target, names, requests)
    wanted = [i for i, assembly in enumerate(assemblies) if assembly is not None]
    return Selection(names, requests, assemblies, wanted, leaves, treedef)


def leaf_request(name: str, leaf: Any, seen: dict[tuple[Any, ...], LeafRequest]) -> LeafRequest:
    """What target leaf ``name`` asks for; ``seen`` holds the requests of leaves alike."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = getattr(leaf, "sharding", None)
        key = (leaf.dtype, leaf.shape, sharding)
        try:
            return seen[key]  # a leaf alike was checked
        except KeyError:
            request = seen[key] = _device_request(name, leaf, sharding)
            return request
        except TypeError:  # a sharding that cannot be hashed
            return _device_request(name, leaf, sharding)
    if isinstance(leaf, (np.ndarray, np.generic)):
        return LeafRequest(leaf.dtype, tuple(leaf.shape), None)
    raise ArgumentTypeError(
        f"target leaf {name!r} is a {type(leaf).__name__}; use a jax.Array, a "
        "jax.ShapeDtypeStruct (without a sharding: a numpy array) or a numpy array")


def _device_request(name: str, leaf: jax.Array | jax.ShapeDtypeStruct,
                    sharding: jax.sharding.Sharding | None) -> LeafRequest:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise ArgumentTypeError(
            f"target leaf {name!r} is a typed PRNG key ({leaf.dtype}), which no checkpoint holds: "
            + ("load the params alone, nnx.split(abstract_model, nnx.Param, ...), or "
               if ".rngs." in f".{name}." else "")
            + "leave it out of the target")
    return LeafRequest(np.dtype(leaf.dtype), tuple(leaf.shape), concrete_sharding(name, sharding))


def concrete_sharding(name: str, sharding: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    """A sharding over devices: ``jax.eval_shape`` of sharded arrays names only an abstract
    mesh (axis names and sizes), which the mesh set with ``jax.sharding.set_mesh`` makes
    concrete."""
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        return sharding
    current = jax.sharding.get_mesh()
    if isinstance(current, jax.sharding.Mesh) and current.devices.size and current.abstract_mesh == mesh:
        return jax.sharding.NamedSharding(current, sharding.spec, memory_kind=sharding.memory_kind)
    raise ArgumentError(
        f"target leaf {name!r} is sharded over an abstract mesh ({mesh}), as jax.eval_shape "
        "returns: load inside `with jax.sharding.set_mesh(mesh):` with the mesh it stands for, "
        "or give shardings on a concrete mesh (ost.target builds them from the checkpoint)")


def match(checkpoint: Checkpoint, names: list[str], requests: list[LeafRequest],
          strict: bool | str) -> list[int]:
    """Indices of the target leaves to load; unless ``strict`` is False, every mismatch at once
    (``MissingTensorError`` when tensors are missing)."""
    missing = [n for n in names if n not in checkpoint.tensors]
    unexpected = sorted(set(checkpoint.tensors) - set(names)) if strict is True else []
    mismatched = [
        f"{n}: checkpoint {checkpoint.tensors[n].shape}, target {r.shape}"
        for n, r in zip(names, requests)
        if n in checkpoint.tensors and r.shape is not None
        and r.shape != checkpoint.tensors[n].shape
    ]
    if strict and (missing or unexpected or mismatched):
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            problems.append(f"in the checkpoint but not the target: {', '.join(unexpected)}")
        if mismatched:
            problems.append("shape mismatch: " + "; ".join(mismatched))
        error = MissingTensorError if missing else SafetensorsError
        raise error(f"target does not match the checkpoint ({_LOOSER[strict]}): " + " | ".join(problems))
    return [
        i for i, (n, r) in enumerate(zip(names, requests))
        if n in checkpoint.tensors
        and (r.shape is None or r.shape == checkpoint.tensors[n].shape)
    ]


def map_leaves(checkpoint: Checkpoint, target: LoadTarget, names: list[str], requests: list[LeafRequest],
               ) -> tuple[list[str], list[LeafRequest], list[Assembly | None]]:
    """Tree names, their requests, and how each leaf is made of stored tensors.

    ``names`` are tree names, or (no target) stored ones, which become the
    tree leaves they map to (a stacked leaf gathers many). A leaf no rule
    maps, or whose stored tensors are missing or of shapes the rule cannot
    map, gets ``None`` (not loaded) unless ``strict``, which reports every
    such leaf at once (``MissingTensorError`` when stored tensors are
    missing), and with ``strict=True`` every stored tensor no leaf uses.
    """
    mapping, strict, from_checkpoint = target.mapping, target.strict, target.tree is None
    shapes = mapping.stored_view({name: tensor.shape for name, tensor in checkpoint.tensors.items()},
                                 {name: tensor.dtype.code for name, tensor in checkpoint.tensors.items()})
    side = "stored" if from_checkpoint else "tree"
    if from_checkpoint:
        names = sorted(shapes)  # a quantized tensor's twin, its scales not a tensor of their own
    unmapped = set(mapping.unmapped(names, side))
    problems = [f"no single rule maps the {side} names: {_some(sorted(unmapped))}"] if unmapped else []
    if from_checkpoint:
        names = list(dict.fromkeys([*(leaf for n in names if n not in unmapped for leaf in mapping.tree_names(n)),
                                    *mapping.constants]))
        requests = [_ANY] * len(names)
        unmapped = set()
    assemblies: list[Assembly | None] = []
    failed: dict[str, list[str]] = {}  # what stops leaves → the leaves it stops
    used: set[str] = set()
    any_missing = False
    for name, request in zip(names, requests):
        assembly = None
        if name not in unmapped:
            try:
                assembly = mapping.assembly(name, tree_shape=request.shape, stored_shapes=shapes)
                missing = [p.stored for p in assembly.pieces if p.stored not in shapes]
                any_missing |= bool(missing)
                if missing:
                    raise MappingError(f"missing from the checkpoint: {', '.join(missing)}")
                wrong = [f"{p.stored} {shapes[p.stored]} (needs {p.transform.stored_shape})"
                         for p in assembly.pieces if tuple(shapes[p.stored]) != p.transform.stored_shape]
                if wrong:
                    raise MappingError(f"shape mismatch: {'; '.join(wrong)}")
                used.update(stored for p in assembly.pieces for stored in p.stored_tensors)
            except MappingError as e:
                failed.setdefault(str(e), []).append(name)
                assembly = None
        assemblies.append(assembly)
    problems += [f"{leaves[0]}: {cause}" if len(leaves) == 1 else
                 f"{cause} (in {len(leaves)} tensors, e.g. {leaves[0]})" for cause, leaves in failed.items()]
    # A quantized module's activation parameters are accounted for: no part of its values.
    used.update(n for q in getattr(shapes, "quantized", {}).values() for n in q.dropped)
    unexpected = sorted(n for n in set(checkpoint.tensors) - used if not mapping.ignores(n))
    if strict is True and unexpected and not from_checkpoint:
        problems.append(f"in the checkpoint but not the target: {', '.join(unexpected)}")
    if strict and problems:
        error = MissingTensorError if any_missing else SafetensorsError
        head = ("the checkpoint does not load through the mapping" if from_checkpoint
                else f"target does not map to the checkpoint ({_LOOSER[strict]})")
        raise error(f"{head}: " + " | ".join(problems))
    return names, requests, assemblies


_NAMED = 5  # names a message lists before it counts the rest


def _some(names: list[str]) -> str:
    """The first few ``names`` and how many more: a mapping of another model family leaves
    every tensor unmapped, thousands of names no one reads on one line."""
    more = f", ... ({len(names)} in all)" if len(names) > _NAMED else ""
    return ", ".join(names[:_NAMED]) + more
