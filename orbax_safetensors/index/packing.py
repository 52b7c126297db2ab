"""Packing tensors into shard files under ``max_shard_size``.

The rule is the one ``huggingface_hub.split_torch_state_dict_into_shards``
applies: walk tensors in order, start a new file when the next tensor would
push the current one over the limit, and give a tensor bigger than the limit a
file of its own. That rule counts tensor bytes only; a save also counts each
tensor's header entry (``sizes``) and the header every file holds
(``file_overhead``), so that a file stays within the limit whenever its
tensors fit at all: 100 000 tiny tensors under "2MB" made 4.8 MB files when
headers were left out. For tensors of megabytes the headers are noise and the
files split where transformers splits them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from orbax_safetensors.errors import ArgumentError

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_DIGITS = re.compile(r"([0-9]+)")


def parse_size(size: int | str) -> int:
    """``5_000_000``, ``"5GB"`` (10^9) or ``"5GiB"`` (2^30) → bytes."""
    if isinstance(size, bool):
        raise ArgumentError(f"invalid size {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.match(str(size))
        if not match or match.group(2).upper() not in _UNITS:
            raise ArgumentError(
                f"invalid size {size!r}: use an int or a string like '5GB', '500MB', '2GiB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ArgumentError(f"size must be positive, got {size!r}")
    return value


def pack_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int, *,
                file_overhead: int = 0) -> list[list[str]]:
    """Groups ``(name, nbytes)`` in order into files of at most ``max_shard_size`` bytes, each
    holding ``file_overhead`` bytes besides its tensors' ``nbytes``."""
    room = max_shard_size - file_overhead
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, nbytes in sizes:
        if nbytes > room:
            shards.append([name])
            continue
        if current and current_size + nbytes > room:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def natural_key(name: str) -> tuple[tuple[tuple[str | int, ...], str], ...]:
    """Sorts dotted names as a PyTorch ``state_dict`` lists them: in each ``.``-separated part,
    a run of digits compares as a number, so ``layers.2`` comes before ``layers.10`` (and
    Flax's ``Dense_2`` before ``Dense_10``), and a number before text; the rest as text.

    Shards are filled in this order, so they hold consecutive layers, as transformers'
    do; sorted as text (a JAX dict's order), one would hold layers 1, 10, 11, ...
    """
    # re.split puts text at even positions and numbers at odd ones: elementwise comparable.
    key = []
    for part in name.split("."):
        pieces = _DIGITS.split(part)
        pieces[1::2] = map(int, pieces[1::2])
        key.append((tuple(pieces), part))
    return tuple(key)
