"""Pure read planning: boxes → byte runs → regions → coalesced reads (hypothesis)."""

import dataclasses
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from orbax_safetensors.planning import (
    GAP,
    Runs,
    box_shape,
    box_size,
    byte_runs,
    coalesce,
    intersect,
    normalize_index,
    plan_region_reads,
    plan_regions,
    read_once_boxes,
    relative_slices,
    replication_factor,
    reshard_parts,
    box_runs,
    row_runs,
    row_slabs,
)

_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None)


@st.composite
def shapes_and_boxes(draw, max_dims=5):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=max_dims)))
    box = []
    for size in shape:
        start = draw(st.integers(0, size - 1))
        box.append((start, draw(st.integers(start + 1, size))))
    return shape, tuple(box)


@st.composite
def tilings(draw):
    """A shape split into a grid of tiles (as a sharding does), and a subset held locally."""
    ndim = draw(st.integers(1, 4))
    splits = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape = tuple(s * draw(st.integers(1, 3)) for s in splits)
    tiles = []
    for index in np.ndindex(*splits):
        tiles.append(tuple(
            (i * size // n, (i + 1) * size // n) for i, size, n in zip(index, shape, splits)))
    local = draw(st.lists(st.sampled_from(tiles), min_size=1, max_size=len(tiles)))
    return shape, tiles, local


def _tensor_bytes(shape, itemsize):
    return np.random.default_rng(len(shape)).integers(
        0, 256, math.prod(shape) * itemsize, dtype=np.uint8)


@_SETTINGS
@given(shapes_and_boxes(), st.sampled_from([1, 2, 4, 8]))
def test_byte_runs_gather_exactly_the_box(shape_box, itemsize):
    shape, box = shape_box
    data = _tensor_bytes(shape, itemsize)
    offsets, length = byte_runs(box, shape, itemsize)
    gathered = b"".join(data[o:o + length].tobytes() for o in offsets)
    expected = data.reshape(shape + (itemsize,))[tuple(slice(a, b) for a, b in box)]
    assert gathered == np.ascontiguousarray(expected).tobytes()
    assert list(offsets) == sorted(offsets)


def test_leading_dim_box_is_one_run_and_column_box_one_run_per_row():
    assert len(byte_runs(((2, 4), (0, 8)), (8, 8), 2)[0]) == 1
    offsets, length = byte_runs(((0, 8), (4, 8)), (8, 8), 2)
    assert len(offsets) == 8 and length == 8


@_SETTINGS
@given(tilings())
def test_regions_cover_the_local_tiles_and_merge_when_their_union_is_a_box(tiling):
    shape, tiles, local = tiling
    regions = plan_regions(shape, local)
    members = [m for r in regions for m in r.members]
    assert sorted(members) == sorted(set(local))  # each distinct tile exactly once
    for region in regions:
        for member in region.members:
            assert all(r0 <= m0 and m1 <= r1 for (m0, m1), (r0, r1) in zip(member, region.box))
    if len(regions) == 1:
        assert box_size(regions[0].box) == sum(box_size(t) for t in set(local))


def test_a_process_holding_every_column_block_reads_whole_rows_once():
    tiles = [((0, 8), (c, c + 2)) for c in range(0, 8, 2)]
    (region,) = plan_regions((8, 8), tiles)
    assert region.box == ((0, 8), (0, 8))
    runs = box_runs(region.box, (8, 8), 4, 1000, target=0)
    (transfer,) = coalesce(runs, max_gap=0, max_overread=1.0, chunk_bytes=1 << 20)
    assert (transfer.offset, transfer.length) == (1000, 256)


@st.composite
def run_sets(draw):
    """Disjoint runs in a small file, each delivered to a region of some target buffer."""
    file_size = draw(st.integers(1, 400))
    cuts = sorted(set(draw(st.lists(st.integers(0, file_size), max_size=30))) | {0, file_size})
    segments = [(a, b) for a, b in zip(cuts, cuts[1:])]
    chosen = [s for s in segments if draw(st.booleans())]
    targets = [draw(st.integers(0, 2)) for _ in chosen]
    return file_size, chosen, targets


@_SETTINGS
@given(run_sets(), st.integers(0, 64), st.sampled_from([1.0, 1.5, 2.0, 4.0]), st.integers(1, 100))
def test_coalesced_reads_deliver_every_needed_byte_within_the_bounds(runs, max_gap, ratio, chunk):
    file_size, segments, targets = runs
    file = np.random.default_rng(file_size).integers(0, 256, file_size, dtype=np.uint8)
    cursor = [0, 0, 0]
    offsets, lengths, target_offsets = [], [], []
    for (a, b), t in zip(segments, targets):
        offsets.append(a)
        lengths.append(b - a)
        target_offsets.append(cursor[t])
        cursor[t] += b - a
    plan = Runs(*(np.array(x, np.int64) for x in (offsets, lengths, targets, target_offsets)))
    transfers = coalesce(plan, max_gap=max_gap, max_overread=ratio, chunk_bytes=chunk)

    buffers = [np.zeros(n, np.uint8) for n in cursor]
    for transfer in transfers:
        assert 0 < transfer.length <= chunk
        position = transfer.offset
        for segment in transfer.segments:
            if segment.target == GAP:
                assert segment.length <= max_gap
            else:
                buffers[segment.target][segment.offset:segment.offset + segment.length] = \
                    file[position:position + segment.length]
            position += segment.length
        assert position == transfer.offset + transfer.length
    for t in range(3):
        expected = [file[a:b] for (a, b), tt in zip(segments, targets) if tt == t]
        np.testing.assert_array_equal(
            buffers[t], np.concatenate(expected) if expected else np.zeros(0, np.uint8))
    needed = sum(lengths)
    assert sum(t.length for t in transfers) <= ratio * needed
    assert sum(t.needed for t in transfers) == needed


def test_replication_and_read_once_split():
    shape = (8, 4)
    rows = {0: [((0, 4), (0, 4))], 1: [((4, 8), (0, 4))]}
    assert replication_factor(shape, rows) == 1.0
    everywhere = {p: [((0, 8), (0, 4))] * 4 for p in range(3)}
    assert replication_factor(shape, everywhere) == 3.0
    boxes = read_once_boxes(10, 4)
    assert boxes == (((0, 3),), ((3, 6),), ((6, 9),), ((9, 10),))
    assert read_once_boxes(2, 4)[-1] == ((2, 2),)


def _column_strips(shape, processes, devices_each):
    """Each process's devices hold its column block, cut in rows among them (P("tp", "fsdp"))."""
    rows, cols = shape[0] // devices_each, shape[1] // processes
    return {p: [((d * rows, (d + 1) * rows), (p * cols, (p + 1) * cols)) for d in range(devices_each)]
            for p in range(processes)}


def test_reshard_parts_for_thin_strips_across_processes():
    shape = (4096, 512)  # float32: a process's column block is 1 KiB of every row
    strips = _column_strips(shape, 2, 4)
    assert reshard_parts(shape, 4, strips, [4, 4], thin=16384) == 8  # a block per device
    assert reshard_parts(shape, 4, strips, [4, 4], thin=1024) is None  # runs not thinner
    assert reshard_parts(shape, 4, {0: strips[0]}, [8], thin=16384) is None  # one process
    assert reshard_parts((4096,), 4, {0: [((0, 2048),)], 1: [((2048, 4096),)]}, [4, 4],
                         thin=1 << 30) is None  # 1-D: already contiguous
    # 12 rows on 8 devices: 4 blocks of 3 rows, each on 2 devices of one process.
    assert reshard_parts((12, 512), 4, _column_strips((12, 512), 2, 4), [4, 4], thin=16384) == 4
    # 6 rows on 8 devices: 2 blocks of 4 devices; with 4 processes of 2 each block would
    # straddle two processes (both would read it).
    assert reshard_parts((6, 512), 4, _column_strips((6, 512), 4, 2), [2, 2, 2, 2],
                         thin=16384) is None
    # Leading-dim shards are whole rows: never thin, whatever the threshold says.
    rows = {p: [((p * 2048, (p + 1) * 2048), (0, 512))] for p in range(2)}
    assert reshard_parts(shape, 4, rows, [4, 4], thin=1 << 30) is None
    single_rows = {p: [((r, r + 1), (0, 512)) for r in range(p * 4, p * 4 + 4)] for p in range(2)}
    assert reshard_parts((8, 512), 4, single_rows, [4, 4], thin=1 << 30) is None
    # Whole rows cut into column blocks among a process's devices (P("fsdp", "tp")): each
    # device's box is strided, but the process reads the row block they tile, in one run.
    fsdp_tp = {p: [((p * 2048, (p + 1) * 2048), (d * 128, (d + 1) * 128)) for d in range(4)]
               for p in range(2)}
    assert reshard_parts(shape, 4, fsdp_tp, [4, 4], thin=1 << 30) is None
    # A process whose two boxes do not tile their bounding box reads each: thin here.
    corners = {0: [((0, 2048), (0, 128)), ((2048, 4096), (384, 512))],
               1: [((0, 2048), (128, 384)), ((2048, 4096), (0, 384))]}
    assert reshard_parts(shape, 4, corners, [2, 2], thin=16384) == 4
    # A 3-D shard cut on its middle axis: 4 runs of 2 rows each.
    middle = {p: [((0, 4), (p * 2, p * 2 + 2), (0, 8))] for p in range(2)}
    assert reshard_parts((4, 4, 8), 4, middle, [1, 1], thin=1024) == 2
    assert reshard_parts((4, 4, 8), 4, middle, [1, 1], thin=64) is None


def test_normalize_index_and_relative_slices():
    assert normalize_index((slice(2, 4), slice(None)), (8, 3)) == ((2, 4), (0, 3))
    assert normalize_index((), ()) == ()
    assert relative_slices(((2, 4), (1, 3)), ((2, 6), (0, 3))) == (slice(0, 2), slice(1, 3))


@_SETTINGS
@given(tilings(), st.sampled_from([1, 2, 4]), st.integers(1, 64))
def test_region_reads_fill_every_shard_exactly_once(tiling, itemsize, block_bytes):
    shape, _, local = tiling
    for region in plan_regions(shape, local):
        reads = plan_region_reads(region, shape, itemsize, block_bytes)
        covered = np.zeros(shape, int)
        for read in reads:
            covered[tuple(slice(a, b) for a, b in read.box)] += 1
            if read.direct is not None:
                assert read.direct == read.box and read.box in region.members
            else:
                rows = read.box[0][1] - read.box[0][0]
                assert rows == 1 or box_size(read.box) * itemsize <= block_bytes
        for member in region.members:  # every byte of every shard arrives exactly once
            assert (covered[tuple(slice(a, b) for a, b in member)] == 1).all()


def test_row_shards_are_read_directly_and_column_shards_through_bounce_blocks():
    rows = [((r, r + 2), (0, 8)) for r in range(0, 8, 2)]
    (region,) = plan_regions((8, 8), rows)
    assert [r.direct for r in plan_region_reads(region, (8, 8), 4, 1 << 20)] == rows
    columns = [((0, 8), (c, c + 2)) for c in range(0, 8, 2)]
    (region,) = plan_regions((8, 8), columns)
    reads = plan_region_reads(region, (8, 8), 4, 64)  # 64 bytes = two full rows per block
    assert [r.box for r in reads] == [((r, r + 2), (0, 8)) for r in range(0, 8, 2)]
    assert all(r.direct is None for r in reads)


@_SETTINGS
@given(tilings(), st.integers(1, 4), st.integers(1, 97))
def test_owned_write_ranges_of_all_processes_tile_every_file_once(tiling, owners, chunk):
    """A save's write plan: every process's ranges (its tiles, one process per tile owner)
    written into files built from those ranges reproduce each tensor exactly, no byte twice."""
    from orbax_safetensors.format import DTYPES
    from orbax_safetensors.planning import TensorSpec, owned_ranges, plan_hf_checkpoint

    shape, tiles, _ = tiling
    dtype = DTYPES["F32"]
    specs = [TensorSpec("a", dtype, shape), TensorSpec("b", dtype, shape)]
    plan = plan_hf_checkpoint(specs, max_shard_size=max(8, math.prod(shape) * 4), metadata=None)
    values = {s.name: np.random.default_rng(i).random(shape, np.float32) for i, s in enumerate(specs)}
    files = {f.name: np.zeros(f.size, np.uint8) for f in plan.files}
    written = {f.name: np.zeros(f.size, np.int64) for f in plan.files}
    for owner in range(owners):
        boxes = [(s.name, tile) for s in specs for i, tile in enumerate(tiles) if i % owners == owner]
        payloads = [np.frombuffer(values[n][tuple(slice(a, b) for a, b in box)].tobytes(), np.uint8)
                    for n, box in boxes]
        for file, transfers in owned_ranges(plan.files, boxes, chunk):
            for transfer in transfers:
                assert transfer.length <= max(chunk, max(s.length for s in transfer.segments))
                position = transfer.offset
                for segment in transfer.segments:
                    files[file][position:position + segment.length] = \
                        payloads[segment.target][segment.offset:segment.offset + segment.length]
                    written[file][position:position + segment.length] += 1
                    position += segment.length
    for f in plan.files:
        for info in f.tensors:
            start = f.data_start + info.begin
            assert (written[f.name][start:start + info.nbytes] == 1).all()
            stored = files[f.name][start:start + info.nbytes].view(np.float32).reshape(shape)
            np.testing.assert_array_equal(stored, values[info.name])


@st.composite
def blocked_runs(draw):
    """A small file of a few tensors cut into checksum blocks, and runs inside its tensors:
    disjoint ones plus a few that overlap them (two buffers wanting the same bytes)."""
    from orbax_safetensors.format import DTYPES, TensorInfo
    from orbax_safetensors.format.checksums import BlockGrid

    data_start = draw(st.integers(0, 40))
    sizes = draw(st.lists(st.integers(0, 150), min_size=1, max_size=5))
    begins = np.cumsum([0] + sizes[:-1]).tolist()
    infos = [TensorInfo(f"t{i}", DTYPES["U8"], (n,), b, b + n) for i, (b, n) in enumerate(zip(begins, sizes))]
    grid = BlockGrid.of(infos, data_start, draw(st.integers(1, 48)))
    runs = []
    for b, n in zip(begins, sizes):
        cuts = sorted(set(draw(st.lists(st.integers(0, n), max_size=8))) | {0, n})
        runs += [(data_start + b + a, z - a) for a, z in zip(cuts, cuts[1:]) if draw(st.booleans())]
        if n and draw(st.booleans()):
            a = draw(st.integers(0, n - 1))
            runs.append((data_start + b + a, draw(st.integers(1, n - a))))
    targets = [draw(st.integers(0, 2)) for _ in runs]
    return data_start + sum(sizes), grid, runs, targets


def _runs(runs, targets):
    cursor = [0, 0, 0]
    target_offsets = []
    for (_, length), t in zip(runs, targets):
        target_offsets.append(cursor[t])
        cursor[t] += length
    return Runs(*(np.array(x, np.int64).reshape(-1) for x in (
        [o for o, _ in runs], [n for _, n in runs], targets, target_offsets))), cursor


@_SETTINGS
@given(blocked_runs(), st.integers(0, 64), st.sampled_from([1.0, 2.0]), st.integers(1, 100),
       st.integers(1, 100), st.randoms(use_true_random=False))
def test_checked_reads_read_every_touched_block_whole_within_two_blocks_a_run(
        case, max_gap, ratio, chunk, other_chunk, shuffle):
    """With a file's checksum blocks, requests still deliver every run; every block a run
    touches is read whole, so pieces of the reads complete it (two plans' pieces, cut at other
    chunk boundaries and arriving interleaved, complete it twice over); the padding is exactly
    the bytes beyond the plan without blocks, under two blocks per request of that plan."""
    from orbax_safetensors.format.checksums import Tally, crc32c

    file_size, grid, runs, targets = case
    file = np.random.default_rng(file_size).integers(0, 256, file_size, dtype=np.uint8)
    plan, sizes = _runs(runs, targets)
    transfers = coalesce(plan, max_gap=max_gap, max_overread=ratio, chunk_bytes=chunk, blocks=grid)
    plain = coalesce(plan, max_gap=max_gap, max_overread=ratio, chunk_bytes=1 << 40)
    buffers = [np.zeros(n, np.uint8) for n in sizes]
    covered = np.zeros(file_size, bool)
    for transfer in transfers:
        assert 0 < transfer.length <= chunk
        position = transfer.offset
        for segment in transfer.segments:
            if segment.target != GAP:
                buffers[segment.target][segment.offset:segment.offset + segment.length] = \
                    file[position:position + segment.length]
            position += segment.length
        assert position == transfer.offset + transfer.length
        covered[transfer.offset:position] = True
    for t in range(3):
        expected = [file[o:o + n] for (o, n), tt in zip(runs, targets) if tt == t]
        np.testing.assert_array_equal(
            buffers[t], np.concatenate(expected) if expected else np.zeros(0, np.uint8))
    blocks = [grid.block(i) for i in range(grid.count)]
    touched = {i for i, (_, start, stop) in enumerate(blocks)
               for offset, length in runs if offset < stop and start < offset + length}
    for i, (_, start, stop) in enumerate(blocks):
        assert covered[start:stop].all() or not covered[start:stop].any()  # whole or not at all
        assert i not in touched or covered[start:stop].all()
    assert transfers.padding == transfers.nbytes - plain.nbytes
    assert 0 <= transfers.padding < 2 * grid.block_bytes * max(len(plain), 1)

    again = coalesce(plan, max_gap=max_gap, max_overread=ratio, chunk_bytes=other_chunk, blocks=grid)
    pieces = [p for t in [*transfers, *again]
              for p in grid.pieces(t.offset, [file[t.offset:t.offset + t.length]])]
    shuffle.shuffle(pieces)
    tally = Tally(grid)
    done = [d for p in pieces for d in tally.add([p])]
    assert tally.incomplete == []
    assert sum(blocks[b][2] - blocks[b][1] for b, _ in done) == sum(p.length for p in pieces)
    assert touched <= {b for b, _ in done}
    assert all(crc == crc32c(file[blocks[b][1]:blocks[b][2]]) for b, crc in done)


def test_plans_without_checksum_blocks_of_their_files_are_unchanged():
    from orbax_safetensors.format import DTYPES, TensorInfo
    from orbax_safetensors.format.checksums import BlockGrid
    from orbax_safetensors.planning import (
        ReadProfile,
        StoredSlice,
        TensorSource,
        plan_reads,
        plan_tensor_reads,
    )

    info = TensorInfo("w", DTYPES["F32"], (64, 64), 0, 64 * 64 * 4)
    source = TensorSource(info.dtype, info.shape, (StoredSlice(info, "a", 100, (0, 0)),))
    reads = [plan_tensor_reads(source, [((8, 24), (0, 64)), ((0, 64), (16, 32))], 0, 1024)]
    profile = ReadProfile(chunk_bytes=4096, max_gap=512, max_overread=2.0, memory_budget=1 << 20)
    grid = BlockGrid.of([info], 100, 1000)

    def flat(plan):
        return [[getattr(t, f.name) for f in dataclasses.fields(t)]
                for batch in plan.batches
                for t in [*(t for _, t in batch.transfers), *(b.transfers for b in batch.bounced)]]

    def same(a, b):
        return len(a) == len(b) and all(
            all(np.array_equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b))

    unchecked = plan_reads(reads, profile)
    assert unchecked.padding == 0
    assert same(flat(plan_reads(reads, profile, {"b": grid})), flat(unchecked))
    checked = plan_reads(reads, profile, {"a": grid})
    assert checked.padding > 0 and not same(flat(checked), flat(unchecked))


@_SETTINGS
@given(tilings(), st.lists(st.integers(1, 3), min_size=4, max_size=4), st.sampled_from([1, 4]),
       st.integers(1, 64), st.booleans())
def test_sliced_tensor_reads_fill_every_shard_exactly_once(tiling, slicing, itemsize, bounce_bytes,
                                                           by_region):
    """A tensor stored in a grid of slices, read into local tiles shard by shard or region by
    region: every element of every shard arrives exactly once, from the slice holding it."""
    from orbax_safetensors.format import DTYPES, TensorInfo
    from orbax_safetensors.planning import StoredSlice, TensorSource, plan_tensor_reads

    shape, _, local = tiling
    local = list(dict.fromkeys(local))  # device boxes are distinct
    cuts = [sorted({0, size} | {size * i // n for i in range(n)}) for size, n in zip(shape, slicing)]
    dtype = DTYPES[{1: "U8", 4: "F32"}[itemsize]]
    slices = []
    for corner in np.ndindex(*[len(c) - 1 for c in cuts]):
        box = tuple((c[i], c[i + 1]) for c, i in zip(cuts, corner))
        extent = tuple(b - a for a, b in box)
        info = TensorInfo(f"slice{len(slices)}", dtype, extent, 0, math.prod(extent) * itemsize)
        slices.append(StoredSlice(info, f"file{len(slices)}", 0, tuple(a for a, _ in box)))
    source = TensorSource(dtype, shape, tuple(slices))
    reads = plan_tensor_reads(source, local, 0, bounce_bytes, slices_by_region=by_region)
    covered = {shard: np.zeros(box_shape(shard), int) for shard in reads.shards}
    for read in reads.reads:
        assert intersect(read.box, slices[read.slice].box) == read.box
        for shard in reads.shards if read.direct is None else [read.direct]:
            inside = intersect(read.box, shard)
            if inside is not None:
                covered[shard][relative_slices(inside, shard)] += 1
    assert all((c == 1).all() for c in covered.values())


@_SETTINGS
@given(tilings(), st.sampled_from([1, 2, 4]), st.integers(0, 64), st.sampled_from([1, 8, 64]))
def test_row_runs_join_consecutive_rows_into_one_array_each(tiling, itemsize, least, align):
    """Every local box is in one run; a run's boxes are consecutive row slices of it (the
    same bounds on every other axis), each starting a multiple of ``align`` bytes into it;
    a run closes once it holds ``least`` bytes, and boxes that could join are joined."""
    shape, _, local = tiling
    local = list(dict.fromkeys(local))
    runs = row_runs(local, itemsize, least, align)
    assert sorted(b for boxes in runs.values() for b in boxes) == sorted(local)
    values = np.arange(math.prod(shape)).reshape(shape)
    for run, boxes in runs.items():
        held = values[tuple(slice(a, b) for a, b in run)]
        flat, start = held.reshape(-1), 0
        for box in boxes:  # consecutive slices of the run's C-order array
            assert box[1:] == run[1:]
            part = values[tuple(slice(a, b) for a, b in box)].reshape(-1)
            assert start * itemsize % align == 0
            np.testing.assert_array_equal(flat[start:start + part.size], part)
            start += part.size
        assert start == held.size
        assert sum(box_size(b) for b in boxes[:-1]) * itemsize < max(least, 1) or len(boxes) == 1
    ordered = sorted(local)
    for a, b in zip(ordered, ordered[1:]):  # two that could join, and the first's run had room, are one run
        run_of = {box: run for run, boxes in runs.items() for box in boxes}
        room = sum(box_size(x) for x in runs[run_of[a]] if x <= a) * itemsize < least
        offset = (b[0][0] - run_of[a][0][0]) * math.prod(box_shape(b[1:])) * itemsize
        if b[1:] == a[1:] and b[0][0] == a[0][1] and room and offset % align == 0:
            assert run_of[a] == run_of[b]


def test_row_runs_of_a_sharding_s_row_blocks_and_column_blocks():
    rows = [((r, r + 64), (0, 1024)) for r in range(0, 512, 64)]
    assert row_runs(rows, 2, 4 << 20, 64) == {((0, 512), (0, 1024)): tuple(rows)}
    assert list(row_runs(rows, 2, 256 << 10, 64)) == [((0, 128), (0, 1024)), ((128, 256), (0, 1024)),
                                                       ((256, 384), (0, 1024)), ((384, 512), (0, 1024))]
    columns = [((0, 512), (c, c + 128)) for c in range(0, 1024, 128)]
    assert row_runs(columns, 2, 4 << 20, 64) == {c: (c,) for c in columns}
    odd = [((r, r + 1), (0, 3)) for r in range(4)]  # rows of 6 bytes: only every 32nd starts aligned
    assert all(len(boxes) == 1 for boxes in row_runs(odd, 2, 1 << 20, 64).values())
    assert row_runs([()], 4, 1, 64) == {(): ((),)}


@_SETTINGS
@given(shapes_and_boxes(), st.sampled_from([1, 2, 4]), st.integers(1, 256), st.integers(1, 8))
def test_row_slabs_tile_the_box_along_its_rows(shape_box, itemsize, least, most):
    _, box = shape_box
    slabs = row_slabs(box, itemsize, least, most)
    assert 1 <= len(slabs) <= max(most, 1)
    if len(slabs) > 1:
        assert all(s[1:] == box[1:] and box_size(s) * itemsize >= least // 2 for s in slabs)
        assert [s[0] for s in slabs] == sorted(s[0] for s in slabs)
        assert slabs[0][0][0] == box[0][0] and slabs[-1][0][1] == box[0][1]
        assert all(a[0][1] == b[0][0] for a, b in zip(slabs, slabs[1:]))
    else:
        assert slabs == [box]


@_SETTINGS
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), min_size=1, max_size=30), st.randoms())
def test_whole_reads_land_each_slice_in_one_buffer_and_read_each_byte_once(layout, rng):
    """Small tensors of one file (``plan_whole_reads``), in any order: gapless neighbours share a
    buffer, a gap opens another, a slice inside another (two leaves of one stored tensor, a
    zero-byte tensor) lands in its buffer; every slice's bytes are where its place says, and
    no byte is read twice or without a slice asking for it."""
    from orbax_safetensors.format import DTYPES, TensorInfo
    from orbax_safetensors.planning import StoredSlice, plan_whole_reads

    slices, offset = [], 1000
    for gap, size in layout:  # gap 0: right after the last; 3: a copy of the last one
        if gap == 3 and slices:
            slices.append(slices[-1])
            continue
        offset += gap
        slices.append(StoredSlice(TensorInfo(f"t{len(slices)}", DTYPES["U8"], (size,), 0, size), "f", offset, (0,)))
        offset += size
    rng.shuffle(slices)
    planned = plan_whole_reads(slices)
    reads = planned.reads
    (stretch,) = reads.slices
    ranges = [(stretch.offset + a, stretch.offset + b) for ((a, b),) in reads.shards]
    assert [r.box for r in reads.reads] == [r.direct for r in reads.reads] == list(reads.shards)
    assert all(a1 > b0 for (_, b0), (a1, _) in zip(ranges, ranges[1:]))  # in order, a gap between
    wanted = set()
    for s, k, start in zip(slices, planned.buffers, planned.starts):
        begin, end = ranges[k]
        assert begin + start == s.offset and s.offset + s.info.nbytes <= end
        wanted |= set(range(s.offset, s.offset + s.info.nbytes))
    covered = [byte for begin, end in ranges for byte in range(begin, end)]
    assert len(covered) == len(set(covered)) == reads.needed == reads.nbytes
    assert set(covered) == wanted
