"""Hugging Face safetensors as a first-class checkpoint format for JAX.

    import orbax_safetensors as ost
    ost.save("ckpt/", params, max_shard_size="2GB")
    params = ost.load("ckpt/", target=abstract_params)   # sharded like the target
    loading = ost.async_load("ckpt/", abstract_params)     # planned; reads in the background

The Orbax integration (``ost.SafetensorsSave``, ``ost.SafetensorsLayout``, ``ost.convert``, ...)
is imported on first use, and Orbax with it; the handlers join Orbax's registries whenever
Orbax is imported, before or after this package (``integrations/orbax_registration.py``).
"""

import importlib
from typing import TYPE_CHECKING, Any

from orbax_safetensors.engine import (
    CheckpointMetadata,
    ConsolidateOptions,
    LoadOptions,
    LoadStats,
    Problem,
    SaveOptions,
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
    StorageError,
    UnreachableError,
    UnsupportedOrbaxError,
)
from orbax_safetensors.planning.group_quantization import NVFP4, IntQuantized, MXFP4Packed
from orbax_safetensors.planning.quantization import FP8, MXFP4
from orbax_safetensors.planning.assembly import Constant
from orbax_safetensors.planning.rules import Mapping, Rule, Strided
from orbax_safetensors.planning.transforms import Transform
from orbax_safetensors import mappings
from orbax_safetensors.integrations.orbax_registration import register_with_orbax
from orbax_safetensors.integrations.orbax_version import check_orbax_version

if TYPE_CHECKING:  # type checkers see the Orbax names that __getattr__ imports on first use
    from orbax_safetensors.integrations.orbax_convert import ConvertOptions, ConvertStats, convert
    from orbax_safetensors.integrations.orbax_install import install_orbax_layout
    from orbax_safetensors.integrations.orbax_items import SafetensorsRestore, SafetensorsSave
    from orbax_safetensors.integrations.orbax_v0 import SafetensorsCheckpointHandler
    from orbax_safetensors.integrations.orbax_v1 import SafetensorsHandler, SafetensorsLayout

__version__ = "0.1.0"

# Each Orbax name, and the module of orbax_safetensors.integrations that defines it.
_ORBAX_NAMES = {
    "SafetensorsSave": "orbax_items",
    "SafetensorsRestore": "orbax_items",
    "SafetensorsCheckpointHandler": "orbax_v0",
    "SafetensorsHandler": "orbax_v1",
    "SafetensorsLayout": "orbax_v1",
    # Orbax's own v1 safetensors entry points (ocp.v1.load_pytree, ...) through ours.
    "install_orbax_layout": "orbax_install",
    # Orbax PyTree checkpoint <-> safetensors (also the `orbax-safetensors convert` command).
    "ConvertStats": "orbax_convert",
    "ConvertOptions": "orbax_convert",
    "convert": "orbax_convert",
}


def __getattr__(name: str) -> Any:
    """An Orbax name, imported on first use: importing Orbax costs more than JAX itself does,
    and the engine never needs it. With an unsupported Orbax the engine works and only this
    raises (``UnsupportedOrbaxError``), before anything of Orbax is imported."""
    module = _ORBAX_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'orbax_safetensors' has no attribute {name!r}")
    check_orbax_version()
    value = getattr(importlib.import_module(f"orbax_safetensors.integrations.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ORBAX_NAMES})


__all__ = [
    "FP8", "MXFP4", "IntQuantized", "MXFP4Packed", "NVFP4", "Constant", "Mapping", "MappingError", "Rule", "Strided", "Transform", "mappings",
    "Error", "ArgumentError", "ArgumentTypeError", "CheckpointChangedError", "ProtocolError",
    "AccessDeniedError", "ReadOnlyLocationError", "UnreachableError", "LocationTakenError",
    "MissingDependencyError", "DistributedSetupError", "PeerTimeoutError",
    "CheckpointBusyError", "CheckpointMetadata", "ChecksumError", "DistributedError", "LoadStats", "MissingFileError",
    "MissingTensorError", "PeerFailedError", "ProcessFailure", "Problem", "LoadOptions", "SafetensorsError", "SaveStats",
    "SkippedLeavesWarning",
    "StorageError", "UnsupportedOrbaxError", "VerifyReport",
    "async_load", "async_save", "consolidate", "load", "metadata", "save", "target", "verify", "__version__",
    "SafetensorsCheckpointHandler", "SafetensorsHandler", "SafetensorsLayout",
    "SafetensorsRestore", "SafetensorsSave", "ConvertOptions", "ConvertStats", "convert", "install_orbax_layout",
    "SaveOptions", "ConsolidateOptions",
]


# A fresh CheckpointManager restores safetensors items without arguments: Orbax finds our
# handlers by the typestrs a step records, once registered (now, or once Orbax is imported).
register_with_orbax()
