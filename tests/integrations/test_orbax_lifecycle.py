"""Trust through Orbax's lifecycle: what a layout or manager save promises when the path
already holds a checkpoint, when another item of the step fails, when the script ends with a
save pending, and what a restore without a target gives on several processes.

Each test failed before its fix (main at ee7f7f4): the layout wrote ``model.safetensors``
beside an old index (two checkpoints in one directory, ``ost.load`` returning the old
weights); a Composite save whose other item failed went on writing our item into the step's
temporary directory; a script ending with a manager save pending lost the step with status 0
and nothing said; a path ending in ``.safetensors`` could not be saved through the layout;
``SafetensorsRestore(mapping=m)`` without ``item`` failed on two processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp_v1
import pytest

import orbax_safetensors as ost
from tests.support import REPO

_MODULE = "tests.integrations.test_orbax_lifecycle"


def _tree(offset: float = 0.0) -> dict[str, np.ndarray]:
    return {"layers.0.w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + offset,
            "layers.1.w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) * 2 + offset}


def _save_through_layout(path, checkpointable) -> None:
    async def save():
        await (await ost.SafetensorsLayout().save_checkpointables(
            path, checkpointables={"state": checkpointable}))
    asyncio.run(save())


def _files(directory) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, f), directory)
                  for root, _, files in os.walk(directory) for f in files)


def test_a_layout_save_onto_a_checkpoint_is_refused_and_an_overwrite_replaces_it_whole(tmp_path):
    """Orbax's steps are fresh temporaries; a plain path is the caller's, taken as ``ost.save``
    takes it. Before: ``model.safetensors`` went beside the old index and shards, ``ost.load``
    kept returning the old weights and transformers the new ones."""
    path = tmp_path / "ckpt"
    ost.save(path, _tree(), max_shard_size=10_000)  # an index and two shards
    before = _files(path)
    with pytest.raises(FileExistsError, match="overwrite"):
        _save_through_layout(path, _tree(1.0))
    assert _files(path) == before  # nothing written beside it
    _save_through_layout(path, ost.SafetensorsSave(_tree(1.0), overwrite=True))
    assert _files(path) == ["model.safetensors"]  # the old checkpoint replaced whole
    for name, value in ost.load(path).items():
        np.testing.assert_array_equal(value, _tree(1.0)[name])
    assert ost.verify(path).ok


def test_a_layout_save_never_awaited_lets_the_path_go(tmp_path):
    """The caller gave up before awaiting the writes: no lock is left on its path (the next
    save there was refused as busy), nothing is written, and the directory it made is gone."""
    path = tmp_path / "ckpt"

    async def give_up():
        await ost.SafetensorsLayout().save_checkpointables(path, checkpointables={"state": _tree()})
    asyncio.run(give_up())
    gc.collect()
    assert not path.exists()
    ost.save(path, _tree(1.0))
    np.testing.assert_array_equal(ost.load(path)["layers.0.w"], _tree(1.0)["layers.0.w"])


def test_a_layout_save_to_a_safetensors_path_writes_one_file(tmp_path):
    """The docstring's promise: a path ending in ``.safetensors`` is one file (the default
    ``max_shard_size`` was passed on and refused there)."""
    path = tmp_path / "model.safetensors"
    _save_through_layout(path, _tree())
    assert os.path.isfile(path)
    for name, value in ost.load(path).items():
        np.testing.assert_array_equal(value, _tree()[name])
    with pytest.raises(ValueError, match="max_shard_size"):
        _save_through_layout(tmp_path / "other.safetensors",
                             ost.SafetensorsSave(_tree(), max_shard_size="1MB"))


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_step_whose_other_item_fails_gets_none_of_our_writes_and_its_retry_works(tmp_path, asynchronous):
    """Another item of the Composite fails in its ``async_save``: ``mngr.save`` raises, and our
    writes, which start only when Orbax commits the step, never start. Before, our writer ran
    on and wrote ``model.safetensors`` into the step's temporary directory (a retry then
    failed on its temporaries, or with async checkpointing got the failed attempt's tensors)."""
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous)
    with ocp.CheckpointManager(tmp_path, options=options) as mngr:
        with pytest.raises(ValueError, match="Unsupported type"):
            mngr.save(0, args=ocp.args.Composite(params=ost.SafetensorsSave(_tree()),
                                                 other=ocp.args.StandardSave({"x": object()})))
        time.sleep(1.0)  # what a writer left running would have written by now
        assert not [f for f in _files(tmp_path) if f.endswith(".safetensors")], _files(tmp_path)
        mngr.save(0, args=ocp.args.Composite(params=ost.SafetensorsSave(_tree(1.0)),
                                             other=ocp.args.StandardSave({"x": np.ones(3)})))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0]
        restored = mngr.restore(0, args=ocp.args.Composite(params=ost.SafetensorsRestore()))
    for name, value in restored["params"].items():
        np.testing.assert_array_equal(value, _tree(1.0)[name])


# The child imports tests.support.exit_without_threads: its exit starts no thread, as on Python 3.12.0-1.
_CHILD_ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
    [str(REPO), os.environ.get("PYTHONPATH", "")])}
_SCRIPT = """
import tests.support.exit_without_threads
import errno, numpy as np, orbax.checkpoint as ocp, orbax_safetensors as ost
from orbax_safetensors.storage.local import LocalStorage
if {disk_full!r}:
    def write_at(self, *args):
        raise OSError(errno.ENOSPC, "No space left on device")
    LocalStorage.write_at = write_at
params = {{"w": np.arange(1 << 20, dtype=np.float32)}}
mngr = ocp.CheckpointManager({directory!r})
mngr.save(0, args=ocp.args.Composite(params=ost.SafetensorsSave(params)))
{ending}
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending,status", [("", 1), ("mngr.close()", 0), ("mngr.wait_until_finished()", 0)])
def test_a_script_ending_with_a_manager_save_pending_says_which_and_exits_1(tmp_path, ending, status):
    """Orbax commits a step in a thread the end of the script cuts short (its own items are
    lost the same way). Before: the step lost, status 0, nothing said (or a 300 s hang).
    Now: never a hang, the item not committed named on stderr and status 1; a closed
    manager commits and exits 0."""
    directory = str(tmp_path / "run")
    script = textwrap.dedent(_SCRIPT.format(directory=directory, ending=ending, disk_full=False))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=_CHILD_ENV)
    assert time.monotonic() - started < 100  # never the 300 s wait for a signal that cannot come
    assert done.returncode == status, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("orbax_safetensors:")]
    if status:
        assert len(ours) == 1 and "0.orbax-checkpoint-tmp" in ours[0] and "not committed" in ours[0], ours
        assert "wait_until_finished" in ours[0]
    else:
        assert ours == []
        with ocp.CheckpointManager(directory) as mngr:
            assert mngr.all_steps() == [0]
            np.testing.assert_array_equal(mngr.restore(0)["params"]["w"],
                                          np.arange(1 << 20, dtype=np.float32))


@pytest.mark.slow
def test_a_manager_save_that_failed_and_was_handled_ends_the_script_normally(tmp_path):
    """Our write failed (a full disk): Orbax raises it from ``wait_until_finished``; a script
    that handles it ends with its own status, and the exit adds nothing (the user knows)."""
    ending = textwrap.dedent("""
        try:
            mngr.wait_until_finished()
        except OSError as e:
            print("handled", e.errno)
        """)
    script = textwrap.dedent(_SCRIPT.format(directory=str(tmp_path / "run"), ending=ending,
                                            disk_full=True))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=_CHILD_ENV)
    assert done.returncode == 0 and "handled 28" in done.stdout, done.stderr[-3000:]
    assert not [line for line in done.stderr.splitlines() if line.startswith("orbax_safetensors:")]


def test_v0_restores_a_v1_step_with_a_plain_pytree_beside_ours_through_arguments(tmp_path):
    """What works, exactly (docs/orbax.md says the same): a v1 step holding our item and a plain
    PyTree restores in a v0 manager with arguments for both, or for ours alone. Without
    arguments Orbax's v0 registry cannot name v1's own PyTree handler (Orbax's limit, not the
    shim's: a step of ours alone restores without arguments, tested in
    test_orbax_integration)."""
    values = _tree()
    with ocp_v1.training.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save_checkpointables(3, {"params": ost.SafetensorsSave(values),
                                              "opt": {"m": np.ones(3, np.float32)}})
    with ocp.CheckpointManager(tmp_path) as mngr:
        with pytest.raises(ValueError, match='Item "opt" was found in the checkpoint, but could not be restored'):
            mngr.restore(3)
    with ocp.CheckpointManager(tmp_path) as mngr:
        ours = mngr.restore(3, args=ocp.args.Composite(params=ost.SafetensorsRestore()))
    with ocp.CheckpointManager(tmp_path) as mngr:
        both = mngr.restore(3, args=ocp.args.Composite(params=ost.SafetensorsRestore(),
                                                       opt=ocp.args.StandardRestore()))
    for restored in (both["params"], ours["params"]):
        for name, value in restored.items():
            np.testing.assert_array_equal(value, values[name])
    np.testing.assert_array_equal(both["opt"]["m"], np.ones(3, np.float32))


def test_a_prng_key_in_a_safetensors_save_is_named_where_the_item_is_built():
    """A train state carries its typed PRNG key beside the params: named at the caller's
    line, before Orbax starts a step (was numpy's "Cannot interpret 'key<fry>'")."""
    with pytest.raises(TypeError, match=r"'rng' is a typed PRNG key"):
        ost.SafetensorsSave({"rng": jax.random.key(0), "w": np.zeros(2, np.float32)})


def test_a_missing_shard_restored_through_a_manager_is_a_file_not_found_error(tmp_path):
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=ocp.args.Composite(params=ost.SafetensorsSave(_tree(), max_shard_size=10_000)))
    os.remove(tmp_path / "0" / "params" / "model-00002-of-00002.safetensors")
    with ocp.CheckpointManager(tmp_path) as mngr:
        with pytest.raises(FileNotFoundError, match="model-00002-of-00002") as raised:
            mngr.restore(0, args=ocp.args.Composite(params=ost.SafetensorsRestore()))
    assert isinstance(raised.value, ost.MissingFileError)


_MAPPING = ost.Mapping([ost.Rule("layers.{i}.w", "layers_{i}.kernel", transpose=(1, 0))])


def _child_mapped_restore_without_item(args):
    with ocp.CheckpointManager(args["path"]) as mngr:
        restored = mngr.restore(0, args=ocp.args.Composite(
            params=ost.SafetensorsRestore(mapping=_MAPPING)))["params"]
    return {name: (np.asarray(value.addressable_data(0)).tolist(), value.sharding.is_fully_replicated,
                   value.dtype.name) for name, value in restored.items()}


@pytest.mark.slow
def test_a_mapped_restore_without_item_on_two_processes_gives_the_mapped_leaves_replicated(
        multiprocess, tmp_path):
    """The docstring's promise, with a mapping too: every leaf the mapping makes, replicated
    (was "every target leaf needs a sharding")."""
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=ocp.args.Composite(params=ost.SafetensorsSave(_tree())))
    results = multiprocess(f"{_MODULE}:_child_mapped_restore_without_item", num_processes=2,
                           devices_per_process=4, timeout=300, args={"path": str(tmp_path)})
    for result in results:
        assert sorted(result.value) == ["layers_0.kernel", "layers_1.kernel"]
        for i in (0, 1):
            value, replicated, dtype = result.value[f"layers_{i}.kernel"]
            np.testing.assert_array_equal(np.array(value, np.float32), _tree()[f"layers.{i}.w"].T)
            assert replicated and dtype == "float32"


def test_a_cancelled_item_save_stops_and_is_rolled_back_before_cancel_returns(tmp_path, slow_writes):
    """The handler's commit future, cancelled while writing (Orbax cancels what it gives up
    on): the writers stop and the item's temporaries are gone when ``cancel`` returns; one
    cancelled before Orbax asked for it never writes."""
    handler = ost.SafetensorsCheckpointHandler()
    gate, started = slow_writes
    for when in ("writing", "before"):
        directory = tmp_path / when
        directory.mkdir()
        (future,) = asyncio.run(handler.async_save(directory, ost.SafetensorsSave(_tree())))
        outcome: list[BaseException] = []

        def wait(future=future, outcome=outcome):
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001 -- checked below
                outcome.append(e)

        if when == "writing":
            waiter = threading.Thread(target=wait)
            waiter.start()
            assert started.wait(30)
            threading.Timer(0.2, gate.set).start()  # the write in flight completes, then it stops
            future.cancel()
            assert os.listdir(directory) == []
            waiter.join(30)
        else:
            future.cancel()
            wait()
            assert os.listdir(directory) == []
        assert len(outcome) == 1 and isinstance(outcome[0], concurrent.futures.CancelledError), outcome


@pytest.mark.slow
@pytest.mark.parametrize("other,then,steps", [("meta", "next", [0, 2]), ("z_meta", "next", [0, 2]),
                                              ("z_meta", "close", [0])])
def test_a_step_that_failed_in_another_item_and_was_handled_ends_the_script_normally(tmp_path, other, then,
                                                                                     steps):
    """Step 1 fails in a JSON item (a value JSON cannot hold); the script catches it, then saves
    step 2 and closes the manager, or just closes it. Was: at exit ``the Orbax save of
    .../1.orbax-checkpoint-tmp/params was not committed: the script ended before the
    CheckpointManager finished it`` and status 1, a recovered job reported failed, blaming the
    wrong cause; still so where the other item comes after ours (``z_meta``: our writes had run)."""
    ending = textwrap.dedent(f"""
        try:
            mngr.save(1, args=ocp.args.Composite(params=ost.SafetensorsSave(params),
                                                 {other}=ocp.args.JsonSave({{"a": object()}})))
            mngr.wait_until_finished()
        except TypeError as e:
            print("handled", type(e).__name__)
        if {then!r} == "next":
            mngr.save(2, args=ocp.args.Composite(params=ost.SafetensorsSave(params),
                                                 {other}=ocp.args.JsonSave({{"a": 2}})))
        mngr.close()
        """)
    directory = str(tmp_path / "run")
    script = textwrap.dedent(_SCRIPT.format(directory=directory, ending=ending, disk_full=False))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=_CHILD_ENV)
    assert done.returncode == 0 and "handled TypeError" in done.stdout, done.stderr[-3000:]
    assert not [line for line in done.stderr.splitlines() if line.startswith("orbax_safetensors:")]
    with ocp.CheckpointManager(directory) as mngr:
        assert mngr.all_steps() == steps
        np.testing.assert_array_equal(
            mngr.restore(steps[-1], args=ocp.args.Composite(params=ost.SafetensorsRestore()))["params"]["w"],
            np.arange(1 << 20, dtype=np.float32))
