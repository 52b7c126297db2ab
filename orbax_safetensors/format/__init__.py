"""Layer 1: the safetensors file format and nothing else (no JAX, no I/O)."""

from orbax_safetensors.format import checksums
from orbax_safetensors.format.dtypes import DTYPES, DType, dtype_for_numpy, from_bytes, to_bytes, write_order
from orbax_safetensors.format.header import (
    MAX_HEADER_SIZE,
    METADATA_KEY,
    PREFIX_SIZE,
    Header,
    TensorInfo,
    check_metadata,
    check_names,
    header_size,
    is_encodable,
    parse_file_bytes,
    parse_header,
    reject_duplicate_keys,
    serialize_header,
)

__all__ = [
    "checksums",
    "DTYPES", "DType", "dtype_for_numpy", "from_bytes", "to_bytes", "write_order",
    "MAX_HEADER_SIZE", "METADATA_KEY", "PREFIX_SIZE", "Header", "TensorInfo", "check_metadata", "check_names",
    "header_size", "is_encodable", "parse_file_bytes", "parse_header", "reject_duplicate_keys", "serialize_header",
]
