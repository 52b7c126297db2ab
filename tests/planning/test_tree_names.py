"""PyTree ↔ tensor names: the rule DESIGN.md fixes, as properties and examples."""

import collections
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import orbax_safetensors as ost
from orbax_safetensors.engine.core.tree_names import flatten_with_names

_KEYS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=6)
_LEAF = st.builds(
    lambda n, seed: np.random.default_rng(seed).standard_normal(n).astype(np.float32),
    st.integers(0, 4), st.integers(0, 2**16))
_TREES = st.recursive(
    _LEAF,
    lambda children: st.one_of(
        st.dictionaries(_KEYS, children, min_size=1, max_size=4),
        st.lists(children, min_size=1, max_size=3),
    ),
    max_leaves=12,
).filter(lambda t: not isinstance(t, np.ndarray))


def _expected_names(tree, prefix=()):
    if isinstance(tree, dict):
        for key in sorted(tree):
            yield from _expected_names(tree[key], prefix + (str(key),))
    elif isinstance(tree, (list, tuple)):
        for i, child in enumerate(tree):
            yield from _expected_names(child, prefix + (str(i),))
    else:
        yield ".".join(prefix)


@settings(max_examples=100, deadline=None)
@given(_TREES)
def test_names_are_key_paths_joined_with_dots(tree):
    try:
        names, leaves, treedef = flatten_with_names(tree)
    except ValueError as e:  # only a real collision may be refused
        expected = list(_expected_names(tree))
        assert len(set(expected)) < len(expected), e
        return
    assert names == list(_expected_names(tree))
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    jax.tree_util.tree_map(np.testing.assert_array_equal, rebuilt, tree)


@settings(max_examples=25, deadline=None)
@given(_TREES)
def test_save_load_round_trip_keeps_structure(tmp_path_factory, tree):
    try:
        names, _, _ = flatten_with_names(tree)
    except ValueError:
        return
    path = tmp_path_factory.mktemp("tree") / "t.safetensors"
    ost.save(path, tree)
    restored = ost.load(path, target=tree)
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, tree)
    assert sorted(ost.load(path)) == sorted(names)


def test_nested_flax_tree_and_flat_hf_dict_name_the_same_tensors(tmp_path):
    rng = np.random.default_rng(0)
    nested = {"model": {"layers": [
        {"mlp": {"kernel": rng.standard_normal((2, 3)).astype(np.float32)}},
        {"mlp": {"kernel": rng.standard_normal((2, 3)).astype(np.float32)}},
    ]}}
    flat = {f"model.layers.{i}.mlp.kernel": nested["model"]["layers"][i]["mlp"]["kernel"]
            for i in range(2)}
    ost.save(tmp_path / "nested.safetensors", nested)
    ost.save(tmp_path / "flat.safetensors", flat)
    from_nested_as_flat = ost.load(tmp_path / "nested.safetensors", target=flat)
    from_flat_as_nested = ost.load(tmp_path / "flat.safetensors", target=nested)
    jax.tree_util.tree_map(np.testing.assert_array_equal, from_nested_as_flat, flat)
    jax.tree_util.tree_map(np.testing.assert_array_equal, from_flat_as_nested, nested)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Dense:
    kernel: np.ndarray
    bias: np.ndarray


def test_dataclass_fields_and_namedtuples_are_named_by_attribute():
    Pair = collections.namedtuple("Pair", ["left", "right"])
    tree = {"dense": _Dense(np.zeros(2), np.ones(1)), "pair": Pair(np.zeros(1), np.ones(1))}
    names, _, _ = flatten_with_names(tree)
    assert names == ["dense.kernel", "dense.bias", "pair.left", "pair.right"]


def test_collision_names_both_paths():
    with pytest.raises(ValueError, match=r"a\.b.*\['a'\]\['b'\].*\['a\.b'\]|a\.b.*\['a\.b'\].*\['a'\]\['b'\]"):
        flatten_with_names({"a.b": np.zeros(1), "a": {"b": np.zeros(1)}})


def test_bare_array_has_no_name():
    with pytest.raises(ValueError, match="bare array"):
        flatten_with_names(np.zeros(3))
