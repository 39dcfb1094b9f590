"""The gateway's Prometheus metrics."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable
from typing import get_args

from prometheus_client import Counter, Gauge, Histogram

from .records import ENDED, BatchStatus

HTTP_REQUESTS = Counter(
    "ebb_gateway_http_requests_total",
    "Batch API requests answered, by route and HTTP status",
    ["route", "status"],
)
HTTP_SECONDS = Histogram(
    "ebb_gateway_http_seconds",
    "Time to answer a Batch API request (an upload: until it is stored)",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
UPLOADED_BYTES = Counter("ebb_gateway_uploaded_bytes_total", "Bytes of files uploaded")
BATCHES = Gauge(
    "ebb_gateway_batches", "Batches not ended per status, as their last steps read them", ["status"]
)
BATCH_REQUESTS = Counter(
    "ebb_gateway_batch_requests_total",
    "Requests of batches: accepted at validation, then completed or failed when it ended; "
    "by API (openai: /v1/batches, anthropic: /v1/messages/batches)",
    ["api", "outcome"],
)


def api_of(endpoint: str) -> str:
    """Whose Batch API a batch of `endpoint` came through."""
    return "anthropic" if endpoint == "/v1/messages" else "openai"


STATUSES: tuple[BatchStatus, ...] = tuple(s for s in get_args(BatchStatus) if s not in ENDED)


def observe_batches(statuses: Iterable[str]) -> None:
    counts = Tally(statuses)
    for status in STATUSES:
        BATCHES.labels(status).set(counts.get(status, 0))
