"""tests/support/fault_proxy.py against moto and the GCS emulator, and what s3fs and
gcsfs do when requests through it fail.

The filesystems are built directly on ``proxy.url`` (not through
``fsspec.config``), with ``skip_instance_cache=True``. Unless a test says
otherwise, the clients' own retry sleeps are scaled down 100x
(``fast_backoff``) so a fault costs milliseconds; that changes no retry
decision or count, only the waiting.

Observed behaviour (s3fs 2026.9 / aiobotocore 3.10 / botocore 1.43 legacy
retry mode, gcsfs 2026.10, aiohttp 3.14), asserted by the tests below:

* aiohttp itself resends an idempotent request (GET, HEAD, PUT, DELETE) once,
  at once, when the connection drops; only a second consecutive reset, or a
  reset of a POST, reaches the client libraries' retry loops.
* One fault of kind 503 or reset on any step (ranged GET, small PUT, the
  multipart / resumable upload's start, part and completion, ls, info,
  delete) is retried and the operation succeeds, for both clients.
* s3fs with "after_forward" (the request took effect, the answer was lost):
  everything succeeds against moto.
* gcsfs with "after_forward": ranged GET, small upload, starting a resumable
  upload, ls and info succeed, but
    - a resumable-upload chunk that landed is sent again, and the emulator
      refuses the repeated offset with 400 -> ``gcsfs.retry.HttpError``
      (code 400) and the object is not created (the real GCS answers 308
      and gcsfs would continue, so this one is partly an emulator artefact);
    - the final chunk that landed is sent again to a finished session ->
      404 -> ``FileNotFoundError``, although the object is complete;
    - a DELETE that landed is resent by aiohttp -> 404 ->
      ``FileNotFoundError``, although the object is gone.
* Persistent faults, default settings (measured without fast_backoff):
    - s3fs, 503 SlowDown: 25 requests (botocore 5 attempts x s3fs 5), ~32 s,
      then ``OSError(errno.EBUSY)``;
    - s3fs, reset: 10 requests (aiohttp 2 x botocore 5; s3fs does not retry
      ``EndpointConnectionError``), 4-11 s, then
      ``botocore.exceptions.EndpointConnectionError`` (not an OSError);
    - gcsfs, 503: 6 requests (fixed ``retry_request(retries=6)``), ~32-36 s
      of 1+2+4+8+16 s sleeps plus jitter, then ``gcsfs.retry.HttpError``
      (``.code == 503``);
    - gcsfs, reset: 12 requests for GET (aiohttp 2 x 6), 6 for POST, ~32 s,
      then ``aiohttp.ClientOSError`` (an OSError).
  Shorter: s3fs ``config_kwargs={"retries": {"max_attempts": 1}}`` (botocore)
  plus ``fs.retries = 1`` (s3fs's own loop); gcsfs has no option, its retry
  count is fixed when the class is defined -- a subclass that re-wraps
  ``_request`` with ``gcsfs.retry.retry_request(retries=n)`` works.
* Stalled server ("timeout" faults): s3fs times out after ``read_timeout``
  (``config_kwargs``, default 15 s) and retries. gcsfs has no request timeout
  by default (``requests_timeout=None``) and waits as long as the server
  does; with ``requests_timeout`` set it does NOT retry a timeout and raises
  ``fsspec.exceptions.FSTimeoutError`` at once.
* Selecting faults by object name: gcsfs ``info()`` also starts a listing of
  ``prefix=<key>/`` and returns without waiting for it, so that GET can
  reach the proxy after ``info()`` returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import itertools
import os
import random
import threading
import time
import uuid
from collections.abc import Callable

import pytest

# Before gcsfs is imported: it picks its (gRPC-probing) class at import.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
import aiobotocore.endpoint  # noqa: E402
import botocore.exceptions  # noqa: E402
import fsspec.exceptions  # noqa: E402
import gcsfs  # noqa: E402
import gcsfs.retry  # noqa: E402
import s3fs  # noqa: E402
import s3fs.core  # noqa: E402

from tests.support.fault_proxy import FaultProxy  # noqa: E402
from tests.support.object_stores import object_store_server  # noqa: E402

pytestmark = pytest.mark.slow  # object-store servers behind a fault proxy

MiB = 1 << 20
BLOCK = 5 * MiB  # S3's minimum part; a multiple of GCS's 256 KiB chunk unit
BIG = random.Random(0).randbytes(12 * MiB)  # 3 parts / 3 resumable chunks
SMALL = random.Random(1).randbytes(64 << 10)


@dataclasses.dataclass
class Store:
    protocol: str  # "s3" or "gs"
    bucket: str
    upstream: str  # the real server's URL


@pytest.fixture(scope="module", params=["s3", "gs"])
def store(request):
    with object_store_server(request.param) as (bucket_url, env):
        upstream = env[f"FSSPEC_{request.param.upper()}_ENDPOINT_URL"]
        yield Store(request.param, bucket_url.split("://", 1)[1], upstream)


@pytest.fixture(autouse=True)
def _default_botocore_retries(monkeypatch, tmp_path):
    # Retry counts asserted below are botocore's defaults (legacy mode, 5
    # attempts); keep the environment and ~/.aws/config out of them.
    for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))


@pytest.fixture
def proxy(store):
    with FaultProxy(store.upstream, seed=0) as proxy:
        yield proxy


def make_fs(protocol: str, url: str, **kwargs):
    if protocol == "s3":
        return s3fs.S3FileSystem(endpoint_url=url, key="test", secret="test",
                                 skip_instance_cache=True, **kwargs)
    return gcsfs.GCSFileSystem(endpoint_url=url, token="anon", project="test",
                               skip_instance_cache=True, **kwargs)


@pytest.fixture
def fs(store, proxy):
    return make_fs(store.protocol, proxy.url)


class _ScaledAsyncio:
    """``asyncio`` with a faster ``sleep``, for one module's retry loop."""

    def __init__(self, factor: float):
        self.factor = factor

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def sleep(self, delay, result=None):
        return await asyncio.sleep(delay * self.factor, result)


@pytest.fixture
def fast_backoff(monkeypatch):
    """Scales the backoff sleeps of gcsfs, s3fs and botocore down 100x."""
    shim = _ScaledAsyncio(0.01)
    for module in (gcsfs.retry, s3fs.core, aiobotocore.endpoint):
        monkeypatch.setattr(module, "asyncio", shim)


def gcsfs_with_retries(n: int) -> type:
    """A GCSFileSystem whose requests are tried ``n`` times instead of 6."""
    base = gcsfs.GCSFileSystem
    return type(f"GCSFileSystemRetries{n}", (base,), {
        "retries": n,
        "_request": gcsfs.retry.retry_request(retries=n)(base._request.__wrapped__),
    })


def write_big(fs, path: str) -> None:
    """Streams BIG in 1 MiB writes: a 3-part multipart / 3-chunk resumable upload."""
    with fs.open(path, "wb", block_size=BLOCK) as f:
        for i in range(0, len(BIG), MiB):
            f.write(BIG[i:i + MiB])


def token() -> str:
    return uuid.uuid4().hex[:10]


# -- the proxy on its own -------------------------------------------------------


def _request(url: str, method: str, target: str, body=None, headers=None, conn=None):
    host, port = url.removeprefix("http://").split(":")
    own = conn is None
    conn = conn or http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, target, body=body, headers=headers or {})  # iterables: chunked
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        if own:
            conn.close()


def test_seeded_faults_are_reproducible(store):
    patterns = []
    for _ in range(2):
        with FaultProxy(store.upstream, seed=7) as proxy:
            proxy.set_faults(0.5, "503")
            target = f"/{store.bucket}" if store.protocol == "s3" else f"/storage/v1/b/{store.bucket}"
            patterns.append([_request(proxy.url, "GET", target)[0] for _ in range(20)])
            assert proxy.stats.faults["503"] == patterns[-1].count(503)
    assert patterns[0] == patterns[1]
    assert 0 < patterns[0].count(503) < 20


def test_fail_next_precedence_filters_and_stats(store):
    with FaultProxy(store.upstream) as proxy:
        target = f"/{store.bucket}" if store.protocol == "s3" else f"/storage/v1/b/{store.bucket}"
        proxy.fail_next(2, "500", methods={"HEAD"})  # never matches a GET
        proxy.fail_next(1, "503", methods={"GET"})
        proxy.set_faults(1.0, "429", match="no-such-substring")
        statuses = [_request(proxy.url, "GET", target)[0] for _ in range(3)]
        assert statuses == [503, 200, 200]
        assert proxy.pending_failures == 2
        status, _, body = _request(proxy.url, "HEAD", target)
        assert status == 500 and body == b""
        stats = proxy.stats
        assert (stats.requests, stats.forwarded) == (4, 2)
        assert stats.faults == {"503": 1, "500": 1}
        assert stats.methods == {"GET": 3, "HEAD": 1}
        proxy.reset_stats()
        assert proxy.stats.requests == 0 and proxy.log == []


def test_error_bodies_by_flavor(store):
    with FaultProxy(store.upstream) as proxy:
        proxy.fail_always("503")
        status, headers, body = _request(proxy.url, "GET", "/b/k")
        assert status == 503 and b"<Code>SlowDown</Code>" in body
        status, headers, body = _request(proxy.url, "GET", "/storage/v1/b/x/o")
        assert status == 503 and b'"code": 503' in body
        assert headers["Content-Type"].startswith("application/json")


def test_chunked_request_body_and_head_length(store, fs, proxy):
    # http.client sends a generator body chunked; the proxy forwards it with
    # a Content-Length. A HEAD answer keeps the object's size.
    path = f"{store.bucket}/{token()}-chunked"
    if store.protocol == "s3":
        # A bogus SigV4 signature (over another Host, too): moto server does
        # not check signatures, so rewriting the Host header is harmless.
        auth = {"Authorization": "AWS4-HMAC-SHA256 Credential=test/20260101/us-east-1/s3/"
                                 "aws4_request, SignedHeaders=host, Signature=00",
                "x-amz-content-sha256": "UNSIGNED-PAYLOAD"}
        status, _, _ = _request(proxy.url, "PUT", "/" + path,
                                body=iter([SMALL[:1000], SMALL[1000:]]), headers=auth)
        assert status == 200
        status, headers, body = _request(proxy.url, "HEAD", "/" + path, headers=auth)
        assert status == 200 and body == b"" and headers["Content-Length"] == str(len(SMALL))
    else:
        bucket, name = path.split("/", 1)
        status, _, _ = _request(
            proxy.url, "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
            body=iter([SMALL[:1000], SMALL[1000:]]), headers={"Content-Type": "application/octet-stream"})
        assert status == 200
    fs.invalidate_cache()
    assert fs.cat_file(path) == SMALL


def test_close_with_idle_keepalive_connection_does_not_hang(store):
    before = set(threading.enumerate())
    proxy = FaultProxy(store.upstream).start()
    host, port = proxy.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    target = f"/{store.bucket}" if store.protocol == "s3" else f"/storage/v1/b/{store.bucket}"
    assert _request(proxy.url, "GET", target, conn=conn)[0] == 200  # stays open
    proxy.fail_next(1, "timeout", delay=30)
    def stalled_request():
        with contextlib.suppress(OSError, http.client.HTTPException):  # reset on close
            _request(proxy.url, "GET", target)

    waiter = threading.Thread(target=stalled_request, daemon=True)
    waiter.start()
    time.sleep(0.2)
    started = time.monotonic()
    proxy.close()
    assert time.monotonic() - started < 3
    conn.close()
    waiter.join(5)
    leftover = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert leftover == []


# -- clients through the proxy, no faults ------------------------------------------


def roundtrip(fs, bucket: str) -> str:
    """Write big (multipart/resumable) and small, read ranges and whole, ls, info, rm."""
    prefix = f"{bucket}/{token()}"
    write_big(fs, f"{prefix}/big")
    fs.pipe_file(f"{prefix}/small", SMALL)
    for start, end in [(0, 1), (100, 5000), (BLOCK - 10, BLOCK + 10), (len(BIG) - 7, len(BIG))]:
        assert fs.cat_file(f"{prefix}/big", start=start, end=end) == BIG[start:end]
    assert fs.cat_file(f"{prefix}/big") == BIG
    assert fs.cat_file(f"{prefix}/small") == SMALL
    fs.invalidate_cache()
    assert sorted(fs.ls(prefix, detail=False)) == [f"{prefix}/big", f"{prefix}/small"]
    assert fs.info(f"{prefix}/big")["size"] == len(BIG)
    fs.rm(f"{prefix}/big")
    fs.rm(f"{prefix}/small")
    fs.invalidate_cache()
    assert not fs.exists(f"{prefix}/big") and fs.find(prefix) == []
    return prefix


def test_passthrough(store, fs, proxy):
    roundtrip(fs, store.bucket)
    stats = proxy.stats
    assert stats.requests == stats.forwarded > 10 and stats.faults_total == 0
    log = [(r.method, r.target, r.status) for r in proxy.log]
    if store.protocol == "s3":
        assert sum(m == "POST" and t.endswith("?uploads") for m, t, _ in log) == 1
        assert sum(m == "PUT" and "partNumber=" in t for m, t, _ in log) == 3
        assert sum(m == "POST" and "uploadId=" in t for m, t, _ in log) == 1
        assert stats.methods["HEAD"] >= 1 and stats.statuses[206] >= 4
    else:
        # The chunks go to the Location of the resumable session: seen here,
        # so the proxy rewrote it to itself.
        assert sum(m == "POST" and "uploadType=resumable" in t and "upload_id" not in t
                   for m, t, _ in log) == 1
        assert [s for m, t, s in log if "upload_id=" in t] == [308, 308, 200]
        assert stats.methods["DELETE"] == 2 and stats.statuses[206] >= 4


# -- random faults --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_random_faults_are_retried(store, fs, proxy, fast_backoff, kind):
    """30 % of all requests fail (not forwarded): both clients still succeed."""
    proxy.set_faults(0.3, kind)
    roundtrip(fs, store.bucket)
    assert proxy.stats.faults[kind] >= 1


# -- one fault at each step --------------------------------------------------------


def _nth_on(predicate: Callable[[str, str], bool], n: int):
    """Matches the n-th request satisfying ``predicate`` and every later one."""
    count = itertools.count(1)
    return lambda method, target: predicate(method, target) and next(count) >= n


def _steps(protocol: str, bucket: str, key: str) -> dict:
    """name -> (fault selector, prepare, run, verify) for object ``bucket/key``."""
    s3 = protocol == "s3"
    path = f"{bucket}/{key}"

    def in_upload(method, target):
        return method == "POST" and key in target and "upload_id=" in target

    def check(fs, expected):
        fs.invalidate_cache()
        assert fs.cat_file(path) == expected

    def gone(fs):
        fs.invalidate_cache()
        assert not fs.exists(path)

    big = (lambda fs: write_big(fs, path), lambda fs: check(fs, BIG))
    return {
        "ranged_get": (dict(methods="GET", match=key), lambda fs: fs.pipe_file(path, SMALL),
                       lambda fs: fs.cat_file(path, start=10, end=5000) == SMALL[10:5000] or 1 / 0,
                       None),
        # gcsfs's one-shot upload names the object in the body, not the URL.
        "small_put": (dict(methods="PUT", match=key) if s3 else dict(match="uploadType=multipart"), None,
                      lambda fs: fs.pipe_file(path, SMALL), lambda fs: check(fs, SMALL)),
        "upload_start": (dict(match=(lambda m, t: m == "POST" and key in t and t.endswith("?uploads"))
                              if s3 else (lambda m, t: m == "POST" and key in t and "uploadType=resumable" in t
                                          and "upload_id" not in t)), None, *big),
        "upload_part": (dict(match=(lambda m, t: m == "PUT" and key in t and "partNumber=2" in t)
                             if s3 else _nth_on(in_upload, 2)), None, *big),
        "upload_complete": (dict(match=(lambda m, t: m == "POST" and key in t and "uploadId=" in t)
                                 if s3 else _nth_on(in_upload, 3)), None, *big),
        "ls": (dict(methods="GET", match=(lambda m, t: key in t and ("list-type" in t if s3 else "/o?" in t))),
               lambda fs: fs.pipe_file(f"{path}/x", b"1"),
               lambda fs: fs.ls(path, refresh=True) == [f"{path}/x"] or 1 / 0, None),
        "info": (dict(methods="HEAD" if s3 else "GET", match=key), lambda fs: fs.pipe_file(path, SMALL),
                 lambda fs: fs.info(path)["size"] == len(SMALL) or 1 / 0, None),
        "delete": (dict(match=(lambda m, t: m == "POST" and t.endswith("?delete")) if s3
                        else (lambda m, t: m == "DELETE" and key in t)),
                   lambda fs: fs.pipe_file(path, SMALL), lambda fs: fs.rm(path), gone),
    }


STEPS = ["ranged_get", "small_put", "upload_start", "upload_part", "upload_complete", "ls", "info",
         "delete"]

# (protocol, fault kind, step) -> name of the exception the step raises; every
# other combination succeeds. _VERIFY_AFTER_FAILURE: whether the store holds
# the intended result all the same (the write / delete landed).
SINGLE_FAULT_FAILURES = {
    ("gs", "after_forward", "upload_part"): "HttpError",  # 400 from the emulator
    ("gs", "after_forward", "upload_complete"): "FileNotFoundError",  # object complete
    ("gs", "after_forward", "delete"): "FileNotFoundError",  # object deleted
}
_VERIFY_AFTER_FAILURE = {"upload_part": False, "upload_complete": True, "delete": True}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("kind,count", [("503", 1), ("reset", 1), ("reset", 2), ("after_forward", 1)])
def test_single_fault(store, fs, proxy, fast_backoff, kind, count, step):
    key = f"{token()}-{step}"
    selector, prepare, run, verify = _steps(store.protocol, store.bucket, key)[step]
    if prepare:
        prepare(fs)
        fs.invalidate_cache()
    proxy.reset_stats()
    proxy.fail_next(count, kind, **selector)
    try:
        run(fs)
        outcome = "ok"
    except Exception as e:  # noqa: BLE001 -- the type is the result
        outcome = type(e).__name__
    proxy.clear_faults()
    assert proxy.stats.faults[kind] == count, proxy.log  # the selector hit the step
    expected = SINGLE_FAULT_FAILURES.get((store.protocol, kind, step), "ok")
    assert outcome == expected
    if verify and (outcome == "ok" or _VERIFY_AFTER_FAILURE[step]):
        verify(fs)
    if (store.protocol, kind, step) == ("gs", "after_forward", "upload_part"):
        fs.invalidate_cache()
        assert not fs.exists(f"{store.bucket}/{key}")


# -- stalled server ---------------------------------------------------------------


def test_timeout_fault(store, proxy, fast_backoff):
    path = f"{store.bucket}/{token()}-slow"
    make_fs(store.protocol, proxy.url).pipe_file(path, SMALL)
    proxy.fail_next(1, "timeout", methods="GET", match=path.split("/")[1], delay=2.0)
    started = time.monotonic()
    if store.protocol == "s3":
        fs = make_fs("s3", proxy.url, config_kwargs={"read_timeout": 0.3})
        assert fs.cat_file(path, start=0, end=100) == SMALL[:100]  # timed out, retried
    else:
        fs = make_fs("gs", proxy.url, requests_timeout=0.3)
        with pytest.raises(fsspec.exceptions.FSTimeoutError):  # not retried
            fs.cat_file(path, start=0, end=100)
    assert time.monotonic() - started < 1.5
    assert proxy.stats.faults["timeout"] == 1


# -- persistent faults ----------------------------------------------------------------

# (protocol, kind, step) -> (exception type, requests until the client gives up)
PERSISTENT = {
    ("s3", "503", "ranged_get"): (OSError, 25),
    ("s3", "503", "small_put"): (OSError, 25),
    ("s3", "reset", "ranged_get"): (botocore.exceptions.EndpointConnectionError, 10),
    ("s3", "reset", "small_put"): (botocore.exceptions.EndpointConnectionError, 10),
    ("gs", "503", "ranged_get"): (gcsfs.retry.HttpError, 6),
    ("gs", "503", "small_put"): (gcsfs.retry.HttpError, 6),
    ("gs", "reset", "ranged_get"): (OSError, 12),  # aiohttp.ClientOSError
    ("gs", "reset", "small_put"): (OSError, 6),
}


@pytest.mark.parametrize("step", ["ranged_get", "small_put"])
@pytest.mark.parametrize("kind", ["503", "reset"])
def test_persistent_faults(store, fs, proxy, fast_backoff, kind, step):
    key = f"{token()}-{step}"
    selector, prepare, run, _ = _steps(store.protocol, store.bucket, key)[step]
    if prepare:
        prepare(fs)
        fs.invalidate_cache()
    proxy.reset_stats()
    proxy.fail_always(kind, **selector)
    error, attempts = PERSISTENT[(store.protocol, kind, step)]
    started = time.monotonic()
    with pytest.raises(error) as info:
        run(fs)
    assert time.monotonic() - started < 10
    assert proxy.stats.faults[kind] == proxy.stats.requests == attempts
    if (store.protocol, kind) == ("s3", "503"):
        assert info.value.errno == 16  # EBUSY, s3fs's translation of SlowDown
    if (store.protocol, kind) == ("gs", "503"):
        assert info.value.code == 503


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_retry_options_make_persistent_faults_fail_fast(store, proxy, kind):
    """Real sleeps: these options are what to use when failing fast matters."""
    path = f"{store.bucket}/{token()}-fast"
    make_fs(store.protocol, proxy.url).pipe_file(path, SMALL)
    if store.protocol == "s3":
        # botocore's "max_attempts" counts retries (1 means 2 requests);
        # "total_max_attempts" counts requests.
        fs = make_fs("s3", proxy.url, config_kwargs={"retries": {"total_max_attempts": 1}})
        fs.retries = 1  # s3fs's own retry loop around botocore's
    else:
        fs = gcsfs_with_retries(1)(endpoint_url=proxy.url, token="anon", project="test",
                                   skip_instance_cache=True)
    # Session set up before the clock starts. (Not with info(): gcsfs's info
    # also starts a listing of the same key that can arrive after it returns.)
    assert fs.cat_file(path, start=0, end=1) == SMALL[:1]
    proxy.reset_stats()
    proxy.fail_always(kind, methods="GET", match=path.split("/")[1])
    started = time.monotonic()
    with pytest.raises((OSError, botocore.exceptions.BotoCoreError, gcsfs.retry.HttpError)):
        fs.cat_file(path, start=0, end=100)
    assert time.monotonic() - started < 1.0
    # One attempt; aiohttp still resends a GET once when the connection drops.
    assert proxy.stats.faults[kind] == (2 if kind == "reset" else 1), proxy.log
