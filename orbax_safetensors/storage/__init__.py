"""Layer 4: byte I/O behind one interface, chosen from the path's URL."""

from orbax_safetensors.storage.base import Capabilities, Replayable, Storage
from orbax_safetensors.storage.fsspec_storage import FsspecStorage
from orbax_safetensors.storage.local import LocalStorage
from orbax_safetensors.storage.location import Location
from orbax_safetensors.storage.retry import RetryPolicy

__all__ = ["Capabilities", "FsspecStorage", "Location", "LocalStorage", "Replayable", "RetryPolicy",
           "Storage"]
