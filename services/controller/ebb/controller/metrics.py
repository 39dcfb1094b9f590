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
HARVESTED = Gauge("ebb_harvested_cpu_cores", "CPU cores of lent mixed nodes (tidal state offline)")
BATCH_EVICTIONS = Counter(
    "ebb_batch_evictions_total",
    "Batch worker pods the tide drained (their node reclaimed, or over the batch budget)",
)
TIDAL_FORECAST = Gauge(
    "ebb_tidal_forecast_cpu_cores",
    "Online demand on the mixed pool the tide expects lead_s ahead (forecast policy)",
)
TIDAL_BUDGET = Gauge(
    "ebb_tidal_budget_cpu_cores",
    "CPU cores batch pods may take on the mixed pool (forecast policy)",
)
IDLE_CAPACITY = Gauge(
    "ebb_idle_capacity",
    "Capacity free for batch workers, per pool and resource",
    ["pool", "resource"],
)
