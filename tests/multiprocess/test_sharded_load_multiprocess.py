"""Sharding-driven load across real JAX processes (2×4 and 4×2 CPU devices).

The parent writes one checkpoint; every child loads it under a target
sharding, checks each of its addressable shards against the source values,
and returns its LoadStats, so the parent can check what each process read.
"""

import dataclasses

import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support.sharding_cases import (
    LEADING_DIM,
    SCENARIOS,
    TOPOLOGIES,
    assert_shards_equal,
    sources,
    target_for,
)

pytestmark = pytest.mark.slow  # several JAX processes

_MODULE = "tests.multiprocess.test_sharded_load_multiprocess"


def _child_load(args):
    values = sources()  # deterministic: the same values the parent saved
    target = target_for(values, args["scenario"])
    stats = ost.LoadStats()
    options = ost.LoadOptions(**args.get("options", {}))
    restored = ost.load(args["path"], target=target, options=options, stats=stats)
    assert_shards_equal(restored, values, target)
    return dataclasses.asdict(stats)


def _coalesced(stats: dict) -> int:
    """Bytes read but those read only to complete checksum blocks: what the sharding and the
    coalescing of runs decide (the blocks' share, under two blocks a run, is tested in
    tests/engine/test_checksums_load.py)."""
    return stats["bytes_read"] - stats["checksum_overread"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded_load")
    values = sources()
    ost.save(directory / "ckpt", values, max_shard_size=200_000)  # several files
    return {"path": str(directory / "ckpt"), "total": sum(v.nbytes for v in values.values())}


@pytest.mark.parametrize("processes,devices", TOPOLOGIES, ids=["2x4", "4x2"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_process_reads_only_what_its_devices_need(
        multiprocess, checkpoint, scenario, processes, devices):
    results = multiprocess(
        f"{_MODULE}:_child_load", num_processes=processes, devices_per_process=devices,
        args={"path": checkpoint["path"], "scenario": scenario})
    stats = [r.value for r in results]
    for s in stats:
        assert s["tensors"] == len(sources())
        if scenario in LEADING_DIM:
            assert _coalesced(s) <= 1.05 * s["bytes_needed"], s
        elif s["tensors_read_once"] == 0:
            assert _coalesced(s) <= ost.LoadOptions().max_overread * s["bytes_needed"], s
    if scenario == "replicated":  # read once per cluster, all-gathered
        assert all(s["tensors_read_once"] == len(sources()) - 1 for s in stats)  # not "empty"
        assert sum(_coalesced(s) for s in stats) <= 1.05 * checkpoint["total"]


def test_no_overread_when_asked(multiprocess, checkpoint):
    results = multiprocess(
        f"{_MODULE}:_child_load", num_processes=2, devices_per_process=4,
        args={"path": checkpoint["path"],
              "scenario": "tensor_parallel",
              "options": {"max_overread": 1.0, "replicated_read_once": False}})
    for r in results:
        assert _coalesced(r.value) == r.value["bytes_needed"], r.value


def test_replicated_without_read_once_reads_everything_everywhere(multiprocess, checkpoint):
    results = multiprocess(
        f"{_MODULE}:_child_load", num_processes=2, devices_per_process=4,
        args={"path": checkpoint["path"],
              "scenario": "replicated", "options": {"replicated_read_once": False}})
    for r in results:
        assert r.value["tensors_read_once"] == 0
        assert r.value["bytes_read"] == r.value["bytes_needed"] == checkpoint["total"]


def _child_host_target(args):
    """Host arrays are this process's own: process 1 loads them alone, process 0 not at all."""
    import jax

    if jax.process_index() == 0:
        return None
    loaded = ost.load(args["path"], target={"embed": np.zeros((512, 64), np.float32)}, strict=False)
    return bool(np.array_equal(loaded["embed"], sources()["embed"]))


def test_a_host_target_is_one_process_s_own_load(multiprocess, checkpoint):
    """Before, a multi-process job refused host targets ("every target leaf needs a
    sharding"); a load into host arrays needs no other process, so it is local now."""
    results = multiprocess(f"{_MODULE}:_child_host_target", num_processes=2,
                           args={"path": checkpoint["path"]})
    assert [r.value for r in results] == [None, True]


def test_thin_strips_are_read_in_row_blocks_and_resharded_on_device(multiprocess, checkpoint):
    """Under mesh_2d each process holds 64-256-byte pieces of every row of several tensors:
    without resharding that is a request per row (no over-read allowed here); read as row
    blocks and moved by XLA, a few requests, and the shards still equal the source. (Checked
    against checksums, these tensors of under a block are read whole either way.)"""
    def run(reshard):
        results = multiprocess(
            f"{_MODULE}:_child_load", num_processes=2, devices_per_process=4,
            args={"path": checkpoint["path"], "scenario": "mesh_2d",
                  "options": {"max_overread": 1.0, "reshard_thin_shards": reshard,
                              "verify_checksums": False}})
        return [r.value for r in results]

    resharded, strided = run(True), run(False)
    for on, off in zip(resharded, strided):
        assert on["tensors_resharded"] >= 3 and off["tensors_resharded"] == 0, (on, off)
        assert on["bytes_needed"] == off["bytes_needed"]
        assert on["requests"] * 20 < off["requests"], (on, off)
        assert _coalesced(on) <= _coalesced(off), (on, off)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_pooled_load_across_processes_equals_the_source(multiprocess, checkpoint, scenario):
    """Staging recycled from the pool (``LoadOptions(staging="pooled")``, what accelerators get)
    through every way a sharded tensor is read across processes: shards read directly, read
    once per cluster and all-gathered (replicated), row blocks resharded on device (thin
    strips), each buffer given back only once its arrays exist; a 64 KB budget makes every
    process reuse its arenas many times. Every child checks its shards against the source."""
    results = multiprocess(
        f"{_MODULE}:_child_load", num_processes=2, devices_per_process=4,
        args={"path": checkpoint["path"], "scenario": scenario,
              "options": {"staging": "pooled", "memory_budget": "64KB"}})
    for stats in (r.value for r in results):
        assert stats["tensors"] == len(sources())
        assert stats["staging_peak"] > 0, stats  # it went through the pool
