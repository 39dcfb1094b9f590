"""Every read, write and list of a store (local disk or an object store, through fsspec) goes
through `retrying`: errors are classified where they enter, and only the ones that may pass are
retried, with capped exponential backoff and full jitter.

- throttled: the store asks us to slow down (S3 `SlowDown`, HTTP 429/503): retried, from a
  longer base delay, so that a fleet of workers backs off together.
- transient: the connection dropped, timed out or the store had an internal error (5xx):
  retried.
- permanent: anything else (access denied, no such bucket, a corrupt file): raised at once as
  `StoreError` with the store's own message. The caller fails its unit of work with it (a
  worker: the shard attempt), never its process.

`FileNotFoundError` and `FileExistsError` are answers, not failures (a missing commit record,
an exclusive create that lost): they pass through unchanged and are never retried.

Credentials come from where each store's own library looks (for S3: the AWS_* environment,
~/.aws/config and credentials, a web identity token, the instance's role); an S3-compatible
store elsewhere is named by AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeVar

import fsspec.config
from prometheus_client import Counter

log = logging.getLogger(__name__)

T = TypeVar("T")
ErrorKind = Literal["throttled", "transient", "permanent"]

STORE_RETRIES = Counter("ebb_store_retries", "Store operations retried, by error kind", ["kind"])
STORE_FAILURES = Counter("ebb_store_failures", "Store operations given up, by error kind", ["kind"])


class StoreError(OSError):
    """A store operation failed for good: permanently, or after every retry."""

    def __init__(self, what: str, kind: ErrorKind, cause: BaseException) -> None:
        super().__init__(f"{what}: {_message(cause)}")
        self.kind: ErrorKind = kind


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How store operations are retried. Delays are drawn uniformly from [0, ceiling] (full
    jitter), the ceiling doubling per try from the kind's base up to `cap_s`."""

    attempts: int = 8
    """Tries in all, the first included, before a throttled or transient error is final."""
    base_s: float = 0.05
    """First ceiling for transient errors."""
    throttled_base_s: float = 0.5
    """First ceiling when the store throttles: slowing down is what it asked for."""
    cap_s: float = 10.0
    """The ceiling never grows past this."""

    def delay(self, kind: ErrorKind, retry: int) -> float:
        base = self.throttled_base_s if kind == "throttled" else self.base_s
        return random.uniform(0, min(self.cap_s, base * 2**retry))  # noqa: S311


DEFAULT_POLICY = RetryPolicy()

_THROTTLED_CODES = (
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestThrottled",
    "ServerBusy",  # Azure
    "rateLimitExceeded",  # GCS
    "Please reduce your request rate",
)
_TRANSIENT_CODES = (
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "BadDigest",
    "IncompleteBody",
    "OperationAborted",
)
_TRANSIENT_TYPES = (
    "ServerDisconnectedError",
    "ClientConnectionError",
    "ClientConnectorError",
    "ClientOSError",
    "ClientPayloadError",
    "ServerTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "IncompleteRead",
    "ProtocolError",
    "RemoteDisconnected",
    "HTTPClientError",
)


def _one_retry_layer() -> None:
    """s3fs retries some errors itself, and botocore under it again: three nested schedules
    would multiply (5 x 5 x ours) and hide throttling from our counts. Unless the user's fsspec
    configuration says otherwise (FSSPEC_S3_* or fsspec's config files), ours is the only one.
    s3fs is configured once it is loaded (fsspec loads it for the first s3:// URL): importing it
    here would cost every process its start-up time, S3 or not."""
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None and s3fs.S3FileSystem.retries == 5:  # s3fs's default: not the user's
        s3fs.S3FileSystem.retries = 1


fsspec.config.conf.setdefault("s3", {}).setdefault(
    "config_kwargs", {"retries": {"max_attempts": 1, "mode": "standard"}}
)


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if isinstance(status, int) else None
    status = getattr(error, "status", None) or getattr(error, "code", None)
    return status if isinstance(status, int) and 100 <= status < 600 else None


def classify(error: BaseException) -> ErrorKind:
    """Whether an error from a store may pass if the operation is tried again."""
    kind: ErrorKind = "permanent"
    for e in _chain(error):
        text = f"{type(e).__name__}: {e}"
        status = _status(e)
        if status in (429, 503) or any(code in text for code in _THROTTLED_CODES):
            return "throttled"
        if (
            isinstance(e, ConnectionError | TimeoutError)
            or type(e).__name__ in _TRANSIENT_TYPES
            or (status is not None and status >= 500)
            or any(code in text for code in _TRANSIENT_CODES)
        ):
            kind = "transient"
    return kind


def _message(error: BaseException) -> str:
    """The store's own words: the innermost message that says something."""
    for e in _chain(error):
        text = str(e).strip()
        if text:
            return f"{type(e).__name__}: {text}"
    return type(error).__name__


def retrying(
    what: str,
    operation: Callable[[], T],
    *,
    policy: RetryPolicy = DEFAULT_POLICY,
    passthrough: tuple[type[Exception], ...] = (),
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run a blocking store operation, retrying throttled and transient errors.

    `passthrough`: the caller's own errors, raised from `operation` as they are.
    Runs in a thread (callers use asyncio.to_thread), hence a blocking sleep."""
    answers: tuple[type[Exception], ...] = (FileNotFoundError, FileExistsError, *passthrough)
    retry = 0
    while True:
        _one_retry_layer()
        try:
            return operation()
        except answers:
            raise
        except Exception as e:
            kind = classify(e)
            if kind == "permanent" or retry + 1 >= policy.attempts:
                STORE_FAILURES.labels(kind).inc()
                if isinstance(e, StoreError):
                    raise
                raise StoreError(what, kind, e) from e
            delay = policy.delay(kind, retry)
            STORE_RETRIES.labels(kind).inc()
            log.warning("%s: %s (%s); retry %d in %.2fs", what, _message(e), kind, retry + 1, delay)
            retry += 1
            sleep(delay)


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")
