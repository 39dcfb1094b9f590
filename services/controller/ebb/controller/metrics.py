"""The controller's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

WORKERS_DESIRED = Gauge("ebb_workers_desired", "Workers the controller wants for a job", ["job"])
WORKERS_ACTUAL = Gauge("ebb_workers_actual", "Workers running for a job", ["job"])
WORKER_FAILURES = Counter(
    "ebb_worker_failures_total", "Workers that ended in failure", ["job", "reason"]
)
RECONCILES = Counter("ebb_reconciles_total", "Reconcile passes", ["result"])
