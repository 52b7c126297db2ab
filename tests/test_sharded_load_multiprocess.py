"""Sharding-driven load across real JAX processes (2×4 and 4×2 CPU devices).

The parent writes one checkpoint; every child loads it under a target
sharding, checks each of its addressable shards against the source values,
and returns its LoadStats, so the parent can check what each process read.
"""

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import orbax_safetensors as ost

_MODULE = "tests.test_sharded_load_multiprocess"
_TOPOLOGIES = [(2, 4), (4, 2)]


def _sources():
    """Tensors big enough that another process's share (a gap) exceeds the 16 KiB
    a local read may read through, so leading-dim loads read exactly their rows."""
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((512, 64)).astype(np.float32),
        "mlp.w": rng.standard_normal((512, 128)).astype(ml_dtypes.bfloat16),
        "ids": rng.integers(-1000, 1000, (128, 256)).astype(np.int32),
        "five_d": rng.standard_normal((8, 32, 3, 4, 8)).astype(np.float32),
        "vector": rng.standard_normal((65536,)).astype(np.float16),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 8), np.float32),
        "uneven": rng.standard_normal((3600, 7)).astype(np.float32),
        "mask": rng.integers(0, 2, (16384, 8)).astype(bool),
    }


# Target PartitionSpecs per scenario, on a mesh ("data" = processes, "model" = local devices)
# or ("x",) over all devices.
_SCENARIOS = {
    "fsdp": {n: P("x") for n in ("embed", "mlp.w", "ids", "five_d", "vector", "empty", "mask")}
    | {"scalar": P(), "uneven": P(("data",))},
    "tensor_parallel": {n: P(None, "x") for n in ("embed", "mlp.w", "ids", "empty", "mask")}
    | {"five_d": P(None, None, None, None, "data"), "vector": P("x"), "scalar": P(),
       "uneven": P("data")},
    "mesh_2d": {"embed": P("data", "model"), "mlp.w": P("model", "data"), "ids": P("data", "model"),
                "five_d": P(None, "model", None, "data"), "vector": P(("data", "model")),
                "scalar": P(), "empty": P(None, "model"), "uneven": P("data"),
                "mask": P("model", "data")},
    "replicated": {n: P() for n in _sources()},
    "mixed": {"embed": P("data"), "mlp.w": P(), "ids": P(None, "model"), "five_d": P(),
              "vector": P("model"), "scalar": P(), "empty": P(), "uneven": P(None),
              "mask": P("data", "model")},
}
_LEADING_DIM = {"fsdp"}


def _mesh_for(spec):
    axes = {a for part in spec for a in (part if isinstance(part, tuple) else (part,)) if a}
    devices = np.array(jax.devices())
    if "x" in axes:
        return Mesh(devices, ("x",))
    return Mesh(devices.reshape(jax.process_count(), -1), ("data", "model"))


def _child_load(args):
    sources = _sources()  # deterministic: the same values the parent saved
    specs = _SCENARIOS[args["scenario"]]
    target = {
        name: jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=NamedSharding(_mesh_for(specs[name]), specs[name]))
        for name, value in sources.items()
    }
    stats = ost.LoadStats()
    options = ost.ReadOptions(**args.get("options", {}))
    restored = ost.load(args["path"], target=target, options=options, stats=stats)
    for name, array in restored.items():
        assert array.sharding == target[name].sharding, name
        assert array.dtype == sources[name].dtype, name
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(
                np.asarray(shard.data), sources[name][shard.index], err_msg=name)
    return dataclasses.asdict(stats)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded_load")
    sources = _sources()
    ost.save(directory / "ckpt", sources, max_shard_size=200_000)  # several files
    return {"path": str(directory / "ckpt"), "total": sum(v.nbytes for v in sources.values())}


@pytest.mark.parametrize("processes,devices", _TOPOLOGIES, ids=["2x4", "4x2"])
@pytest.mark.parametrize("scenario", sorted(_SCENARIOS))
def test_every_process_reads_only_what_its_devices_need(
        multiprocess, checkpoint, scenario, processes, devices):
    results = multiprocess(
        f"{_MODULE}:_child_load", num_processes=processes, devices_per_process=devices,
        args={"path": checkpoint["path"], "scenario": scenario})
    stats = [r.value for r in results]
    for s in stats:
        assert s["tensors"] == len(_sources())
        if scenario in _LEADING_DIM:
            assert s["bytes_read"] <= 1.05 * s["bytes_needed"], s
        elif s["tensors_read_once"] == 0:
            assert s["bytes_read"] <= ost.ReadOptions().max_overread * s["bytes_needed"], s
    if scenario == "replicated":  # read once per cluster, all-gathered
        assert all(s["tensors_read_once"] == len(_sources()) - 1 for s in stats)  # not "empty"
        assert sum(s["bytes_read"] for s in stats) <= 1.05 * checkpoint["total"]


def test_no_overread_when_asked(multiprocess, checkpoint):
    results = multiprocess(
        f"{_MODULE}:_child_load", num_processes=2, devices_per_process=4,
        args={"path": checkpoint["path"],
              "scenario": "tensor_parallel",
              "options": {"max_overread": 1.0, "replicated_read_once": False}})
    for r in results:
        assert r.value["bytes_read"] == r.value["bytes_needed"], r.value


def test_replicated_without_read_once_reads_everything_everywhere(multiprocess, checkpoint):
    results = multiprocess(
        f"{_MODULE}:_child_load", num_processes=2, devices_per_process=4,
        args={"path": checkpoint["path"],
              "scenario": "replicated", "options": {"replicated_read_once": False}})
    for r in results:
        assert r.value["tensors_read_once"] == 0
        assert r.value["bytes_read"] == r.value["bytes_needed"] == checkpoint["total"]


def _child_host_target(args):
    try:
        ost.load(args["path"], target={"embed": np.zeros((512, 64), np.float32)}, strict=False)
    except ValueError as e:
        return str(e)
    return "no error"


def test_host_targets_need_a_single_process(multiprocess, checkpoint):
    results = multiprocess(f"{_MODULE}:_child_host_target", num_processes=2,
                           args={"path": checkpoint["path"]})
    for r in results:
        assert "needs a sharding" in r.value and "embed" in r.value
