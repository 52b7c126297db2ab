"""A fault-injecting HTTP reverse proxy between fsspec and a test object store.

The object-store tests talk to real servers (moto for S3, the GCS emulator;
see ``tests/support/object_stores.py``), but those servers never fail. Real stores
do: 503 SlowDown, connections reset mid-request, requests that hang, writes
that land although the client never saw the answer. This module puts a small
HTTP/1.1 reverse proxy on 127.0.0.1 in front of such a server; tests point
s3fs/gcsfs at ``proxy.url`` instead of the server's URL and decide, at
runtime, which requests fail and how::

    with FaultProxy(server_url, seed=0) as proxy:
        fs = s3fs.S3FileSystem(endpoint_url=proxy.url, ...)
        proxy.set_faults(rate=0.3, kinds=("503", "reset"))  # 30 % of requests
        proxy.fail_next(1, "after_forward", methods={"PUT"})  # exactly one
        ...
        proxy.clear_faults()
        assert proxy.stats.faults["503"] > 0

Fault kinds (``FAULT_KINDS``):

* ``"503"`` (or any other 3-digit status such as ``"500"``, ``"429"``):
  answer with that status without forwarding; the body is an S3 XML error
  (``<Code>SlowDown</Code>`` for 503) or a GCS JSON error
  (``{"error": {"code": 503, ...}}``), by ``flavor``.
* ``"reset"``: abort the client connection (SO_LINGER 0, so a TCP RST) with
  no response; the request is not forwarded.
* ``"timeout"``: hold the request for ``delay`` seconds, then reset (or
  answer 503 with ``timeout_action="503"``), without forwarding. A client
  whose read timeout is below ``delay`` times out first.
* ``"after_forward"``: forward the request (so it takes effect upstream),
  then reset instead of returning the answer: a write that succeeded but
  looks failed to the client.
* ``"corrupt"``: one bit flipped in the middle of the body, the request's
  when it has one (an upload stored damaged), else the response's (a
  download that arrives damaged); status and headers unchanged.

Which requests fail is drawn from a seeded ``random.Random``, so a
sequential run is reproducible (concurrent requests draw in arrival order).
``fail_next`` rules are consulted before the random ``set_faults`` rule.

Forwarding: one request at a time is read completely (bodies are buffered;
chunked request bodies are de-chunked), sent upstream on a fresh
``http.client`` connection with the Host header rewritten to the upstream's,
and the upstream's status, headers and body go back to the client on its
keep-alive connection. Hop-by-hop headers are dropped and Content-Length is
recomputed (HEAD keeps the upstream's). Upstream URLs in ``Location`` headers
and in GCS JSON metadata (``selfLink``, ``mediaLink``; never in object data)
are rewritten to the proxy, so follow-up requests such as resumable-upload
chunks also pass through it. moto does not check SigV4 signatures unless
``INITIAL_NO_AUTH_ACTION_COUNT`` is set, so the rewritten Host is harmless.

Network model (optional, off by default; for benchmarks, not faults):
``latency`` seconds are added before each request is forwarded, and with
``bandwidth_per_connection`` (bytes/s) every response body goes back to the
client in 256 KiB chunks, paced so that each client connection (one TCP
stream; its requests are sequential) never exceeds that rate. This models a
real store's per-request latency and per-stream throughput cap::

    FaultProxy(moto_url, bandwidth_per_connection=40e6, latency=0.02)

This module deliberately has no pytest dependency.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import http.client
import http.server
import json
import logging
import os
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterable

__all__ = [
    "FAULT_KINDS",
    "FaultProxy",
    "ProxyStats",
    "RequestRecord",
]

logger = logging.getLogger(__name__)

FAULT_KINDS = ("503", "reset", "timeout", "after_forward", "corrupt")

# Not forwarded in either direction (RFC 9110 section 7.6.1), plus the headers
# the proxy sets itself: Host (rewritten), Content-Length (recomputed), Expect
# (the proxy answers 100-continue itself and sends the body in one go).
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding",
    "upgrade", "expect", "host", "content-length",
})

_GCS_PREFIXES = ("/storage/", "/upload/storage/", "/download/storage/", "/batch/")

S3_ERROR_CODES = {
    408: "RequestTimeout",
    429: "SlowDown",
    500: "InternalError",
    502: "BadGateway",
    503: "SlowDown",
    504: "GatewayTimeout",
}

_CHUNK = 256 * 1024  # pacing granularity of bandwidth_per_connection

_STATUS_KIND = re.compile(r"[1-5][0-9][0-9]")


@dataclasses.dataclass
class ProxyStats:
    """Counters since start or ``reset_stats()``; ``proxy.stats`` is a copy."""

    requests: int = 0  # every request received, faulted or not
    forwarded: int = 0  # sent upstream (includes "after_forward" faults)
    upstream_errors: int = 0  # upstream unreachable -> 502 to the client
    faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    methods: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def faults_total(self) -> int:
        return sum(self.faults.values())


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One request as the proxy saw it, in ``proxy.log``."""

    method: str
    target: str  # path and query, as sent by the client
    fault: str | None  # the injected fault kind, None if passed through
    status: int | None  # status sent to the client; None if none was (reset)


Match = str | Callable[[str, str], bool] | None


@dataclasses.dataclass
class _Rule:
    kinds: tuple[str, ...]
    methods: frozenset[str] | None
    match: Match
    delay: float
    timeout_action: str
    rate: float = 1.0
    remaining: int | None = None  # None: unlimited (random rule)

    def applies(self, method: str, target: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        if self.match is None:
            return True
        if callable(self.match):
            return bool(self.match(method, target))
        return self.match in target


def _flipped(data: bytes) -> bytes:
    """``data`` with the lowest bit of its middle byte flipped."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]


def _check_kinds(kinds: Iterable[str]) -> tuple[str, ...]:
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    if not kinds:
        raise ValueError("kinds must not be empty")
    for kind in kinds:
        if kind not in FAULT_KINDS and not _STATUS_KIND.fullmatch(kind):
            raise ValueError(f"unknown fault kind {kind!r}; use one of {FAULT_KINDS} "
                             "or an HTTP status such as '500'")
    return kinds


def _check_methods(methods: Collection[str] | str | None) -> frozenset[str] | None:
    if methods is None:
        return None
    if isinstance(methods, str):
        methods = (methods,)
    return frozenset(m.upper() for m in methods)


class FaultProxy:
    """Reverse proxy on 127.0.0.1 in front of ``upstream_url``, with faults.

    Args:
      upstream_url: ``"http://host:port"`` of the real server.
      seed: seed of the ``random.Random`` that decides which requests fail.
      flavor: ``"s3"`` or ``"gcs"`` error bodies; ``None`` sniffs the path
        (GCS JSON API paths start with ``/storage/``, ``/upload/``, ...).
      delay: default hold time of ``"timeout"`` faults, in seconds.
      upstream_timeout: socket timeout towards the upstream, in seconds.
      log_size: how many ``RequestRecord`` entries ``log`` keeps.
      bandwidth_per_connection: if set, the most bytes/s of response body
        the proxy writes to each client connection (see the module docstring).
      latency: seconds added before forwarding each request.

    Use as a context manager, or call ``start()`` and ``close()``.
    """

    def __init__(self, upstream_url: str, *, seed: int = 0, flavor: str | None = None,
                 delay: float = 2.0, upstream_timeout: float = 60.0, log_size: int = 10_000,
                 bandwidth_per_connection: float | None = None, latency: float = 0.0):
        parsed = urllib.parse.urlsplit(upstream_url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"upstream_url must be http://host:port, got {upstream_url!r}")
        if flavor not in (None, "s3", "gcs"):
            raise ValueError(f"flavor must be 's3', 'gcs' or None, got {flavor!r}")
        self.upstream_url = f"http://{parsed.netloc}"
        self._upstream_host = parsed.hostname
        self._upstream_port = parsed.port or 80
        self._upstream_netloc = parsed.netloc
        self.flavor = flavor
        self.delay = delay
        self.upstream_timeout = upstream_timeout
        if bandwidth_per_connection is not None and bandwidth_per_connection <= 0:
            raise ValueError(f"bandwidth_per_connection must be > 0, got {bandwidth_per_connection}")
        if latency < 0:
            raise ValueError(f"latency must be >= 0, got {latency}")
        self.bandwidth_per_connection = bandwidth_per_connection
        self.latency = latency
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._random_rule: _Rule | None = None
        self._next_rules: list[_Rule] = []
        self._stats = ProxyStats()
        self._log: collections.deque[RequestRecord] = collections.deque(maxlen=log_size)
        self._closing = threading.Event()
        self._connections: set[socket.socket] = set()
        self._handler_threads: set[threading.Thread] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None
        self.port: int | None = None

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> FaultProxy:
        if self._server is not None:
            raise RuntimeError("FaultProxy already started")
        server = _Server(("127.0.0.1", 0), _Handler)
        server.fault_proxy = self
        self._server = server
        self.port = server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"FaultProxy:{self.port}", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stops serving, drops open client connections, joins the threads."""
        server, self._server = self._server, None
        if server is None:
            return
        self._closing.set()  # wakes "timeout" faults
        server.shutdown()
        server.server_close()
        with self._lock:
            connections = list(self._connections)
            threads = list(self._handler_threads)
        for conn in connections:  # wakes handlers idling on keep-alive reads
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)
        for thread in threads:
            thread.join(timeout)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- fault configuration -------------------------------------------------

    def set_faults(self, rate: float, kinds: Iterable[str] | str = ("503",), *,
                   methods: Collection[str] | str | None = None, match: Match = None,
                   delay: float | None = None, timeout_action: str = "reset") -> None:
        """Fails each matching request with probability ``rate``.

        ``kinds``: faults to pick from, uniformly. ``methods``: only these
        HTTP methods (e.g. ``{"GET"}``). ``match``: only requests whose target
        (path and query) contains this substring, or for which
        ``match(method, target)`` is true. ``rate=1.0`` makes the faults
        persistent until ``clear_faults()``. Replaces the previous rule.
        """
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        rule = self._rule(kinds, methods, match, delay, timeout_action)
        rule.rate = rate
        with self._lock:
            self._random_rule = rule

    def fail_always(self, kinds: Iterable[str] | str = ("503",), **kwargs) -> None:
        """Persistent faults: ``set_faults(rate=1.0, ...)``."""
        self.set_faults(1.0, kinds, **kwargs)

    def fail_next(self, n: int, kind: str = "503", *,
                  methods: Collection[str] | str | None = None, match: Match = None,
                  delay: float | None = None, timeout_action: str = "reset") -> None:
        """Fails exactly the next ``n`` matching requests with ``kind``.

        Rules queue up; each request consumes from the first rule it matches.
        They take precedence over ``set_faults``.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rule = self._rule((kind,), methods, match, delay, timeout_action)
        rule.remaining = n
        with self._lock:
            self._next_rules.append(rule)

    def clear_faults(self) -> None:
        """Removes the random rule and any unconsumed ``fail_next`` rules."""
        with self._lock:
            self._random_rule = None
            self._next_rules.clear()

    @property
    def pending_failures(self) -> int:
        """How many ``fail_next`` failures have not happened yet."""
        with self._lock:
            return sum(r.remaining for r in self._next_rules)

    def _rule(self, kinds, methods, match, delay, timeout_action) -> _Rule:
        if timeout_action not in ("reset", "503"):
            raise ValueError(f"timeout_action must be 'reset' or '503', got {timeout_action!r}")
        return _Rule(kinds=_check_kinds(kinds), methods=_check_methods(methods), match=match,
                     delay=self.delay if delay is None else delay,
                     timeout_action=timeout_action)

    # -- statistics ------------------------------------------------------------

    @property
    def stats(self) -> ProxyStats:
        with self._lock:
            return copy.deepcopy(self._stats)

    @property
    def log(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._log)

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = ProxyStats()
            self._log.clear()

    # -- used by the handler -------------------------------------------------

    def _decide(self, method: str, target: str) -> _Rule | None:
        """Counts the request; returns the rule whose fault it gets, if any."""
        with self._lock:
            self._stats.requests += 1
            self._stats.methods[method] += 1
            for rule in self._next_rules:
                if rule.remaining and rule.applies(method, target):
                    rule.remaining -= 1
                    self._next_rules = [r for r in self._next_rules if r.remaining]
                    return rule
            rule = self._random_rule
            if rule is not None and rule.applies(method, target) and self._rng.random() < rule.rate:
                return rule
            return None

    def _pick_kind(self, rule: _Rule) -> str:
        with self._lock:
            kind = rule.kinds[0] if len(rule.kinds) == 1 else self._rng.choice(rule.kinds)
            self._stats.faults[kind] += 1
            return kind

    def _record(self, method: str, target: str, fault: str | None, status: int | None) -> None:
        with self._lock:
            if status is not None:
                self._stats.statuses[status] += 1
            self._log.append(RequestRecord(method, target, fault, status))

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
                self._handler_threads.add(threading.current_thread())
            else:
                self._connections.discard(conn)
                self._handler_threads.discard(threading.current_thread())

    def _flavor(self, target: str) -> str:
        if self.flavor is not None:
            return self.flavor
        return "gcs" if target.startswith(_GCS_PREFIXES) else "s3"

    def _error_body(self, status: int, target: str) -> tuple[str, bytes]:
        try:
            message = f"{http.HTTPStatus(status).phrase} (injected by FaultProxy)"
        except ValueError:
            message = f"HTTP {status} (injected by FaultProxy)"
        if self._flavor(target) == "gcs":
            body = {"error": {"code": status, "message": message,
                              "errors": [{"message": message, "domain": "global",
                                          "reason": "backendError"}]}}
            return "application/json; charset=UTF-8", json.dumps(body).encode()
        code = S3_ERROR_CODES.get(status, "ServiceUnavailable" if status >= 500 else "BadRequest")
        xml = ('<?xml version="1.0" encoding="UTF-8"?>\n'
               f"<Error><Code>{code}</Code><Message>{message}</Message>"
               "<RequestId>FAULTPROXY</RequestId><HostId>FAULTPROXY</HostId></Error>")
        return "application/xml", xml.encode()

    def _forward(self, method: str, target: str, headers, body: bytes | None):
        """Sends one request upstream; returns (status, reason, headers, body)."""
        connection_tokens = {t.strip().lower() for v in headers.get_all("Connection", [])
                             for t in v.split(",")}
        conn = http.client.HTTPConnection(self._upstream_host, self._upstream_port,
                                          timeout=self.upstream_timeout)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers.items():
                lower = name.lower()
                if lower not in _HOP_BY_HOP and lower not in connection_tokens:
                    conn.putheader(name, value)
            conn.putheader("Host", self._upstream_netloc)
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.putheader("Connection", "close")
            conn.endheaders(body)
            response = conn.getresponse()
            data = response.read()
            return response.status, response.reason, response.getheaders(), data
        finally:
            conn.close()

    def _rewrite_response(self, method: str, target: str, headers, data: bytes):
        upstream, proxy = self.upstream_url, self.url
        out = []
        for name, value in headers:
            if name.lower() in ("location", "content-location"):
                value = value.replace(upstream, proxy)
            out.append((name, value))
        content_type = next((v for n, v in headers if n.lower() == "content-type"), "")
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query)
        is_media = "media" in query.get("alt", ()) or target.startswith("/download/")
        if (self._flavor(target) == "gcs" and "json" in content_type and not is_media
                and upstream.encode() in data):
            data = data.replace(upstream.encode(), proxy.encode())
        return out, data


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # idle keep-alive connections must not block close()
    request_queue_size = 128
    fault_proxy: FaultProxy

    def handle_error(self, request, client_address):
        logger.debug("FaultProxy: error on connection from %s", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp's pools expect
    server: _Server

    def setup(self):
        super().setup()
        self.server.fault_proxy._track(self.connection, add=True)

    def finish(self):
        self.server.fault_proxy._track(self.connection, add=False)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format, *args):
        logger.debug("FaultProxy: " + format, *args)

    def do_GET(self):
        self._proxy()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def _proxy(self):
        proxy = self.server.fault_proxy
        method = self.command
        target = self.path
        if "://" in target.split("?", 1)[0]:  # absolute-form request target
            parts = urllib.parse.urlsplit(target)
            target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            return
        rule = proxy._decide(method, target)
        kind = proxy._pick_kind(rule) if rule is not None else None

        if kind == "timeout":
            proxy._closing.wait(rule.delay)
            if rule.timeout_action == "503":
                self._send_fault(503, target, kind)
            else:
                self._reset(method, target, kind)
            return
        if kind == "reset":
            self._reset(method, target, kind)
            return
        if kind is not None and kind not in ("after_forward", "corrupt"):
            self._send_fault(int(kind), target, kind)
            return
        corrupt_request = kind == "corrupt" and bool(body)
        if corrupt_request:
            body = _flipped(body)

        if proxy.latency:
            proxy._closing.wait(proxy.latency)
        try:
            proxy._count("forwarded")
            status, reason, headers, data = proxy._forward(method, target, self.headers, body)
        except (OSError, http.client.HTTPException) as e:
            proxy._count("upstream_errors")
            logger.debug("FaultProxy: upstream error for %s %s: %r", method, target, e)
            self._send(502, "Bad Gateway", [("Content-Type", "text/plain")],
                       f"FaultProxy: upstream error: {e!r}".encode(), method, target, None)
            return
        if kind == "after_forward":
            self._reset(method, target, kind)
            return
        headers, data = proxy._rewrite_response(method, target, headers, data)
        if kind == "corrupt" and not corrupt_request and data:
            data = _flipped(data)
        self._send(status, reason, headers, data, method, target, kind)

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size_line = self.rfile.readline(65537)
                if not size_line:
                    raise ValueError("connection closed in chunked body")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(3)  # CRLF after the chunk
        length = self.headers.get("Content-Length")
        if length is None:
            return None
        data = self.rfile.read(int(length))
        if len(data) != int(length):
            raise ValueError("connection closed in body")
        return data

    def _send(self, status, reason, headers, data, method, target, kind):
        try:
            self.send_response_only(status, reason)
            has_length = False
            for name, value in headers:
                lower = name.lower()
                if lower == "content-length" and method == "HEAD":
                    has_length = True
                    self.send_header(name, value)  # the object's size, no body follows
                elif lower not in _HOP_BY_HOP:
                    self.send_header(name, value)
            no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
            if not no_body:
                self.send_header("Content-Length", str(len(data)))
            elif method == "HEAD" and not has_length:
                self.send_header("Content-Length", "0")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if not no_body and data:
                self._write_body(data)
            self.wfile.flush()
        except OSError:  # the client went away
            self.close_connection = True
        self.server.fault_proxy._record(method, target, kind, status)

    def _write_body(self, data: bytes) -> None:
        """Writes ``data``, paced to ``bandwidth_per_connection`` if set."""
        rate = self.server.fault_proxy.bandwidth_per_connection
        if rate is None:
            self.wfile.write(data)
            return
        self.wfile.flush()  # the headers go out before the first chunk
        started = time.monotonic()
        view = memoryview(data)
        for offset in range(0, len(view), _CHUNK):
            self.wfile.write(view[offset:offset + _CHUNK])
            ahead = started + min(offset + _CHUNK, len(view)) / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)

    def _send_fault(self, status: int, target: str, kind: str):
        content_type, data = self.server.fault_proxy._error_body(status, target)
        self._send(status, None, [("Content-Type", content_type)], data,
                   self.command, target, kind)

    def _reset(self, method: str, target: str, kind: str):
        """Aborts the connection: SO_LINGER 0 makes close() send a TCP RST."""
        self.close_connection = True
        sock = self.connection
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            os.close(sock.detach())
        except OSError:
            pass
        self.server.fault_proxy._record(method, target, kind, None)
