"""Coverage-guided fuzzing (atheris / libFuzzer) of every parser of untrusted bytes.

The first input byte picks the target, the rest is its input:

  0: ``parse_file_bytes`` (a whole safetensors file: prefix, header, data)
  1: ``parse_index`` (``model.safetensors.index.json``)
  2: ``parse_distributed_index`` (``orbax_safetensors.distributed.json``)
  3: ``dcp_offsets`` (the ``DCP_SHARDING_INFO`` metadata string)

Anything but a result or a ``SafetensorsError`` naming the file is a crash;
libFuzzer's ``-timeout`` and ``-rss_limit_mb`` catch hangs and runaway
allocations. Run it (from the repository root) for as long as you like:

  .venv/bin/python fuzz/fuzz_parsers.py -max_len=4096 -timeout=10 /tmp/fuzz-corpus

seeding ``/tmp/fuzz-corpus`` with ``tests/format/fuzz_corpus/*/*`` prefixed by the
target byte (``tests/format/test_fuzz.py::test_atheris_harness_runs_clean`` shows
how, and runs this harness for 20000 inputs). Add every crash it finds to
``tests/format/fuzz_corpus/`` with its expected message.
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with atheris.instrument_imports(include=["orbax_safetensors.format", "orbax_safetensors.index"]):
    from orbax_safetensors.errors import SafetensorsError
    from orbax_safetensors.format.header import parse_file_bytes
    from orbax_safetensors.index.distributed_index import (
        DCP_SHARDING_INFO,
        dcp_offsets,
        parse_distributed_index,
    )
    from orbax_safetensors.index.hf_index import parse_index

FILE = "fuzz-input"
TARGETS = (
    lambda raw: parse_file_bytes(raw, file=FILE),
    lambda raw: parse_index(raw, file=FILE),
    lambda raw: parse_distributed_index(raw, file=FILE),
    lambda raw: dcp_offsets({DCP_SHARDING_INFO: raw.decode("utf-8", "surrogateescape")}, file=FILE),
)


def test_one_input(data: bytes) -> None:
    """One input: the parser returns, or raises a SafetensorsError that names the file."""
    if not data:
        return
    try:
        TARGETS[data[0] % len(TARGETS)](data[1:])
    except SafetensorsError as e:
        if f"file {FILE!r}" not in str(e):
            raise AssertionError(f"error does not name the file: {e}") from e


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
