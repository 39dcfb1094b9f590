"""The worker's Prometheus metrics (its stage processes report through the router)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ROWS = Counter("ebb_worker_rows_total", "Rows written by this worker (error rows included)")
ERROR_ROWS = Counter("ebb_worker_error_rows_total", "Rows written with an error")
SHARDS = Counter("ebb_worker_shards_total", "Shard attempts by outcome", ["result"])
ROWS_KEPT = Counter(
    "ebb_worker_rows_kept_by_splits_total",
    "Rows committed as parts of shards that had to stop, by cause (drain, straggler)",
    ["cause"],
)
SHARD_SECONDS = Histogram(
    "ebb_worker_shard_seconds",
    "Time from lease to commit of a shard",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
)
RENEWALS = Counter("ebb_worker_lease_renewals_total", "Lease renewals this worker sent")
LEASES_HELD = Gauge("ebb_worker_leases_held", "Shards this worker holds now")
QUEUE_DEPTH = Gauge("ebb_stage_queue_depth", "Items waiting for or inside a stage", ["stage"])
BATCH_SIZE = Histogram(
    "ebb_stage_batch_size",
    "Items per batch a stage ran",
    ["stage"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)
STAGE_RESTARTS = Counter(
    "ebb_stage_restarts_total", "Stage processes replaced", ["stage", "reason"]
)
STAGE_WORKERS = Gauge("ebb_stage_workers", "Processes running a stage", ["stage"])
STAGE_UTILIZATION = Gauge(
    "ebb_stage_utilization", "Busy fraction of a stage's processes (elastic stages)", ["stage"]
)
DEVICE_UTILIZATION = Gauge(
    "ebb_device_utilization",
    "Busy fraction of a device the pipeline uses (cpu: the machine's; cuda:N: NVML's)",
    ["device"],
)
LLM_PROMPT_TOKENS = Counter(
    "ebb_llm_prompt_tokens_total", "Prompt tokens of the rows an llm stage generated", ["stage"]
)
LLM_OUTPUT_TOKENS = Counter(
    "ebb_llm_output_tokens_total", "Tokens an llm stage generated", ["stage"]
)
LLM_IN_FLIGHT = Gauge(
    "ebb_llm_requests_in_flight", "Rows an llm stage's engines run now", ["stage"]
)
LLM_HELD_TOKENS = Gauge(
    "ebb_llm_held_tokens",
    "Prompt tokens plus max_tokens of the rows in flight: what their KV cache may grow to",
    ["stage"],
)
LLM_ENGINE_RESTARTS = Counter(
    "ebb_llm_engine_restarts_total", "Engines made again in place after they failed", ["stage"]
)
