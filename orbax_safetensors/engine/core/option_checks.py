"""Option values checked where the options are built, each error naming its option.

Unchecked, a bad value fails deep inside a load or a write with a message that
names no option ("size must be positive"), or is taken and does harm quietly:
``threads=0`` and ``max_gap=-5`` loaded as if nothing were wrong, a 1-byte
``chunk_bytes`` made a 6 MB load take a minute. Every operation's options
(``core.options``) check every field here when they are constructed, and store
sizes as ints.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from orbax_safetensors.errors import ArgumentError, ArgumentTypeError
from orbax_safetensors.index import parse_size


def size(what: str, value: Any, *, minimum: int = 1, why: str = "") -> int:
    """``value`` (an int, or a string like ``"64MB"``) in bytes, at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise ArgumentTypeError(f"{what} must be a size in bytes (an int, or a string like '64MB'), "
                        f"not {value!r}")
    try:
        nbytes = parse_size(value)
    except ValueError as e:
        raise ArgumentError(f"{what}: {e}") from None
    if nbytes < minimum:
        raise ArgumentError(f"{what} must be at least {minimum} bytes{why}, got {value!r}")
    return nbytes


def count(what: str, value: Any, *, minimum: int) -> int:
    """An int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{what} must be an int, not {value!r}")
    if value < minimum:
        raise ArgumentError(f"{what} must be at least {minimum}, got {value!r}")
    return int(value)


def ratio(what: str, value: Any, *, minimum: float) -> float:
    """A number (not a bool) of at least ``minimum``; infinity means no bound."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{what} must be a number, not {value!r}")
    if math.isnan(value) or value < minimum:
        raise ArgumentError(f"{what} must be at least {minimum}, got {value!r}")
    return float(value)


def flag(what: str, value: Any) -> bool:
    """``True`` or ``False``: a string such as ``"false"`` would otherwise read as true."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{what} must be True or False, not {value!r}")
    return value
