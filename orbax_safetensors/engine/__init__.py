"""Layer 5: load and save, running plans against storage and JAX devices."""

from orbax_safetensors.engine.load import CheckpointMetadata, load, metadata
from orbax_safetensors.engine.save import save

__all__ = ["CheckpointMetadata", "load", "metadata", "save"]
