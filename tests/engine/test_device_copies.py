"""A blocking save of arrays in accelerator memory copies them off the devices a window ahead of
the writes (``engine.device_copies``): the files are the same, the copies started and not yet
written stay within ``memory_budget``, each copy starts before its bytes are written, and a write
that fails or a shard bigger than the budget ends the save (no hang).

This machine has no accelerator. CPU arrays stand in for HBM shards: ``host_shards.on_accelerator``
(the one place a save decides a shard is on an accelerator) is made to say yes for them, so
they go through ``OnDevice`` and the window exactly as a GPU's would; on CPU ``copy_to_host_async``
and ``np.asarray`` are the same calls, cheaper.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.engine.saving import device_copies, host_shards
from orbax_safetensors.storage.local import LocalStorage

SHARD = 512 * 512 * 4 // 8  # bytes of one device's rows of a (512, 512) float32 array


@pytest.fixture
def in_hbm(monkeypatch):
    """CPU arrays treated as accelerator shards; returns the events: ("copy"|"host"|"release",
    shard id)."""
    events, lock = [], threading.Lock()
    monkeypatch.setattr(host_shards, "on_accelerator", lambda data: isinstance(data, jax.Array))
    real_prefetch, real_host = device_copies.OnDevice.prefetch, device_copies.OnDevice.host
    real_release = device_copies.OnDevice.release

    def prefetch(self):
        with lock:
            events.append(("copy", id(self)))
        real_prefetch(self)

    def host(self):
        with lock:
            events.append(("host", id(self)))
        return real_host(self)

    def release(self):
        with lock:
            events.append(("release", id(self)))
        real_release(self)

    monkeypatch.setattr(device_copies.OnDevice, "release", release)
    monkeypatch.setattr(device_copies.OnDevice, "prefetch", prefetch)
    monkeypatch.setattr(device_copies.OnDevice, "host", host)
    return events


def _model(count=20):
    rng = np.random.default_rng(3)
    tree = {f"layer{i}.w": rng.standard_normal((512, 512)).astype(np.float32) for i in range(count)}
    mesh = jax.make_mesh((8,), ("x",))
    return tree, {n: jax.device_put(x, NamedSharding(mesh, P("x"))) for n, x in tree.items()}


@pytest.mark.parametrize("budget", ["64KB", "1MB", "8MB"], ids=["below-a-shard", "8-shards", "64-shards"])
def test_a_blocking_save_holds_a_window_of_copies(tmp_path, in_hbm, budget):
    tree, arrays = _model()
    stats = ost.save(tmp_path / "c", arrays, max_shard_size="3MB", memory_budget=budget)
    loaded = ost.load(tmp_path / "c")
    for name, value in tree.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    limit = {"64KB": 64_000, "1MB": 10**6, "8MB": 8 * 10**6}[budget]
    # A range's new shards wait for room unless nothing else is in flight: then one range
    # (at most one file of 3 MB here) may hold more than a tiny budget.
    assert 0 < stats.copied_peak <= max(limit, 3 * 10**6), stats.copied_peak
    copies = [k for kind, k in in_hbm if kind == "copy"]
    assert set(copies) == {k for kind, k in in_hbm if kind == "host"}
    assert len(set(copies)) == 20 * 8  # every replica-0 shard, copied once
    started, released = set(), set()
    for kind, shard in in_hbm:  # every copy starts before its bytes are taken, and goes after
        if kind == "copy":
            started.add(shard)
        elif kind == "host":
            assert shard in started and shard not in released
        else:
            released.add(shard)
    assert released == started  # every copy let go once written


def test_the_budget_bounds_the_copies_ahead(tmp_path, in_hbm):
    """With room for two files' shards (one tensor of 8 shards a file), at most 16 shards are
    copied and not yet written at any time, out of 160: the window moves along the writes
    instead of the whole model sitting on the host."""
    _, arrays = _model()
    stats = ost.save(tmp_path / "c", arrays, max_shard_size="1100KB", memory_budget=16 * SHARD)
    assert stats.files == 20 and 8 * SHARD <= stats.copied_peak <= 16 * SHARD, stats


def test_other_layouts_and_stores_copy_everything_at_once(tmp_path, in_hbm):
    """The distributed layout streams files (an upload retried replays its stream) and object
    stores upload parts: every copy starts up front, as before; the files are the same."""
    tree, arrays = _model(4)
    ost.save(tmp_path / "d", arrays, layout="distributed", memory_budget="64KB")
    ost.save("memory://ost-device-copies/c", arrays, memory_budget="64KB", overwrite=True)
    for path in (tmp_path / "d", "memory://ost-device-copies/c"):
        loaded = ost.load(path)
        for name, value in tree.items():
            np.testing.assert_array_equal(loaded[name], value, err_msg=f"{path}: {name}")


def test_a_failed_write_ends_the_save_without_a_hang(tmp_path, in_hbm, monkeypatch):
    """A write failing part way, while later ranges wait for room: the save raises it (naming
    the file), and leaves nothing behind."""
    _, arrays = _model()
    real_write, calls = LocalStorage.write_at, []

    def failing_write(self, path, offset, buffers):
        calls.append(path)
        if len(calls) == 5:
            raise OSError(28, "No space left on device", path)
        real_write(self, path, offset, buffers)

    monkeypatch.setattr(LocalStorage, "write_at", failing_write)
    with pytest.raises(OSError, match="No space left"):
        ost.save(tmp_path / "c", arrays, max_shard_size="3MB", memory_budget=2 * SHARD)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_async_save_still_copies_before_it_returns(tmp_path, in_hbm):
    """``async_save``'s caller may change its arrays once it returns: nothing stays on device."""
    tree, arrays = _model(2)
    future = ost.async_save(tmp_path / "c", arrays, max_shard_size="3MB")
    assert in_hbm == []  # no OnDevice was made
    future.result()
    np.testing.assert_array_equal(ost.load(tmp_path / "c")["layer1.w"], tree["layer1.w"])
