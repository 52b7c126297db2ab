"""Host staging recycled from a pool (``LoadOptions(staging="pooled")``, the default for
accelerators): loads through it equal the saved values bit for bit on 8 CPU devices, the pool
stays within the memory budget while a load many times larger goes through it, and arenas are
registered for DMA once and unregistered when the load ends, however it ends.

This machine has no accelerator: the CPU client answers ``dma_map`` with UNIMPLEMENTED, so the
registration tests hand the pool a client that records what it is asked (standing in for a GPU
client, whose ``dma_map``/``dma_unmap`` take the same arguments) where the load asks for the
accelerators' clients (``read_execution.accelerator_clients``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.engine.loading import execution as read_execution
from orbax_safetensors.engine.loading.staging import StagingPool, arena_size


def _tree() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    tree = {f"layer{i}.w": rng.standard_normal((256, 384)).astype(np.float32) for i in range(24)}
    tree |= {"embed": rng.standard_normal((512, 64)).astype(ml_dtypes.bfloat16),
             "norm": rng.standard_normal((384,)).astype(np.float32),
             "step": np.arange(5, dtype=np.int32), "flags": np.array([True, False, True])}
    return tree


def _target(tree, mesh, spec):
    return {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec if x.ndim == 2 else P()))
            for name, x in tree.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("staging") / "ckpt"
    tree = _tree()
    ost.save(path, tree, max_shard_size="1MB")
    return path, tree


@pytest.mark.parametrize("spec", [P("x", None), P(None, "x"), P()], ids=["rows", "columns", "replicated"])
def test_a_pooled_load_equals_the_saved_values(saved, spec):
    """Rows (read straight into the pool), columns (strided: through bounce buffers into it),
    replicated (one read per host, copied device to device), small tensors read in groups;
    a budget of 1 MB makes the 10 MB load go through many batches reusing the same arenas."""
    path, tree = saved
    mesh = jax.make_mesh((8,), ("x",))
    stats = ost.LoadStats()
    loaded = ost.load(path, _target(tree, mesh, spec),
                      options=ost.LoadOptions(staging="pooled", memory_budget="1MB"), stats=stats)
    for name, value in tree.items():
        assert loaded[name].sharding == _target(tree, mesh, spec)[name].sharding
        np.testing.assert_array_equal(np.asarray(loaded[name]), value, err_msg=name)
    assert 0 < stats.staging_peak <= (1 << 20) + (64 << 10), stats.staging_peak  # the budget, in pages
    assert stats.staging_pinned == 0  # the CPU client registers nothing


def test_a_pooled_load_casts_and_maps_like_any_load(saved):
    """A cast (float32 → bfloat16) and a mapping rule (a transposed leaf) go through the pool too."""
    path, tree = saved
    mesh = jax.make_mesh((8,), ("x",))
    target = {"layer0.w": jax.ShapeDtypeStruct((256, 384), ml_dtypes.bfloat16, sharding=NamedSharding(mesh, P("x"))),
              "kernel": jax.ShapeDtypeStruct((384, 256), np.float32, sharding=NamedSharding(mesh, P(None, "x")))}
    mapping = ost.Mapping([ost.Rule("layer1.w", "kernel", transpose=(1, 0)), ost.Rule("layer0.w", "layer0.w")])
    loaded = ost.load(path, target, mapping=mapping, strict=False,
                      options=ost.LoadOptions(staging="pooled", memory_budget="1MB"))
    np.testing.assert_array_equal(np.asarray(loaded["layer0.w"]), tree["layer0.w"].astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(np.asarray(loaded["kernel"]), tree["layer1.w"].T)


def test_auto_keeps_fresh_pages_on_cpu_devices(saved):
    """On CPU devices XLA adopts the host buffers a load reads into: ``"auto"`` keeps that path
    (no pool, no copy)."""
    path, tree = saved
    mesh = jax.make_mesh((8,), ("x",))
    stats = ost.LoadStats()
    ost.load(path, _target(tree, mesh, P("x", None)), stats=stats)
    assert stats.staging_peak == 0


def test_staging_must_be_one_of_three():
    with pytest.raises(ValueError, match=r'LoadOptions.staging must be "auto".*not \'pinned\''):
        ost.LoadOptions(staging="pinned")


class _RecordingClient:
    """Stands in for an accelerator's PjRt client: records what is registered, or refuses."""

    platform = "recording"

    def __init__(self, refuse: bool = False):
        self.refuse, self.mapped, self.calls = refuse, {}, 0

    def dma_map(self, address: int, size: int) -> None:
        self.calls += 1
        if self.refuse:
            raise RuntimeError("UNIMPLEMENTED: DmaMap not supported")
        assert address % 4096 == 0 and address not in self.mapped
        self.mapped[address] = size

    def dma_unmap(self, address: int) -> None:
        del self.mapped[address]


def test_arenas_are_reused_and_registered_once():
    client = _RecordingClient()
    pool = StagingPool(8 << 20, [client])
    first = pool.take([1000, 3000])
    address = first[0].ctypes.data
    pool.give(first)
    again = pool.take([2000])  # fits the arena given back
    assert again[0].ctypes.data == address and client.calls == 1
    assert all(b.ctypes.data % 64 == 0 for b in pool.take([10, 100, 1000]))
    assert pool.pinned == sum(client.mapped.values()) > 0
    pool.give(again)
    pool.close(lent_done=True)
    assert client.mapped == {}


def test_the_pool_keeps_at_most_its_capacity():
    """Free arenas too small for a request are let go (and unregistered) rather than kept beside
    a new one; an arena bigger than the capacity is let go when given back."""
    client = _RecordingClient()
    pool = StagingPool(4 << 20, [client])
    small = pool.take([2 << 20])
    pool.give(small)
    big = pool.take([3 << 20])  # the 2 MiB arena cannot hold it: let go first
    assert pool.peak <= 4 << 20 and len(client.mapped) == 1
    pool.give(big)
    huge = pool.take([9 << 20])  # one batch bigger than the pool
    assert len(client.mapped) == 1  # the 4 MiB arena went to make room
    pool.give(huge)
    assert client.mapped == {}  # let go once given back
    pool.close(lent_done=True)


def test_a_small_job_is_never_lent_a_big_arena():
    """The load's budget counts the bytes asked for: with 3 jobs lent (384 + 64 + 384 KiB, 832
    KiB of a 1 MB budget), the pool holds no more than its capacity. Before, the 64 KiB job was
    lent a free 384 KiB arena, the next 384 KiB job found none free and got a new one: 1.13 MiB
    held, an overshoot a pooled load hit now and then, as its batches happened to overlap."""
    pool = StagingPool(1_000_000)
    first, second = pool.take([384 << 10]), pool.take([384 << 10])
    pool.give(first)
    pool.give(second)
    lent = [pool.take([384 << 10]), pool.take([64 << 10]), pool.take([384 << 10])]
    assert pool.peak <= 1_000_000, pool.peak
    assert {v[0].ctypes.data for v in (lent[0], lent[2])} == {first[0].ctypes.data, second[0].ctypes.data}
    for views in lent:
        pool.give(views)
    pool.close(lent_done=True)


def test_a_refusing_client_leaves_staging_pageable():
    client = _RecordingClient(refuse=True)
    pool = StagingPool(8 << 20, [client])
    pool.give(pool.take([5000]))
    pool.give(pool.take([3 << 20]))
    assert client.calls == 1 and pool.pinned == 0  # asked once, not per arena
    pool.close(lent_done=True)


def test_an_arena_a_transfer_may_still_read_stays_registered():
    client = _RecordingClient()
    pool = StagingPool(8 << 20, [client])
    lent = pool.take([5000])
    pool.close(lent_done=False)
    assert list(client.mapped) == [lent[0].ctypes.data - lent[0].ctypes.data % 4096]


def test_arenas_are_whole_pages():
    assert [arena_size(n) for n in (1, 4096, 4097, 10 << 20)] == [4096, 4096, 8192, 10 << 20]


@pytest.mark.parametrize("fails", [False, True], ids=["completed", "failed"])
def test_a_load_unregisters_what_it_registered(saved, tmp_path, monkeypatch, fails):
    """Through ``ost.load``: every arena the load registered is unregistered when it returns,
    and when it fails part way (a damaged byte in the last file: ``ChecksumError`` naming it)."""
    path, tree = saved
    client = _RecordingClient()
    monkeypatch.setattr(read_execution, "accelerator_clients", lambda devices: [client])
    if fails:
        import shutil
        shutil.copytree(path, tmp_path / "cut")
        path = tmp_path / "cut"
        last = sorted(path.glob("*.safetensors"))[-1]
        damaged = bytearray(last.read_bytes())
        damaged[-1000] ^= 0xFF
        last.write_bytes(bytes(damaged))
    mesh = jax.make_mesh((8,), ("x",))
    options = ost.LoadOptions(staging="pooled", memory_budget="1MB")
    stats = ost.LoadStats()
    if fails:
        with pytest.raises(ost.ChecksumError, match=last.name):
            ost.load(path, _target(tree, mesh, P("x", None)), options=options, stats=stats)
    else:
        ost.load(path, _target(tree, mesh, P("x", None)), options=options, stats=stats)
        assert stats.staging_pinned > 0
    assert client.calls > 0 and client.mapped == {}
