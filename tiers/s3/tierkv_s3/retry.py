"""What an S3 error means, and retrying the ones worth retrying.

Every request the tier makes goes through `call_with_retries`: throttling (429, 503
SlowDown), other 5xx, timeouts and lost or refused connections are retried with
jittered exponential backoff up to `retries` times; then, or at once for anything
else, it raises `S3Failure` with a `kind` the tier acts on and a message that names
what failed and why.

s3fs's and botocore's own retry loops are turned off by the tier (one attempt each),
so this is the only retry policy in play.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import anyio
from botocore.exceptions import (  # type: ignore[import-untyped]
    ClientError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    EndpointConnectionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

T = TypeVar("T")

Kind = Literal["missing", "no_bucket", "denied", "no_credentials", "retry", "unreachable", "fatal"]
"""missing: no such object. no_bucket: the bucket is gone. denied: credentials or
policy refuse. no_credentials: the client found no credentials to sign with (botocore
says so before it sends anything, so nothing is known about the endpoint then).
retry: throttled, 5xx, timed out, connection lost. unreachable: no connection could be
made. fatal: anything else (a bug, a bad request)."""

RETRYABLE: frozenset[Kind] = frozenset({"retry", "unreachable"})
JOB_WIDE: frozenset[Kind] = frozenset({"unreachable", "no_bucket", "denied", "no_credentials"})
"""Kinds that will fail every other key of the job the same way."""

_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestThrottled",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
    }
)
_DENIED_STATUS = frozenset({401, 403})


class S3Failure(Exception):
    """A request failed for good: `kind` says how, the message says what and why."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind: Kind = kind


def _find_client_error(exc: BaseException) -> ClientError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ClientError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def classify(exc: BaseException) -> tuple[Kind, str]:
    """The kind of an exception raised by s3fs/aiobotocore, and a short description."""
    client_error = _find_client_error(exc)
    if client_error is not None:
        response = client_error.response
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        error = response.get("Error", {})
        code = str(error.get("Code", ""))
        message = str(error.get("Message", ""))
        text = f"HTTP {status} {code}".rstrip() + (f": {message}" if message else "")
        if code == "NoSuchBucket":
            return "no_bucket", text
        if status == 404 or code in ("NoSuchKey", "404", "NotFound"):
            return "missing", text
        if status in (429, 500, 502, 503, 504) or code in _THROTTLE_CODES:
            return "retry", text
        if status in _DENIED_STATUS or code in ("AccessDenied", "InvalidAccessKeyId"):
            return "denied", text
        return "fatal", text
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return "no_credentials", f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ConnectionRefusedError)):
        return "unreachable", f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ReadTimeoutError)):
        return "retry", "timed out"
    if isinstance(exc, (HTTPClientError, ConnectionError)):
        return "retry", f"connection lost: {type(exc).__name__}: {exc}"
    if isinstance(exc, FileNotFoundError):
        return "missing", str(exc) or "not found"
    try:  # aiohttp's errors, when aiobotocore lets one through
        import aiohttp

        if isinstance(exc, aiohttp.ClientError):
            return "retry", f"connection lost: {type(exc).__name__}: {exc}"
    except ImportError:  # pragma: no cover - aiobotocore depends on aiohttp
        pass
    if isinstance(exc, PermissionError):
        return "denied", str(exc)
    return "fatal", f"{type(exc).__name__}: {exc}"


def backoff(attempt: int, base: float, cap: float) -> float:
    """Seconds to wait after failed attempt `attempt` (0-based): half fixed, half random."""
    delay = min(cap, base * float(2**attempt))
    return delay / 2 + random.uniform(0.0, delay / 2)


async def call_with_retries(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    retries: int,
    timeout: float,
    backoff_base: float,
    backoff_cap: float,
) -> T:
    """`await call()`, each attempt bounded by `timeout`, retried as described above.

    Raises `S3Failure("<what>: <why>")`."""
    for attempt in range(retries + 1):
        try:
            with anyio.fail_after(timeout):
                return await call()
        except Exception as exc:
            kind, text = classify(exc)
            if kind in RETRYABLE and attempt < retries:
                await anyio.sleep(backoff(attempt, backoff_base, backoff_cap))
                continue
            if kind in RETRYABLE:
                text = f"{text} (gave up after {attempt + 1} attempts)"
            raise S3Failure(kind, f"{what}: {text}") from None
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises
