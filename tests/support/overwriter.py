"""A writer thread that overwrites one checkpoint in a loop, for tests of readers racing it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import orbax_safetensors as ost


@contextlib.contextmanager
def overwriting(url: str, versions: Sequence[Any], *, pause: float = 0.0,
                **save_options: Any) -> Iterator[list[BaseException]]:
    """Saves ``versions`` in turn at ``url`` until the block ends (``pause`` seconds between
    saves); yields the list the writer's error lands in, if it fails."""
    stop, errors = threading.Event(), []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            time.sleep(pause)
            try:
                ost.save(url, versions[i % len(versions)], overwrite=True, **save_options)
            except BaseException as e:  # noqa: BLE001 -- reported to the test
                errors.append(e)
                return

    thread = threading.Thread(target=writer, name="overwriter")
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join(60)
