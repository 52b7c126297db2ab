"""The cyclic garbage collector, paused while a call builds its per-tensor objects.

A load or save of a checkpoint of 100 000 tensors makes a few objects per
tensor (header entries, slices, planned reads, arrays) that all live until the
call returns. CPython's collector runs a full collection each time the objects
that survived a younger one grow by a quarter, and each full collection walks
every object of the process (JAX alone makes hundreds of thousands): most of
such a call's time went into collections that found nothing to free, since
none of these objects is garbage or part of a cycle. Reference counting still
frees everything as usual; only the search for cycles waits until the call
ends.

Nested and concurrent pauses share one: the collector is re-enabled when the
last one ends, and only if it was enabled when the first began (a caller that
disabled it keeps it disabled). A thread that enables or disables it meanwhile
is overridden by the last pause's end.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside (see the module's docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
