"""Either hashing package gives the same block checksums, so files saved and loaded by installs
with and without the ``crc32c`` extra are one format.

``google-crc32c`` (Apache-2.0) is the dependency; the ``crc32c`` package (LGPL, faster where
threads hash in parallel) is used where installed, as it is for the tests. Here each runs as
an install without the extra would run it: ``sys.modules["crc32c"] = None`` makes its import
fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import orbax_safetensors as ost
from orbax_safetensors.format import checksums
from tests.support import REPO

_REPO = str(REPO)


@pytest.fixture
def hashers(monkeypatch) -> dict:
    """Each package's crc32c function, resolved as the import of ``format.checksums`` does."""
    found = dict([checksums._hasher()])
    monkeypatch.setitem(sys.modules, "crc32c", None)
    found.update([checksums._hasher()])
    assert set(found) == {"crc32c", "google-crc32c"}
    return found


def _buffers(data: bytes, start: int, stop: int) -> list:
    """``data[start:stop]`` in each form the read and write paths hash."""
    array = np.frombuffer(data, np.uint8)
    return [data[start:stop], memoryview(data)[start:stop], array[start:stop],
            memoryview(array)[start:stop], memoryview(bytearray(data))[start:stop],
            bytearray(data[start:stop]), memoryview(array[start:stop].copy()).cast("B")]


def test_both_packages_give_the_same_crcs_of_every_buffer(hashers):
    assert {name: extend(b"123456789") for name, extend in hashers.items()} == dict.fromkeys(
        hashers, 0xE3069283)  # the standard check value of CRC-32C
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 13, np.uint8).tobytes()
    for start in (0, 1, 3, 7, 8):
        for length in (0, 1, 3, 7, 15, 16, 63, 255, 4095, checksums.BLOCK_BYTES, checksums.BLOCK_BYTES + 5):
            for crc in (0, 0x12345678):
                crcs = {(name, type(b).__name__): extend(b, crc) for name, extend in hashers.items()
                        for b in _buffers(data, start, start + length)}
                assert len(set(crcs.values())) == 1, (start, length, crc, crcs)
    # Arrays of any dtype hash as their bytes.
    for values in (np.linspace(-1, 1, 1001, dtype=np.float32),
                   np.linspace(-1, 1, 999).astype(ml_dtypes.bfloat16),
                   np.arange(24, dtype=np.int64).reshape(2, 3, 4)):
        want = hashers["crc32c"](values.tobytes())
        assert {name: extend(values) for name, extend in hashers.items()} == dict.fromkeys(hashers, want)


def test_google_crc32c_hashes_a_memoryview_without_copying_it(hashers):
    data = np.ones(64 << 20, np.uint8)
    tracemalloc.start()
    try:
        hashers["google-crc32c"](memoryview(data)[1:])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


_WITHOUT_THE_EXTRA = textwrap.dedent("""
    import sys
    sys.modules["crc32c"] = None  # as installed without the extra
    import numpy as np
    import orbax_safetensors as ost
    from orbax_safetensors.format import checksums
    from tests.format.test_checksum_hashing import VALUES
    assert checksums.HASHER == "google-crc32c", checksums.HASHER
    path = sys.argv[1]
    ost.save(path, VALUES, max_shard_size=600_000)
    loaded = ost.load(path)
    assert all(np.array_equal(np.asarray(loaded[k]), v) for k, v in VALUES.items())
    target = path + "/model-00001-of-00002.safetensors"
    with open(target, "r+b") as f:
        f.seek(-1000, 2)
        byte = f.read(1)
        f.seek(-1000, 2)
        f.write(bytes([byte[0] ^ 1]))
    try:
        ost.load(path)
    except ost.ChecksumError as e:
        print("damage found:", e.tensor)
    with open(target, "r+b") as f:
        f.seek(-1000, 2)
        f.write(byte)
""")

VALUES = {"a": np.random.default_rng(4).standard_normal((300, 513)).astype(np.float32),
          "b": np.arange(100_001, dtype=np.int16)}


def test_a_checkpoint_saved_without_the_extra_is_the_same_bytes_and_checked_alike(tmp_path):
    assert checksums.HASHER == "crc32c"  # the test extra installs it
    ost.save(tmp_path / "fast", VALUES, max_shard_size=600_000)
    done = subprocess.run([sys.executable, "-c", _WITHOUT_THE_EXTRA, os.fspath(tmp_path / "portable")],
                          capture_output=True, text=True, timeout=300, cwd=_REPO)
    assert done.returncode == 0, done.stderr
    assert "damage found: a" in done.stdout, done.stdout
    names = sorted(os.listdir(tmp_path / "fast"))
    assert names == sorted(os.listdir(tmp_path / "portable")) and len(names) == 3
    for name in names:
        assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "portable" / name).read_bytes(), name
    assert ost.verify(tmp_path / "portable", data=True).ok
