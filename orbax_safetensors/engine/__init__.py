"""Layer 5: load and save, running plans against storage and JAX devices."""

from orbax_safetensors.engine.consolidate import consolidate
from orbax_safetensors.engine.load import CheckpointMetadata, ReadOptions, load, metadata
from orbax_safetensors.engine.save import SaveStats, async_save, save
from orbax_safetensors.engine.shard_reader import LoadStats
from orbax_safetensors.engine.verify import Problem, VerifyReport, verify

__all__ = [
    "CheckpointMetadata", "LoadStats", "Problem", "ReadOptions", "SaveStats", "VerifyReport",
    "async_save", "consolidate", "load", "metadata", "save", "verify",
]
