"""What a write is asked to do: one value per call, checked and resolved where the call is made.

``save`` and ``async_save`` (and Orbax's ``SafetensorsSave``) take a
``SaveOptions``; ``consolidate`` and ``convert`` a ``StreamOptions`` (a block
source has no tree, layout or mapping, and is read ``block_bytes`` at a
time). Each checks its fields when built, naming the one that is wrong, and
holds sizes as ints: nothing below the public entry parses a size, and every
default is written here once. The one step that needs the location,
``SaveOptions.resolve``, gives ``max_shard_size`` its default, which only a
directory has (a ``.safetensors`` path is one file, which no size splits).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from orbax_safetensors.engine import option_checks
from orbax_safetensors.errors import ArgumentError, ArgumentTypeError
from orbax_safetensors.format import check_metadata as format_check_metadata
from orbax_safetensors.format.checksums import RESERVED_KEYS
from orbax_safetensors.index import parse_size
from orbax_safetensors.planning import rules as mapping_rules
from orbax_safetensors.storage import Location

DEFAULT_MAX_SHARD_SIZE = "5GB"  # bytes per file of a checkpoint directory, as transformers
DEFAULT_BLOCK_BYTES = "64MB"  # the most bytes of one tensor a block source hands over at once
DEFAULT_MEMORY_BUDGET = "1GB"  # convert's buffers, all told
CONVERT_DTYPES = ("float32", "bfloat16")  # what convert may write floats as: no range lost to either
DEFAULT_SAVE_BUDGET = "1GB"  # a blocking save's copies off accelerators, ahead of the writes
_DEFAULT_MAX_SHARD_BYTES = parse_size(DEFAULT_MAX_SHARD_SIZE)


def check_metadata(metadata: Mapping[str, str] | None, *, checksums: bool) -> None:
    """The caller's ``__metadata__`` must be what every reader reads (string keys and values,
    a header under 100 MB) and, with checksums, leave our checksum entries to us."""
    format_check_metadata(metadata or {})
    taken = sorted(set(metadata or ()) & set(RESERVED_KEYS)) if checksums else []
    if taken:
        raise ArgumentError(f"metadata keys {taken} are reserved for the checksums a save writes "
                            "(pass checksums=False to write none)")


def model_config_json(config: Any, mapping: mapping_rules.Mapping | None) -> bytes:
    """The ``config.json`` a save writes beside its weights, so that the directory is a model
    transformers loads (``from_pretrained``) and not only its tensors.

    ``config``: a transformers ``PretrainedConfig`` (written whole, as
    ``to_json_string(use_diff=False)`` gives it) or a mapping of JSON values. A
    save through a mapping that reads a quantized release dequantized
    (``Mapping.quantization``) writes plain tensors, so their config must not
    say they are quantized: its ``quantization_config`` is left out.
    """
    if hasattr(config, "to_json_string"):
        values = json.loads(config.to_json_string(use_diff=False))
    elif isinstance(config, Mapping):
        values = dict(config)
    else:
        raise ArgumentTypeError(f"config= takes a transformers config or a dict of its values, "
                                f"not {type(config).__name__}")
    if mapping is not None and mapping.quantization is not None:
        values.pop("quantization_config", None)
    try:
        return (json.dumps(values, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"config= must hold JSON values, as config.json does: {e}") from None


def files_beside(config: bytes | None) -> tuple[tuple[str, bytes], ...]:
    """The small files a write commits with its tensors (``WriteSession.beside``)."""
    return (("config.json", config),) if config is not None else ()


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """What to write, besides the tree (``save``'s keyword arguments, as one value).

    ``max_shard_size`` is held in bytes; ``None`` until ``resolve`` says where the
    save goes: a directory's default, or nothing for one ``.safetensors`` file.
    ``config`` is held as the bytes of the ``config.json`` it writes
    (``model_config_json``).
    """

    layout: str = "hf"
    max_shard_size: int | str | None = None
    metadata: Mapping[str, str] | None = None
    overwrite: bool = False
    mapping: mapping_rules.Mapping | None = None
    checksums: bool = True
    progress: bool = False
    memory_budget: int | str = DEFAULT_SAVE_BUDGET
    config: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_budget", option_checks.size("memory_budget", self.memory_budget))
        if self.config is not None and not isinstance(self.config, bytes):
            object.__setattr__(self, "config", model_config_json(self.config, self.mapping))
        if self.max_shard_size is not None:
            object.__setattr__(self, "max_shard_size",
                               option_checks.size("max_shard_size", self.max_shard_size))
        check_metadata(self.metadata, checksums=self.checksums)

    def resolve(self, location: Location) -> SaveOptions:
        """These options for a save to ``location``; what cannot apply there (a size or the
        distributed layout for one ``.safetensors`` file) is the caller's error."""
        if self.config is not None and location.is_single_file:
            raise ArgumentError(f"{location.url!r} is one .safetensors file, and config= writes "
                                "config.json beside the weights of a model directory: save to a "
                                "directory (no .safetensors suffix), or drop config=")
        if not location.is_single_file:
            return self if self.max_shard_size is not None else dataclasses.replace(
                self, max_shard_size=_DEFAULT_MAX_SHARD_BYTES)
        if self.max_shard_size is not None:
            raise ArgumentError(
                f"{location.url!r} is one .safetensors file, which max_shard_size cannot split: "
                "save to a directory (no .safetensors suffix) to get "
                "model-0000i-of-0000N.safetensors files and an index, or drop max_shard_size")
        if self.layout == "distributed":
            raise ArgumentError(f"{location.url!r}: the distributed layout is a directory of files")
        return self


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How a block source is written: ``consolidate``'s and ``convert``'s options, as one value."""

    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    metadata: Mapping[str, str] | None = None
    overwrite: bool = False
    block_bytes: int | str = DEFAULT_BLOCK_BYTES
    progress: bool | None = None
    checksums: bool = True
    config: bytes | None = None  # the config.json to write beside the tensors (model_config_json)

    def __post_init__(self) -> None:
        """Checks every field where the call is made, naming it (``block_bytes=0`` used to
        fail after the source was opened, naming no option); sizes are stored as ints."""
        for field in ("max_shard_size", "block_bytes"):
            object.__setattr__(self, field, option_checks.size(field, getattr(self, field)))
        for field in ("overwrite", "checksums"):
            option_checks.flag(field, getattr(self, field))
        if self.progress is not None:
            option_checks.flag("progress", self.progress)
