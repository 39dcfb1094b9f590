"""A write to KV that lands but whose answer is lost: the master must not carry on from memory.

Tier-1 shard A's DONE (naming its hand-off N) lands, its answer is lost. A master that went on
serving from memory would still see A DOING, and B's DONE would name N too: A's rows lost, N's
listed twice in the manifest. Here the master steps down (StateUnsure), a new one loads KV, and
every row is in the output once. The same for a split's remainder. (The lease table on the
in-memory store; test_master.py has the same over a real nats-server and its failpoint.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from ebb.common.data.output import OutputStore
from ebb.common.messaging.messages import ShardSpec
from ebb.shard_master.errors import Deposed, StateUnsure, TableCorrupt
from ebb.shard_master.table.finish import in_input_order
from ebb.shard_master.table.records import ShardRecord, shard_key
from ebb.shard_master.table.transitions import handoff_record, missing_successors

from .test_lease_table import Clock, MemoryStore, assert_indexes_match_records, new_table
from .test_master_tiers import commit, lease, tiered_job
from .test_splits import commit_part, finish_all, running_job


def naming(what: str) -> Callable[[ShardRecord], bool]:
    """A record the store loses the answer to: a DONE naming a hand-off, or a split part."""

    def says(record: ShardRecord) -> bool:
        if record.state != "DONE":
            return False
        return record.handoff is not None if what == "handoff" else record.remainder is not None

    return says


async def test_a_done_whose_answer_is_lost_hands_its_rows_on_once(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = tiered_job(tmp_path, shards=2)
    assert await table.intake.submit(spec)
    a = await lease(table, spec, "p1", "prep")
    b = await lease(table, spec, "p2", "prep")
    commit(spec, a, tier="prep")
    commit(spec, b, tier="prep")

    store.lose_answer = naming("handoff")
    with pytest.raises(StateUnsure):
        await table.commit(a.token)
    # A's DONE is in KV, naming its hand-off; this master must serve nothing more from
    # memory. (Before, it answered UNAVAILABLE and went on: B's DONE took A's hand-off index.)
    stored_a = store.shards[shard_key(spec.id, 0)][0]
    assert stored_a.state == "DONE" and stored_a.handoff == 2
    # Until its agents are stopped, requests still reach the master that steps down: each
    # write is refused. (Before, B's DONE was written naming index 2, A's hand-off.)
    with pytest.raises(Deposed, match="stepping down"):
        await table.commit(b.token)
    assert store.shards[shard_key(spec.id, 1)][0].state == "DOING"

    # A new master (this one campaigns again) loads KV, which creates A's hand-off.
    table = new_table(store, Clock())
    await table.load()
    job = table.jobs[spec.id]
    assert job.shards[2].record.handed_from == 0
    assert (await table.commit(a.token)).status == "already_done"  # the worker's retry
    assert (await table.commit(b.token)).status == "done"
    assert job.shards[1].record.handoff == 3 and job.shards[3].record.handed_from == 1
    assert_indexes_match_records(job, store)

    while (reply := await lease(table, spec, "i1", "infer")).status == "granted":
        commit(spec, reply, tier="infer")
        await table.commit(reply.token)
    assert job.record.state == "SUCCEEDED" and job.record.rows_done == 200
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None
    assert Counter(f.path for f in manifest.files).most_common(1)[0][1] == 1
    assert sorted(f.shard for f in manifest.files) == [2, 3] and manifest.rows == 200


async def test_a_split_whose_answer_is_lost_keeps_its_rest_once(tmp_path: Path) -> None:
    store, _clock, table, spec, _job = await running_job(tmp_path, shards=2)
    a = await table.lease(spec.id, "w1")
    b = await table.lease(spec.id, "w2")
    commit_part(spec, a, rows=40, split_at=40)
    commit_part(spec, b, rows=30, split_at=30)

    store.lose_answer = naming("split")
    with pytest.raises(StateUnsure):
        await table.commit(a.token)
    with pytest.raises(Deposed, match="stepping down"):
        await table.commit(b.token)
    table = new_table(store, Clock())
    await table.load()
    job = table.jobs[spec.id]
    assert job.shards[2].record.split_from == 0  # A's rest, created on load
    assert (await table.commit(b.token)).status == "done"
    assert job.shards[1].record.remainder is not None
    assert job.shards[1].record.remainder.index == 3 and job.shards[3].record.split_from == 1
    assert_indexes_match_records(job, store)
    assert sorted(await finish_all(table, spec)) == [2, 3]
    assert job.record.state == "SUCCEEDED" and job.record.rows_done == 200
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None
    assert [f.shard for f in manifest.files] == [0, 2, 1, 3]


async def test_indexes_come_from_a_counter_past_every_index_a_record_names(
    tmp_path: Path,
) -> None:
    """A successor a DONE names but whose record is not there yet holds its index all the
    same: the next split takes the one after."""
    store, _clock, table, spec, _job = await running_job(tmp_path, shards=2)
    a = await table.lease(spec.id, "w1")
    commit_part(spec, a, rows=40, split_at=40)

    async def no_answer(record: ShardRecord) -> int | None:
        raise StateUnsure("no answer came")

    create = store.create_shard
    store.create_shard = no_answer  # type: ignore[method-assign]
    with pytest.raises(StateUnsure):
        await table.commit(a.token)
    store.create_shard = create  # type: ignore[method-assign]
    table = new_table(store, Clock())
    records = [r for r, _ in await store.load_shards(spec.id)]
    assert max(r.spec.index for r in records) == 1  # the rest (2) exists only as a name
    await table.load()
    assert table.jobs[spec.id].next_index == 3


def test_a_successor_made_for_another_shard_is_refused_not_adopted() -> None:
    """What a master of the version before could leave: two DONEs naming one index. Loading
    it says so (the job fails with the reason) rather than lose one's rows."""

    def done(index: int, *, handoff: int) -> ShardRecord:
        spec = ShardSpec(index=index, path="x.parquet", format="parquet", rows=10, row_groups=[0])
        return ShardRecord(job="j", spec=spec, state="DONE", handoff=handoff, done_attempt=1)

    a, b = done(0, handoff=2), done(1, handoff=2)
    made_for_b = handoff_record("j", b, root="/out/_tiers/prep", seq=5)
    with pytest.raises(TableCorrupt, match="names shard 2 as its successor"):
        missing_successors([a, b, made_for_b], ["/out/_tiers/prep", "/out"])


async def test_a_corrupt_job_fails_on_load_and_the_master_serves_the_others(
    tmp_path: Path,
) -> None:
    store, _clock, table, spec, job = await running_job(tmp_path / "one", shards=2)
    other = await running_job(tmp_path / "two", shards=1)
    a = await table.lease(spec.id, "w1")
    commit_part(spec, a, rows=40, split_at=40)
    await table.commit(a.token)
    # Shard 1 made to name shard 2 (A's rest) as its own: an older master's lost answer.
    record, revision = store.shards[shard_key(spec.id, 1)]
    assert job.shards[0].record.remainder is not None
    store.shards[shard_key(spec.id, 1)] = (
        replace(record, state="DONE", remainder=job.shards[0].record.remainder, split_at=5),
        revision,
    )
    store.jobs.update(other[0].jobs)
    store.shards.update(other[0].shards)

    table = new_table(store, Clock())
    await table.load()
    assert table.jobs[spec.id].record.state == "FAILED"
    assert "names shard 2 as its successor" in table.jobs[spec.id].record.reason
    other_spec = other[3]
    assert table.jobs[other_spec.id].record.state == "RUNNING"
    assert [s.index for s in in_input_order(table.jobs[other_spec.id])] == [0]
