"""Imported first by a child script: once the interpreter begins to exit, no thread starts.

That is Python 3.12.0 and 3.12.1 ("can't create new thread at interpreter
shutdown" from the moment the non-daemon threads are being waited for); later
Pythons start threads until the last non-daemon thread has ended. Made so here
on every Python, a test of what a script's exit does fails wherever the code
needs a new thread then, not only where that Python is installed.
"""

import threading

_exiting = threading.Event()
_shutdown, _start = threading._shutdown, threading.Thread.start  # type: ignore[attr-defined]


def _exit_begins() -> None:
    _exiting.set()
    _shutdown()


def _start_unless_exiting(self: threading.Thread) -> None:
    if _exiting.is_set():
        raise RuntimeError("can't create new thread at interpreter shutdown")
    _start(self)


threading._shutdown = _exit_begins  # type: ignore[attr-defined]
threading.Thread.start = _start_unless_exiting  # type: ignore[method-assign]
