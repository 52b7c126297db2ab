"""Shipped ``ost.Mapping``s for well-known architectures (Hugging Face names ↔ Flax trees)."""

from orbax_safetensors.mappings.llama import llama

__all__ = ["llama"]
