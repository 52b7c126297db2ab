"""Layer 2: checkpoint-level metadata (indexes, file naming, shard packing)."""

from orbax_safetensors.index.hf_index import (
    FILE_CRCS_KEY,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    HFIndex,
    check_file_name,
    decode_crc,
    encode_crc,
    incomplete_shard_sets,
    is_shard_file_name,
    listed_crcs,
    parse_index,
    serialize_index,
    shard_file_name,
)
from orbax_safetensors.index.distributed_index import (
    DISTRIBUTED_INDEX_NAME,
    DistributedTensor,
    SliceEntry,
    check_slices,
    dcp_metadata,
    dcp_offsets,
    distributed_file_name,
    is_distributed_file_name,
    parse_distributed_index,
    serialize_distributed_index,
)
from orbax_safetensors.index.packing import natural_key, pack_shards, parse_size

__all__ = [
    "FILE_CRCS_KEY", "INDEX_NAME", "SINGLE_FILE_NAME", "decode_crc", "encode_crc", "HFIndex", "check_file_name", "incomplete_shard_sets", "is_shard_file_name",
    "listed_crcs",
    "parse_index", "serialize_index", "shard_file_name", "natural_key", "pack_shards", "parse_size",
    "DISTRIBUTED_INDEX_NAME", "DistributedTensor", "SliceEntry", "check_slices", "dcp_metadata",
    "dcp_offsets", "distributed_file_name", "is_distributed_file_name",
    "parse_distributed_index", "serialize_distributed_index",
]
