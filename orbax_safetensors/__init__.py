"""Hugging Face safetensors as a first-class checkpoint format for JAX.

    import orbax_safetensors as ost
    ost.save("ckpt/", params, max_shard_size="2GB")
    params = ost.load("ckpt/", target=abstract_params)   # sharded like the target
    loading = ost.async_load("ckpt/", abstract_params)     # planned; reads in the background
"""

from orbax_safetensors.engine import (
    CheckpointMetadata,
    LoadStats,
    Problem,
    ReadOptions,
    SaveStats,
    VerifyReport,
    async_load,
    async_save,
    consolidate,
    load,
    metadata,
    save,
    target,
    verify,
)
from orbax_safetensors.errors import (
    AccessDeniedError,
    ArgumentError,
    ArgumentTypeError,
    CheckpointBusyError,
    CheckpointChangedError,
    ChecksumError,
    DistributedError,
    DistributedSetupError,
    Error,
    LocationTakenError,
    MappingError,
    MissingDependencyError,
    MissingFileError,
    MissingTensorError,
    PeerFailedError,
    PeerTimeoutError,
    ProcessFailure,
    ProtocolError,
    ReadOnlyLocationError,
    SafetensorsError,
    SkippedLeavesWarning,
    UnreachableError,
)
from orbax_safetensors.planning.quantization import FP8, MXFP4
from orbax_safetensors.planning.rules import Mapping, Rule, Strided
from orbax_safetensors.planning.transforms import Transform
from orbax_safetensors import mappings
from orbax_safetensors.storage import StorageError
from orbax_safetensors.integrations.orbax_version import UnsupportedOrbaxError

__version__ = "0.1.0"

_ORBAX_NAMES = ("SafetensorsCheckpointHandler", "SafetensorsHandler", "SafetensorsLayout",
                "SafetensorsRestore", "SafetensorsSave", "ConvertStats", "convert", "install_orbax_layout")
try:
    # orbax_items checks the installed Orbax version before it imports any of Orbax.
    from orbax_safetensors.integrations.orbax_items import SafetensorsRestore, SafetensorsSave
except UnsupportedOrbaxError as e:
    # The engine works without Orbax; only touching an Orbax name raises.
    _orbax_error: UnsupportedOrbaxError | None = e
else:
    _orbax_error = None
    # Importing registers the handlers, so that a fresh CheckpointManager
    # restores safetensors items without arguments.
    from orbax_safetensors.integrations import orbax_shim  # noqa: F401
    from orbax_safetensors.integrations.orbax_v0 import SafetensorsCheckpointHandler
    from orbax_safetensors.integrations.orbax_v1 import SafetensorsHandler, SafetensorsLayout
    # Orbax's own v1 safetensors entry points (ocp.v1.load_pytree, ...) through ours.
    from orbax_safetensors.integrations.orbax_install import install_orbax_layout
    # Orbax PyTree checkpoint <-> safetensors (also the `orbax-safetensors convert` command).
    from orbax_safetensors.integrations.orbax_convert import ConvertStats, convert


def __getattr__(name: str):
    if name in _ORBAX_NAMES and _orbax_error is not None:
        raise _orbax_error
    raise AttributeError(f"module 'orbax_safetensors' has no attribute {name!r}")


__all__ = [
    "FP8", "MXFP4", "Mapping", "MappingError", "Rule", "Strided", "Transform", "mappings",
    "Error", "ArgumentError", "ArgumentTypeError", "CheckpointChangedError", "ProtocolError",
    "AccessDeniedError", "ReadOnlyLocationError", "UnreachableError", "LocationTakenError",
    "MissingDependencyError", "DistributedSetupError", "PeerTimeoutError",
    "CheckpointBusyError", "CheckpointMetadata", "ChecksumError", "DistributedError", "LoadStats", "MissingFileError",
    "MissingTensorError", "PeerFailedError", "ProcessFailure", "Problem", "ReadOptions", "SafetensorsError", "SaveStats",
    "SkippedLeavesWarning",
    "StorageError", "UnsupportedOrbaxError", "VerifyReport",
    "async_load", "async_save", "consolidate", "load", "metadata", "save", "target", "verify", "__version__",
    "SafetensorsCheckpointHandler", "SafetensorsHandler", "SafetensorsLayout",
    "SafetensorsRestore", "SafetensorsSave", "ConvertStats", "convert", "install_orbax_layout",
]
