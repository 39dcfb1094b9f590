"""A job's metrics: the partials of its DONE shards, merged as each became DONE (`Job.metrics`),
each shard's as its winning attempt committed it, so that a row retried, speculated, split off
or resumed counts once."""

from __future__ import annotations

from typing import Any

from ebb.common.job import accumulators

from .jobs import Job


def results(job: Job) -> dict[str, Any]:
    """The job's metrics' values over the rows of its DONE shards (empty: it has none)."""
    if not job.metric_specs:
        return {}
    return accumulators.results_named(job.metric_specs, job.metrics)
