"""The master's side of metrics counted once (the lease table on an in-memory store, as
test_lease_table.py): each DONE shard's partials, as its winning attempt committed them, are
merged into the job's once; they survive a restart in KV, not in memory; `_metrics.json` and
the job's record hold the values when it ends. End to end: test_job_metrics.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ebb.common.data.layout import METRICS
from ebb.common.job import JobSpec, accumulators, parse_job
from ebb.common.messaging.messages import LeaseReply
from ebb.shard_master.table.records import shard_key

from ..helpers import job_spec, write_dataset
from .test_lease_table import Clock, MemoryStore, assert_indexes_match_records, new_table
from .test_splits import commit_part

METRICS_SPEC = {
    "rows": {"kind": "count"},
    "mean_p": {"kind": "mean", "column": "p"},
    "auc": {"kind": "auc", "label": "y", "score": "p"},
}


def metrics_job(tmp_path: Path, shards: int = 3) -> JobSpec:
    write_dataset(tmp_path / "data", rows=100 * shards, row_group_size=100)
    stages = [{"name": "score", "modelet": "ebbtest_modelets:Labelled", "metrics": METRICS_SPEC}]
    return parse_job(job_spec(tmp_path, rows_per_shard=100, stages=stages)).with_id()


def shard_rows(index: int) -> dict[str, Any]:
    """The columns a shard's rows would have had: the partials follow from them."""
    rng = np.random.default_rng(index)
    return {"p": rng.random(100), "y": rng.integers(0, 2, 100)}


def commit_with_metrics(spec: JobSpec, reply: LeaseReply) -> None:
    """Write a shard's file and a commit record with the partials of its rows."""
    assert reply.shard is not None
    specs = spec.pipeline.all_metrics()
    values = accumulators.row_values_named(specs, shard_rows(reply.shard.index))
    partials = accumulators.reduce_named(specs, values)
    commit_part(spec, reply, rows=100, metrics=partials)


def expected_results(spec: JobSpec, indexes: list[int]) -> dict[str, Any]:
    specs = spec.pipeline.all_metrics()
    rows = [shard_rows(i) for i in indexes]
    columns = {k: np.concatenate([r[k] for r in rows]) for k in ("p", "y")}
    values = accumulators.row_values_named(specs, columns)
    return accumulators.results_named(specs, accumulators.reduce_named(specs, values))


async def test_the_winners_partials_merge_once_and_survive_a_restart(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = metrics_job(tmp_path)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]

    first = await table.lease(spec.id, "w1")
    commit_with_metrics(spec, first)
    await table.commit(first.token)
    # A second commit of the same attempt (a retried reply) changes nothing.
    await table.commit(first.token)
    assert accumulators.results_named(job.metric_specs, job.metrics) == expected_results(spec, [0])
    # Kept in KV, let go of in memory.
    stored, _ = store.shards[shard_key(spec.id, 0)]
    assert stored.metrics and not job.shards[0].record.metrics
    assert_indexes_match_records(job, store)

    restarted = new_table(store, Clock())
    await restarted.load()
    again = restarted.jobs[spec.id]
    assert again.metrics == job.metrics
    while (reply := await restarted.lease(spec.id, "w2")).status == "granted":
        commit_with_metrics(spec, reply)
        await restarted.commit(reply.token)
    assert again.record.state == "SUCCEEDED"
    expected = expected_results(spec, [0, 1, 2])
    assert again.record.metrics == expected
    written = json.loads((Path(spec.output.uri) / METRICS).read_text())
    assert written["metrics"] == expected and written["job"] == spec.id
    assert written["specs"]["auc"]["kind"] == "auc"
    assert expected["rows"] == 300
