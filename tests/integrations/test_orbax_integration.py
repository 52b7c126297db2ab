"""Orbax integration: CheckpointManager training loops, v0 ↔ v1 cross reads, the v1 layout, crashes.

The training loop runs the same code in one process (8 devices) and in two
real JAX processes (2×4): params saved as safetensors, optimizer state as
Orbax standard, asynchronously, ``max_to_keep=2``; the latest step is restored
under another sharding and, on a fresh manager, without arguments.
"""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp_v1
import pytest
import safetensors
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.index import INDEX_NAME
from orbax_safetensors.integrations.orbax_version import (
    SUPPORTED_RANGE,
    UnsupportedOrbaxError,
    check_orbax_version,
)
from tests.support.multiprocess import REPO_ROOT

_MODULE = "tests.integrations.test_orbax_integration"
_STEPS = 5
_MAX_SHARD = 5_000  # several files + an index per step


def _initial_params():
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((128, 16)).astype(ml_dtypes.bfloat16),
        "dense": {"kernel": rng.standard_normal((64, 32)).astype(np.float32),
                  "bias": rng.standard_normal((32,)).astype(np.float32)},
    }


def _update(params, opt_state, step):
    """A deterministic stand-in for an optimizer step (exact in float32 and bfloat16)."""
    params = jax.tree.map(lambda p: (p * 0.5 + step).astype(p.dtype), params)
    opt_state = {"mu": jax.tree.map(lambda m: m * 2 + step, opt_state["mu"]),
                 "count": opt_state["count"] + 1}
    return params, opt_state


def _expected(steps):
    params = _initial_params()
    opt_state = {"mu": jax.tree.map(lambda p: np.zeros(p.shape, np.float32), params),
                 "count": np.int32(0)}
    for step in range(steps):
        params, opt_state = _update(params, opt_state, step)
    return jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, opt_state)


def _shard(tree, spec_for):
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("data", "model"))
    return jax.tree.map(lambda x: jax.make_array_from_callback(
        np.shape(x), NamedSharding(mesh, spec_for(np.ndim(x))),
        lambda index, v=np.asarray(x): v[index]), tree)


def _fsdp(ndim):
    return P(("data", "model")) if ndim else P()


def _tensor_parallel(ndim):
    return P(None, ("data", "model")) if ndim == 2 else P()


def _abstract(tree, spec_for):
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("data", "model"))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), np.asarray(x).dtype, sharding=NamedSharding(mesh, spec_for(np.ndim(x)))), tree)


def _assert_tree_equal(actual, expected):
    flat_actual = jax.tree_util.tree_leaves_with_path(actual)
    flat_expected = jax.tree_util.tree_leaves_with_path(expected)
    assert [p for p, _ in flat_actual] == [p for p, _ in flat_expected]
    for (path, a), (_, e) in zip(flat_actual, flat_expected):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            for shard in a.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(e)[shard.index],
                                              err_msg=str(path))
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=str(path))
        assert np.asarray(e).dtype == a.dtype, path


def _flat_names(tree):
    return {".".join(str(k.key) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def run_training_loop(directory):
    """The loop both tests run; returns what was checked, for the multi-process parent."""
    params = _shard(_initial_params(), _fsdp)
    opt_state = {"mu": _shard(jax.tree.map(lambda p: np.zeros(p.shape, np.float32),
                                           _initial_params()), _fsdp),
                 "count": _shard(np.int32(0), _fsdp)}
    update = jax.jit(_update, static_argnums=2, donate_argnums=(0, 1))
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    with ocp.CheckpointManager(directory, options=options) as mngr:
        for step in range(_STEPS):
            params, opt_state = update(params, opt_state, step)
            mngr.save(step, args=ocp.args.Composite(
                params=ost.SafetensorsSave(params, max_shard_size=_MAX_SHARD,
                                           metadata={"step": str(step)}),
                opt_state=ocp.args.StandardSave(opt_state)))
        # The next update donates the arrays an async save may still be writing from.
        params, opt_state = update(params, opt_state, _STEPS)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [3, 4]
        assert mngr.latest_step() == 4
    assert sorted(os.listdir(directory)) == ["3", "4"]

    expected_params, expected_opt = _expected(_STEPS)
    with ocp.CheckpointManager(directory) as mngr:
        restored = mngr.restore(4, args=ocp.args.Composite(
            params=ost.SafetensorsRestore(_abstract(expected_params, _tensor_parallel)),
            opt_state=ocp.args.StandardRestore(_abstract(expected_opt, _tensor_parallel))))
        _assert_tree_equal(restored["params"], expected_params)
        _assert_tree_equal(restored["opt_state"], expected_opt)
        assert restored["params"]["dense"]["kernel"].sharding.spec == P(None, ("data", "model"))
        item = mngr.item_metadata(4)["params"]
        assert item.metadata["step"] == "4"
        assert {n: (t.shape, t.dtype) for n, t in item.tensors.items()} == {
            n: (v.shape, v.dtype) for n, v in _flat_names(expected_params).items()}

    # A fresh manager, no arguments: the step's typestrs pick the handlers.
    with ocp.CheckpointManager(directory) as mngr:
        restored = mngr.restore(mngr.latest_step())
    _assert_tree_equal(restored["params"], _flat_names(expected_params))
    if jax.process_count() > 1:
        assert all(a.sharding.is_fully_replicated for a in restored["params"].values())

    # The item directory is an HF checkpoint as it stands.
    item_dir = os.path.join(directory, "4", "params")
    index = json.load(open(os.path.join(item_dir, INDEX_NAME)))
    files = set(index["weight_map"].values())
    assert len(files) > 1
    for name, file in index["weight_map"].items():
        with safetensors.safe_open(os.path.join(item_dir, file), "np") as f:
            assert name in f.keys()
    return {"steps": [3, 4], "files": sorted(files)}


def _child_training_loop(args):
    return run_training_loop(args["directory"])


def test_training_loop_single_process(tmp_path):
    run_training_loop(str(tmp_path / "run"))


def test_training_loop_two_processes(multiprocess, tmp_path):
    results = multiprocess(f"{_MODULE}:_child_training_loop", num_processes=2,
                           args={"directory": str(tmp_path / "run")}, timeout=240)
    assert results[0].value == results[1].value


def test_save_interval_steps_and_should_save(tmp_path):
    params = _shard(_initial_params(), _fsdp)
    options = ocp.CheckpointManagerOptions(save_interval_steps=2, max_to_keep=5)
    with ocp.CheckpointManager(tmp_path, options=options) as mngr:
        for step in range(5):
            assert mngr.should_save(step) == (step % 2 == 0)
            mngr.save(step, args=ocp.args.Composite(params=ost.SafetensorsSave(params)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 2, 4]
    assert os.listdir(tmp_path / "4" / "params").count("model.safetensors") == 1


def test_writes_wait_until_orbax_has_created_the_item_directory(tmp_path, monkeypatch):
    """Orbax creates step directories on a background thread after the handler returns; the
    writes must not start before (they would create the directory under Orbax's feet)."""
    from orbax.checkpoint._src.path import atomicity

    from orbax_safetensors.storage.local import LocalStorage

    real_create, real_makedirs = atomicity._create_paths, LocalStorage.makedirs
    existed = []

    async def slow_create(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await real_create(*args, **kwargs)

    def makedirs(self, path):
        existed.append(os.path.isdir(path))
        real_makedirs(self, path)

    monkeypatch.setattr(atomicity, "_create_paths", slow_create)
    monkeypatch.setattr(LocalStorage, "makedirs", makedirs)
    params = _shard(_initial_params(), _fsdp)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=ocp.args.Composite(params=ost.SafetensorsSave(params)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0]
    assert existed == [True]
    _assert_tree_equal(ost.load(tmp_path / "0" / "params"), _flat_names(_initial_params()))


def test_bad_item_fails_at_the_call_before_orbax_starts_a_step(tmp_path):
    with pytest.raises(TypeError, match="'config.name' is a str"):
        ost.SafetensorsSave({"w": jnp.ones(3), "config": {"name": "llama"}})
    with pytest.raises(ValueError, match="unknown layout 'torch'"):
        ost.SafetensorsSave({"w": jnp.ones(3)}, layout="torch")
    with pytest.raises(ValueError, match="size"):
        ost.SafetensorsSave({"w": jnp.ones(3)}, max_shard_size="lots")
    with ocp.CheckpointManager(tmp_path) as mngr:
        assert mngr.all_steps() == []


def _v1_tree():
    values = _expected(2)[0]
    return values, _shard(values, _fsdp)


def test_v1_reads_steps_the_v0_handler_wrote(tmp_path):
    values, params = _v1_tree()
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(7, args=ocp.args.Composite(
            params=ost.SafetensorsSave(params, max_shard_size=_MAX_SHARD),
            extra=ocp.args.StandardSave({"lr": np.float32(0.1)})))
    step = str(tmp_path / "7")
    loaded = ocp_v1.load_checkpointables(step, {"params": _abstract(values, _tensor_parallel)})
    _assert_tree_equal(loaded["params"], values)
    assert loaded["params"]["embed"].sharding.spec == P(None, ("data", "model"))
    everything = ocp_v1.load_checkpointables(step)  # no abstract tree: typestrs decide
    _assert_tree_equal(everything["params"], _flat_names(values))
    assert float(everything["extra"]["lr"]) == pytest.approx(0.1)
    metadata = ocp_v1.checkpointables_metadata(step).metadata["params"]
    assert metadata == {n: jax.ShapeDtypeStruct(v.shape, v.dtype)
                        for n, v in _flat_names(values).items()}


def test_v0_reads_steps_v1_wrote(tmp_path):
    values, params = _v1_tree()
    with ocp_v1.training.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save_checkpointables(3, {"params": ost.SafetensorsSave(params)})
    record = json.load(open(tmp_path / "3" / "_CHECKPOINT_METADATA"))
    assert record["item_handlers"]["params"] == "orbax_safetensors.integrations.orbax_v1.SafetensorsHandler"
    assert os.path.exists(tmp_path / "3" / "params" / "model.safetensors")
    with ocp.CheckpointManager(tmp_path) as mngr:
        assert mngr.all_steps() == [3]
        _assert_tree_equal(mngr.restore(3)["params"], _flat_names(values))
    with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(3, args=ocp.args.Composite(
            params=ost.SafetensorsRestore(_abstract(values, _tensor_parallel))))
    _assert_tree_equal(restored["params"], values)


def test_v1_handler_scoped_to_a_name_saves_plain_trees(tmp_path):
    values, params = _v1_tree()
    registry = ocp_v1.handlers.local_registry().add(ost.SafetensorsHandler,
                                                     checkpointable_name="params")
    context = ocp_v1.Context(checkpointables_options=ocp_v1.options.CheckpointablesOptions(
        registry=registry))
    with context:
        ocp_v1.save_checkpointables(tmp_path / "ckpt", {"params": params,
                                                        "other": {"x": np.arange(3)}})
    assert ost.metadata(tmp_path / "ckpt" / "params").tensors.keys() == _flat_names(values).keys()
    assert not os.path.exists(tmp_path / "ckpt" / "other" / "model.safetensors")  # Orbax's own
    loaded = ocp_v1.load_checkpointables(tmp_path / "ckpt")
    _assert_tree_equal(loaded["params"], _flat_names(values))
    np.testing.assert_array_equal(loaded["other"]["x"], np.arange(3))


def _run(coroutine):
    """The layout's protocol is async and its load returns an awaitable: await both."""

    async def both():
        return await (await coroutine)

    return asyncio.run(both())


def test_layout_saves_and_loads_hf_directories(tmp_path):
    values, params = _v1_tree()
    layout = ost.SafetensorsLayout()
    _run(layout.save_checkpointables(str(tmp_path / "hf"), checkpointables={"params": params}))
    asyncio.run(layout.validate_checkpointables(str(tmp_path / "hf")))
    with safetensors.safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        np.testing.assert_array_equal(f.get_tensor("dense.kernel"), values["dense"]["kernel"])
    loaded = _run(layout.load(str(tmp_path / "hf"), abstract_state=_abstract(values, _tensor_parallel)))
    _assert_tree_equal(loaded, values)
    named = _run(layout.load_checkpointables(str(tmp_path / "hf")))
    _assert_tree_equal(named["state"], _flat_names(values))
    metadata = asyncio.run(layout.metadata(str(tmp_path / "hf"), None))
    assert metadata.metadata["dense.bias"] == jax.ShapeDtypeStruct((32,), np.float32)
    assert metadata.custom_metadata == {"format": "pt"}
    with pytest.raises(ValueError, match="holds one PyTree"):
        asyncio.run(layout.save_checkpointables(str(tmp_path / "two"),
                                                  checkpointables={"a": params, "b": params}))


def test_layout_rejects_what_is_not_a_safetensors_checkpoint(tmp_path):
    (tmp_path / "orbax").mkdir()
    (tmp_path / "orbax" / "_METADATA").write_text("{}")
    layout = ost.SafetensorsLayout()
    for path in (tmp_path / "orbax", tmp_path / "missing"):
        with pytest.raises(ocp_v1.errors.InvalidLayoutError, match="not a safetensors checkpoint"):
            asyncio.run(layout.validate_checkpointables(str(path)))


def test_layout_loads_a_transformers_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "llama", max_shard_size="20KB")
    assert (tmp_path / "llama" / INDEX_NAME).exists()
    expected = {n: t.detach().numpy() for n, t in model.state_dict().items()
                if n != "lm_head.weight" or not config.tie_word_embeddings}
    layout = ost.SafetensorsLayout()
    asyncio.run(layout.validate_checkpointables(str(tmp_path / "llama")))
    abstract = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
        Mesh(np.array(jax.devices()), ("x",)), P("x") if v.shape[0] % 8 == 0 else P()))
        for n, v in expected.items()}
    loaded = _run(layout.load(str(tmp_path / "llama"), abstract_state=abstract))
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value, err_msg=name)


def test_version_guard_names_the_supported_range():
    for version in ("0.12.5", "0.12.8"):
        check_orbax_version(version)
    for version in ("0.12.4", "0.11.40", "0.10.2", "0.13.0", "0.13.0rc1", "1.0.0"):
        with pytest.raises(UnsupportedOrbaxError, match=SUPPORTED_RANGE.replace(".", r"\.")):
            check_orbax_version(version)


def test_unsupported_orbax_keeps_the_engine_and_fails_on_orbax_names(tmp_path):
    script = f"""
import importlib.metadata as m
real = m.version
m.version = lambda name: "0.10.2" if name == "orbax-checkpoint" else real(name)
import numpy as np
import orbax_safetensors as ost
ost.save({str(tmp_path / 'x.safetensors')!r}, {{"w": np.arange(3)}})
assert list(ost.load({str(tmp_path / 'x.safetensors')!r})) == ["w"]
try:
    ost.SafetensorsCheckpointHandler
except ost.UnsupportedOrbaxError as e:
    print("ERROR:", e)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR: orbax-checkpoint 0.10.2 is installed" in out.stdout
    assert SUPPORTED_RANGE in out.stdout


# --- crash safety: SIGKILL in the middle of an async safetensors save -------------------------

_KILL_POINTS = ("mid_write", "before_commit", "after_commit")


def _crash_child(directory, kill_point, marker):
    """Saves step 0, then step 1 with a hook that announces ``kill_point`` and hangs there."""
    from orbax_safetensors.engine.saving import strategies as write
    from orbax_safetensors.storage.local import LocalStorage

    def announce_and_hang():
        open(marker, "w").close()
        time.sleep(600)

    if kill_point == "mid_write":
        real = LocalStorage.write_at

        def write_at(self, *args):
            real(self, *args)
            if armed:
                announce_and_hang()
        LocalStorage.write_at = write_at
    else:
        real_commit = write.commit_written

        def commit(*args):
            if armed and kill_point == "before_commit":
                announce_and_hang()
            real_commit(*args)
            if armed:
                announce_and_hang()
        write.commit_written = commit

    armed = False
    values = _expected(1)[0]
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(0, args=ocp.args.Composite(params=ost.SafetensorsSave(
            _shard(values, _fsdp), max_shard_size=_MAX_SHARD)))
        mngr.wait_until_finished()
        armed = True
        mngr.save(1, args=ocp.args.Composite(params=ost.SafetensorsSave(
            _shard(_expected(2)[0], _fsdp), max_shard_size=_MAX_SHARD)))
        time.sleep(600)


@pytest.mark.parametrize("kill_point", _KILL_POINTS)
def test_sigkill_during_async_save_keeps_the_previous_step(tmp_path, kill_point):
    directory, marker = str(tmp_path / "run"), str(tmp_path / "hanging")
    child = subprocess.Popen(
        [sys.executable, "-c", f"import tests.conftest; from {_MODULE} import _crash_child; "
         f"_crash_child({directory!r}, {kill_point!r}, {marker!r})"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            assert child.poll() is None, child.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child never reached the kill point"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()

    with ocp.CheckpointManager(directory) as mngr:
        assert mngr.all_steps() == [0]
        restored = mngr.restore(0)
        _assert_tree_equal(restored["params"], _flat_names(_expected(1)[0]))
        # A re-run of the interrupted step succeeds and is restorable.
        values = _expected(2)[0]
        mngr.save(1, args=ocp.args.Composite(params=ost.SafetensorsSave(_shard(values, _fsdp))))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 1]
        _assert_tree_equal(mngr.restore(1)["params"], _flat_names(values))


def test_flax_example_trains_checkpoints_and_resumes(tmp_path):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "flax_train.py"),
         "--directory", str(tmp_path / "run"), "--steps", "4"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kept steps [2, 3]; restored step 3" in result.stdout
    with safetensors.safe_open(str(tmp_path / "run" / "3" / "params" / "model.safetensors"),
                               "np") as f:
        assert f.metadata()["step"] == "3"
        assert f.get_tensor("Dense_1.kernel").shape == (256, 256)
