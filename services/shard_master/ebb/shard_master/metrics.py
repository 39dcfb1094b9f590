"""The shard master's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

OPS = Counter("ebb_master_ops_total", "Lease-protocol requests served", ["op", "result"])
OP_SECONDS = Histogram(
    "ebb_master_op_seconds",
    "Time to serve a lease-protocol request, persistence included",
    ["op"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
LEASE_EXPIRIES = Counter("ebb_lease_expiries_total", "Leases that expired unrenewed", ["job_id"])
LEASE_RENEWALS = Counter("ebb_lease_renewals_total", "Leases renewed", ["job_id"])
RETRIES = Counter("ebb_shard_retries_total", "Shards sent back to the queue", ["job_id", "reason"])
ATTEMPTS_FORGIVEN = Counter(
    "ebb_attempts_forgiven_total",
    "Attempts lost with a worker the cluster took, not counted against max_attempts",
    ["job_id"],
)
SHARDS = Gauge("ebb_shards", "Shards per state", ["job_id", "state"])
SHARDS_DONE = Counter("ebb_shards_done_total", "Shards committed", ["job_id"])
ROWS_DONE = Counter("ebb_rows_done_total", "Rows committed (error rows included)", ["job_id"])
ERROR_ROWS = Counter("ebb_error_rows_total", "Rows committed with an error", ["job_id"])
TIER_SHARDS = Gauge(
    "ebb_tier_shards",
    "Shards per state of each tier of a job in tiers (a later tier's TODO: its backlog)",
    ["job_id", "tier", "state"],
)
TIER_ROWS = Counter(
    "ebb_tier_rows_done_total",
    "Rows each tier of a job in tiers committed: hand-offs, then the last tier's output",
    ["job_id", "tier"],
)
SPLITS = Counter(
    "ebb_shard_splits_total",
    "Shards split: a part committed by an attempt that stopped, the rest queued first",
    ["job_id"],
)
SPLIT_REQUESTS = Counter(
    "ebb_split_requests_total",
    "Holders of long-running shards asked to split them for idle workers (the liquid tail)",
    ["job_id"],
)
JOBS = Gauge("ebb_jobs", "Jobs per state, as this master knows them", ["state"])
SETUP_FAILURES = Counter(
    "ebb_master_setup_failures",
    "Failed attempts to set up on NATS (stream, buckets, leader key, state), retried",
)
INVALID_MESSAGES = Counter(
    "ebb_invalid_messages_total", "Messages refused by validation", ["source"]
)
