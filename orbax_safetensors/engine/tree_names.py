"""PyTree leaves ↔ tensor names.

A leaf's name is its key path joined with ``.``: dict keys, sequence indices
and dataclass/attribute fields alike. That makes a nested Flax params tree
(``{"model": {"layers": [{"mlp": ...}]}}``) and the flat dict a PyTorch
``state_dict`` gives (``"model.layers.0.mlp"``) name the same tensors, which
is what lets either side load the other's checkpoint by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def key_name(key: Any) -> str:
    """One path element as text."""
    for attribute in ("key", "idx", "name"):  # DictKey, SequenceKey/FlattenedIndexKey, GetAttrKey
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def path_name(path: tuple[Any, ...]) -> str:
    return ".".join(key_name(k) for k in path)


def flatten_with_names(
    tree: Any, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[str], list[Any], Any]:
    """``(names, leaves, treedef)``; raises if two leaves would share a name."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    names = [path_name(path) for path, _ in pairs]
    first_path: dict[str, Any] = {}
    for name, (path, _) in zip(names, pairs):
        if name == "":
            raise ValueError(
                "a bare array has no name: put it in a dict, e.g. {'weight': array}")
        if name in first_path:
            raise ValueError(
                f"two leaves are both named {name!r}: {jax.tree_util.keystr(first_path[name])} "
                f"and {jax.tree_util.keystr(path)}; rename one of them")
        first_path[name] = path
    return names, [leaf for _, leaf in pairs], treedef
