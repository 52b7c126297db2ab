"""An overwrite under injected errors: ENOSPC, EPERM and EIO at every storage operation.

Each scenario is first run clean to count the file-changing operations of the
local backend it makes; then, for every operation k and every errno, the old
checkpoint (plus the user's own files) is set up afresh and the overwrite runs
with operation k failing once. Afterwards: if the save raised, the error is
the original ``OSError`` (that errno, a file name inside the location) and
exactly the old checkpoint loads with nothing of ours left over; if it
succeeded (the failure hit the clean-up after the commit point), exactly the
new one loads. Either way the user's files are untouched, ``ost.verify``
agrees, and a clean re-run leaves what an uninterrupted save leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import orbax_safetensors as ost
from orbax_safetensors.storage.local import LocalStorage

pytestmark = pytest.mark.slow  # fault injection: errors at every storage operation

MUTATING = ("write", "create_sized", "write_at", "sync", "rename", "remove", "makedirs", "lock",
            "sync_directory")
ERRNOS = (errno.ENOSPC, errno.EPERM, errno.EIO)
USER_FILES = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}",
              "README.md": b"# my model", "notes/x.txt": b"keep me"}


def _tree(version: int, n: int = 6) -> dict[str, np.ndarray]:
    return {f"layers.{i}.w": np.full((48, 40), version * 100 + i, np.float32) for i in range(n)}


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    old: Callable[[Path], None]
    new: Callable[[Path], object]
    path: Callable[[Path], Path]
    config: dict | None = None  # the config= a save passes: committed, it replaces config.json


def _save(layout: str = "hf", size: int | str = "5GB", version: int = 2, n: int = 6,
          config: dict | None = None):
    return lambda path: ost.save(path, _tree(version, n), layout=layout, max_shard_size=size,
                                 overwrite=True, config=config)


NEW_CONFIG = {"model_type": "llama", "hidden_size": 40}


def _source(root: Path) -> Path:
    return root.parent / f"{root.name}-src"


def _old_and_source(root: Path) -> None:
    ost.save(root, _tree(1), max_shard_size=8000)
    if not _source(root).exists():
        ost.save(_source(root), _tree(2), layout="distributed", max_shard_size=8000)


def _consolidate(root: Path):
    return ost.consolidate(_source(root), root, max_shard_size=20000, overwrite=True)


SCENARIOS = [
    Scenario("model.safetensors", _save(version=1), _save(), lambda d: d),
    Scenario("sharded, same files", _save(size=20000, version=1), _save(size=20000), lambda d: d),
    Scenario("sharded 4 files -> 2", _save(size=8000, version=1), _save(size=30000), lambda d: d),
    Scenario("sharded -> model.safetensors", _save(size=8000, version=1), _save(), lambda d: d),
    Scenario("sharded, with config.json", _save(size=8000, version=1),
             _save(size=20000, config=NEW_CONFIG), lambda d: d, NEW_CONFIG),
    Scenario("distributed", _save("distributed", 8000, 1), _save("distributed", 20000), lambda d: d),
    Scenario("x.safetensors path", lambda d: ost.save(d / "x.safetensors", _tree(1)),
             lambda d: ost.save(d / "x.safetensors", _tree(2), overwrite=True),
             lambda d: d / "x.safetensors"),
    Scenario("consolidate over hf", _old_and_source, _consolidate, lambda d: d),
]


class Injector:
    """Counts calls of ``MUTATING`` methods of ``LocalStorage``; fails call ``fail_at`` once."""

    def __init__(self, fail_at: int | None = None, code: int = errno.EIO):
        self.fail_at, self.code, self.calls, self.failed = fail_at, code, [], None

    @contextlib.contextmanager
    def installed(self) -> Iterator[Injector]:
        originals = {m: getattr(LocalStorage, m) for m in MUTATING if hasattr(LocalStorage, m)}

        def wrap(method: str, original):
            def injected(storage, *args, **kwargs):
                self.calls.append((method, args[0] if args else None))
                if len(self.calls) == self.fail_at:
                    self.failed = (method, args[0])
                    raise OSError(self.code, os.strerror(self.code), args[0])
                return original(storage, *args, **kwargs)
            return injected

        try:
            for method, original in originals.items():
                setattr(LocalStorage, method, wrap(method, original))
            yield self
        finally:
            for method, original in originals.items():
                setattr(LocalStorage, method, original)


def _setup(root: Path, scenario: Scenario) -> Path:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for name, data in USER_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    scenario.old(root)
    return scenario.path(root)


def _ours(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def _loads(path: Path, version: int) -> bool:
    loaded, expected = ost.load(path), _tree(version)
    return sorted(loaded) == sorted(expected) and all(
        np.array_equal(loaded[k], expected[k]) for k in expected)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_an_overwrite_failing_at_any_operation_keeps_the_old_checkpoint(tmp_path, scenario):
    root = tmp_path / "ckpt"
    _setup(root, scenario)
    with Injector().installed() as counting:
        scenario.new(root)
    clean_listing = sorted(os.listdir(root))
    operations = len(counting.calls)
    assert operations >= 5, counting.calls
    problems, outcomes = [], {"raised": 0, "committed": 0}
    for k in range(1, operations + 1):
        for code in ERRNOS:
            path = _setup(root, scenario)
            where = f"k={k} {errno.errorcode[code]}"
            with Injector(k, code).installed() as injector:
                try:
                    scenario.new(root)
                    raised = None
                except OSError as e:
                    raised = e
            if injector.failed is None:
                problems.append(f"{where}: no operation {k} this time")
                continue
            where += f" at {injector.failed[0]}({os.path.basename(str(injector.failed[1]))})"
            if raised is not None:
                outcomes["raised"] += 1
                if raised.errno != code or not str(raised.filename or "").startswith(str(root)):
                    problems.append(f"{where}: raised {raised!r} (errno {raised.errno}, "
                                    f"file {raised.filename!r})")
                if not _loads(path, 1):
                    problems.append(f"{where}: the old checkpoint does not load")
                if _ours(root):
                    problems.append(f"{where}: left {_ours(root)}")
            else:
                outcomes["committed"] += 1
                if not _loads(path, 2):
                    problems.append(f"{where}: succeeded but the new checkpoint does not load")
            expected = dict(USER_FILES)
            if raised is None and scenario.config is not None:
                expected["config.json"] = (root / "config.json").read_bytes()
                if json.loads(expected["config.json"]) != scenario.config:
                    problems.append(f"{where}: committed without its config.json")
            if any((root / n).read_bytes() != data for n, data in expected.items()):
                problems.append(f"{where}: the user's files changed")
            if not ost.verify(path).ok:
                problems.append(f"{where}: verify: {ost.verify(path).problems}")
            scenario.new(root)
            if sorted(os.listdir(root)) != clean_listing or not _loads(path, 2):
                problems.append(f"{where}: a clean re-run left {sorted(os.listdir(root))}")
    assert not problems, f"{len(problems)} problems over {operations} operations:\n" + "\n".join(problems[:40])
    # Every operation before the commit point raises; after it, clean-up failures only warn.
    assert outcomes["raised"] >= 3 * len(ERRNOS), outcomes
