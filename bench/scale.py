"""Planning at scale: what one process plans to load and save a Llama-3-405B checkpoint.

    .venv/bin/python bench/scale.py            # 64, 512 and 4096 devices in 1, 64, 512 processes
    .venv/bin/python bench/scale.py --quick    # 64 devices only: a smoke test

Pure planning, no files and no JAX devices: the checkpoint is the hf layout
``plan_hf_checkpoint`` gives the real Llama-3-405B tensors (bf16, ~812 GB, in
the order transformers writes them, 5 GB files), and each process's device
boxes are computed here with numpy the way ``NamedSharding.devices_indices_map``
cuts a ``(fsdp, tp)`` mesh (tp = 8, device ids row-major over the mesh, each
process holding a contiguous run of them). 2-D weights are sharded as MaxText
shards the projections they come from (stored as HF's ``(out, in)``):
``P("tp", "fsdp")`` for q/k/v, gate/up, the embedding and lm_head,
``P("fsdp", "tp")`` for o_proj and down_proj; norms are replicated.

For one or two representative processes (0, and the middle one when there
are several) it reports:

* **load**: everything ``ost.load`` plans before its first read, with the
  default ``LoadOptions`` on local disk (32 MB chunks, 16 KiB gaps, 2x
  over-read, 1 GB budget, 4 MB bounce blocks): ``replication_factor`` and
  ``reshard_parts`` of each (shape, sharding) over every process's boxes
  (several processes only, once per pair as the engine caches them), each
  tensor's reads (``plan_tensor_reads`` of its shards, ``plan_byte_reads`` of
  its 1/N for a replicated tensor read once, or of its row blocks for a tensor
  resharded on device), then ``plan_reads``. Time (best of ``--repeats``
  untraced runs), tracemalloc's peak during a traced run,
  the bytes the finished plan keeps, its ranged requests and bytes read.
* **save**: the hf write plan every process derives (``plan_hf_checkpoint``),
  the byte ranges this process owns (``owned_ranges`` of its ``replica_id ==
  0`` shards -- row blocks for a tensor resharded on device --, 64 MB writes)
  and its part objects for an object store (``plan_uploads``), measured the
  same way. A process owning more than ``MAX_SAVE_RUNS`` byte runs (one
  process holding every column block of every tensor) is not planned: its
  plan would take tens of GB, a segment per run; the row says how many runs
  it owns.

Building the boxes is the bench's (and, in ``ost.load``, JAX's and the
engine's) work, not the planner's: it happens outside the timed and traced
regions. Results go to stdout and ``bench/results/scale.md``
(``scale-quick.md`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import pathlib
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from orbax_safetensors.engine.saving.strategies import (  # noqa: E402
    _MAX_OBJECTS_PER_FILE,
    _SMALL_OBJECT,
    WRITE_CHUNK_BYTES,
)
from orbax_safetensors.format import DTYPES  # noqa: E402
from orbax_safetensors.planning import (  # noqa: E402
    Box,
    ReadProfile,
    StoredSlice,
    TensorReads,
    TensorSource,
    TensorSpec,
    WritePlan,
    box_size,
    full_box,
    owned_ranges,
    plan_byte_reads,
    plan_hf_checkpoint,
    plan_reads,
    plan_tensor_reads,
    plan_uploads,
    read_once_boxes,
    replication_factor,
    reshard_parts,
)

# Llama-3.1-405B (config.json of meta-llama/Llama-3.1-405B)
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 126, 16384, 53248, 128, 8, 128, 128256
TP = 8
DEVICES = (64, 512, 4096)
PROCESSES = (1, 64, 512)
# ost.load's defaults on a local disk (LoadOptions, LocalStorage's capabilities, loading.options.BOUNCE_BYTES)
PROFILE = ReadProfile(chunk_bytes=32 << 20, max_gap=16 << 10, max_overread=2.0,
                      memory_budget=1 << 30)
BOUNCE_BYTES = 4 << 20
# A save plan holds a segment per run it owns (~50 bytes each): a process that owns every
# column block of every tensor alone (one process, 512+ devices) would need tens of GB.
MAX_SAVE_RUNS = 50_000_000
RESULTS = pathlib.Path(__file__).resolve().parent / "results"

Spec = tuple[str | None, ...]  # mesh axis per dimension, like a PartitionSpec
ROWS_TP, ROWS_FSDP, REPLICATED = ("tp", "fsdp"), ("fsdp", "tp"), (None,)


def llama_405b() -> list[tuple[TensorSpec, Spec]]:
    """Every tensor in ``model.state_dict()`` order, with its MaxText-like partitioning."""
    bf16 = DTYPES["BF16"]
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    layer = [
        ("self_attn.q_proj.weight", (q, HIDDEN), ROWS_TP),
        ("self_attn.k_proj.weight", (kv, HIDDEN), ROWS_TP),
        ("self_attn.v_proj.weight", (kv, HIDDEN), ROWS_TP),
        ("self_attn.o_proj.weight", (HIDDEN, q), ROWS_FSDP),
        ("mlp.gate_proj.weight", (FFN, HIDDEN), ROWS_TP),
        ("mlp.up_proj.weight", (FFN, HIDDEN), ROWS_TP),
        ("mlp.down_proj.weight", (HIDDEN, FFN), ROWS_FSDP),
        ("input_layernorm.weight", (HIDDEN,), REPLICATED),
        ("post_attention_layernorm.weight", (HIDDEN,), REPLICATED),
    ]
    tensors = [("model.embed_tokens.weight", (VOCAB, HIDDEN), ROWS_TP)]
    tensors += [(f"model.layers.{i}.{name}", shape, spec)
                for i in range(LAYERS) for name, shape, spec in layer]
    tensors += [("model.norm.weight", (HIDDEN,), REPLICATED),
                ("lm_head.weight", (VOCAB, HIDDEN), ROWS_TP)]
    return [(TensorSpec(name, bf16, shape), spec) for name, shape, spec in tensors]


@dataclasses.dataclass(frozen=True)
class Layout:
    """``devices`` on a ``(devices // TP, TP)`` mesh, split evenly over ``processes``."""

    devices: int
    processes: int

    @property
    def per_process(self) -> int:
        return self.devices // self.processes

    def axis_index(self, axis: str) -> np.ndarray:
        """Each device's coordinate along mesh ``axis`` (device ids row-major over the mesh)."""
        ids = np.arange(self.devices)
        return ids // TP if axis == "fsdp" else ids % TP

    def axis_size(self, axis: str) -> int:
        return self.devices // TP if axis == "fsdp" else TP

    def bounds(self, shape: tuple[int, ...], spec: Spec) -> np.ndarray:
        """``(devices, ndim, 2)`` bounds of every device's shard, cut like JAX cuts them
        (chunks of ``ceil(size / axis size)``, the last ones short or empty)."""
        out = np.zeros((self.devices, len(shape), 2), np.int64)
        for d, size in enumerate(shape):
            axis = spec[d] if d < len(spec) else None
            if axis is None:
                out[:, d, 1] = size
                continue
            chunk = -(-size // self.axis_size(axis))
            index = self.axis_index(axis)
            out[:, d, 0] = np.minimum(index * chunk, size)
            out[:, d, 1] = np.minimum((index + 1) * chunk, size)
        return out

    def devices_of(self, process: int) -> range:
        return range(process * self.per_process, (process + 1) * self.per_process)

    @functools.lru_cache(maxsize=None)
    def boxes(self, shape: tuple[int, ...], spec: Spec) -> list[Box]:
        """Every device's box, in device order (the layers share a few of these)."""
        return [tuple(map(tuple, b)) for b in self.bounds(shape, spec).tolist()]


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the engine hands the planner for one tensor on one process."""

    source: TensorSource
    local: tuple[Box, ...]  # distinct boxes of this process's devices
    read_once_parts: list[int]  # this process's indices among the sharding's devices
    sharing: Callable[[], tuple[bool, int | None]]  # ``sharing`` of its (shape, sharding)


def sources(plan: WritePlan) -> dict[str, TensorSource]:
    """The checkpoint ``plan`` writes, as the catalog opens it."""
    return {info.name: TensorSource(info.dtype, info.shape, (StoredSlice(
        info, file.name, file.data_start + info.begin, (0,) * len(info.shape)),))
            for file in plan.files for info in file.tensors}


def inputs(layout: Layout, process: int, specs: list[tuple[TensorSpec, Spec]],
           stored: dict[str, TensorSource]) -> Iterator[Inputs]:
    """Per tensor, what ``engine.loading.jobs.sharded_job`` derives from ``devices_indices_map``."""
    mine = layout.devices_of(process)
    for spec, partition in specs:
        boxes = layout.boxes(spec.shape, partition)
        local = tuple(dict.fromkeys(boxes[mine.start:mine.stop]))
        yield Inputs(stored[spec.name], local, list(mine), functools.partial(
            sharing, layout, spec.shape, partition, spec.dtype.bits // 8))


@functools.lru_cache(maxsize=None)
def sharing(layout: Layout, shape: tuple[int, ...], partition: Spec, itemsize: int
            ) -> tuple[bool, int | None]:
    """Whether processes share bytes of the tensor (read it once), and the row blocks to read
    it in and reshard (``reshard_parts``): ``engine.resharding``'s decisions, cached per
    (shape, sharding) as there. Several processes only."""
    if layout.processes == 1:
        return False, None
    boxes = layout.boxes(shape, partition)
    by_process = {p: boxes[p * layout.per_process:(p + 1) * layout.per_process]
                  for p in range(layout.processes)}
    return replication_factor(shape, by_process) > 1.0, reshard_parts(
        shape, itemsize, by_process, [layout.per_process] * layout.processes, PROFILE.max_gap)


def row_block(shape: tuple[int, ...], parts: int, block: int) -> Box:
    rows = shape[0] // parts
    return ((block * rows, (block + 1) * rows),) + full_box(shape[1:])


def plan_load(items: list[Inputs], devices: int) -> tuple[Any, ...]:
    """Everything the load path plans: per-tensor reads, then the batched, coalesced plan."""
    reads = [tensor_reads(item, devices) for item in items]
    return plan_reads(reads, PROFILE), reads


def tensor_reads(item: Inputs, devices: int) -> TensorReads:
    """``sharded_job``'s planning: read once (replicated over processes), read row blocks to
    reshard on device (thin strips over processes), or read the shards."""
    source = item.source
    needed = sum(box_size(b) for b in item.local) * source.dtype.bits // 8
    shared, row_parts = item.sharing()
    if shared:
        parts = read_once_boxes(source.nbytes, devices)
        return plan_byte_reads(source.slices[0], [parts[k] for k in item.read_once_parts], needed,
                               read_once=True)
    if row_parts is not None:  # row blocks, each on ``devices // parts`` devices
        per_part = devices // row_parts
        boxes = [row_block(source.shape, row_parts, j)
                 for j in sorted({k // per_part for k in item.read_once_parts})]
        return dataclasses.replace(plan_tensor_reads(source, boxes, needed, BOUNCE_BYTES),
                                   resharded=True)
    return plan_tensor_reads(source, item.local, needed, BOUNCE_BYTES)


def owned_boxes(layout: Layout, process: int, specs: list[tuple[TensorSpec, Spec]]
                ) -> list[tuple[str, Box]]:
    """This process's shards with ``replica_id == 0`` (a replicated tensor: device 0's),
    after ``engine.save`` moved thin strips to row blocks (the first device of each holds
    replica 0)."""
    mine = layout.devices_of(process)
    owned = []
    for spec, partition in specs:
        parts = sharing(layout, spec.shape, partition, spec.dtype.bits // 8)[1]
        if parts is not None:
            per_part = layout.devices // parts
            owned += [(spec.name, row_block(spec.shape, parts, j))
                      for j in range(parts) if j * per_part in mine]
            continue
        first: dict[Box, int] = {}  # box -> the first device holding it, whose copy is replica 0
        for device, box in enumerate(layout.boxes(spec.shape, partition)):
            first.setdefault(box, device)
        owned += [(spec.name, box) for box, device in first.items() if device in mine]
    return owned


def plan_save(specs: list[TensorSpec], owned: list[tuple[str, Box]], process: int) -> tuple:
    """What every process derives for an hf save: the files, its ranges, its part objects."""
    plan = plan_hf_checkpoint(specs, max_shard_size=5 * 10**9)
    ranges = owned_ranges(plan.files, owned, WRITE_CHUNK_BYTES)
    uploads = plan_uploads(ranges, plan.files if process == 0 else (),
                           max_objects_per_file=_MAX_OBJECTS_PER_FILE, small_object=_SMALL_OBJECT)
    return plan, ranges, uploads


@dataclasses.dataclass(frozen=True)
class Cost:
    seconds: float
    peak: int  # tracemalloc peak while planning
    retained: int  # what the plan keeps once planning is done


def measure(make: Callable[[], Any], repeats: int) -> tuple[Any, Cost]:
    """Best untraced time of ``make``, then one traced run for its memory."""
    seconds = float("inf")
    for _ in range(repeats):
        gc.collect()
        started = time.perf_counter()
        result = make()
        seconds = min(seconds, time.perf_counter() - started)
        del result
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    result = make()
    peak = tracemalloc.get_traced_memory()[1] - base
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return result, Cost(seconds, peak, retained)


def requests_of(plan) -> tuple[int, int]:
    """Ranged requests and bytes a read plan makes (direct and bounced)."""
    count = nbytes = 0
    for batch in plan.batches:
        for _, transfers in batch.transfers:
            count, nbytes = count + len(transfers), nbytes + transfers.nbytes
        for bounced in batch.bounced:
            count, nbytes = count + len(bounced.transfers), nbytes + bounced.transfers.nbytes
    return count, nbytes


def run(layout: Layout, process: int, specs: list[tuple[TensorSpec, Spec]],
        stored: dict[str, TensorSource], repeats: int) -> dict[str, Any]:
    items = list(inputs(layout, process, specs, stored))
    sharing.cache_clear()  # each row pays for its decisions, as a fresh process does
    (load_plan, _), load = measure(functools.partial(plan_load, items, layout.devices), repeats)
    requests, read_bytes = requests_of(load_plan)
    del items, load_plan
    row = {"devices": layout.devices, "processes": layout.processes, "process": process,
           "load": load, "requests": requests, "read_gb": read_bytes / 1e9}
    owned = owned_boxes(layout, process, specs)
    shapes = {s.name: s.shape for s, _ in specs}
    runs = sum(run_count(box, shapes[name]) for name, box in owned)
    if runs > MAX_SAVE_RUNS:
        return {**row, "save": None, "runs": runs}
    tensor_specs = [s for s, _ in specs]
    (_, ranges, uploads), save = measure(lambda: plan_save(tensor_specs, owned, process), repeats)
    return {**row, "save": save, "runs": runs, "ranges": sum(len(t) for _, t in ranges),
            "uploads": len(uploads), "write_gb": sum(t.nbytes for _, t in ranges) / 1e9}


def run_count(box: Box, shape: tuple[int, ...]) -> int:
    """How many byte runs ``box`` occupies (``len(byte_runs(...)[0])``, without the array)."""
    split = len(shape) - 1
    while split >= 0 and box[split] == (0, shape[split]):
        split -= 1
    return math.prod(stop - start for start, stop in box[:max(split, 0)])


def table(rows: list[dict[str, Any]]) -> str:
    header = ("| devices | processes | process | load plan s | load peak MB | load plan MB "
              "| requests | read GB | save plan s | save peak MB | save plan MB | write ranges "
              "| uploads | write GB |")
    lines = [header, "|" + "|".join(["---:"] * (header.count("|") - 1)) + "|"]
    mb = 1e6
    for r in rows:
        load, save = r["load"], r["save"]
        line = (f"| {r['devices']} | {r['processes']} | {r['process']} | {load.seconds:.3f} "
                f"| {load.peak / mb:.1f} | {load.retained / mb:.1f} | {r['requests']} "
                f"| {r['read_gb']:.2f} | ")
        if save is None:
            line += f"not planned: {r['runs']} runs | | | | | |"
        else:
            line += (f"{save.seconds:.3f} | {save.peak / mb:.1f} | {save.retained / mb:.1f} "
                     f"| {r['ranges']} | {r['uploads']} | {r['write_gb']:.2f} |")
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 devices only")
    parser.add_argument("--repeats", type=int, default=1, help="untimed runs: best of this many")
    args = parser.parse_args()
    specs = llama_405b()
    stored = sources(plan_hf_checkpoint([s for s, _ in specs], max_shard_size=5 * 10**9))
    rows = []
    for devices in DEVICES[:1] if args.quick else DEVICES:
        for processes in PROCESSES:
            if devices < processes or devices % processes:
                continue
            layout = Layout(devices, processes)
            for process in sorted({0, processes // 2}):
                rows.append(run(layout, process, specs, stored, args.repeats))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("scale-quick.md" if args.quick else "scale.md")).write_text(text + "\n")


if __name__ == "__main__":
    main()
