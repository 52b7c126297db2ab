"""moto's S3 server, with ranged GETs served the way S3 serves them: in O(range).

    python bench/moto_ranged.py PORT

moto 5 answers ``GET`` with ``Range: bytes=a-b`` by copying the whole object out of
its buffer (``FakeKey.value``, under the key's lock) and slicing the copy, so every
ranged GET of a 64 MB object costs the server ~35 ms of CPU however few bytes it
returns, and concurrent ranged GETs of one object queue on the lock. Real S3 does
not behave like that, and a benchmark of ranged reads against it measures moto.
Here, while a ranged GET is answered, the key's value is a view that reads only
the requested bytes. Everything else (whole-object GETs, uploads, listings) is
moto unchanged.
"""

from __future__ import annotations

import sys
import threading

from moto.s3 import models, responses
from moto.server import main

_ranged = threading.local()
_whole_value = models.FakeKey.value


class _RangeView:
    """Stands in for the object's bytes: a length, and slices read on demand."""

    def __init__(self, key: models.FakeKey):
        self._key = key

    def __len__(self) -> int:
        return self._key.size

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(self._key.size)
        with self._key.lock:
            self._key._value_buffer.seek(start)
            return self._key._value_buffer.read(max(0, stop - start))

    def __bytes__(self) -> bytes:
        return self[:]


def _value(key: models.FakeKey):
    return _RangeView(key) if getattr(_ranged, "active", False) else _whole_value.fget(key)


def _get_object(self: responses.S3Response):
    _ranged.active = bool(self.headers.get("range"))
    try:
        return _original_get_object(self)
    finally:
        _ranged.active = False


def _handle_range_header(self, request, response_headers, response_content):
    status, headers, body = _original_range(self, request, response_headers, response_content)
    return status, headers, bytes(body) if isinstance(body, _RangeView) else body


_original_get_object = responses.S3Response.get_object
_original_range = responses.S3Response._handle_range_header
models.FakeKey.value = property(_value, _whole_value.fset)
responses.S3Response.get_object = _get_object
responses.S3Response._handle_range_header = _handle_range_header

if __name__ == "__main__":
    main(["-H", "127.0.0.1", "-p", sys.argv[1]])
