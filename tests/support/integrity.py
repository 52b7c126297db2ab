"""Checks of the checksums a checkpoint stores, recomputed from its bytes (test support)."""

from __future__ import annotations

import json

import crc32c
import fsspec
import google_crc32c
import safetensors

from orbax_safetensors.format import checksums, parse_file_bytes
from orbax_safetensors.format.checksums import FileChecksums
from orbax_safetensors.index import FILE_CRCS_KEY, decode_crc

# Whichever package ours does not hash with (the test extra installs both).
oracle = google_crc32c.value if checksums.HASHER == "crc32c" else crc32c.crc32c


def assert_checksummed(url: str) -> int:
    """Every safetensors file at ``url`` (a file or a directory) stores block checksums that
    match its bytes (hashed by the other package), under our keys only, the crate reads it,
    and an index lists each file's whole crc32c; returns how many blocks were checked."""
    fs, path = fsspec.core.url_to_fs(str(url))
    files = [path] if path.endswith(".safetensors") else sorted(
        p for p in fs.ls(path, detail=False) if p.endswith(".safetensors")
        and not p.rsplit("/", 1)[1].startswith("."))
    assert files, f"no safetensors files at {url}"
    indexes = [] if path.endswith(".safetensors") else [
        p for p in fs.ls(path, detail=False) if p.endswith(".index.json")]
    listed = {}
    for index in indexes:
        document = json.loads(fs.cat(index))
        assert checksums.LEGACY_BLOCKS_KEY not in document["metadata"], index
        listed.update(document["metadata"][FILE_CRCS_KEY])
    blocks = 0
    for file in files:
        data = fs.cat(file)
        safetensors.deserialize(data)  # the Rust crate accepts it
        header = parse_file_bytes(data, file=file)
        assert header.metadata.get("format") == "pt", file
        stored = FileChecksums.of_metadata(header.metadata, header.tensors.values(), header.data_start,
                                           file=file)
        assert stored is not None, f"{file} stores no checksums"
        assert not {checksums.LEGACY_BLOCKS_KEY, checksums.LEGACY_BLOCK_SIZE_KEY} & set(header.metadata)
        for index in range(stored.grid.count):
            _, start, stop = stored.grid.block(index)
            assert oracle(data[start:stop]) == int(stored.crcs[index]), (file, index)
        assert stored.file_crc(data[:header.data_start]) == oracle(data)
        name = file.rsplit("/", 1)[1]
        if indexes:
            assert decode_crc(listed.get(name)) == oracle(data), f"index crc of {name}"
        blocks += stored.grid.count
    return blocks
