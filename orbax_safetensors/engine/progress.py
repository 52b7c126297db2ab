"""A one-line progress report for long jobs, on a terminal only.

Scripts and CI get nothing on stderr but what goes wrong; a person at a
terminal sees bytes done, throughput and an estimate of the time left,
redrawn at most a few times a second.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total_bytes: int, *, enabled: bool | None = None,
                 stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label, self.total, self.done = label, total_bytes, 0
        self.started = self._drawn = time.perf_counter()
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.perf_counter()
            if self.enabled and now - self._drawn >= 0.2:
                self._drawn = now
                self._draw(now, end="")

    def close(self) -> str:
        """Draws the final line (on a terminal) and returns the summary."""
        summary = self._line(time.perf_counter())
        if self.enabled:
            self.stream.write("\r" + summary + "\n")
            self.stream.flush()
        return summary

    def _draw(self, now: float, end: str) -> None:
        self.stream.write("\r" + self._line(now) + end)
        self.stream.flush()

    def _line(self, now: float) -> str:
        seconds = max(now - self.started, 1e-9)
        rate = self.done / seconds
        share = self.done / self.total if self.total else 1.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        return (f"{self.label}: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB ({share:.0%}) "
                f"in {seconds:.1f} s, {rate / 1e9:.2f} GB/s, ~{left:.0f} s left")
