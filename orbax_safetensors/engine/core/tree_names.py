"""PyTree leaves ↔ tensor names.

A leaf's name is its key path joined with ``.``: dict keys, sequence indices
and dataclass/attribute fields alike. That makes a nested Flax params tree
(``{"model": {"layers": [{"mlp": ...}]}}``) and the flat dict a PyTorch
``state_dict`` gives (``"model.layers.0.mlp"``) name the same tensors, which
is what lets either side load the other's checkpoint by name.

A Flax NNX ``Variable`` (``nnx.Param``, ...) is a node of its own, whose one
child sits under its ``value`` attribute: the name of an ``nnx.split`` state's
leaf leaves that attribute out (``down.kernel``, not ``down.kernel.value``),
so an NNX state, a Linen params dict and a PyTorch ``state_dict`` name the
same tensors alike. The leaves and the tree's structure stay JAX's, so what a
load returns for an NNX target is an NNX state again.
"""

from __future__ import annotations

import sys
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


def _named_paths(tree: Any, paths: list[tuple[Any, ...]],
                 is_leaf: Callable[[Any], bool] | None) -> list[tuple[Any, ...]]:
    """``paths`` (the leaves' key paths, in order) without each NNX ``Variable``'s own key.

    Only where Flax is imported can a tree hold a ``Variable``, and only a path through a
    ``value`` attribute can lead into one: any other tree costs a look at its paths. A
    ``Variable``'s leaves are found again with the ``Variable`` as the root, where its own
    key comes first; a flatten without paths finds the ``Variable``s (one with paths is
    several times slower on a large tree)."""
    variable = getattr(sys.modules.get("flax.nnx"), "Variable", None)
    if variable is None or not any(type(key) is jax.tree_util.GetAttrKey and key.name == "value"
                                   for path in paths for key in path):
        return paths
    outer = jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, variable) or (is_leaf is not None and is_leaf(x)))
    named: list[tuple[Any, ...]] = []
    for node in outer:
        if not isinstance(node, variable):
            named.append(paths[len(named)])
            continue
        for inner, _ in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_leaf)[0]:
            path = paths[len(named)]  # the Variable's path, its key (inner[0]), the rest of inner
            named.append(path[:len(path) - len(inner)] + inner[1:])
    return named


def flatten_with_names(
    tree: Any, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[str], list[Any], Any]:
    """``(names, leaves, treedef)``; raises if two leaves would share a name."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    named = _named_paths(tree, [path for path, _ in pairs], is_leaf)
    pairs = [(path, leaf) for path, (_, leaf) in zip(named, pairs)]
    names = [path_name(path) for path, _ in pairs]
    if len(set(names)) < len(names) or "" in names or not all(named):  # at C speed: 100 000 leaves
        _refuse_names(names, named)
    return names, [leaf for _, leaf in pairs], treedef


def _refuse_names(names: list[str], paths: list[tuple[Any, ...]]) -> None:
    """Raises at the first leaf whose name no file can hold: none, empty, or another's."""
    first_path: dict[str, Any] = {}
    for name, path in zip(names, paths):
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
