"""Targets over the 8 CPU devices for loads through a mapping, cutting what a release stores in
blocks (quantization groups, scale blocks) between shards."""

import jax
import numpy as np

import orbax_safetensors as ost


def sharded_target(mapping: ost.Mapping, path: str, dtype=np.float32) -> dict:
    """Every leaf the mapping makes of the checkpoint at ``path`` (a quantized one's twins), its
    largest axis over 4 devices and its next over 2, where they divide: a 64-wide axis is cut
    every 16 values, inside groups of 32 and blocks of 128."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    stored = mapping.stored_view({n: t.shape for n, t in ost.metadata(path).tensors.items()})
    target = {}
    for name, shape in mapping.tree_shapes(stored).items():
        spec = [None] * len(shape)
        for axis, (mesh_axis, ways) in zip(np.argsort(shape, kind="stable")[::-1], (("a", 4), ("b", 2))):
            if shape[axis] % ways == 0:
                spec[axis] = mesh_axis
        target[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*spec)))
    return target
