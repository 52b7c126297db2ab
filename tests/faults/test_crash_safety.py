"""Crash safety of ``ost.save`` and ``ost.consolidate``: SIGKILL at every point of a save.

A fork server (``tests/support/crash_child.py``) runs each save or consolidation in a
forked worker and kills it with SIGKILL

* right before its k-th file-changing storage operation, for *every* k of an
  unkilled run (kill points are counted by the worker itself, so they are
  exact and reproducible; chunks of a streaming write count, so files also die
  half written), and
* from outside, after a seeded random wall-clock delay within the duration of
  an unkilled run.

After every kill the directory must hold exactly the old or the new values
when the save was an overwrite (an overwrite is atomic: never neither), and
otherwise either those or no loadable checkpoint (``ost.load`` raises
``FileNotFoundError`` or an "interrupted save" ``SafetensorsError``) -- never a mix,
never a subset, never garbage -- and every file under a final name must be a
valid safetensors file for the Rust reference implementation. Then the same
save run again must succeed: without ``overwrite=True`` exactly when nothing
loadable is there (debris of a never-committed save is no reason to refuse),
and it must leave the directory exactly as an uninterrupted save does (no
temporaries, no stale files).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors

import orbax_safetensors as ost
from tests.support import REPO
from tests.support.crash_child import run, tree
from tests.support.multiprocess import MultiProcessError

pytestmark = pytest.mark.slow  # fault injection: SIGKILL at every storage operation

REPO_ROOT = REPO
OLD, NEW = 1, 2  # tree versions: same names, shapes and dtypes; different values
BIG, MEDIUM, SMALL = "1GB", 9000, 5000  # one file; 3 files; 4 files (hf) of ~17 KB of tensors
WALL_CLOCK_KILLS = 6  # per scenario, on top of a kill before every counted operation
_TEMPORARY = re.compile(r"^\..+\.(tmp-[0-9a-f]{12}|old-[0-9a-f]{12}|part-[0-9a-f]{12}-\d{20})$|"
                        r"^\..+\.lock$|^\.orbax_safetensors\.commit-[0-9a-f]{12}\.json$")
_FINAL = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                    r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors|orbax_safetensors\.distributed\.json)$")


class ForkServer:
    """Client of ``python -m tests.support.crash_child``: runs commands in killed (or not) workers."""

    def __init__(self, log: Path):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
        self._log = log
        self._stderr = open(log, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.crash_child"], cwd=REPO_ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, bufsize=1)
        self._messages: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._messages.put(json.loads(line))
        self._messages.put(None)

    def run(self, command: dict, timeout: float = 60.0) -> dict:
        """Runs ``command`` in a fresh worker; returns its messages merged, once it has exited."""
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        result: dict = {}
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if "pid" in result:
                    os.kill(result["pid"], signal.SIGKILL)  # unreaped child of the server
                pytest.fail(f"worker hung on {command}:\n{self._log.read_text()[-4000:]}")
            if message is None:
                pytest.fail(f"the fork server died:\n{self._log.read_text()[-4000:]}")
            result.update(message)
            if message["event"] == "exit":
                return result

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory):
    server = ForkServer(tmp_path_factory.mktemp("crash") / "server.log")
    yield server
    server.close()


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    new: tuple[str, int | str | None]  # layout and max_shard_size of the save (or of consolidate's output)
    old: tuple[str, int | str | None] | None = None  # checkpoint already there (version OLD)
    consolidate: bool = False  # consolidate a distributed checkpoint of NEW instead of saving
    single_file_path: bool = False  # the path is ``.../model.safetensors`` itself, not a directory

    @property
    def overwrite(self) -> bool:
        return self.old is not None


SCENARIOS = [
    Scenario("hf single file, fresh", new=("hf", BIG)),
    Scenario("hf sharded, fresh", new=("hf", SMALL)),
    Scenario("hf sharded over hf sharded, other shard count", new=("hf", SMALL), old=("hf", MEDIUM)),
    Scenario("hf sharded over hf sharded, same file names", new=("hf", SMALL), old=("hf", SMALL)),
    Scenario("hf single file over hf sharded", new=("hf", BIG), old=("hf", SMALL)),
    Scenario("hf sharded over hf single file", new=("hf", SMALL), old=("hf", BIG)),
    Scenario("hf sharded over distributed", new=("hf", MEDIUM), old=("distributed", SMALL)),
    Scenario(".safetensors file path over an existing file", new=("hf", None), old=("hf", None),
             single_file_path=True),
    Scenario("distributed, fresh", new=("distributed", SMALL)),
    Scenario("distributed over distributed, same file names", new=("distributed", SMALL),
             old=("distributed", SMALL)),
    Scenario("distributed over distributed, other file count", new=("distributed", SMALL),
             old=("distributed", MEDIUM)),
    Scenario("distributed over hf sharded", new=("distributed", SMALL), old=("hf", MEDIUM)),
    Scenario("consolidate, fresh dst", new=("hf", SMALL), consolidate=True),
    Scenario("consolidate over hf sharded dst", new=("hf", SMALL), old=("hf", MEDIUM),
             consolidate=True),
]


def _checkpoint_path(scenario: Scenario, root: Path) -> Path:
    return root / "model.safetensors" if scenario.single_file_path else root / "ckpt"


def _prepare(scenario: Scenario, root: Path, src: Path) -> dict:
    """The old checkpoint (if any) under ``root``; returns the command that writes the new one."""
    root.mkdir()
    path = _checkpoint_path(scenario, root)
    if scenario.old is not None:
        layout, size = scenario.old
        ost.save(path, tree(OLD), layout=layout, max_shard_size=size)
    layout, size = scenario.new
    if scenario.consolidate:
        return {"op": "consolidate", "src": str(src), "dst": str(path), "max_shard_size": size,
                "overwrite": scenario.overwrite, "block_bytes": 2048}
    return {"op": "save", "path": str(path), "version": NEW, "layout": layout,
            "max_shard_size": size, "overwrite": scenario.overwrite}


def _same(loaded: dict, expected: dict) -> bool:
    return sorted(loaded) == sorted(expected) and all(
        loaded[k].dtype == expected[k].dtype and loaded[k].shape == expected[k].shape
        and np.array_equal(loaded[k], expected[k]) for k in expected)


def _check_files(directory: Path) -> None:
    """Every name is a final checkpoint name or one of our temporaries; every file under a final
    name is complete (the Rust implementation reads all its tensors) or a valid index."""
    for name in sorted(os.listdir(directory) if directory.is_dir() else []):
        assert _FINAL.match(name) or _TEMPORARY.match(name), f"unexpected file {name!r}"
        if name.startswith("."):
            continue
        path = directory / name
        if name.endswith(".json"):
            json.loads(path.read_text())
            continue
        with safetensors.safe_open(path, framework="numpy") as f:
            for key in f.keys():
                f.get_tensor(key)


def _observe(scenario: Scenario, path: Path) -> str:
    """What a reader finds at ``path`` now: "old", "new", or why there is no checkpoint.
    ``ost.verify`` must agree: clean exactly when something loads."""
    state = _load_state(scenario, path)
    try:
        report = ost.verify(path)
    except FileNotFoundError:
        assert state == "no checkpoint (FileNotFoundError)", state
    else:
        assert report.ok == (state in ("old", "new")), (state, report.problems)
    return state


def _load_state(scenario: Scenario, path: Path) -> str:
    _check_files(path.parent if scenario.single_file_path else path)
    try:
        loaded = ost.load(path)
    except FileNotFoundError:
        return "no checkpoint (FileNotFoundError)"
    except ost.SafetensorsError as e:
        message = str(e)
        if "interrupted save" in message:
            return "SafetensorsError: interrupted save"
        if "in this directory" in message:
            return "SafetensorsError: no index or model file"
        pytest.fail(f"a killed save left a damaged checkpoint: {message}")
    if _same(loaded, tree(NEW)):
        return "new"
    if scenario.old is not None and _same(loaded, tree(OLD)):
        return "old"
    pytest.fail(f"loads as a checkpoint that is neither the old nor the new one: "
                f"{ {k: v.ravel()[:3].tolist() for k, v in sorted(loaded.items())} }")


def _rerun(command: dict, state: str) -> None:
    """The same operation again: needs ``overwrite=True`` exactly when a checkpoint loads."""
    if state in ("old", "new"):
        with pytest.raises(FileExistsError, match="overwrite=True"):
            run({**command, "overwrite": False})
        run({**command, "overwrite": True})
    else:
        run({**command, "overwrite": False})


def _listing(scenario: Scenario, path: Path) -> list[str]:
    return sorted(os.listdir(path.parent if scenario.single_file_path else path))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_sigkill_anywhere_leaves_old_new_or_nothing_and_a_rerun_succeeds(
        scenario, fork_server, tmp_path):
    src = tmp_path / "src"
    if scenario.consolidate:
        ost.save(src, tree(NEW), layout="distributed", max_shard_size=SMALL)
    # An unkilled run: the number of counted operations, its duration, the final listing.
    command = _prepare(scenario, tmp_path / "reference", src)
    reference = fork_server.run(command)
    assert reference["event"] == "exit" and reference.get("code") == 0, reference
    total, seconds = reference["ops"], reference["seconds"]
    again = fork_server.run(_prepare(scenario, tmp_path / "reference-again", src))
    assert again.get("code") == 0 and again["ops"] == total, again
    seconds = min(seconds, again["seconds"])  # the first run may pay for lazy imports
    assert total >= 5, reference
    path = Path(command.get("path") or command["dst"])
    assert _observe(scenario, path) == "new"
    expected_listing = _listing(scenario, path)
    assert not [n for n in expected_listing if n.startswith(".")]

    rng = np.random.default_rng(zlib.crc32(scenario.name.encode()))
    kills = [{"kill_at": k} for k in range(1, total + 2)]  # total + 1: after the last one
    kills += [{"kill_after": float(d)} for d in rng.uniform(0, seconds, WALL_CLOCK_KILLS)]
    states: collections.Counter = collections.Counter()
    for i, kill in enumerate(kills):
        command = _prepare(scenario, tmp_path / f"kill{i}", src)
        path = Path(command.get("path") or command["dst"])
        result = fork_server.run({**command, **kill})
        if "kill_at" in kill and kill["kill_at"] <= total:
            assert result["signal"] == signal.SIGKILL, (kill, result)
        elif result["signal"] != signal.SIGKILL:  # past the last operation, or the clock was late
            assert result.get("code") == 0 and result["event"] == "exit", (kill, result)
        state = _observe(scenario, path)
        if kill.get("kill_at") == 1:  # before anything changed
            assert state == ("old" if scenario.overwrite else "no checkpoint (FileNotFoundError)")
        if scenario.overwrite:  # an overwrite is atomic: never neither
            assert state in ("old", "new"), (kill, state)
        states[state if result["signal"] == signal.SIGKILL else "(not killed) " + state] += 1
        _rerun(command, state)
        assert _observe(scenario, path) == "new", kill
        assert _listing(scenario, path) == expected_listing, kill
    print(f"\n{scenario.name}: {total} counted operations, {len(kills)} kills "
          f"({total + 1} at operations, {WALL_CLOCK_KILLS} wall-clock): "
          + ", ".join(f"{state}: {n}" for state, n in sorted(states.items())))


@pytest.mark.parametrize("marker", ["writing", "legacy"])
def test_a_directory_of_shard_files_with_the_marker_of_a_save_in_progress_is_an_interrupted_save(
        tmp_path, marker):
    """What a ``DirectCommit`` (object stores) leaves when it dies: files at their final names
    and its marker. The marker lists them, so the next save removes them as its own; an
    earlier save's marker (an empty temporary distributed index) lists nothing, and files
    nobody can show are ours are never removed: the save refuses them without overwrite (with
    it, they are replaced)."""
    path = tmp_path / "ckpt"
    ost.save(path, tree(OLD), layout="distributed", max_shard_size=SMALL)
    os.remove(path / "orbax_safetensors.distributed.json")
    shards = sorted(os.listdir(path))
    if marker == "writing":
        (path / ".orbax_safetensors.writing-0123456789ab.json").write_text(json.dumps({"files": shards}))
    else:
        (path / ".orbax_safetensors.distributed.json.tmp-0123456789ab").write_text("{}")
    with pytest.raises(ost.SafetensorsError, match="interrupted save"):
        ost.load(path)
    assert "interrupted save" in str(ost.verify(path).problems)
    if marker == "legacy":
        with pytest.raises(FileExistsError, match="no save of ours wrote"):
            ost.save(path, tree(NEW), layout="distributed", max_shard_size=MEDIUM)
        assert sorted(n for n in os.listdir(path) if not n.startswith(".")) == shards
        ost.save(path, tree(NEW), layout="distributed", max_shard_size=MEDIUM, overwrite=True)
        assert not set(shards) & set(os.listdir(path))
    else:
        ost.save(path, tree(NEW), layout="distributed", max_shard_size=MEDIUM)  # ours: no refusal
    assert _same(ost.load(path), tree(NEW))
    assert not [n for n in os.listdir(path) if n.startswith(".")]


def test_save_without_overwrite_refuses_a_directory_that_loads_as_torch_dcp(tmp_path):
    path = tmp_path / "ckpt"
    ost.save(path, tree(OLD), layout="distributed", max_shard_size=SMALL)
    os.remove(path / "orbax_safetensors.distributed.json")  # torch DCP output has no index
    assert _same(ost.load(path), tree(OLD))
    ost.save(tmp_path / "src", tree(NEW), layout="distributed")
    for write in (lambda: ost.save(path, tree(NEW)), lambda: ost.consolidate(tmp_path / "src", path)):
        with pytest.raises(FileExistsError, match="overwrite=True"):
            write()
    assert _same(ost.load(path), tree(OLD))
    ost.save(path, tree(NEW), overwrite=True)
    assert sorted(os.listdir(path)) == ["model.safetensors"]


def _two_processes(multiprocess, path: Path, layout: str, **kill) -> tuple[list, list | None]:
    """The values NEW saved by 2 processes over OLD; returns each process's count of operations
    (None where a process died) and, if the group failed, the processes' return codes."""
    try:
        results = multiprocess("tests.support.crash_child:multiprocess_save", num_processes=2,
                               devices_per_process=2, timeout=90, args={
                                   "path": str(path), "version": NEW, "layout": layout,
                                   "max_shard_size": SMALL, **kill})
    except MultiProcessError as e:
        return [r.value and r.value["ops"] for r in e.results], [r.returncode for r in e.results]
    return [r.value["ops"] for r in results], None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["hf", "distributed"])
def test_sigkill_of_one_of_two_saving_processes(multiprocess, tmp_path, layout):
    """Each process of a 2-process overwrite is killed once, at a seeded random operation; the
    other one is then killed by the group's failure handling, as a job scheduler would. The
    re-run is a 1-process save, which must replace the files of both processes."""
    reference = tmp_path / "reference"
    ost.save(reference, tree(OLD), layout=layout, max_shard_size=MEDIUM)
    ops, failed = _two_processes(multiprocess, reference, layout)
    assert failed is None and min(ops) >= 2, ops
    assert _same(ost.load(reference), tree(NEW))
    expected_listing = sorted(os.listdir(reference))
    rng = np.random.default_rng(zlib.crc32(layout.encode()))
    states = []
    for victim in (0, 1):
        path = tmp_path / f"victim{victim}"
        ost.save(path, tree(OLD), layout=layout, max_shard_size=MEDIUM)
        # In the second half, where the processes rename and commit: the writes before it go to
        # temporary names, as the single-process test above shows at every operation.
        kill_at = int(rng.integers(ops[victim] // 2 + 1, ops[victim] + 1))
        _, returncodes = _two_processes(multiprocess, path, layout, victim=victim, kill_at=kill_at)
        assert returncodes is not None and returncodes[victim] == -signal.SIGKILL, returncodes
        scenario = Scenario(f"2 processes, {layout}", new=(layout, SMALL), old=(layout, MEDIUM))
        state = _observe(scenario, path)
        states.append(f"process {victim} killed at operation {kill_at}/{ops[victim]}: {state}")
        command = {"op": "save", "path": str(path), "version": NEW, "layout": layout,
                   "max_shard_size": SMALL, "overwrite": True}
        _rerun(command, state)  # one process now: the files of process 2 are replaced too
        assert _observe(scenario, path) == "new"
        single = tmp_path / f"single{victim}"
        run({**command, "path": str(single)})
        assert sorted(os.listdir(path)) == sorted(os.listdir(single))
    print(f"\n2 processes, {layout} (per-process operations {ops}; reference files "
          f"{len(expected_listing)}): " + "; ".join(states))
