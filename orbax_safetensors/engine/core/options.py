"""One shape for every operation's options: a frozen value, or its fields as keywords.

Each public operation takes its options as one value (``ost.LoadOptions``,
``ost.SaveOptions``, ``ost.ConsolidateOptions``, ``ost.ConvertOptions``) in
``options=``, or any of that value's fields as keyword arguments, the
shorthand of a call that sets a few. ``with_shorthand`` is the one place
the two meet, at the entry and nowhere below it, so that an operation and
its async twin cannot read the same keywords differently: a keyword
replaces that field of ``options=`` (a value built once and tuned per call,
as a command line's flag overrides its config file), and a keyword that
names no field is a ``TypeError`` listing the ones that do.

``memory_budget`` bounds a different thing in each operation, so each has
its own default here, named for what it bounds (each options class's
docstring says what that is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from orbax_safetensors.errors import ArgumentTypeError

DEFAULT_LOAD_BUDGET = "1GB"  # a load's host bytes read and not yet on device
DEFAULT_SAVE_BUDGET = "1GB"  # a save's accelerator shards in host memory ahead of the writes
DEFAULT_CONVERT_BUDGET = "1GB"  # a conversion's buffers and caches, all told

OptionsValue = TypeVar("OptionsValue")


def with_shorthand(kind: type[OptionsValue], options: OptionsValue | None,
                   shorthand: Mapping[str, Any]) -> OptionsValue:
    """``options`` (``kind()`` when ``None``) with each of ``shorthand``'s fields replaced, checked
    as any ``kind`` is when built."""
    if options is not None and not isinstance(options, kind):
        raise ArgumentTypeError(f"options= takes an ost.{kind.__name__}, not {type(options).__name__}")
    fields = [f.name for f in dataclasses.fields(kind) if f.init]  # type: ignore[arg-type]
    unknown = [name for name in shorthand if name not in fields]
    if unknown:
        raise ArgumentTypeError(
            f"unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(name) for name in unknown)}: the keywords besides options= are "
            f"the fields of {kind.__name__} ({', '.join(fields)})")
    if options is None:
        return kind(**shorthand)
    return dataclasses.replace(options, **shorthand) if shorthand else options  # type: ignore[type-var]
