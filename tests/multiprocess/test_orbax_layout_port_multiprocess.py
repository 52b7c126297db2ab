"""Orbax's multi-process tests of its v1 ``SafetensorsLayout``, run against ``ost.SafetensorsLayout``.

Ported from google/orbax at commit 3ff7b24aa0e23db4a575f7dc4bc6f815008ac6fd,
``checkpoint/orbax/checkpoint/experimental/v1/_src/layout/safetensors_layout_multiprocess_test.py``:
4 processes × 2 CPU devices, as there (``ShardedSafetensorsLayoutTest.setUp`` asserts it).
Orbax runs each parameter combination as its own multi-process test; here one group of
processes runs them all (90 loads of tiny files, a process start each would take minutes on
two cores) and reports per combination, so a failure still names it.

Where we differ on purpose: a nested abstract state loads (names are key paths joined with
``.``) where Orbax's refuses it; a missing key is our ``KeyError`` (``ost.MissingTensorError``)
raised by ``load()`` itself. The memory test measures the load's peak RSS (``VmHWM`` over what
the process held before): Orbax measures ``tracemalloc``, which does not see our staging
buffers (anonymous ``mmap``s, ``engine/loading/host_buffers.py``), so it would pass whatever they
held. Orbax's three tests of JAX's own errors (``test_sharding_fails_when_divisibility_check_fails``,
``..._with_scalar``, ``..._with_non_existent_axes``) call ``jax.device_put`` and ``NamedSharding``
only, no layout: not ported.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import numpy as np
import pytest

from tests.support.multiprocess import run_multiprocess

pytestmark = pytest.mark.slow  # several JAX processes

_MODULE = "tests.multiprocess.test_orbax_layout_port_multiprocess"
MESH_CONFIGS = [
    {"shape": (4, 2), "axes": ("data", "model")},
    {"shape": (2, 4), "axes": ("data", "model")},
    {"shape": (8, 1), "axes": ("data", "model")},
    {"shape": (1, 8), "axes": ("data", "model")},
    {"shape": (1, 8, 1), "axes": ("d1", "d2", "d3")},
    {"shape": (1, 2, 4, 1), "axes": ("d1", "d2", "d3", "d4")},
]
ARRAY_SHAPES = [(), (1,), (16,), (8, 8), (4, 4, 4)]
SHARDING_TYPES = ["fully_replicated", "fully_sharded", "one_axis_sharded"]
NUM_TENSORS, TENSOR_SHAPE = 100, (1024, 1024)  # test_load_multi_host_memory_efficiency: 400 MB


def _get_partition_spec(mesh_config, array_shape, sharding_type):
    """Orbax's helper, verbatim in substance: the spec, or None where it is not a valid one."""
    from jax.sharding import PartitionSpec

    mesh_shape, mesh_axes = mesh_config["shape"], mesh_config["axes"]
    rank = len(array_shape)
    if (rank == 0 or (rank == 1 and array_shape[0] == 1)) and sharding_type != "fully_replicated":
        return None
    if sharding_type == "fully_replicated":
        pspec = PartitionSpec()
    elif sharding_type == "fully_sharded":
        if rank > len(mesh_axes):
            return None
        pspec = PartitionSpec(*mesh_axes[:rank])
    else:
        pspec = PartitionSpec(mesh_axes[0], *([None] * (rank - 1)))
    for i, axis_name in enumerate(pspec):
        if axis_name is not None and array_shape[i] % mesh_shape[mesh_axes.index(axis_name)] != 0:
            return None
    return pspec


def _case_id(config, shape, kind):
    return f"{'x'.join(map(str, config['shape']))}-{list(shape)}-{kind}"


def _tensor(shape):
    return np.array(1.0, np.float32) if not shape else np.arange(np.prod(shape), dtype=np.float32).reshape(shape)


def _load(path, abstract_state, **context):
    import orbax.checkpoint.experimental.v1 as ocp_v1

    import orbax_safetensors as ost

    async def both():
        return await (await ost.SafetensorsLayout().load(path, abstract_state=abstract_state))

    if not context:
        return asyncio.run(both())
    with ocp_v1.Context(**context):
        return asyncio.run(both())


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _child(args):
    """Every test of ShardedSafetensorsLayoutTest in one process of the group."""
    import jax
    import orbax.checkpoint.experimental.v1 as ocp_v1
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert (jax.device_count(), jax.process_count(), jax.local_device_count()) == (8, 4, 2)
    directory, results = args["directory"], {}

    # test_sharding_scenarios, every combination
    for config, shape, kind in itertools.product(MESH_CONFIGS, ARRAY_SHAPES, SHARDING_TYPES):
        case = _case_id(config, shape, kind)
        spec = _get_partition_spec(config, shape, kind)
        if spec is None:
            results[case] = "skipped: invalid sharding spec"
            continue
        mesh = Mesh(np.array(jax.devices()).reshape(config["shape"]), config["axes"])
        sharding = NamedSharding(mesh, spec)
        abstract = {"params.tensor": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)}
        restored = _load(os.path.join(directory, f"{case}.safetensors"), abstract)["params.tensor"]
        expected = jax.device_put(_tensor(shape), sharding)
        assert restored.sharding == expected.sharding, case
        for ours, theirs in zip(restored.addressable_shards, expected.addressable_shards):
            assert ours.index == theirs.index and np.asarray(ours.data).tobytes() == np.asarray(theirs.data).tobytes(), case
        results[case] = "ok"

    # test_load_multi_host_memory_efficiency: an 8 MB in-flight budget, as Orbax's test sets
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    abstract = {f"tensor_{i}": jax.ShapeDtypeStruct(TENSOR_SHAPE, np.float32, sharding=sharding)
                for i in range(NUM_TENSORS)}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    before = _vm_hwm()
    pytree = _load(os.path.join(directory, "dummy.safetensors"), abstract,
                   memory_options=ocp_v1.options.MemoryOptions(read_concurrent_bytes=8 * 1024 * 1024))
    jax.block_until_ready(pytree)
    results["memory_peak_bytes"] = _vm_hwm() - before
    del pytree

    # test_load_sharded_fails_with_nested_abstract_pytree: deliberately different, it loads
    replicated = NamedSharding(mesh, PartitionSpec())
    nested = {"params": {"a": jax.ShapeDtypeStruct((8,), np.int32, sharding=replicated)}}
    loaded = _load(os.path.join(directory, "nested.safetensors"), nested)["params"]["a"]
    assert np.asarray(loaded.addressable_data(0)).tobytes() == np.arange(8, dtype=np.int32).tobytes()
    results["nested"] = "loads"

    # test_load_sharded_fails_with_wrong_key_abstract_pytree
    wrong_key = {"a": jax.ShapeDtypeStruct((8,), np.int32, sharding=replicated),
                 "c": jax.ShapeDtypeStruct((3,), np.float32)}
    try:
        _load(os.path.join(directory, "wrong_key_fail.safetensors"), wrong_key)
    except KeyError as e:
        results["wrong_key"] = str(e)
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """What Orbax's process 0 writes before each test's barrier, all at once."""
    from safetensors.numpy import save_file

    directory = tmp_path_factory.mktemp("orbax_port")
    for config, shape, kind in itertools.product(MESH_CONFIGS, ARRAY_SHAPES, SHARDING_TYPES):
        if _get_partition_spec(config, shape, kind) is not None:
            save_file({"params.tensor": _tensor(shape)},
                      str(directory / f"{_case_id(config, shape, kind)}.safetensors"))
    save_file({f"tensor_{i}": np.zeros(TENSOR_SHAPE, np.float32) for i in range(NUM_TENSORS)},
              str(directory / "dummy.safetensors"))
    save_file({"params.a": np.arange(8, dtype=np.int32)}, str(directory / "nested.safetensors"))
    save_file({"a": np.arange(8, dtype=np.int32)}, str(directory / "wrong_key_fail.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def results(checkpoints):
    """One group of processes for the module (the ``multiprocess`` fixture's runner)."""
    group = run_multiprocess(f"{_MODULE}:_child", num_processes=4, devices_per_process=2, timeout=600,
                             args={"directory": checkpoints})
    return [r.value for r in group]


@pytest.mark.parametrize("config, shape, kind", list(itertools.product(MESH_CONFIGS, ARRAY_SHAPES, SHARDING_TYPES)),
                         ids=[_case_id(*c) for c in itertools.product(MESH_CONFIGS, ARRAY_SHAPES, SHARDING_TYPES)])
def test_sharding_scenarios(results, config, shape, kind):
    """Each process's shards equal ``jax.device_put`` of the tensor under the sharding, bit for
    bit, with the target's sharding; combinations Orbax skips (invalid specs) are skipped."""
    outcome = {r[_case_id(config, shape, kind)] for r in results}
    if outcome == {"skipped: invalid sharding spec"}:
        pytest.skip("Invalid sharding spec.")
    assert outcome == {"ok"}


def test_load_multi_host_memory_efficiency(results):
    """Non-owner processes hold no zero buffers: each holds its quarter of the 400 MB (25 of the
    100 tensors' worth) plus in-flight reads and JAX's objects, Orbax's 1.5× of
    ``bytes_per_tensor * (tensors_per_host + 1)``."""
    bytes_per_tensor = int(np.prod(TENSOR_SHAPE)) * 4
    expected_peak = bytes_per_tensor * (NUM_TENSORS // 4 + 1)
    for r in results:
        assert r["memory_peak_bytes"] < 1.5 * expected_peak, r["memory_peak_bytes"]


def test_load_sharded_fails_with_nested_abstract_pytree(results):
    """Deliberately different (module docstring): a nested abstract state loads by its dotted names."""
    assert {r["nested"] for r in results} == {"loads"}


def test_load_sharded_fails_with_wrong_key_abstract_pytree(results):
    """A KeyError naming the missing key on every process (Orbax matches
    'not found in Safetensors checkpoint'; ours 'missing from the checkpoint: c')."""
    for r in results:
        assert "missing from the checkpoint: c" in r["wrong_key"]
