"""The controller's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

WORKERS_DESIRED = Gauge(
    "ebb_workers_desired",
    "Workers the controller wants for a job, per tier (tier empty: a job without tiers)",
    ["job_id", "tier"],
)
WORKERS_ACTUAL = Gauge(
    "ebb_workers_actual",
    "Workers running for a job, per tier (tier empty: a job without tiers)",
    ["job_id", "tier"],
)
WORKER_FAILURES = Counter(
    "ebb_worker_failures_total", "Workers that ended in failure", ["job_id", "reason"]
)
RECONCILES = Counter("ebb_reconciles_total", "Reconcile passes", ["result"])
KUBE_ERRORS = Counter(
    "ebb_kube_api_errors_total",
    "Kubernetes API errors and interrupted watches",
    ["informer", "error"],
)
NODE_STATES = Gauge("ebb_tidal_nodes", "Mixed-pool nodes per tidal state", ["state"])
LENT = Gauge(
    "ebb_tidal_lent",
    "Allocatable of lent mixed nodes (tidal state offline), per resource",
    ["resource"],
)
HARVESTED_NODES = Gauge(
    "ebb_tidal_harvested_nodes",
    "What batch pods hold on the mixed pool, per resource, in nodes (each pod's request over "
    "its node's allocatable: one GPU of an 8-GPU node is 0.125)",
    ["resource"],
)
HARVESTED_NODE_HOURS = Counter(
    "ebb_tidal_harvested_node_hours_total",
    "Node-hours batch pods harvested on the mixed pool, per resource (GPU node-hours for "
    "nvidia.com/gpu)",
    ["resource"],
)
BATCH_EVICTIONS = Counter(
    "ebb_batch_evictions_total",
    "Batch worker pods the tide drained (their node reclaimed, or over the batch budget)",
)
TIDAL_FORECAST = Gauge(
    "ebb_tidal_forecast",
    "Online demand on the mixed pool the tide expects lead_s ahead, per resource (forecast "
    "policy; cores, bytes, GPUs)",
    ["resource"],
)
TIDAL_BUDGET = Gauge(
    "ebb_tidal_budget",
    "What batch pods may take on the mixed pool, per resource (forecast policy)",
    ["resource"],
)
IDLE_CAPACITY = Gauge(
    "ebb_idle_capacity",
    "Capacity free for batch workers, per pool and resource",
    ["pool", "resource"],
)
