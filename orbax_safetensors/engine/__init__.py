"""Layer 5: load and save, running plans against storage and JAX devices.

The names below are the engine's public surface: the user's API (re-exported by
``orbax_safetensors``) and what the integrations build on. Integrations import
nothing else from the engine.
"""

from orbax_safetensors.engine.catalog import Checkpoint, Layout, detect_layout, open_checkpoint
from orbax_safetensors.engine.consolidate import BlockSource, CheckpointBlocks, consolidate, write_blocks
from orbax_safetensors.engine.coordination import Peers, describe_arguments, describe_spec
from orbax_safetensors.engine.load import (
    CheckpointMetadata,
    async_load,
    load,
    metadata,
    metadata_of,
)
from orbax_safetensors.engine.mapped_blocks import StoredBlocks, TreeBlocks
from orbax_safetensors.engine.operation import Operation
from orbax_safetensors.engine.pending import unwatch, watch_at_exit
from orbax_safetensors.engine.progress import Progress, format_bytes, format_seconds, summary_line
from orbax_safetensors.engine.read_execution import LoadStats
from orbax_safetensors.engine.read_policy import ReadOptions
from orbax_safetensors.engine.save import async_save, check_tree, prepare_save, save
from orbax_safetensors.engine.session import SaveStats, WriteSession
from orbax_safetensors.engine.targets import target
from orbax_safetensors.engine.tree_names import flatten_with_names, nest
from orbax_safetensors.engine.verify import Problem, VerifyReport, verify
from orbax_safetensors.engine.write_options import (
    CONVERT_DTYPES,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_MEMORY_BUDGET,
    SaveOptions,
    StreamOptions,
    check_metadata,
    model_config_json,
)

__all__ = [
    "CheckpointMetadata", "LoadStats", "Problem", "ReadOptions", "SaveStats", "VerifyReport",
    "async_load", "async_save", "consolidate", "load", "metadata", "nest", "save", "target", "verify",
    "BlockSource", "Checkpoint", "CheckpointBlocks", "Layout", "Progress", "SaveOptions",
    "StreamOptions", "check_metadata", "check_tree", "detect_layout", "flatten_with_names",
    "format_bytes", "format_seconds", "metadata_of", "open_checkpoint", "prepare_save",
    "summary_line", "unwatch", "watch_at_exit", "write_blocks",
    "CONVERT_DTYPES", "DEFAULT_BLOCK_BYTES", "DEFAULT_MAX_SHARD_SIZE", "DEFAULT_MEMORY_BUDGET", "WriteSession",
    "Operation", "Peers", "StoredBlocks", "TreeBlocks", "describe_arguments", "describe_spec",
    "model_config_json",
]
