"""What a write is asked to do: one value per call, checked and resolved where the call is made.

``save`` and ``async_save`` (and Orbax's ``SafetensorsSave``) take a
``SaveOptions``; ``consolidate`` a ``ConsolidateOptions`` (a block source has
no tree, layout or mapping, and is read ``block_bytes`` at a time), which
``convert`` derives from its own. Each is given as ``options=`` or as
keywords (``core.options.with_shorthand``), checks its fields when built,
naming the one that is wrong, and holds sizes as ints: nothing below the
public entry parses a size, and every default is written here once (the
memory budgets' in ``core.options``). The one step that needs the location,
``SaveOptions.resolve``, gives ``max_shard_size`` its default, which only a
directory has (a ``.safetensors`` path is one file, which no size splits).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, TypedDict

from orbax_safetensors.engine.core import option_checks
from orbax_safetensors.engine.core.options import DEFAULT_SAVE_BUDGET
from orbax_safetensors.errors import ArgumentError, ArgumentTypeError
from orbax_safetensors.format import check_metadata as format_check_metadata
from orbax_safetensors.format.checksums import RESERVED_KEYS
from orbax_safetensors.index import parse_size
from orbax_safetensors.planning import rules as mapping_rules
from orbax_safetensors.storage import Location

DEFAULT_MAX_SHARD_SIZE = "5GB"  # bytes per file of a checkpoint directory, as transformers
DEFAULT_BLOCK_BYTES = "64MB"  # the most bytes of one tensor a block source hands over at once
CONVERT_DTYPES = ("float32", "bfloat16")  # what convert may write floats as: no range lost to either
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
    """What to write besides the tree: ``save``'s and ``async_save``'s options, as one value
    (``options=``) or as keywords. Every field is checked when the options are built, naming
    it, and sizes are stored as ints.

    Attributes:
      layout: ``"hf"``, whole tensors in the Hugging Face layout; ``"distributed"``,
        each process's slices in files of its own, with an index of them all.
      max_shard_size: bytes per file of a checkpoint directory, as an int or a
        string like ``"2GB"`` (default ``"5GB"``, as transformers), headers
        included: only a tensor too big for it alone makes a bigger file. A
        ``.safetensors`` path is one file: passing it there is an error. Held in
        bytes; ``None`` until the save knows where it goes (``resolve``).
      metadata: str→str stored in every file's ``__metadata__`` (next to
        ``"format": "pt"``, which transformers requires).
      overwrite: replace a checkpoint already at the path instead of refusing.
      mapping: an ``ost.Mapping`` from checkpoint names and arrangements to the tree's;
        each leaf is stored under its mapped name, each shard transposed or
        reshaped on the host into the stored box(es) it covers.
      checksums: store the crc32c of every 256 KiB block of every tensor (in
        each file's ``__metadata__``, and each file's whole crc32c in the
        index), computed by each process over the bytes it writes; every load
        then checks the blocks it reads. Other readers ignore them. ``False``
        writes exactly what transformers' ``save_pretrained`` writes.
      progress: report progress on stderr (this process's bytes written, rate,
        time left; process 0 only): one updating line on a terminal, as the CLI
        draws it, else a plain line every 10 s and one at the end.
      memory_budget: host bytes of this process's accelerator shards coming off the
        devices at once (default 1 GB); shards on CPU devices and numpy leaves are
        host memory already and are not counted. A blocking ``save`` copies the
        shards next in write order while the writes go on and lets each copy go
        once written, so a model in HBM never sits in host memory whole
        (``engine.device_copies``; ``SaveStats.copied_peak`` is the most it held).
        ``async_save`` holds every copy when it returns (its caller may then change
        the arrays), so there the budget bounds the transfers under way: a shard's
        copy starts once it fits beside those started and not yet landed in the
        save's own host memory (``SaveStats.copied_peak`` again).
      config: the model's Hugging Face config (a transformers ``PretrainedConfig`` or a
        dict), written as ``config.json`` beside the weights and committed with them, so
        the directory is a model ``transformers`` loads as it stands. Through a mapping
        that reads a quantized release dequantized, its ``quantization_config`` is left
        out (the tensors written are plain). Other files there (a tokenizer) are kept.
        Checked when the options are built; ``config_json`` holds what is written.
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
    # Derived, not given: a keyword ``mapping`` over ``options=`` changes what config.json says.
    config_json: bytes | None = dataclasses.field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_budget", option_checks.size("memory_budget", self.memory_budget))
        if self.max_shard_size is not None:
            object.__setattr__(self, "max_shard_size",
                               option_checks.size("max_shard_size", self.max_shard_size))
        for field in ("overwrite", "checksums", "progress"):
            option_checks.flag(field, getattr(self, field))
        if self.mapping is not None and not isinstance(self.mapping, mapping_rules.Mapping):
            raise ArgumentTypeError(f"mapping= takes an ost.Mapping, e.g. ost.mappings.llama(config), "
                                    f"not {type(self.mapping).__name__}")
        if self.config is not None:
            object.__setattr__(self, "config_json", model_config_json(self.config, self.mapping))
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


class SaveKeywords(TypedDict, total=False):
    """``SaveOptions``'s fields as keywords of ``save`` and ``async_save`` (``**shorthand``),
    typed once for both, so that a type checker sees each keyword ``SaveOptions`` takes."""

    layout: str
    max_shard_size: int | str | None
    metadata: Mapping[str, str] | None
    overwrite: bool
    mapping: mapping_rules.Mapping | None
    checksums: bool
    progress: bool
    memory_budget: int | str
    config: Any


@dataclasses.dataclass(frozen=True)
class ConsolidateOptions:
    """How ``consolidate`` writes the checkpoint it reads, as one value (``options=``) or as
    keywords. Every field is checked when the options are built, naming it (``block_bytes=0``
    used to fail after the source was opened, naming no option); sizes are stored as ints.

    There is no ``memory_budget``: a consolidation holds a few blocks at once (the
    writer's read-ahead), so ``block_bytes`` is its memory bound.

    Attributes:
      max_shard_size: bytes per output file.
      metadata: extra str→str for every output file's ``__metadata__`` (the
        source's own metadata is kept, minus torch DCP's sharding info).
      overwrite: replace a checkpoint already at the destination (its other files,
        config.json and the like, stay).
      block_bytes: the most bytes of one tensor held at once (times a few
        blocks read ahead); memory stays bounded by it, not by tensor size.
      progress: a progress line on stderr; ``None`` shows it on a terminal.
      checksums: write block checksums as ``ost.save`` does (the source's own,
        where it has them, are checked as its bytes are read).
    """

    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    metadata: Mapping[str, str] | None = None
    overwrite: bool = False
    block_bytes: int | str = DEFAULT_BLOCK_BYTES
    progress: bool | None = None
    checksums: bool = True

    def __post_init__(self) -> None:
        for field in ("max_shard_size", "block_bytes"):
            object.__setattr__(self, field, option_checks.size(field, getattr(self, field)))
        for field in ("overwrite", "checksums"):
            option_checks.flag(field, getattr(self, field))
        if self.progress is not None:
            option_checks.flag("progress", self.progress)


class ConsolidateKeywords(TypedDict, total=False):
    """``ConsolidateOptions``'s fields as keywords of ``consolidate`` (``**shorthand``)."""

    max_shard_size: int | str
    metadata: Mapping[str, str] | None
    overwrite: bool
    block_bytes: int | str
    progress: bool | None
    checksums: bool
