"""Hugging Face safetensors as a first-class checkpoint format for JAX.

    import orbax_safetensors as ost
    ost.save("ckpt/", params, max_shard_size="2GB")
    params = ost.load("ckpt/", target=abstract_params)   # sharded like the target
"""

from orbax_safetensors.engine import (
    CheckpointMetadata,
    LoadStats,
    ReadOptions,
    SaveStats,
    async_save,
    consolidate,
    load,
    metadata,
    save,
)
from orbax_safetensors.errors import SafetensorsError

__version__ = "0.1.0"

__all__ = [
    "CheckpointMetadata", "LoadStats", "ReadOptions", "SafetensorsError", "SaveStats",
    "async_save", "consolidate", "load", "metadata", "save", "__version__",
]
