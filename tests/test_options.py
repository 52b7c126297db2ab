"""Options are checked when they are built, each error naming its option: a value out of range
used to fail deep inside a load ("size must be positive"), or to be taken (``threads=0``,
``max_gap=-5``; a 1-byte ``chunk_bytes`` made a 6 MB load take a minute)."""

from __future__ import annotations

import numpy as np
import pytest

import orbax_safetensors as ost


@pytest.mark.parametrize("options, message", [
    ({"chunk_bytes": 0}, r"ReadOptions.chunk_bytes: size must be positive, got 0"),
    ({"chunk_bytes": 1}, r"ReadOptions.chunk_bytes must be at least 4096 bytes \(each chunk is one "),
    ({"chunk_bytes": "1KB"}, r"ReadOptions.chunk_bytes must be at least 4096 bytes"),
    ({"memory_budget": 0}, r"ReadOptions.memory_budget: size must be positive"),
    ({"memory_budget": "lots"}, r"ReadOptions.memory_budget: invalid size 'lots'"),
    ({"threads": 0}, r"ReadOptions.threads must be at least 1, got 0"),
    ({"threads": -1}, r"ReadOptions.threads must be at least 1, got -1"),
    ({"threads": 1.5}, r"ReadOptions.threads must be an int, not 1.5"),
    ({"threads": True}, r"ReadOptions.threads must be an int, not True"),
    ({"max_gap": -5}, r"ReadOptions.max_gap must be at least 0, got -5"),
    ({"max_gap": "16KB"}, r"ReadOptions.max_gap must be an int"),
    ({"max_overread": 0.5}, r"ReadOptions.max_overread must be at least 1.0, got 0.5"),
    ({"max_overread": float("nan")}, r"ReadOptions.max_overread must be at least 1.0"),
    ({"verify_checksums": "no"}, r"ReadOptions.verify_checksums must be True or False, not 'no'"),
    ({"reshard_thin_shards": 1}, r"ReadOptions.reshard_thin_shards must be True or False"),
])
def test_read_options_are_checked_when_built_naming_the_option(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ost.ReadOptions(**options)


def test_read_options_store_sizes_as_ints_and_keep_what_they_accept(tmp_path):
    options = ost.ReadOptions(memory_budget="2GB", chunk_bytes="4KiB", max_gap=0, threads=np.int64(2),
                              max_overread=1)
    assert (options.memory_budget, options.chunk_bytes, options.threads) == (2 * 10**9, 4096, 2)
    assert ost.ReadOptions() == ost.ReadOptions(memory_budget=10**9)
    ost.save(tmp_path / "c", {"w": np.arange(6000, dtype=np.float32)})
    stats = ost.LoadStats()
    loaded = ost.load(tmp_path / "c", options=options, stats=stats)
    np.testing.assert_array_equal(loaded["w"], np.arange(6000, dtype=np.float32))
    assert stats.requests == 6  # 24000 bytes in 4 KiB chunks


@pytest.mark.parametrize("call", ["consolidate", "convert"])
@pytest.mark.parametrize("kwargs, message", [
    ({"block_bytes": 0}, "block_bytes: size must be positive, got 0"),
    ({"max_shard_size": "5 lots"}, "max_shard_size: invalid size '5 lots'"),
    ({"overwrite": "yes"}, "overwrite must be True or False, not 'yes'"),
])
def test_consolidate_and_convert_options_are_checked_before_anything_is_read(tmp_path, call, kwargs,
                                                                             message):
    with pytest.raises((ValueError, TypeError), match=message):
        getattr(ost, call)(tmp_path / "nothing here", tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
