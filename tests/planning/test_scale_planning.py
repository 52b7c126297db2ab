"""Planning stays linear at scale: one process of 512 (4096 devices), and one process holding
thousands of shards (``bench/scale.py`` runs the full Llama-3-405B version).

Costs are counted, not timed: Python function calls (``cProfile``, deterministic) and the
bytes a plan keeps (``tracemalloc``). A loop over every pair of shards, over every device
per block, or a Python object per byte run blows these bounds by orders of magnitude.
"""

import cProfile
import gc
import pstats
import tracemalloc

import numpy as np

from orbax_safetensors.format import DTYPES
from orbax_safetensors.planning import (
    ReadProfile,
    StoredSlice,
    TensorSource,
    TensorSpec,
    owned_ranges,
    plan_hf_checkpoint,
    plan_reads,
    plan_regions,
    plan_tensor_reads,
    plan_uploads,
    replication_factor,
    reshard_parts,
)

BF16 = DTYPES["BF16"]
FSDP, TP = 512, 8  # 4096 devices, 8 per process: process 0 holds fsdp row 0, every tp column
PROFILE = ReadProfile(chunk_bytes=32 << 20, max_gap=16 << 10, max_overread=2.0,
                      memory_budget=1 << 30)


def _grid(shape, rows_axis_first_tp):
    """Every device's box of a 2-D ``shape`` on the (FSDP, TP) mesh, device ids row-major:
    ``P("tp", "fsdp")`` when ``rows_axis_first_tp``, else ``P("fsdp", "tp")``."""
    boxes = []
    for f in range(FSDP):
        for t in range(TP):
            rows, cols = (t, f) if rows_axis_first_tp else (f, t)
            splits = (TP, FSDP) if rows_axis_first_tp else (FSDP, TP)
            step = [size // n for size, n in zip(shape, splits)]
            boxes.append(((rows * step[0], (rows + 1) * step[0]),
                          (cols * step[1], (cols + 1) * step[1])))
    return boxes


def _model(layers=2, hidden=4096, ffn=8192):
    """A Llama-like stack: (spec, tp-rows?) per 2-D weight, norms replicated (``None``)."""
    tensors = []
    for i in range(layers):
        tensors += [(TensorSpec(f"layers.{i}.q", BF16, (hidden, hidden)), True),
                    (TensorSpec(f"layers.{i}.o", BF16, (hidden, hidden)), False),
                    (TensorSpec(f"layers.{i}.up", BF16, (ffn, hidden)), True),
                    (TensorSpec(f"layers.{i}.down", BF16, (hidden, ffn)), False),
                    (TensorSpec(f"layers.{i}.norm", BF16, (hidden,)), None)]
    return tensors


def _boxes(spec, tp_rows):
    if tp_rows is None:
        return [((0, spec.shape[0]),)] * (FSDP * TP)
    return _grid(spec.shape, tp_rows)


def _calls(fn):
    """``fn()`` and the number of Python function calls it made."""
    profile = cProfile.Profile()
    result = profile.runcall(fn)
    return result, sum(s[1] for s in pstats.Stats(profile).stats.values())


def _retained(fn):
    """``fn()`` and the bytes its result keeps allocated."""
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        gc.collect()
        return result, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def test_a_shard_grid_of_thousands_is_one_region_in_linear_work():
    boxes = _grid((4096, 4096), rows_axis_first_tp=True)
    regions, calls = _calls(lambda: plan_regions((4096, 4096), boxes))
    assert [r.box for r in regions] == [((0, 4096), (0, 4096))]
    assert len(regions[0].members) == len(boxes)
    assert calls < 20 * len(boxes)  # every pair compared: ~8 million


def test_one_process_of_512_plans_its_save_in_arrays():
    """Process 0 owns a 16-byte column block of every row of the tp-row tensors: one write
    range per row, kept as arrays (a Python object per range costs ~10x the bound)."""
    model = _model()
    specs = [s for s, _ in model]
    plan = plan_hf_checkpoint(specs, max_shard_size=64 * 10**6)
    owned = [(s.name, b) for s, tp_rows in model
             for b in dict.fromkeys(_boxes(s, tp_rows)[:TP])]
    rows = sum(s.shape[0] for s, tp_rows in model if tp_rows)

    def save_plan():
        ranges = owned_ranges(plan.files, owned, 64 << 20)
        return ranges, plan_uploads(ranges, plan.files, max_objects_per_file=64,
                                    small_object=4 << 20)

    (ranges, uploads), kept = _retained(save_plan)
    assert sum(len(t) for _, t in ranges) >= rows
    assert len(ranges) == len({f for f, _ in ranges})  # one value per file, not per range
    assert len(uploads) <= len(plan.files) * 64
    assert kept < 128 * rows + (1 << 20)


def test_one_process_of_512_plans_its_load_in_linear_work():
    model = _model()
    plan = plan_hf_checkpoint([s for s, _ in model], max_shard_size=64 * 10**6)
    sources = {i.name: TensorSource(i.dtype, i.shape, (StoredSlice(
        i, f.name, f.data_start + i.begin, (0,) * len(i.shape)),))
        for f in plan.files for i in f.tensors}
    inputs = []
    for spec, tp_rows in model:
        boxes = _boxes(spec, tp_rows)
        inputs.append((spec, {p: boxes[p * TP:(p + 1) * TP] for p in range(FSDP)},
                       tuple(dict.fromkeys(boxes[:TP]))))

    def load_plan():
        reads = []
        for spec, by_process, local in inputs:
            assert replication_factor(spec.shape, by_process) == (1.0 if len(local) > 1 else FSDP)
            reads.append(plan_tensor_reads(sources[spec.name], local, 0, 4 << 20))
        return plan_reads(reads, PROFILE)

    read_plan, calls = _calls(load_plan)
    devices = FSDP * TP
    # Linear in the devices each tensor is sharded over (the input), not their square.
    assert calls < 2 * devices * len(model)  # before: 6.4x that
    requests = sum(len(t) for b in read_plan.batches for _, t in b.transfers) + sum(
        len(r.transfers) for b in read_plan.batches for r in b.bounced)
    assert requests >= 1
    copies = [c for b in read_plan.batches for r in b.bounced for c in r.copies]
    assert all(0 <= shard < TP for shard, _, _ in copies)
    assert np.unique([shard for shard, _, _ in copies]).size == TP


def test_one_process_of_512_reads_thin_strips_as_row_blocks():
    """``P("tp", "fsdp")`` gives process 0 a 16-byte piece of every row of q and up: read as
    row blocks (resharded on device) those are a few requests, not one per row; o and down
    (``P("fsdp", "tp")``) are a contiguous row block per process already and stay as they are."""
    model = _model()
    plan = plan_hf_checkpoint([s for s, _ in model], max_shard_size=64 * 10**6)
    stored = {i.name: TensorSource(i.dtype, i.shape, (StoredSlice(
        i, f.name, f.data_start + i.begin, (0,) * len(i.shape)),))
        for f in plan.files for i in f.tensors}
    devices = FSDP * TP
    reads = []
    for spec, tp_rows in model:
        boxes = _boxes(spec, tp_rows)
        by_process = {p: boxes[p * TP:(p + 1) * TP] for p in range(FSDP)}
        parts, calls = _calls(lambda: reshard_parts(spec.shape, 2, by_process, [TP] * FSDP, 16 << 10))
        assert calls < 4 * devices  # linear in the boxes, numpy per box
        assert (parts is not None) == bool(tp_rows), spec
        if parts is not None:
            rows = spec.shape[0] // parts
            blocks = sorted({d // (devices // parts) for d in range(TP)})  # process 0's devices
            local = [((j * rows, (j + 1) * rows), (0, spec.shape[1])) for j in blocks]
            reads.append(plan_tensor_reads(stored[spec.name], local, 0, 4 << 20))
    read_plan = plan_reads(reads, PROFILE)
    requests = sum(len(t) for b in read_plan.batches for _, t in b.transfers)
    assert not any(b.bounced for b in read_plan.batches)
    assert requests <= len(reads)  # process 0's row blocks, coalesced within each file
