"""Layer 5: load and save, running plans against storage and JAX devices.

The names below are the engine's public surface: the user's API (re-exported by
``orbax_safetensors``) and what the integrations build on. Integrations import
nothing else from the engine.
"""

from orbax_safetensors.engine.core.catalog import Checkpoint, CheckpointKind, detect_kind, open_checkpoint
from orbax_safetensors.engine.streams.consolidate import BlockSource, CheckpointBlocks, consolidate, write_blocks
from orbax_safetensors.engine.core.coordination import Peers, describe_arguments, describe_spec
from orbax_safetensors.engine.loading.load import (
    CheckpointMetadata,
    async_load,
    load,
    metadata,
    metadata_of,
)
from orbax_safetensors.engine.streams.mapped_blocks import StoredBlocks, TreeBlocks
from orbax_safetensors.engine.core.operation import Operation
from orbax_safetensors.engine.core.pending import unwatch, watch_at_exit
from orbax_safetensors.engine.core.progress import Progress, format_bytes, format_seconds, summary_line
from orbax_safetensors.engine.loading.execution import LoadStats
from orbax_safetensors.engine.loading.options import LoadOptions
from orbax_safetensors.engine.core import option_checks
from orbax_safetensors.engine.core.options import DEFAULT_CONVERT_BUDGET, with_shorthand
from orbax_safetensors.engine.saving.save import async_save, check_tree, prepare_save, save
from orbax_safetensors.engine.saving.session import SaveStats, WriteSession
from orbax_safetensors.engine.loading.targets import target
from orbax_safetensors.engine.core.tree_names import flatten_with_names, nest
from orbax_safetensors.engine.streams.verify import Problem, VerifyReport, verify
from orbax_safetensors.engine.saving.options import (
    CONVERT_DTYPES,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_MAX_SHARD_SIZE,
    ConsolidateOptions,
    SaveOptions,
    check_metadata,
    files_beside,
    model_config_json,
)

__all__ = [
    "CheckpointMetadata", "LoadOptions", "LoadStats", "Problem", "SaveStats", "VerifyReport",
    "async_load", "async_save", "consolidate", "load", "metadata", "nest", "save", "target", "verify",
    "BlockSource", "Checkpoint", "CheckpointBlocks", "CheckpointKind", "Progress", "SaveOptions",
    "ConsolidateOptions", "check_metadata", "check_tree", "detect_kind", "flatten_with_names",
    "format_bytes", "format_seconds", "metadata_of", "open_checkpoint", "prepare_save",
    "summary_line", "unwatch", "watch_at_exit", "write_blocks",
    "CONVERT_DTYPES", "DEFAULT_BLOCK_BYTES", "DEFAULT_CONVERT_BUDGET", "DEFAULT_MAX_SHARD_SIZE", "WriteSession",
    "Operation", "Peers", "StoredBlocks", "TreeBlocks", "describe_arguments", "describe_spec",
    "files_beside", "model_config_json", "option_checks", "with_shorthand",
]
