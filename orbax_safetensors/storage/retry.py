"""Retries with exponential backoff: requests to object stores, and snapshot re-reads.

gcsfs and s3fs retry some failures themselves, but not all of them (a
connection reset in the middle of a ranged GET surfaces as an aiohttp error;
botocore's own retries stop after a few attempts), and when they give up the
error rarely says which object was involved. Every remote call the storage
layer makes therefore goes through ``call``: transient failures (throttling,
5xx, timeouts, dropped connections) are retried with full-jitter exponential
backoff, anything else is raised at once, and the final error names the
object and the operation.

Only idempotent operations are retried, and all of ours are: a ranged read, a
whole-object write, a compose, a delete. A write that succeeded on the server
but whose response was lost is simply written again.

A reader that finds the checkpoint changed under it (an overwrite committed
between its listing and its reads) looks again under ``SNAPSHOT_REREADS``, the
one policy for every such loop (the directory's view, opening a checkpoint,
reading one): a commit takes milliseconds to seconds, so many short, jittered
looks, and no deadline (one look may be a whole load).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from orbax_safetensors.errors import PeerFailedError, StorageError

T = TypeVar("T")

# HTTP statuses worth another attempt: timeout, throttling, server-side failures.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Exception types (by name, so no client library has to be importable) that mean
# the request may not have reached the server or its answer was lost.
_TRANSIENT_TYPES = frozenset({
    "ClientConnectionError", "ClientConnectorError", "ClientOSError", "ClientPayloadError",
    "ServerDisconnectedError", "ServerTimeoutError", "ConnectionClosedError",
    "EndpointConnectionError", "ReadTimeoutError", "ConnectTimeoutError",
    "IncompleteReadError", "ResponseStreamingError", "TransferEncodingError",
})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestTimeTooSkewed",
})


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry: ``attempts`` in all, sleeping a random
    time up to ``first_backoff * 2**i`` (capped at ``max_backoff``) before retry ``i``,
    and no new attempt once ``deadline`` seconds have passed since the first (the
    client libraries retry inside each attempt, so one attempt may itself be long)."""

    attempts: int = 5
    first_backoff: float = 0.2
    max_backoff: float = 5.0
    deadline: float = 30.0

    def backoff(self, retry: int, rng: random.Random) -> float:
        return rng.uniform(0, min(self.max_backoff, self.first_backoff * 2 ** retry))

    def tries(self, rng: random.Random | None = None, *, first: int = 0) -> Iterator[int]:
        """The attempts this policy allows, numbered from 0, with the backoff slept before
        each one after the first: the loop body returns on success and goes on to retry.
        ``first``: where a caller resumes that already spent attempts (a load that read a
        changed checkpoint plans again), without sleeping before it."""
        rng = rng or random.Random()
        started = time.monotonic()
        for attempt in range(first, self.attempts):
            if attempt > first:
                if time.monotonic() - started > self.deadline:
                    return
                time.sleep(self.backoff(attempt - 1, rng))
            yield attempt


# Reading one version of a checkpoint again after it changed under the reader. Fifty looks whose
# sleeps, capped at 0.1 s, add up to about two seconds on average: an overwrite commits in less.
SNAPSHOT_REREADS = RetryPolicy(attempts=50, first_backoff=0.002, max_backoff=0.1, deadline=math.inf)


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is worth another attempt."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return False
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        if type(current).__name__ in _TRANSIENT_TYPES:
            return True
        for attribute in ("code", "status"):  # gcsfs HttpError.code, aiohttp .status
            if getattr(current, attribute, None) in TRANSIENT_STATUS:
                return True
        response = getattr(current, "response", None)  # botocore ClientError
        if isinstance(response, dict):
            error_info = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in TRANSIENT_STATUS or error_info.get("Code") in _TRANSIENT_CODES:
                return True
        current = current.__cause__ or current.__context__
    return False


def call(policy: RetryPolicy, url: str, operation: str, fn: Callable[[], T],
         rng: random.Random | None = None) -> T:
    """``fn()``, retried under ``policy`` while it fails transiently; errors name ``url``."""
    for attempt in policy.tries(rng):
        try:
            return fn()
        except (FileNotFoundError, FileExistsError, PermissionError):
            raise
        except PeerFailedError:  # a stream's writer stopped for another process: not this store's
            raise
        except Exception as e:
            if not is_transient(e):
                raise StorageError(f"{url}: {operation} failed: {type(e).__name__}: {e}",
                                   url=url) from e
            last = e
    tried = attempt + 1
    raise StorageError(f"{url}: {operation} failed after {tried} attempt{'s' * (tried > 1)} "
                       f"(transient errors; the last: {type(last).__name__}: {last})",
                       url=url) from last
