"""Tests for the multi-process JAX fixture (tests/support/multiprocess.py).

The ``_child_*`` functions run inside the child processes, as
``tests.multiprocess.test_multiprocess_fixture:<name>``.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tests.support.multiprocess import MultiProcessError

pytestmark = pytest.mark.slow  # several JAX processes, including ones that hang

_MODULE = "tests.multiprocess.test_multiprocess_fixture"


def _sharded_global_array(shape):
    """A global array over all devices, sharded on axis 0, plus its numpy value."""
    expected = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    arr = jax.make_array_from_callback(shape, sharding, lambda idx: expected[idx])
    assert arr.shape == shape
    assert not arr.is_fully_addressable
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
    return arr, expected


def _child_global_array(args):
    assert jax.process_count() == args["num_processes"]
    assert jax.device_count() == args["num_processes"] * args["devices_per_process"]
    assert jax.local_device_count() == args["devices_per_process"]

    arr, expected = _sharded_global_array(tuple(args["shape"]))
    total = jax.jit(jnp.sum)(arr)
    # Non-fully-addressable arrays can only be gathered with tiled=True.
    gathered = multihost_utils.process_allgather(arr, tiled=True)
    return {
        "process_index": jax.process_index(),
        "num_addressable_shards": len(arr.addressable_shards),
        "sum": int(total),
        "gathered": np.asarray(gathered).tolist(),
        "device_process_index": {str(d.id): d.process_index for d in jax.devices()},
        "local_device_ids": sorted(d.id for d in jax.local_devices()),
    }


def _check_global_array_results(results, num_processes, devices_per_process, shape):
    expected = np.arange(int(np.prod(shape))).reshape(shape)
    assert [r.process_id for r in results] == list(range(num_processes))
    device_maps = []
    for r in results:
        assert r.returncode == 0
        v = r.value
        assert v["process_index"] == r.process_id
        assert v["num_addressable_shards"] == devices_per_process
        assert v["sum"] == int(expected.sum())
        np.testing.assert_array_equal(np.array(v["gathered"]), expected)
        device_maps.append(v["device_process_index"])
    # All processes agree on which process owns which device, each process owns
    # devices_per_process of them, and its local devices are exactly those.
    assert all(m == device_maps[0] for m in device_maps)
    owners = list(device_maps[0].values())
    for r in results:
        assert owners.count(r.process_id) == devices_per_process
        mine = sorted(int(d) for d, p in device_maps[0].items() if p == r.process_id)
        assert r.value["local_device_ids"] == mine


def test_two_processes_four_devices(multiprocess):
    args = dict(num_processes=2, devices_per_process=4, shape=[16, 6])
    results = multiprocess(
        f"{_MODULE}:_child_global_array",
        num_processes=2,
        devices_per_process=4,
        args=args,
    )
    _check_global_array_results(results, 2, 4, (16, 6))


def test_four_processes_two_devices(multiprocess):
    args = dict(num_processes=4, devices_per_process=2, shape=[8, 3])
    results = multiprocess(
        f"{_MODULE}:_child_global_array",
        num_processes=4,
        devices_per_process=2,
        args=args,
    )
    _check_global_array_results(results, 4, 2, (8, 3))


def _child_process_1_raises(args):
    del args
    if jax.process_index() == 1:
        raise ValueError("deliberate failure in process one")
    # The survivor blocks in a collective waiting for the dead peer.
    arr, _ = _sharded_global_array((8, 2))
    multihost_utils.process_allgather(arr, tiled=True)
    time.sleep(3600)
    return "unreachable"


def test_failing_child_reports_error_quickly(multiprocess):
    timeout = 120
    start = time.monotonic()
    with pytest.raises(MultiProcessError) as excinfo:
        multiprocess(
            f"{_MODULE}:_child_process_1_raises",
            num_processes=2,
            devices_per_process=1,
            timeout=timeout,
        )
    elapsed = time.monotonic() - start
    message = str(excinfo.value)
    assert "process 1: exit code 1  <-- first to fail" in message
    assert "ValueError: deliberate failure in process one" in message
    assert "process 0:" in message
    # The survivor must have been killed, not waited on until the timeout.
    assert elapsed < 30, elapsed
    by_id = {r.process_id: r for r in excinfo.value.results}
    assert by_id[1].returncode == 1
    assert by_id[0].returncode != 0
    assert by_id[0].value is None


def _child_hangs(args):
    del args
    print("about to hang", flush=True)
    while True:
        time.sleep(1)


def test_hanging_child_times_out(multiprocess):
    timeout = 10
    start = time.monotonic()
    with pytest.raises(MultiProcessError) as excinfo:
        multiprocess(
            f"{_MODULE}:_child_hangs",
            num_processes=2,
            devices_per_process=1,
            timeout=timeout,
        )
    elapsed = time.monotonic() - start
    message = str(excinfo.value)
    assert "process 0: timed out after 10s (killed by SIGKILL)" in message
    assert "process 1: timed out after 10s (killed by SIGKILL)" in message
    assert "about to hang" in message  # stdout tail is included
    assert "_child_hangs" in message  # faulthandler stack dump in stderr tail
    assert timeout <= elapsed < timeout + 10, elapsed
