"""PyTree leaves ↔ tensor names.

A leaf's name is its key path joined with ``.``: dict keys, sequence indices
and dataclass/attribute fields alike. That makes a nested Flax params tree
(``{"model": {"layers": [{"mlp": ...}]}}``) and the flat dict a PyTorch
``state_dict`` gives (``"model.layers.0.mlp"``) name the same tensors, which
is what lets either side load the other's checkpoint by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from orbax_safetensors.errors import ArgumentError


_NAMED_BY = {jax.tree_util.DictKey: "key", jax.tree_util.SequenceKey: "idx",
             jax.tree_util.FlattenedIndexKey: "key", jax.tree_util.GetAttrKey: "name"}


def key_name(key: Any) -> str:
    """One path element as text."""
    attribute = _NAMED_BY.get(type(key))  # JAX's own keys (a tree of 100 000 leaves has as many)
    if attribute is not None:
        return str(getattr(key, attribute))
    for attribute in ("key", "idx", "name"):  # DictKey, SequenceKey/FlattenedIndexKey, GetAttrKey
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def path_name(path: tuple[Any, ...]) -> str:
    return ".".join([key_name(k) for k in path])


def flatten_with_names(
    tree: Any, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[str], list[Any], Any]:
    """``(names, leaves, treedef)``; raises if two leaves would share a name."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    names = [path_name(path) for path, _ in pairs]
    first_path: dict[str, Any] = {}
    for name, (path, _) in zip(names, pairs):
        if not path:
            raise ArgumentError(
                "a bare array has no name: put it in a dict, e.g. {'weight': array}")
        if name == "":
            raise ArgumentError(f"the leaf at {jax.tree_util.keystr(path)} has an empty name; "
                             "safetensors names a tensor by its key path, so give it a key")
        if name in first_path:
            raise ArgumentError(
                f"two leaves are both named {name!r}: {jax.tree_util.keystr(first_path[name])} "
                f"and {jax.tree_util.keystr(path)}; rename one of them")
        first_path[name] = path
    return names, [leaf for _, leaf in pairs], treedef


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": x, "a.c": y}`` → ``{"a": {"b": x, "c": y}}``: the tree whose leaves have
    these names (every key a string, ``"layers.0"`` → ``{"layers": {"0": ...}}``, which
    flattens back to the same names). Raises if one name is a prefix of another, or has an
    empty part, since no tree names its leaves so."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split(".")
        if "" in parts:
            raise ArgumentError(f"tensor name {name!r} has an empty part, so it cannot nest: keep "
                             "the names flat (nest=False)")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        if not isinstance(node, dict) or parts[-1] in node:
            raise ArgumentError(f"cannot nest {name!r}: another tensor's name is a prefix of it, or it "
                             "of another's; keep the names flat (nest=False)")
        node[parts[-1]] = value
    return tree
