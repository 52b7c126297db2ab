"""One family for every error the library raises on purpose: ``ost.Error`` catches
each of them, and each keeps the builtin base a user would catch without knowing the library.

Checked twice: the family itself (every exception class ``orbax_safetensors`` exports is an
``ost.Error`` with its builtin base), and the source (no ``raise`` of a bare builtin exception
for a condition we detect, outside the few places listed below with the reason each is not one).
"""

from __future__ import annotations

import ast
import re
import builtins
import errno
import inspect
from pathlib import Path

import numpy as np
import pytest

import orbax_safetensors as ost
from orbax_safetensors import errors

PACKAGE = Path(ost.__file__).resolve().parent

# Builtin raises that are not conditions a user meets: (file, exception, why).
NOT_ON_PURPOSE = {
    # json.loads hooks: the parser turns them into a SafetensorsError naming the file.
    ("format/header.py", "ValueError"), ("index/hf_index.py", "ValueError"),
    # A backend that declares it cannot write at offsets is never asked to (Capabilities).
    ("storage/base.py", "NotImplementedError"),
    # A short read: the catalog and the readers turn it into a SafetensorsError naming the file.
    ("storage/local.py", "EOFError"), ("storage/fsspec_storage.py", "EOFError"),
    # A lost resumable upload: retry.py retries it, then raises StorageError.
    ("storage/fsspec_storage.py", "ConnectionError"),
    # Submitting to a closed pool is a bug of ours.
    ("storage/executor.py", "RuntimeError"),
    # Cancellation: Ctrl-C, or an Orbax cancel, stops the work as an interrupt.
    ("storage/executor.py", "KeyboardInterrupt"), ("engine/core/operation.py", "KeyboardInterrupt"),
    # The module-level __getattr__ protocol.
    ("__init__.py", "AttributeError"),
}
BUILTINS = {name for name, value in vars(builtins).items()
            if isinstance(value, type) and issubclass(value, BaseException)}


def _builtin_raises() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and isinstance(node.exc.func, ast.Name) and node.exc.func.id in BUILTINS:
                found.append((relative, node.exc.func.id, node.lineno))
    return found


def test_nothing_is_raised_on_purpose_as_a_bare_builtin():
    stray = [f"{file}:{line} raises {name}" for file, name, line in _builtin_raises()
             if (file, name) not in NOT_ON_PURPOSE]
    assert not stray, stray


def test_the_allowed_builtin_raises_are_still_there():
    # An entry whose raise went away must leave the list, or the list stops meaning anything.
    present = {(file, name) for file, name, _ in _builtin_raises()}
    assert NOT_ON_PURPOSE <= present, NOT_ON_PURPOSE - present


def _exported_exceptions() -> list[type[BaseException]]:
    return [value for name in ost.__all__ if inspect.isclass(value := getattr(ost, name, None))
            and issubclass(value, BaseException) and not issubclass(value, Warning)]


def test_every_exported_error_is_in_the_family_with_a_builtin_base():
    exported = _exported_exceptions()
    assert ost.Error in exported and len(exported) > 15
    for cls in exported:
        assert issubclass(cls, ost.Error), cls
        builtin = [base for base in cls.__mro__ if base.__module__ == "builtins"
                   and base not in (Exception, BaseException, object)]
        assert builtin or cls is ost.Error, f"{cls.__name__} has no builtin base a user would catch"
    defined = {value for value in vars(errors).values()
               if inspect.isclass(value) and issubclass(value, ost.Error)}
    assert defined <= set(exported), defined - set(exported)


@pytest.mark.parametrize("cls, builtin", [
    ("ArgumentError", ValueError), ("ArgumentTypeError", TypeError), ("SafetensorsError", ValueError),
    ("MissingFileError", FileNotFoundError), ("MissingTensorError", KeyError),
    ("CheckpointChangedError", ValueError), ("MappingError", ValueError),
    ("CheckpointBusyError", OSError), ("PeerFailedError", OSError), ("StorageError", OSError),
    ("AccessDeniedError", PermissionError), ("UnreachableError", ConnectionError),
    ("ReadOnlyLocationError", OSError), ("ProtocolError", RuntimeError),
    ("UnsupportedOrbaxError", ImportError),
])
def test_each_member_keeps_the_builtin_a_user_would_catch(cls, builtin):
    assert issubclass(getattr(ost, cls), builtin) and issubclass(getattr(ost, cls), ost.Error)


def test_the_family_reaches_the_user_through_the_public_api(tmp_path):
    tree = {"a": np.arange(8, dtype=np.float32)}
    ost.save(tmp_path / "c", tree)
    with pytest.raises(ost.MissingTensorError) as missing:  # a KeyError too
        ost.load(tmp_path / "c", target={"b": np.zeros(8, np.float32)})
    assert isinstance(missing.value, KeyError) and isinstance(missing.value, ost.Error)
    with pytest.raises(ost.ArgumentError) as bad:  # a ValueError too
        ost.save(tmp_path / "d", tree, max_shard_size="five gigabytes")
    assert isinstance(bad.value, ValueError)
    with pytest.raises(ost.ArgumentTypeError):  # a TypeError too
        ost.load(tmp_path / "c", options=ost.LoadOptions(threads="8"))
    with pytest.raises(ost.Error) as taken:
        ost.save(tmp_path / "c", tree)
    assert isinstance(taken.value, FileExistsError) and taken.value.errno == errno.EEXIST
    with pytest.raises(ost.ArgumentError, match="s3x://bucket/x.*Protocol not known"):
        ost.load("s3x://bucket/x")  # a mistyped scheme: fsspec's own ValueError, named
    with pytest.raises(ost.MappingError):
        ost.Mapping([ost.Rule("x.{i}.{i}", "y.{i}")])


def test_the_family_tree_in_the_docs_is_the_real_one():
    # ost.Error's docstring (docs/api.md) draws the family: each line's parent and builtin hold.
    drawn = re.findall(r"^ *([│ ]*)[├└]── (\w+)(?: \((\w+)\))?", ost.Error.__doc__, re.M)
    assert {name for _, name, _ in drawn} == {cls.__name__ for cls in _exported_exceptions()} - {"Error"}
    parents: dict[int, type] = {}
    for indent, name, builtin in drawn:
        cls, depth = getattr(ost, name), len(indent) // 4
        parents[depth + 1] = cls
        assert issubclass(cls, parents.get(depth, ost.Error)), name
        if builtin:
            assert issubclass(cls, getattr(builtins, builtin)), (name, builtin)
