"""A job's metrics: the partials of its DONE shards merged, each shard's as its winning attempt
committed it, so that a row retried, speculated, split off or resumed counts once."""

from __future__ import annotations

import logging
from typing import Any

from ebb.common import accumulators

from .jobs import Job

log = logging.getLogger(__name__)


def merged_partials(job: Job) -> dict[str, accumulators.Partial]:
    """The job's metrics' partials over the rows of its DONE shards."""
    specs = job.spec.pipeline.all_metrics()
    merged: dict[str, accumulators.Partial] = {}
    if not specs:
        return merged
    for shard in job.shards:
        record = shard.record
        if record.state != "DONE" or not record.metrics:
            continue
        try:
            merged = accumulators.merge_named(specs, merged, record.metrics)
        except ValueError as e:
            # A commit record written by another version, or damaged: the metrics leave its
            # rows out, and say so in the log rather than failing the job's status.
            log.warning("job %s: shard %d's metrics left out: %s", job.id, shard.index, e)
    return merged


def results(job: Job) -> dict[str, Any]:
    """The job's metrics' values over the rows of its DONE shards (empty: it has none)."""
    specs = job.spec.pipeline.all_metrics()
    return accumulators.results_named(specs, merged_partials(job)) if specs else {}
