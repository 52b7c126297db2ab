"""Shared test data: tensors of every kind and the target shardings the multi-process tests use."""

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

TOPOLOGIES = [(2, 4), (4, 2)]  # (processes, devices per process)


def sources():
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
SCENARIOS = {
    "fsdp": {n: P("x") for n in ("embed", "mlp.w", "ids", "five_d", "vector", "empty", "mask")}
    | {"scalar": P(), "uneven": P(("data",))},
    "tensor_parallel": {n: P(None, "x") for n in ("embed", "mlp.w", "ids", "empty", "mask")}
    | {"five_d": P(None, None, None, None, "data"), "vector": P("x"), "scalar": P(),
       "uneven": P("data")},
    "mesh_2d": {"embed": P("data", "model"), "mlp.w": P("model", "data"), "ids": P("data", "model"),
                "five_d": P(None, "model", None, "data"), "vector": P(("data", "model")),
                "scalar": P(), "empty": P(None, "model"), "uneven": P("data"),
                "mask": P("model", "data")},
    "replicated": {n: P() for n in sources()},
    "mixed": {"embed": P("data"), "mlp.w": P(), "ids": P(None, "model"), "five_d": P(),
              "vector": P("model"), "scalar": P(), "empty": P(), "uneven": P(None),
              "mask": P("data", "model")},
}
LEADING_DIM = {"fsdp"}


def mesh_for(spec):
    axes = {a for part in spec for a in (part if isinstance(part, tuple) else (part,)) if a}
    devices = np.array(jax.devices())
    if "x" in axes:
        return Mesh(devices, ("x",))
    return Mesh(devices.reshape(jax.process_count(), -1), ("data", "model"))


def target_for(values, scenario):
    """ShapeDtypeStructs of ``values`` with the scenario's shardings."""
    from jax.sharding import NamedSharding

    specs = SCENARIOS[scenario]
    return {
        name: jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=NamedSharding(mesh_for(specs[name]), specs[name]))
        for name, value in values.items()
    }


def assert_shards_equal(arrays, values, target=None):
    """Every addressable shard of every array equals the source values (and sharding, dtype)."""
    for name, array in arrays.items():
        if target is not None:
            assert array.sharding == target[name].sharding, name
        assert array.dtype == values[name].dtype, name
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(
                np.asarray(shard.data), values[name][shard.index], err_msg=name)
