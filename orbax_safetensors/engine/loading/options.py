"""``LoadOptions`` (what the caller asks of a load) resolved once into a ``ReadPolicy`` (what it does).

Options are the user's words: sizes, ``None`` for "the backend's" or "by
process count". A load resolves them once per opened checkpoint, with what
only the call and the checkpoint know (is the load collective, does it run in
the background, what the storage's requests cost, which files hold
checksums), into one frozen ``ReadPolicy``. Every job builder and the
executor take the policy as one argument; nothing downstream reads an option
or a default again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

from orbax_safetensors.engine.core import option_checks
from orbax_safetensors.engine.core.catalog import Checkpoint
from orbax_safetensors.engine.core.options import DEFAULT_LOAD_BUDGET
from orbax_safetensors.errors import ArgumentError, ArgumentTypeError
from orbax_safetensors.format.checksums import FileChecksums
from orbax_safetensors.planning import ReadProfile
from orbax_safetensors.planning import rules as mapping_rules

# Strided shards are served through bounce buffers of this size, one per read thread:
# small enough that they add little to the result, big enough to amortise a request.
BOUNCE_BYTES = 4 << 20
# The budget of a load whose jobs stage through recycled scratch (mapped tensors): a small one
# keeps the staging, and the fresh pages it costs, small.
SCRATCH_BUDGET = 128 << 20
STAGINGS = ("auto", "pooled", "fresh")


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """What a load is asked to do besides where and into what: ``load``'s and ``async_load``'s
    options, as one value (``options=``) or as keywords. The defaults suit local disks and
    buckets alike. Every field is checked when the options are built (a ``ValueError`` or
    ``TypeError`` naming it), and sizes are stored as ints (``"1GB"`` → ``10**9``).

    Attributes:
      memory_budget: host bytes staged at once (read but not yet on device),
        ``async_load``'s as ``load``'s (default 1 GB). The result itself is not
        counted: it is what the caller asked for. One tensor's local shard is
        staged whole, so a shard bigger than the budget is the budget. At most
        128 MB when a mapping transforms tensors and the staging is not pooled:
        their staging is only copied from, and recycled, beside results in host
        memory.
      chunk_bytes: the largest single read; bigger runs become parallel reads.
        ``None`` lets the storage backend choose (32 MB locally, 8 MiB on object
        stores, whose connections are slow alone and fast together). At least
        4 KiB (``MIN_CHUNK_BYTES``): every chunk is one request.
      max_overread: a coalesced read may fetch at most this many times the
        bytes it delivers (1.0: never read a byte that is not needed).
      max_gap: the largest unneeded gap read through; ``None`` lets the
        storage backend choose (16 KiB locally, 1 MiB on object stores).
      threads: concurrent reads (at least 1).
      replicated_read_once: with several processes, read each tensor that
        several processes need (replicated across hosts) once per cluster,
        1/N per process, and all-gather it on device. ``None``: on whenever
        ``jax.process_count() > 1``.
      reshard_thin_shards: with several processes, read a tensor whose shards
        are strided strips too thin to read well (runs shorter than
        ``max_gap``, or than a checksum block while checking them: under
        ``P("tp", "fsdp")`` on hundreds of devices, a ranged request per
        512-byte row piece) in contiguous row blocks, one set per
        process, and move it to the target sharding on device (an all-to-all).
        ``None``: on whenever ``jax.process_count() > 1``.
      verify_checksums: check every byte read against the crc32c its file
        stores (``ost.save`` stores one per 256 KiB block of each tensor), and
        raise ``ost.ChecksumError`` naming the file, tensor and bytes that do not
        match: damage on disk or in transit, or a file changed since it was
        written, fails the load instead of loading wrong weights. It costs
        hashing (about 11 GB/s, overlapped with the reads) and, for a
        partial read (a shard of a tensor), reading the blocks it touches whole:
        less than two blocks per contiguous run (``LoadStats.checksum_overread``).
        Files without checksums load unchecked; ``False`` reads exactly what is
        needed and checks nothing.
      casting: which conversions to the target's dtypes a load makes, because
        numpy's ``astype`` changes values without a word (-300.0 into int8 is
        -44, NaN into int32 is INT_MIN) and a model would train or serve on them.
        ``"same_kind"`` converts where every value keeps its meaning: float ↔
        float (bfloat16, float16, fp8: rounded), bool → anything, int → float,
        int → an int type holding all of the stored type's values. It refuses
        float → int or bool (and complex → real) before reading a byte, with an
        ``ost.SafetensorsError`` listing every such tensor; and it checks, on the
        values read, per shard (a min and a max), every cast that only some values
        survive: a narrowing or sign-changing int cast (int32 → int8, int8 → uint8,
        uint64 → int64, int → bool), and a cast to a float type of smaller range
        (float32 → float16 or fp8, float64 → float32, int32 → float16), where a value
        beyond the target's largest would become inf, NaN or that largest value, and
        inf or NaN where the target has none; raising an ``ost.SafetensorsError``
        naming the tensor and the first value that does not fit. With a mapping that scales, the rule applies to
        the final cast (float32 once scaled). ``"unsafe"`` casts as ``astype``
        does, whatever the values.
      staging: where the bytes read wait until they are on device. ``"pooled"``:
        buffers recycled from a pool of at most ``memory_budget`` bytes,
        registered for DMA with the accelerators' clients (page-locked: measured
        on an H200, host→device copies 4-7x faster than from pageable memory),
        each given back once its arrays are on device. ``"fresh"``: new pages
        for every batch, which XLA's CPU backend adopts as the arrays (no copy
        at all); a pooled load onto CPU devices copies out of the pool instead.
        ``"auto"``: pooled when a target leaf is on a device that is not a CPU,
        fresh otherwise.
      strict: ``True``: raise if the target and the checkpoint differ in names
        or shapes (the error lists every offending tensor; an
        ``ost.MissingTensorError``, also a ``KeyError``, when the target names
        tensors the checkpoint lacks). ``"target"``: every target leaf must be
        in the checkpoint with its shape, as with ``True``, but checkpoint
        tensors the target does not name are fine and left unread (a subset
        load: some layers, the weights without the optimizer state; what
        Orbax's ``SafetensorsLayout`` does). ``False``: only tensors present
        in both with equal shapes are loaded; of the other target leaves,
        arrays are returned unchanged and abstract ones (``ShapeDtypeStruct``)
        as ``None``, with a ``SkippedLeavesWarning`` naming them and their
        names in ``stats.skipped``.
      mapping: an ``ost.Mapping`` from checkpoint names and arrangements to the target's
        (e.g. ``ost.mappings.llama()`` for a Hugging Face Llama into a Flax model).
        Each leaf is read as the stored box holding its shards and transposed or
        reshaped on the host, shard by shard. Without a target the result is
        keyed by tree names.
      progress: report progress on stderr (this process's bytes read, rate,
        time left; process 0 only): one updating line on a terminal, as the CLI
        draws it, else a plain line every 10 s and one at the end.
      nest: without a target, return the tensors nested by the dots of their
        names (``{"model": {"layers": {"0": {...}}}}``) instead of flat.
    """

    memory_budget: int | str = DEFAULT_LOAD_BUDGET
    chunk_bytes: int | str | None = None
    max_overread: float = 2.0
    max_gap: int | None = None
    threads: int = 16
    replicated_read_once: bool | None = None
    reshard_thin_shards: bool | None = None
    verify_checksums: bool = True
    casting: str = "same_kind"
    staging: str = "auto"
    strict: bool | str = True
    mapping: mapping_rules.Mapping | None = None
    progress: bool = False
    nest: bool = False

    # Every chunk is one read request (a syscall, or an HTTP request), about 10 us of overhead
    # locally: a 1-byte chunk made a 6 MB load take 60 s. Below a page, a request reads less
    # than the kernel reads anyway; at 4 KiB the overhead stays under ~3 ms per MB.
    MIN_CHUNK_BYTES = 4096

    def __post_init__(self):
        """Checks every field, naming it, and stores sizes as ints (``"1GB"`` → 10**9)."""
        def resolve(field: str, check: Callable[..., Any], *, optional: bool = False,
                    **limits: Any) -> None:
            value = getattr(self, field)
            if not (optional and value is None):  # None: the backend's, or by process count
                object.__setattr__(self, field, check(f"LoadOptions.{field}", value, **limits))
        resolve("memory_budget", option_checks.size)
        resolve("chunk_bytes", option_checks.size, optional=True, minimum=self.MIN_CHUNK_BYTES,
                why=" (each chunk is one read request: smaller ones only add requests)")
        resolve("max_overread", option_checks.ratio, minimum=1.0)
        resolve("max_gap", option_checks.count, optional=True, minimum=0)
        resolve("threads", option_checks.count, minimum=1)
        resolve("replicated_read_once", option_checks.flag, optional=True)
        resolve("reshard_thin_shards", option_checks.flag, optional=True)
        resolve("verify_checksums", option_checks.flag)
        resolve("progress", option_checks.flag)
        resolve("nest", option_checks.flag)
        if self.casting not in ("same_kind", "unsafe"):
            raise ArgumentError(f'LoadOptions.casting must be "same_kind" (refuse casts that change '
                             f'values) or "unsafe" (numpy astype), not {self.casting!r}')
        if self.staging not in STAGINGS:
            raise ArgumentError(f'LoadOptions.staging must be "auto" (pooled for accelerators), '
                                f'"pooled" or "fresh", not {self.staging!r}')
        if self.strict not in (True, False, "target"):
            raise ArgumentError(f'LoadOptions.strict must be True, False or "target", not {self.strict!r}')
        if self.mapping is not None and not isinstance(self.mapping, mapping_rules.Mapping):
            raise ArgumentTypeError(f"mapping= takes an ost.Mapping, e.g. ost.mappings.llama(config), "
                                    f"not {type(self.mapping).__name__}")


class LoadKeywords(TypedDict, total=False):
    """``LoadOptions``'s fields as keywords of ``load`` and ``async_load`` (``**shorthand``), typed
    once for both, so that a type checker sees each keyword ``LoadOptions`` takes."""

    memory_budget: int | str
    chunk_bytes: int | str | None
    max_overread: float
    max_gap: int | None
    threads: int
    replicated_read_once: bool | None
    reshard_thin_shards: bool | None
    verify_checksums: bool
    casting: str
    staging: str
    strict: bool | str
    mapping: mapping_rules.Mapping | None
    progress: bool
    nest: bool


@dataclasses.dataclass(frozen=True)
class ReadPolicy:
    """How one load reads, resolved once (``resolve_policy``); job builders and the executor
    take it whole.

    Attributes:
      profile: how requests are cut and batches sized (``plan_reads``).
      threads: concurrent reads.
      bounce_bytes: the bounce buffer of a strided shard, one per read thread.
      read_once: read tensors replicated across processes 1/N per process, all-gathered.
      reshard_below: read a tensor whose shards have runs under this many bytes in row
        blocks and reshard it on device (0: never).
      casting: ``LoadOptions.casting``.
      checksums: the files whose reads are checked, with their block checksums.
      pooled: jobs whose results go to devices stage their reads in the recycled pool
        (``LoadOptions.staging``, resolved for the target's devices).
    """

    profile: ReadProfile
    threads: int
    bounce_bytes: int
    read_once: bool
    reshard_below: int
    casting: str
    checksums: Mapping[str, FileChecksums]
    pooled: bool = False

    @property
    def slices_by_region(self) -> bool:
        """Whether slices are read by region (``plan_tensor_reads``): where checksum blocks are
        checked, so that each block is read once."""
        return bool(self.checksums)

    def staging_scratch(self) -> ReadPolicy:
        """This policy for jobs that stage through recycled scratch: the budget at most
        ``SCRATCH_BUDGET`` beside results in host memory; a pooled load's staging is all the
        host memory it holds, so its budget stays."""
        if self.pooled:
            return self
        budget = min(self.profile.memory_budget, SCRATCH_BUDGET)
        return dataclasses.replace(self, profile=dataclasses.replace(self.profile, memory_budget=budget))


def resolve_policy(options: LoadOptions, checkpoint: Checkpoint, *, collectives: bool,
                   accelerated: bool = False) -> ReadPolicy:
    """``options`` for this ``checkpoint``: the storage's request sizes where the options leave
    them to it, and its checksums when they are checked. ``collectives``: whether the knobs left
    ``None`` (read once, reshard thin shards) turn on: a load over several processes, not run
    in the background (``async_load``: a collective issued from its thread can deadlock against
    the caller's). ``accelerated``: whether a target leaf is on a device that is not a CPU
    (``staging="auto"`` pools then)."""
    capabilities = checkpoint.storage.capabilities
    profile = ReadProfile(
        chunk_bytes=capabilities.chunk_bytes if options.chunk_bytes is None else options.chunk_bytes,
        max_gap=capabilities.max_gap if options.max_gap is None else options.max_gap,
        max_overread=options.max_overread,
        memory_budget=options.memory_budget)
    checksums = checkpoint.checksums if options.verify_checksums else {}
    reshard = collectives if options.reshard_thin_shards is None else options.reshard_thin_shards
    # A checked read reads every block it touches whole: a strip whose runs are thinner than a
    # block would read the other processes' bytes between them too, so it is read in row
    # blocks and resharded instead; slices are read by region, each block once.
    thin = max([profile.max_gap, *(c.grid.block_bytes for c in checksums.values())])
    return ReadPolicy(
        profile=profile,
        threads=options.threads,
        bounce_bytes=min(profile.chunk_bytes, BOUNCE_BYTES),
        read_once=collectives if options.replicated_read_once is None else options.replicated_read_once,
        reshard_below=thin if reshard else 0,
        casting=options.casting,
        checksums=checksums,
        pooled=options.staging == "pooled" or (options.staging == "auto" and accelerated))
