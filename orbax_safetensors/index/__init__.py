"""Layer 2: checkpoint-level metadata (indexes, file naming, shard packing)."""

from orbax_safetensors.index.hf_index import (
    INDEX_NAME,
    SINGLE_FILE_NAME,
    HFIndex,
    check_file_name,
    is_shard_file_name,
    parse_index,
    serialize_index,
    shard_file_name,
)
from orbax_safetensors.index.packing import pack_shards, parse_size

__all__ = [
    "INDEX_NAME", "SINGLE_FILE_NAME", "HFIndex", "check_file_name", "is_shard_file_name",
    "parse_index", "serialize_index", "shard_file_name", "pack_shards", "parse_size",
]
