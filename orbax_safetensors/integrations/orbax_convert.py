"""``convert``: an Orbax PyTree checkpoint ↔ an HF safetensors checkpoint, streamed.

Both directions move one block of one tensor at a time, so memory stays
within a budget whatever the model size, with one caveat for Orbax sources:
TensorStore decodes whole storage chunks (``orbax_blocks``).

1. Open (every process, agreed: one failing fails all). The direction
   follows the source: an Orbax PyTree item (or a step holding one, or a
   root holding one step: MaxText's) is read as a block source
   (``OrbaxBlocks``); anything the catalog opens as another
   (``CheckpointBlocks``). A ``mapping`` puts one more source in front: the
   tree's leaves out of stored tensors (``TreeBlocks``), or the stored
   tensors out of the tree's leaves (``StoredBlocks``).
2. Write. Safetensors output is the writer ``consolidate`` uses
   (``write_blocks``: the same planning, ``max_shard_size`` packing, lock and
   commit; files shared out among processes). Orbax output goes through
   Orbax's own handler, chunk by chunk (``orbax_writer``), in the form the
   mapping names (``OrbaxForm``: MaxText's train state for
   ``ost.mappings.maxtext``); chunks shared out among processes.

Tree shape. Names are split on ``.`` into nested dicts
(``model.layers.0.mlp.weight`` → ``tree["model"]["layers"]["0"]["mlp"]["weight"]``),
which is what a Flax-style restore wants; sequence indices stay string keys,
since a safetensors name cannot say whether ``0`` was a list index. Either
way Orbax names each array by its key path joined with ``.``, so a
conversion round trip gives back exactly the names (and bytes) it started
with. ``nest=False`` keeps the flat names as top-level keys instead, and is
needed when one name is a prefix of another (``a`` and ``a.b``). The
safetensors ``__metadata__`` becomes the Orbax ``custom_metadata`` and comes
back on the way out. ``__metadata__`` holds only strings: a ``custom_metadata``
value of another type (``"step": 5``) becomes its JSON text (``"5"``), and
stays that text on a way back to Orbax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import posixpath
import re
import time
from collections.abc import Mapping as MappingABC
from typing import Any, TypedDict, Unpack

import fsspec
import numpy as np
from etils import epath
from fsspec.registry import known_implementations

from orbax_safetensors.engine import (
    CONVERT_DTYPES,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CONVERT_BUDGET,
    DEFAULT_MAX_SHARD_SIZE,
    BlockSource,
    CheckpointBlocks,
    ConsolidateOptions,
    Operation,
    Peers,
    StoredBlocks,
    TreeBlocks,
    describe_arguments,
    describe_spec,
    files_beside,
    detect_kind,
    model_config_json,
    open_checkpoint,
    option_checks,
    with_shorthand,
    write_blocks,
)
from orbax_safetensors.errors import (
    ArgumentError,
    ArgumentTypeError,
    LocationTakenError,
    MissingFileError,
    SafetensorsError,
)
from orbax_safetensors.integrations.orbax_blocks import OrbaxBlocks
from orbax_safetensors.integrations.orbax_writer import FORMS, OrbaxForm, write_orbax
from orbax_safetensors.planning import Mapping
from orbax_safetensors.storage import Location

ORBAX = "orbax"
SAFETENSORS = "safetensors"
_TREE_METADATA_FILE = "_METADATA"  # what an Orbax PyTree item directory always holds
# What Orbax writes in a PyTree item directory: its metadata files, the OCDBT manifest and data.
_ORBAX_ENTRY = re.compile(r"^(_[A-Za-z_]+|manifest\.ocdbt|commit_success\.txt|d|"
                          r"ocdbt\.process_\d+|array_metadatas|descriptor)$")


@dataclasses.dataclass
class ConvertStats:
    """What ``convert`` did: the direction, how much it wrote and how long it took."""

    source_format: str  # "orbax" or "safetensors"
    target_format: str
    tensors: int = 0
    bytes_written: int = 0  # tensor bytes (before Orbax's compression), by this process
    files: int = 0  # safetensors files written (0 for an Orbax target)
    seconds: float = 0.0
    item_path: str = ""
    """An Orbax output's item directory, what restores it: ``dst`` itself, or MaxText's
    ``dst/0/items`` (its ``load_parameters_path``); "" for a safetensors output."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / max(self.seconds, 1e-9) / 1e9

    def to_json(self) -> dict[str, Any]:
        return {"source_format": self.source_format, "target_format": self.target_format,
                "tensors": self.tensors, "bytes_written": self.bytes_written, "files": self.files,
                "seconds": round(self.seconds, 3), "gb_per_s": round(self.gb_per_s, 3),
                "item_path": self.item_path}


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """How ``convert`` converts, as one value (``options=``) or as keywords. Every field is
    checked when the options are built, naming it, and sizes are stored as ints. Every
    process must pass the same options: ``agreed`` is what they compare.

    Attributes:
      mapping: an ``ost.Mapping`` between the safetensors names and arrangements
        and the Orbax tree (``ost.mappings.maxtext(...)``, ``ost.mappings.llama(...)``).
      dtype: the output's floating-point dtype (``"float32"``, ``"bfloat16"``);
        ``None`` keeps the input's (float32 where the mapping scales a tensor).
        Integer tensors keep theirs. Held as a ``numpy.dtype``.
      memory_budget: the memory the conversion's buffers and caches may take, all
        told (default 1 GB). It sets the unit of work: Orbax output chunks and
        safetensors output blocks of ``block_bytes``, at most 64 MB and a 32nd of
        the budget. A few blocks are in flight (the writer's read-ahead), each
        with the boxes read for it in the other side's dtype (float32 for a
        bfloat16 block: twice its bytes) and a transformed copy: about four times
        its bytes. With a mapping an Orbax source also keeps a cache of decoded
        chunks, a sixteenth of the budget, and bands of its stacked leaves, a
        quarter (``StoredBlocks``). An Orbax output's OCDBT node cache is another
        sixteenth (TensorStore's, ``orbax_writer``). An Orbax source's largest
        storage chunk comes on top: TensorStore decodes whole chunks.
      max_shard_size: bytes per output file (safetensors output only).
      block_bytes: the most bytes of one tensor moved at once (``None``: from
        ``memory_budget``, see ``unit_bytes``); also the Orbax output's chunk size.
      nest: safetensors → Orbax: split names on ``.`` into nested dicts;
        ``False`` keeps the flat names as keys.
      metadata: extra str→str for the output (``__metadata__``, or the Orbax
        ``custom_metadata``), over the source's own (an Orbax source's values
        that are not strings as their JSON text: ``"step": 5`` as ``"5"``).
      overwrite: replace the checkpoint at ``dst``; without it an existing
        ``dst`` is an error. An HF ``dst`` keeps its other files (config.json,
        tokenizer files); an Orbax ``dst`` is replaced whole, so it must hold an
        Orbax checkpoint and nothing else (a directory of your own is refused
        even with ``overwrite``). The new Orbax checkpoint is written beside it
        and swapped in, so a failure leaves the old one.
      progress: a progress line on stderr; ``None`` shows it on a terminal.
      checksums: safetensors output: write block checksums as ``ost.save``
        does. A safetensors source's own are checked as its bytes are read.
      config: the model's Hugging Face config (a transformers config or a dict): a
        safetensors output gets it as ``config.json``, committed with the tensors, so it
        is a model directory transformers loads (``ost.save``'s ``config``; through a
        dequantizing mapping without its ``quantization_config``). An Orbax output
        has no place for it. ``config_json`` holds what is written.
    """

    mapping: Mapping | None = None
    dtype: Any = None
    memory_budget: int | str = DEFAULT_CONVERT_BUDGET
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    block_bytes: int | str | None = None
    nest: bool = True
    metadata: MappingABC[str, str] | None = None
    overwrite: bool = False
    progress: bool | None = None
    checksums: bool = True
    config: Any = None
    # Derived, not given: a keyword ``mapping`` over ``options=`` changes what config.json says.
    config_json: bytes | None = dataclasses.field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.mapping is not None and not isinstance(self.mapping, Mapping):
            raise ArgumentTypeError(f"mapping= takes an ost.Mapping, e.g. ost.mappings.maxtext(...), "
                                    f"not {type(self.mapping).__name__}")
        object.__setattr__(self, "dtype", _output_dtype(self.dtype))
        for field in ("memory_budget", "max_shard_size"):
            object.__setattr__(self, field, option_checks.size(field, getattr(self, field)))
        if self.block_bytes is not None:
            object.__setattr__(self, "block_bytes", option_checks.size("block_bytes", self.block_bytes))
        for field in ("nest", "overwrite", "checksums"):
            option_checks.flag(field, getattr(self, field))
        if self.progress is not None:
            option_checks.flag("progress", self.progress)
        if self.config is not None:
            object.__setattr__(self, "config_json", model_config_json(self.config, self.mapping))

    @property
    def unit_bytes(self) -> int:
        """The block (and Orbax chunk) size: ``block_bytes``, or a 32nd of the budget, at most
        ``DEFAULT_BLOCK_BYTES``: derived when used, so that a ``memory_budget`` given as a
        keyword over ``options=`` still sizes the blocks."""
        if self.block_bytes is not None:
            return int(self.block_bytes)
        return max(1, min(option_checks.size("block_bytes", DEFAULT_BLOCK_BYTES), int(self.memory_budget) // 32))

    @property
    def stream(self) -> ConsolidateOptions:
        """How a safetensors output is written: as ``consolidate`` writes, a block at a time."""
        return ConsolidateOptions(self.max_shard_size, self.metadata, self.overwrite, self.unit_bytes,
                                  self.progress, self.checksums)

    @property
    def form(self) -> OrbaxForm:
        kind = None if self.mapping is None else self.mapping.checkpoint_form
        if kind not in FORMS:
            raise ArgumentError(f"the mapping's checkpoint_form {kind!r} is not one convert writes "
                                f"({', '.join(repr(k) for k in FORMS)})")
        return FORMS[kind]

    @property
    def cache_bytes(self) -> int:
        """An Orbax source's decoded-chunk cache: only a mapping reads boxes that are not
        whole chunks (a column band of an unstacked kernel), which the next boxes would decode
        again."""
        return 0 if self.mapping is None else int(self.memory_budget) // 16

    @property
    def band_bytes(self) -> int:
        """The bands of stacked leaves a mapped Orbax source keeps (``StoredBlocks``)."""
        return int(self.memory_budget) // 4

    @property
    def node_cache_bytes(self) -> int:
        """TensorStore's cache of OCDBT nodes, on each process writing an Orbax output."""
        return int(self.memory_budget) // 16

    def agreed(self, source: BlockSource) -> list[str]:
        """What shapes an Orbax output, as the processes compare it before any is written
        (a safetensors output is compared by ``write_blocks``, as ``consolidate``'s): a line
        per argument, then the tensors this process will write (through the mapping: the
        tree's names, shapes and dtypes). The memory budget itself may differ (each host
        sized it from its own free memory); the block size it sets, the chunk grid, may not."""
        return (describe_arguments(self, leave_out=("progress", "memory_budget", "block_bytes", "config"))
                + [f"block_bytes={self.unit_bytes} (memory_budget sets it unless block_bytes= is given)"]
                + [f"tensor {describe_spec(spec)}" for spec in source.specs])


class ConvertKeywords(TypedDict, total=False):
    """``ConvertOptions``'s fields as keywords of ``convert`` (``**shorthand``)."""

    mapping: Mapping | None
    dtype: Any
    memory_budget: int | str
    max_shard_size: int | str
    block_bytes: int | str | None
    nest: bool
    metadata: MappingABC[str, str] | None
    overwrite: bool
    progress: bool | None
    checksums: bool
    config: Any


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    options: ConvertOptions | None = None,
    storage_options: MappingABC[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    **shorthand: Unpack[ConvertKeywords],
) -> ConvertStats:
    """Converts an Orbax PyTree checkpoint to safetensors, or safetensors to Orbax.

    The direction follows ``src``: a directory holding Orbax's ``_METADATA``
    (what ``StandardCheckpointer``/``PyTreeCheckpointer`` write; also a
    ``CheckpointManager`` step directory with a single item, or a root with a
    single step) becomes an HF checkpoint at ``dst``; anything ``ost.metadata``
    opens becomes an Orbax PyTree checkpoint at ``dst``. See the module
    docstring for the memory bound and the tree shape.

    With a ``mapping`` the Orbax side holds the mapped tree: a Hugging Face
    checkpoint becomes, e.g., MaxText's params (``ost.mappings.maxtext``:
    written as MaxText's ``to_maxtext.py`` writes it, ``dst/0/items``, which
    MaxText restores with ``load_parameters_path=dst/0/items``), and such a
    checkpoint becomes the Hugging Face tensors again. Every output chunk or
    block is assembled from the boxes of the inputs it needs, so memory stays
    within ``memory_budget`` whatever the model size (for an Orbax source,
    plus its largest storage chunk, which TensorStore decodes whole).

    Under ``jax.distributed`` every process calls ``convert`` with the same
    arguments (compared before anything is written: a difference raises
    ``ArgumentError`` on every process, naming it; ``memory_budget`` may differ
    where it sets the same block size): each reads and writes its share of the
    chunks (Orbax output) or files (safetensors output), and process 0 commits
    the checkpoint once all have written theirs; a failure on any process
    stops all of them within about a second and leaves no checkpoint.

    Args:
      src: the checkpoint to read.
      dst: the directory to write.
      options: an ``ost.ConvertOptions``: a mapping and output dtype, the memory
        budget that sizes every buffer, file size, metadata, overwrite, a config.json.
      storage_options / filesystem: for a safetensors ``src``/``dst`` given
        as an fsspec URL, as in ``ost.load``. The Orbax side goes through
        Orbax's own paths (local or ``gs://``).
      **shorthand: any field of ``ConvertOptions`` as a keyword
        (``memory_budget="4GB"``), replacing that field of ``options``.

    Returns:
      ``ConvertStats``.

    Raises:
      FileNotFoundError: ``src`` does not exist.
      FileExistsError: ``dst`` exists and ``overwrite`` is false, or it is not
        an Orbax checkpoint convert may replace.
      SafetensorsError / ValueError: ``src`` is neither format, or holds
        something the other format cannot (strings; zero-size arrays for Orbax);
        a ``MappingError`` where the mapping does not fit the checkpoint.
      OSError: writing failed; a full disk is ENOSPC naming ``dst`` (for an
        Orbax ``dst`` too, which TensorStore reports as a ``ValueError``). What
        the conversion staged is removed, and a directory it made for ``dst``.
    """
    started = time.perf_counter()
    options = with_shorthand(ConvertOptions, options, shorthand)
    form = options.form
    target = Location.resolve(dst, storage_options, filesystem)
    label = f"convert {os.fspath(src)} -> {target.url}"
    with contextlib.ExitStack() as opened:
        # Each process opens the source and checks the destination; one that fails here fails
        # them all, rather than leaving the others waiting at the first step they share.
        peers = Peers.collective("convert-open", target.url)
        fmt, source = Operation(peers).run(
            "open", functools.partial(_open_source, src, target, options, opened, storage_options,
                                      filesystem))
        if fmt == ORBAX:
            stats = write_blocks(target, source, options.stream, label=label, started=started,
                                 beside=files_beside(options.config_json))
            return ConvertStats(ORBAX, SAFETENSORS, len(source.specs), stats.bytes_written,
                                stats.files, stats.seconds)
        peers.check_same("arguments", options.agreed(source), "convert arguments or sources")
        tensors, written = write_orbax(source, target, form, chunk_bytes=options.unit_bytes,
                                       cache_bytes=options.node_cache_bytes, nest=options.nest,
                                       metadata=options.metadata, progress=options.progress,
                                       label=label)
        return ConvertStats(SAFETENSORS, ORBAX, tensors, written, 0, time.perf_counter() - started,
                            target.storage.url("/".join([target.path.rstrip("/"), *form.item])))


def _output_dtype(dtype: Any) -> np.dtype | None:
    """``dtype=`` as convert writes floats: float32 or bfloat16, which hold every float32's
    range (a float16 output would turn what it cannot hold into inf without a word)."""
    if dtype is None:
        return None
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in CONVERT_DTYPES:
        raise ArgumentError(f"dtype={dtype!r}: convert writes floats as {' or '.join(CONVERT_DTYPES)}; "
                            "pass one of them, or None to keep the input's")
    return resolved


def _open_source(src: str | os.PathLike, target: Location, options: ConvertOptions,
                 opened: contextlib.ExitStack, storage_options: MappingABC[str, Any] | None,
                 filesystem: fsspec.AbstractFileSystem | None) -> tuple[str, BlockSource]:
    """The source's format and its tensors as the output wants them (through the mapping),
    once the destination is known to be one this conversion may write."""
    fmt, item = detect_format(src, storage_options, filesystem)
    _check_apart(src, target)
    _check_destination(target, fmt, options.form, overwrite=options.overwrite)
    if options.dtype is not None and options.mapping is None:
        raise ArgumentError("dtype= needs a mapping (without one the tensors are copied as they are)")
    prefix = options.form.prefixes
    if fmt == ORBAX:
        orbax = OrbaxBlocks(item, prefix=prefix, cache_bytes=options.cache_bytes)
        if options.mapping is None:
            return fmt, orbax
        return fmt, StoredBlocks(orbax, options.mapping, prefix=prefix, dtype=options.dtype,
                                 band_bytes=options.band_bytes)
    checkpoint = opened.enter_context(open_checkpoint(Location.resolve(src, storage_options, filesystem)))
    if options.mapping is None:
        return fmt, CheckpointBlocks(checkpoint)
    return fmt, TreeBlocks(CheckpointBlocks(checkpoint), options.mapping, options.dtype)


def detect_format(
    src: str | os.PathLike,
    storage_options: MappingABC[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> tuple[str, str]:
    """``("orbax", item directory)`` or ``("safetensors", src)``; raises for anything else.
    An Orbax item is recognised here (the engine knows nothing of Orbax); a safetensors
    checkpoint by the catalog, which alone knows their kinds."""
    text = os.fspath(src)
    item = _orbax_item_dir(text)
    if item is not None:
        return ORBAX, item
    try:
        detect_kind(Location.resolve(src, storage_options, filesystem))
    except (FileNotFoundError, SafetensorsError) as e:
        if not _exists(text):
            raise MissingFileError("does not exist: check the path", file=text) from None
        detail = ("neither a directory nor a .safetensors file"
                  if isinstance(e, FileNotFoundError) else str(e))
        raise SafetensorsError(
            f"{text!r} is neither an Orbax PyTree checkpoint (no {_TREE_METADATA_FILE}) "
            f"nor a safetensors checkpoint ({detail})") from None
    return SAFETENSORS, text


def _check_destination(target: Location, source_format: str, form: OrbaxForm, *, overwrite: bool) -> None:
    """Refuses a ``target`` that holds anything, unless ``overwrite``; and, for an Orbax
    output (which replaces the whole directory), one that is not an Orbax checkpoint."""
    if not _occupied(target):
        return
    if not overwrite:
        raise LocationTakenError("already exists and is not empty; pass overwrite=True "
                                 "(--overwrite) to replace it", target.url)
    foreign = _not_orbax(target.url, form.item) if source_format == SAFETENSORS else []
    if foreign:  # replacing an Orbax checkpoint replaces the directory: only if it is one
        raise LocationTakenError(
            f"is not an Orbax checkpoint ({', '.join(repr(n) for n in foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); "
            "convert replaces only an Orbax checkpoint, even with overwrite: choose another "
            "destination", target.url)


def _check_apart(src: str | os.PathLike, target: Location) -> None:
    """Refuses a ``target`` that is ``src``, lies inside it or holds it: the output would go
    into the checkpoint being read (beside its files, or replacing it with ``overwrite``) or
    around it. Local paths are compared resolved (links, ``..``), URLs as normalized text."""
    source, destination = _place(os.fspath(src)), _place(target.url)
    if source[0] != destination[0]:
        return
    relation = ("is" if source[1] == destination[1] else "is inside" if _within(destination[1], source[1])
                else "holds" if _within(source[1], destination[1]) else None)
    if relation is not None:
        raise ArgumentError(f"dst {target.url!r} {relation} src {os.fspath(src)!r}: convert does not write "
                            "where it reads; choose a dst apart from src")


def _place(url: str) -> tuple[str, str]:
    """(filesystem, path) of a location as ``_check_apart`` compares them: fsspec's aliases of
    one filesystem (``gs``, ``gcs``) are one."""
    protocol, path = fsspec.core.split_protocol(url)
    implementation = known_implementations.get(protocol or "file", {}).get("class", protocol)
    if implementation == known_implementations["file"]["class"]:
        return implementation, os.path.realpath(path)
    return implementation, posixpath.normpath("/" + path.lstrip("/"))


def _within(inner: str, outer: str) -> bool:
    return inner.startswith(outer.rstrip("/") + "/")


def _occupied(location: Location) -> bool:
    """Whether ``location`` is a file or a non-empty directory (an empty one may be written into)."""
    storage = location.storage
    if not storage.exists(location.path):
        return False
    return not storage.isdir(location.path) or bool(storage.listdir(location.path))


# Beside an item in a step directory: what Orbax's Checkpointer writes there.
_STEP_ENTRY = re.compile(r"^(_CHECKPOINT_METADATA|commit_success\.txt)$")


def _not_orbax(path: str, item: tuple[str, ...] = ()) -> list[str]:
    """The entries of directory ``path`` that are not an Orbax PyTree checkpoint's own (all of
    them where it is not one), the checkpoint being at ``path``/``item`` (MaxText's ``0/items``;
    ``"no 0/"`` where that is missing)."""
    root = epath.Path(path)
    if not root.is_dir():
        return [root.name]
    names = sorted(p.name for p in root.iterdir())
    if item:
        inner = item[0]
        foreign = [n for n in names if n != inner and not (len(item) == 1 and _STEP_ENTRY.match(n))]
        return foreign + ([f"no {inner}/"] if inner not in names else
                          [f"{inner}/{n}" for n in _not_orbax(os.fspath(root / inner), item[1:])])
    if _TREE_METADATA_FILE not in names:
        return names
    return [n for n in names if not _ORBAX_ENTRY.match(n)]


def _exists(path: str) -> bool:
    try:
        return epath.Path(path).exists()
    except Exception:  # an fsspec-only URL epath cannot handle: let the reader's error stand
        return True




def _orbax_item_dir(path: str) -> str | None:
    """The Orbax PyTree item directory at ``path``: itself, a step's only item, or the only
    item of a root's only step (MaxText's ``base_output_directory``)."""
    if path.endswith(".safetensors"):
        return None
    try:
        root = epath.Path(path)
        if (root / _TREE_METADATA_FILE).exists():
            return os.fspath(root)
        if not root.is_dir():
            return None
        items = _items(root)
        if not items:
            steps = [p for p in root.iterdir() if p.name.isdigit() and p.is_dir()]
            items = _items(steps[0]) if len(steps) == 1 else []
    except Exception:  # not a path Orbax can open (an fsspec-only URL): not an Orbax checkpoint
        return None
    if len(items) > 1:
        raise ArgumentError(
            f"{path!r} is a checkpoint step with several Orbax items "
            f"({', '.join(p.name for p in items)}): convert one of them")
    return os.fspath(items[0]) if items else None


def _items(step: epath.Path) -> list[epath.Path]:
    return sorted(p for p in step.iterdir() if (p / _TREE_METADATA_FILE).exists())
