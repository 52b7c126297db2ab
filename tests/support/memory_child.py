"""Child process of tests/engine/test_memory_bounds.py: builds checkpoints, or runs one measured operation.

Peak memory can only be measured in a process of its own: ``VmHWM`` (the
high-water mark of the resident set) never goes down, and memory freed by one
operation may stay in the allocator and hide the next one's cost. So each
measured operation (a load, a save, a consolidate) runs in a fresh
interpreter started by the test, which reads back one JSON line::

    python tests/support/memory_child.py <command> '<json arguments>'

Every measured command records ``baseline`` (the resident set after the imports,
the devices and the target tree are ready, when the high-water mark is reset to
it), runs the operation, records ``peak`` (``VmHWM``), and only then checks the
result against the expected values, so that checking costs nothing measured.

Checkpoint contents are a pure function of a spec (a list of ``[name, shape]``):
tensor ``i`` holds ``default_rng([SEED, i]).random(shape, float32)``, which a
loader can regenerate to check a result without the checkpoint's bytes in memory.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    [re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")),
     "--xla_force_host_platform_device_count=8"]).strip()

import numpy as np  # noqa: E402  (after the environment: jax is imported later)

RESULT_MARK = "MEMORY_CHILD_RESULT "
SEED = 20261122


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Sets ``VmHWM`` to the current RSS (Linux >= 4.0), so the peak is the operation's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _baseline() -> dict:
    gc.collect()
    reset = _reset_peak()
    return {"baseline": _status("VmRSS"), "peak_was_reset": reset}


def _data(i: int, shape) -> np.ndarray:
    return np.random.default_rng([SEED, i]).random(tuple(shape), dtype=np.float32)


def _sharding(spec: str | None):
    """``None`` (host arrays), or a NamedSharding over the 8 devices on a 1-D mesh ``x``."""
    if spec is None:
        return None
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    return NamedSharding(mesh, P(*[None if a == "-" else a for a in spec.split(",")]))


def make(args: dict) -> dict:
    """Writes the checkpoints the test asks for (not measured)."""
    import orbax_safetensors as ost
    from orbax_safetensors.index import (
        DISTRIBUTED_INDEX_NAME,
        DistributedTensor,
        SliceEntry,
        dcp_metadata,
        distributed_file_name,
        serialize_distributed_index,
    )
    from orbax_safetensors.format import dtype_for_numpy

    for job in args["checkpoints"]:
        spec, path = job["spec"], job["path"]
        if job["layout"] == "hf":
            tree = {name: _data(i, shape) for i, (name, shape) in enumerate(spec)}
            ost.save(path, tree, max_shard_size=job["max_shard_size"])
            del tree
            continue
        # Our distributed layout as N processes that each held a block of rows of every
        # tensor would write it: one file of slices per process, then the index.
        slices = job["slices"]
        os.makedirs(path)
        entries = {name: [] for name, _ in spec}
        for p in range(slices):
            file = distributed_file_name(p, 0, 1)
            part, offsets = {}, {}
            for i, (name, shape) in enumerate(spec):
                rows = shape[0] // slices
                part[name] = np.ascontiguousarray(_data(i, shape)[p * rows:(p + 1) * rows])
                offsets[name] = (p * rows,) + (0,) * (len(shape) - 1)
                entries[name].append(SliceEntry(file, offsets[name], part[name].shape))
            ost.save(os.path.join(path, file), part, metadata=dcp_metadata(offsets))
            del part
        tensors = {name: DistributedTensor(dtype_for_numpy(np.dtype(np.float32)), tuple(shape),
                                           tuple(entries[name])) for name, shape in spec}
        with open(os.path.join(path, DISTRIBUTED_INDEX_NAME), "wb") as f:
            f.write(serialize_distributed_index(tensors, {}))
    return {}


def load(args: dict) -> dict:
    """``ost.load`` of ``path`` into numpy (``sharding`` null) or sharded arrays of ``dtype``."""
    import jax
    import ml_dtypes  # noqa: F401  (bfloat16 by name)
    import orbax_safetensors as ost

    spec, dtype = args["spec"], np.dtype(args["dtype"])
    sharding = _sharding(args["sharding"])
    options = ost.LoadOptions(memory_budget=args["budget"])
    if sharding is None and dtype == np.float32:
        target = None
    elif sharding is None:  # host arrays of another dtype
        target = {name: jax.ShapeDtypeStruct(tuple(shape), dtype) for name, shape in spec}
    else:
        target = {name: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
                  for name, shape in spec}
    jax.devices()
    out = _baseline()
    result = ost.load(args["path"], target, options=options)
    for value in result.values():
        if isinstance(value, jax.Array):
            value.block_until_ready()
    out["peak"] = _status("VmHWM")
    out["result_bytes"] = sum(v.nbytes for v in result.values())
    for i, (name, shape) in enumerate(spec):
        value = result[name]
        if sharding is not None:
            assert value.sharding == sharding, (name, value.sharding)
        expected = _data(i, shape).astype(dtype)
        got = np.asarray(value)
        assert got.dtype == dtype and got.shape == tuple(shape), (name, got.dtype, got.shape)
        assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), f"{name}: wrong values"
    return out


def save(args: dict) -> dict:
    """``ost.save`` of a tree of sharded ``jax.Array``s (built on device, no host copy kept)."""
    import jax
    import orbax_safetensors as ost

    spec, sharding = args["spec"], _sharding(args["sharding"])
    tree = {}
    for i, (name, shape) in enumerate(spec):
        host = _data(i, shape)
        tree[name] = jax.make_array_from_callback(
            tuple(shape), sharding, lambda index, host=host: np.array(host[index]))
        tree[name].block_until_ready()
        del host
    out = _baseline()
    ost.save(args["path"], tree, layout=args["layout"], max_shard_size=args["max_shard_size"])
    out["peak"] = _status("VmHWM")
    out["tree_bytes"] = sum(v.nbytes for v in tree.values())
    del tree
    gc.collect()
    loaded = ost.load(args["path"])
    assert sorted(loaded) == sorted(name for name, _ in spec), sorted(loaded)
    for i, (name, shape) in enumerate(spec):
        assert np.array_equal(loaded[name], _data(i, shape)), f"{name}: wrong values"
    return out


def consolidate(args: dict) -> dict:
    """``ost.consolidate`` of ``src`` to ``dst`` in ``block_bytes`` blocks."""
    import jax
    import orbax_safetensors as ost

    spec = args["spec"]
    jax.devices()
    out = _baseline()
    ost.consolidate(args["src"], args["dst"], block_bytes=args["block_bytes"],
                    max_shard_size=args["max_shard_size"], progress=False)
    out["peak"] = _status("VmHWM")
    meta = ost.metadata(args["dst"])
    assert sorted(meta.tensors) == sorted(name for name, _ in spec), sorted(meta.tensors)
    for i, (name, shape) in enumerate(spec):
        target = {name: jax.ShapeDtypeStruct(tuple(shape), np.float32)}
        got = ost.load(args["dst"], target, strict=False)[name]
        assert np.array_equal(got, _data(i, shape)), f"{name}: wrong values"
        del got
    return out


COMMANDS = {"make": make, "load": load, "save": save, "consolidate": consolidate}


if __name__ == "__main__":
    command, arguments = sys.argv[1], json.loads(sys.argv[2])
    result = COMMANDS[command](arguments)
    print(RESULT_MARK + json.dumps(result), flush=True)
