"""A progress report for long jobs: one updating line on a terminal, plain lines elsewhere.

Scripts and CI get nothing on stderr but what goes wrong unless they ask
(``progress=True``; the CLI shows progress on a terminal only). A person at a
terminal sees bytes done, throughput and an estimate of the time left,
redrawn in place (``\\r`` and an erase-to-end escape) at most a few times a
second; when the job ends the line is redrawn once more, without the
estimate. A stream that is no terminal (a log file, a pipe, CI) cannot redraw
a line, and ``\\r`` and escape codes would litter it: it gets a plain line
every ``LOG_SECONDS`` while the job runs and one when it ends, so a long job
shows it is alive without flooding the log. ``summary_line`` gives the
one-line result the command prints ("wrote 1.23 GB to DST in 4.5 s
(0.27 GB/s)"). Sizes are decimal (GB = 10^9 bytes), as in ``max_shard_size``.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import TextIO


class Progress:
    # Whether some progress line was drawn on a terminal and not finished: an error message
    # then starts on a line of its own.
    unfinished_line = False
    REDRAW_SECONDS = 0.2  # on a terminal
    LOG_SECONDS = 10.0  # elsewhere: a line each time, which a log keeps

    def __init__(self, label: str, total_bytes: int, *, enabled: bool | None = None,
                 stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = bool(isatty and isatty())
        self.enabled = self.terminal if enabled is None else enabled
        self.label, self.total, self.done = label, total_bytes, 0
        self.started = self._drawn = time.perf_counter()
        self._every = self.REDRAW_SECONDS if self.terminal else self.LOG_SECONDS
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.perf_counter()
            if self.enabled and now - self._drawn >= self._every:
                self._drawn = now
                self._draw(self._line(now))

    def start(self) -> "Progress":
        """Draws the line at once on a terminal, before the first bytes are done (a log gets
        its first line once the job has run ``LOG_SECONDS``)."""
        if self.enabled and self.terminal:
            self._draw(self._line(time.perf_counter()))
        return self

    def close(self) -> str:
        """Draws the final line and returns it."""
        with self._lock:
            summary = self._line(time.perf_counter(), final=True)
            if self.enabled:
                self._draw(summary, final=True)
        return summary

    def _draw(self, line: str, final: bool = False) -> None:
        if self.terminal:  # over the previous line, erasing what a longer one left behind
            self.stream.write("\r" + line + _CLEAR_TO_END + ("\n" if final else ""))
            Progress.unfinished_line = not final
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _line(self, now: float, final: bool = False) -> str:
        seconds = max(now - self.started, 1e-9)
        rate = self.done / seconds
        share = self.done / self.total if self.total else 1.0
        line = (f"{self.label}: {format_pair(self.done, self.total)} ({share:.0%}) "
                f"in {format_seconds(seconds)}, {format_rate(rate)}")
        if final:
            return line
        left = (self.total - self.done) / rate if rate > 0 else None
        return line + (f", ETA {format_seconds(left)}" if left is not None else ", ETA -")


_CLEAR_TO_END = "\x1b[K"
_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"))


def _unit(n: float) -> tuple[float, str]:
    for scale, name in _UNITS:
        if n >= scale:
            return scale, name
    return 1.0, "B"


def format_bytes(n: float) -> str:
    """``1234567`` → ``"1.23 MB"`` (decimal units)."""
    scale, name = _unit(n)
    return f"{n:.0f} B" if scale == 1.0 else f"{n / scale:.2f} {name}"


def format_pair(done: float, total: float) -> str:
    """``done/total`` in the total's unit: ``"0.50/2.00 GB"``."""
    scale, name = _unit(total)
    if scale == 1.0:
        return f"{done:.0f}/{total:.0f} B"
    return f"{done / scale:.2f}/{total / scale:.2f} {name}"


def format_rate(bytes_per_second: float) -> str:
    """Always GB/s, so that two lines compare at a glance; two significant digits below
    0.01 GB/s rather than a smaller unit."""
    rate = bytes_per_second / 1e9
    decimals = 2 if rate >= 0.01 or rate <= 0 else 1 - math.floor(math.log10(rate))
    return f"{rate:.{decimals}f} GB/s"


def format_seconds(seconds: float) -> str:
    """``4.5 s``, ``2m05s``, ``1h02m``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def summary_line(nbytes: int, dst: str, seconds: float, verb: str = "wrote") -> str:
    """The result of a job, one line: ``wrote 1.23 GB to DST in 4.5 s (0.27 GB/s)``."""
    return (f"{verb} {format_bytes(nbytes)} to {dst} in {format_seconds(seconds)} "
            f"({format_rate(nbytes / max(seconds, 1e-9))})")
