"""The retry policy of object-store calls and snapshot re-reads: what counts as transient, backoff,
final errors."""

import random
import time

import pytest

from orbax_safetensors.errors import StorageError
from orbax_safetensors.storage.retry import RetryPolicy, call, is_transient

_FAST = RetryPolicy(attempts=4, first_backoff=0.001, max_backoff=0.002)


def _http_error(code):
    gcsfs_retry = pytest.importorskip("gcsfs.retry")
    return gcsfs_retry.HttpError({"code": code, "message": "x"})


def _client_error(status, code):
    botocore_exceptions = pytest.importorskip("botocore.exceptions")
    return botocore_exceptions.ClientError(
        {"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject")


def _chained(outer, inner):
    try:
        try:
            raise inner
        except Exception as e:
            raise outer from e
    except Exception as e:
        return e


@pytest.mark.parametrize("error,transient", [
    (ConnectionResetError(104, "reset"), True),
    (TimeoutError("read timed out"), True),
    (BrokenPipeError(), True),
    (FileNotFoundError("gone"), False),
    (PermissionError("denied"), False),
    (ValueError("bad"), False),
    (OSError("unknown"), False),
    (_chained(OSError("wrapped"), ConnectionResetError()), True),
    (_chained(OSError("wrapped"), ValueError()), False),
])
def test_classification(error, transient):
    assert is_transient(error) is transient


@pytest.mark.parametrize("code,transient", [(503, True), (429, True), (500, True), (404, False),
                                            (403, False)])
def test_gcs_http_errors(code, transient):
    assert is_transient(_http_error(code)) is transient


@pytest.mark.parametrize("status,code,transient", [
    (503, "SlowDown", True), (500, "InternalError", True), (404, "NoSuchKey", False),
    (400, "RequestTimeout", True), (403, "AccessDenied", False)])
def test_s3_client_errors(status, code, transient):
    assert is_transient(_chained(OSError("s3fs"), _client_error(status, code))) is transient


def test_transient_failures_are_retried_until_success():
    failures = [ConnectionResetError(), TimeoutError()]

    def flaky():
        if failures:
            raise failures.pop()
        return "data"

    assert call(_FAST, "s3://b/k", "read", flaky) == "data"


def test_persistent_transient_failure_names_the_object_and_the_attempts():
    attempts = []

    def down():
        attempts.append(1)
        raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(StorageError) as raised:
        call(_FAST, "gs://bucket/ckpt/model.safetensors", "read of bytes [0, 8)", down)
    assert len(attempts) == 4
    message = str(raised.value)
    assert "gs://bucket/ckpt/model.safetensors: read of bytes [0, 8) failed after 4 attempts" in message
    assert "ConnectionResetError" in message and raised.value.url.startswith("gs://")


def test_permanent_failures_are_not_retried():
    attempts = []

    def bad():
        attempts.append(1)
        raise ValueError("malformed request")

    with pytest.raises(StorageError, match=r"s3://b/k: write failed: ValueError"):
        call(_FAST, "s3://b/k", "write", bad)
    assert len(attempts) == 1
    with pytest.raises(FileNotFoundError):
        call(_FAST, "s3://b/k", "read", lambda: (_ for _ in ()).throw(FileNotFoundError("k")))


def test_backoff_grows_exponentially_with_full_jitter_and_a_cap():
    policy = RetryPolicy(first_backoff=0.5, max_backoff=3.0)
    rng = random.Random(0)
    for retry, bound in enumerate([0.5, 1.0, 2.0, 3.0, 3.0]):
        samples = [policy.backoff(retry, rng) for _ in range(200)]
        assert 0 <= min(samples) and max(samples) <= bound
        assert max(samples) > 0.8 * bound


def test_tries_sleep_between_attempts_and_resume_where_a_caller_left_off(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    policy = RetryPolicy(attempts=4, first_backoff=0.5, max_backoff=3.0)
    assert list(policy.tries(random.Random(0))) == [0, 1, 2, 3]
    assert len(slept) == 3 and all(0 <= s <= b for s, b in zip(slept, [0.5, 1.0, 2.0]))
    slept.clear()
    assert list(policy.tries(random.Random(0), first=2)) == [2, 3] and len(slept) == 1
    gone = RetryPolicy(attempts=4, deadline=-1.0)  # past its deadline after the first attempt
    assert list(gone.tries()) == [0]
