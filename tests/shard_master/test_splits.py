"""Splitting a shard: a part committed by an attempt that had to stop, the rest a shard of its
own, in one durable transition (the lease table on an in-memory store, as test_lease_table.py).

What a worker does on a drain is tested end to end in test_drain_split.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ebb.common.data.layout import OutputFile, attempt_dir
from ebb.common.data.output import OutputStore, new_commit
from ebb.common.job import JobSpec, parse_job
from ebb.common.messaging.messages import LeaseReply, ShardSpec, StatusRequest
from ebb.shard_master.errors import StateUnsure
from ebb.shard_master.table.finish import in_input_order
from ebb.shard_master.table.jobs import Job
from ebb.shard_master.table.lease_table import LeaseTable
from ebb.shard_master.table.records import ShardRecord
from ebb.shard_master.table.tail import KEEP_REST_S, RENEW_SOON_S
from ebb.shard_master.table.transitions import missing_remainders, split_part

from ..helpers import job_spec, write_dataset, write_model
from .test_lease_table import (
    Clock,
    MemoryStore,
    assert_indexes_match_records,
    make_job,
    new_table,
)


async def running_job(
    tmp_path: Path, **options: Any
) -> tuple[MemoryStore, Clock, LeaseTable, JobSpec, Job]:
    """A job (`make_job(tmp_path, **options)`) submitted to a table on an in-memory store,
    with the store, the clock the test moves, the table, the spec and the job."""
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, **options)
    assert await table.intake.submit(spec)
    return store, clock, table, spec, table.jobs[spec.id]


async def one_group_job(
    tmp_path: Path, *, lease_s: float
) -> tuple[Clock, LeaseTable, JobSpec, Job]:
    """A job over one Parquet file of one row group of 100,000 rows (one shard that may be
    cut in halves), submitted to a table on an in-memory store."""
    write_dataset(tmp_path / "data", rows=100_000, row_group_size=100_000)
    write_model(tmp_path / "model.onnx")
    spec = parse_job(job_spec(tmp_path, rows_per_shard=100_000, fault={"lease_s": lease_s}))
    spec = spec.with_id()
    clock = Clock()
    table = new_table(MemoryStore(), clock)
    assert await table.intake.submit(spec)
    return clock, table, spec, table.jobs[spec.id]


def commit_part(
    spec: JobSpec,
    reply: LeaseReply,
    *,
    rows: int,
    split_at: int = 0,
    metrics: dict[str, Any] | None = None,
    worker: str = "w",
) -> None:
    """What a worker does before `commit`: its file, then its commit record (of a part of
    `split_at` rows, or of the whole shard; with the partials of its metrics)."""
    assert reply.shard is not None
    store = OutputStore(spec.output.uri)
    path = f"{attempt_dir(reply.shard.index, reply.attempt)}/part-00000.parquet"
    store.write_file(path, b"data")
    won, _ = store.create_commit(
        new_commit(
            job=spec.id,
            shard=reply.shard.index,
            attempt=reply.attempt,
            files=[OutputFile(path=path, rows=rows)],
            worker=worker,
            split_at=split_at,
            metrics=metrics,
        )
    )
    assert won


async def finish_all(table: LeaseTable, spec: JobSpec, *, worker: str = "w9") -> list[int]:
    """Lease and commit whole every shard left, in queue order, as `worker`; the indexes
    leased."""
    leased: list[int] = []
    while (reply := await table.lease(spec.id, worker)).status == "granted":
        assert reply.shard is not None
        leased.append(reply.shard.index)
        commit_part(spec, reply, rows=reply.shard.rows, worker=worker)
        await table.commit(reply.token)
    return leased


async def test_a_part_s_commit_splits_the_shard_and_the_rest_is_leased_next(
    tmp_path: Path,
) -> None:
    store, _clock, table, spec, job = await running_job(tmp_path, shards=3)
    first = await table.lease(spec.id, "w1")
    assert first.shard is not None and first.shard.index == 0

    commit_part(spec, first, rows=40, split_at=40)
    assert (await table.commit(first.token)).status == "done"

    part = job.shards[0].record
    assert (part.state, part.rows, part.split_at) == ("DONE", 40, 40)
    assert part.remainder is not None and part.remainder.index == 3
    rest = job.shards[3].record
    assert (rest.state, rest.split_from) == ("TODO", 0)
    assert (rest.spec.rows, rest.spec.row_offset, rest.spec.row_groups) == (60, 40, [0])
    assert job.shards_total == 4 and not job.settled
    assert_indexes_match_records(job, store)
    told = table.status(StatusRequest(job=spec.id)).jobs[0]
    assert (told.shards_total, told.shards_split) == (4, 1)  # as it happens, not at the end

    assert await finish_all(table, spec) == [3, 1, 2], "the rest first, then the queue"
    assert job.record.state == "SUCCEEDED"
    assert (job.record.shards_total, job.record.rows_done) == (4, 300)
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None
    assert [f.shard for f in manifest.files] == [0, 3, 1, 2], "in the input's order"
    assert manifest.rows == 300 and manifest.shards == 4


async def test_a_part_committed_before_the_master_heard_is_adopted_when_its_lease_expires(
    tmp_path: Path,
) -> None:
    store, clock, table, spec, job = await running_job(tmp_path, shards=2, lease_s=30)
    lost = await table.lease(spec.id, "w1")
    commit_part(spec, lost, rows=25, split_at=25)  # and the worker dies before `commit`
    clock.now += 31
    assert await table.reaper.expire_due() == 1
    assert job.shards[0].record.state == "DONE" and job.shards[0].record.split_at == 25
    assert job.shards[2].record.spec.row_offset == 25
    assert job.shards[0].record.failures == 0
    assert_indexes_match_records(job, store)
    assert await finish_all(table, spec) == [2, 1]
    assert job.record.rows_done == 200


async def test_a_master_that_dies_between_the_part_and_the_rest_creates_the_rest_on_load(
    tmp_path: Path,
) -> None:
    store, _clock, table, spec, job = await running_job(tmp_path, shards=2)
    reply = await table.lease(spec.id, "w1")
    commit_part(spec, reply, rows=70, split_at=70)

    create = store.create_shard

    async def unreachable(record: ShardRecord) -> int | None:
        raise StateUnsure("no answer came")

    store.create_shard = unreachable  # type: ignore[method-assign]
    with pytest.raises(StateUnsure, match="its remainder 2 could not be written"):
        await table.commit(reply.token)
    store.create_shard = create  # type: ignore[method-assign]
    assert store.shards[f"{spec.id}.0000000"][0].remainder is not None
    assert f"{spec.id}.0000002" not in store.shards

    restarted = new_table(store, Clock())
    await restarted.load()
    job = restarted.jobs[spec.id]
    assert [s.record.state for s in job.shards] == ["DONE", "TODO", "TODO"]
    assert job.shards[2].record.split_from == 0
    assert_indexes_match_records(job, store)
    assert await finish_all(restarted, spec) == [2, 1]
    assert job.record.rows_done == 200
    # A second load finds the rest there already: nothing created twice.
    again = new_table(store, Clock())
    await again.load()
    assert len(store.shards) == 3


async def test_splits_at_once_take_distinct_indexes(tmp_path: Path) -> None:
    store, _clock, table, spec, job = await running_job(tmp_path, shards=3)
    replies = [await table.lease(spec.id, f"w{i}") for i in range(3)]
    for reply in replies:
        commit_part(spec, reply, rows=10, split_at=10)
    await asyncio.gather(*(table.commit(r.token) for r in replies))
    rests = sorted(s.record.spec.index for s in job.shards if s.record.split_from is not None)
    assert rests == [3, 4, 5]
    assert_indexes_match_records(job, store)
    assert sorted(await finish_all(table, spec)) == [3, 4, 5]
    assert job.record.rows_done == 300


async def test_a_split_shard_s_parts_stay_done_when_its_job_is_resumed(tmp_path: Path) -> None:
    store, _clock, table, spec, job = await running_job(tmp_path, shards=2)
    reply = await table.lease(spec.id, "w1")
    commit_part(spec, reply, rows=30, split_at=30)
    await table.commit(reply.token)
    await table.lifecycle.cancel(spec.id, "a user's wish")
    assert job.record.shards_total == 3

    resumed = await table.lifecycle.resume(spec.id)
    assert (resumed.shards_done, resumed.shards_todo) == (1, 2)
    assert_indexes_match_records(job, store)
    assert sorted(await finish_all(table, spec)) == [1, 2]
    assert job.record.state == "SUCCEEDED" and job.record.rows_done == 200


def _record(index: int, *, seq: int, rest: int | None = None) -> ShardRecord:
    spec = ShardSpec(index=index, path="x.parquet", format="parquet", rows=100, row_groups=[0])
    record = ShardRecord(job="j", spec=spec, seq=seq)
    if rest is None:
        return record
    return split_part(record, 10, index=rest)


def test_missing_remainders_are_the_splits_whose_rest_has_no_record_first_in_the_queue() -> None:
    records = [_record(0, seq=0, rest=3), _record(1, seq=-1, rest=4), _record(2, seq=2)]
    missing = missing_remainders(records)
    assert [(r.spec.index, r.split_from, r.seq, r.state) for r in missing] == [
        (3, 0, -3, "TODO"),
        (4, 1, -2, "TODO"),
    ]
    assert missing[0].spec.row_offset == 10 and missing[0].spec.rows == 90
    present = [*records, *missing]
    assert missing_remainders(present) == []


def test_a_parquet_part_that_covers_every_row_is_the_whole_shard() -> None:
    whole = split_part(_record(0, seq=0), 100, index=1)
    assert whole.split_at == 0 and whole.remainder is None


async def test_the_input_order_puts_each_shard_s_parts_after_it(tmp_path: Path) -> None:
    _store, _clock, table, spec, job = await running_job(tmp_path, shards=2)
    first = await table.lease(spec.id, "w1")
    commit_part(spec, first, rows=10, split_at=10)
    await table.commit(first.token)
    again = await table.lease(spec.id, "w2")  # the rest of shard 0: shard 2
    commit_part(spec, again, rows=20, split_at=20)
    await table.commit(again.token)
    assert [s.index for s in in_input_order(job)] == [0, 2, 3, 1]
    assert job.shards[3].record.spec.row_offset == 30


async def test_at_the_tail_the_holder_with_most_left_is_asked_to_split_for_an_idle_worker(
    tmp_path: Path,
) -> None:
    store, clock, table, spec, job = await running_job(tmp_path, shards=3, lease_s=30)
    slow = await table.lease(spec.id, "slow")
    slower = await table.lease(spec.id, "slower")
    idle = await table.lease(spec.id, "idle")
    clock.now += 10
    commit_part(spec, idle, rows=100)
    await table.commit(idle.token)
    assert not (await table.renew(slow.token, rows_done=50)).split  # 10 s more to go
    assert not (await table.renew(slower.token, rows_done=10)).split  # 90 s more to go

    assert (await table.lease(spec.id, "idle")).status == "wait"
    assert job.shards[1].split_asked == {slower.token} and not job.shards[0].split_asked
    assert (await table.lease(spec.id, "idle")).status == "wait"  # one ask per idle worker
    assert not job.shards[0].split_asked
    assert (await table.renew(slower.token, rows_done=12)).split
    assert not (await table.renew(slow.token, rows_done=60)).split

    commit_part(spec, slower, rows=12, split_at=12)
    await table.commit(slower.token)
    # The straggler, free first, is not given its own rest back: it is kept for "idle".
    assert (await table.lease(spec.id, "slower")).status == "wait"
    rest = await table.lease(spec.id, "idle")
    assert rest.shard is not None and (rest.shard.index, rest.shard.row_offset) == (3, 12)
    assert not rest.speculative
    assert_indexes_match_records(job, store)


async def test_a_rest_kept_for_a_worker_that_never_comes_goes_to_another_after_a_while(
    tmp_path: Path,
) -> None:
    store, clock, table, spec, job = await running_job(tmp_path, shards=2, lease_s=30)
    straggler = await table.lease(spec.id, "straggler")
    idle = await table.lease(spec.id, "idle")
    clock.now += 10
    commit_part(spec, idle, rows=100)
    await table.commit(idle.token)
    await table.renew(straggler.token, rows_done=5)
    assert (await table.lease(spec.id, "idle")).status == "wait"  # the split is asked
    commit_part(spec, straggler, rows=6, split_at=6)
    await table.commit(straggler.token)
    assert (await table.lease(spec.id, "straggler")).status == "wait"
    clock.now += KEEP_REST_S
    rest = await table.lease(spec.id, "straggler")  # "idle" went away: no row waits forever
    assert rest.shard is not None and rest.shard.index == 2
    assert_indexes_match_records(job, store)


async def test_no_split_is_asked_of_a_holder_that_tells_no_progress_or_when_turned_off(
    tmp_path: Path,
) -> None:
    for split_tail in (True, False):
        _store, clock, table, spec, job = await running_job(
            tmp_path / str(split_tail), shards=2, lease_s=30, split_tail=split_tail
        )
        held = await table.lease(spec.id, "w1")
        done = await table.lease(spec.id, "w2")
        clock.now += 2
        commit_part(spec, done, rows=100)
        await table.commit(done.token)
        clock.now += 10
        await table.renew(held.token, rows_done=0 if split_tail else 5)
        reply = await table.lease(spec.id, "w2")
        # No split: speculation takes the shard that has run 6x the usual time instead.
        assert reply.speculative and not job.shards[0].split_asked


async def test_a_worker_with_nothing_to_do_at_the_tail_asks_again_less_often(
    tmp_path: Path,
) -> None:
    _store, clock, table, spec, _job = await running_job(
        tmp_path, shards=1, lease_s=60, speculative=False
    )
    busy = await table.lease(spec.id, "busy")
    # Its holder has told no rows yet: a split for this worker may be chosen once it does.
    assert (await table.lease(spec.id, "idle")).retry_after_s == 1.0
    await table.renew(busy.token, rows_done=1)
    clock.now += 1.0  # the next look for a split is due: it finds none worth it
    idle = await table.lease(spec.id, "idle")
    assert idle.status == "wait" and idle.retry_after_s == 5.0  # a tenth of a lease, at most 5 s
    short = make_job(tmp_path / "short", shards=1, lease_s=6, speculative=False)
    assert await table.intake.submit(short)
    busy = await table.lease(short.id, "busy")
    await table.renew(busy.token, rows_done=1)
    clock.now += 1.0
    assert (await table.lease(short.id, "idle")).retry_after_s == 1.0  # never below wait_retry_s


async def test_an_idle_worker_asking_before_the_next_look_for_a_split_asks_again_soon(
    tmp_path: Path,
) -> None:
    """A worker's retry is jittered: it may come back a little before the master looks for a
    split again (a second after the last look). It is told to ask again soon, not after the
    tail's long wait, and the split is asked for it at its next ask."""
    clock, table, spec, job = await one_group_job(tmp_path, lease_s=30)
    busy = await table.lease(spec.id, "busy")
    assert (await table.lease(spec.id, "idle")).retry_after_s == 1.0  # untold: a look, none
    clock.now += 0.5
    await table.renew(busy.token, rows_done=500)  # 1,000 rows/s: 99.5 s left
    clock.now += 0.3  # 0.8 s after the look: the jitter's earliest
    early = await table.lease(spec.id, "idle")
    assert early.status == "wait" and early.retry_after_s == 1.0
    assert not job.shards[0].split_asked
    clock.now += 0.3
    assert (await table.lease(spec.id, "idle")).status == "wait"
    assert job.shards[0].split_asked, "the holder is asked to split for the idle worker"


async def test_holders_renew_soon_while_a_worker_waits_idle_at_the_tail(tmp_path: Path) -> None:
    """The split an idle worker waits for is chosen by the rates renewals tell and rides on a
    renewal's reply: at the tail, holders renew within a second while a worker of the job has
    asked for a shard lately and found none, or until they have told rows (no rate yet)."""
    for split_tail in (True, False):
        _store, clock, table, spec, _job = await running_job(
            tmp_path / str(split_tail), shards=2, lease_s=30, split_tail=split_tail
        )
        soon = RENEW_SOON_S if split_tail else None
        first = await table.lease(spec.id, "w1")
        assert first.renew_in_s is None  # a shard is still queued: not the tail
        last = await table.lease(spec.id, "w2")
        assert last.renew_in_s == soon  # the queue is empty, and no rate is known
        clock.now += 5
        assert (await table.renew(last.token, rows_done=1)).renew_in_s is None
        assert (await table.renew(first.token, rows_done=0)).renew_in_s == soon
        assert (await table.renew(first.token, rows_done=1)).renew_in_s is None
        assert (await table.lease(spec.id, "w3")).status == "wait"  # nothing for it
        assert (await table.renew(first.token, rows_done=2)).renew_in_s == soon
        assert (await table.renew(last.token, rows_done=2)).renew_in_s == soon
        clock.now += 2 * 3.0  # two tail waits (a tenth of the lease) and w3 has not asked
        assert (await table.renew(first.token, rows_done=3)).renew_in_s is None


async def test_a_shard_that_may_be_cut_in_halves_counts_as_the_workers_it_can_keep_busy(
    tmp_path: Path,
) -> None:
    """The controller scales a job on `workers_usable`: one shard of a Parquet file of one
    row group counts as the pieces the liquid tail may cut it into for idle workers (by its
    rows against the rows the planner sizes a shard, then by its time left once a rate is
    told), never more than max_workers; a shard that is not cut in halves counts one."""
    write_dataset(tmp_path / "data", rows=100_000, row_group_size=100_000)
    write_model(tmp_path / "model.onnx")
    raw = job_spec(tmp_path, rows_per_shard=10_000, workers=(1, 4), fault={"lease_s": 30})
    spec = parse_job(raw).with_id()
    _store, clock = MemoryStore(), Clock()
    table = new_table(_store, clock)
    assert await table.intake.submit(spec)

    async def usable() -> int:
        (status,) = table.status(StatusRequest(job=spec.id)).jobs
        assert status.shards["TODO"] + status.shards["DOING"] == 1
        return status.workers_usable

    assert await usable() == 4  # ten shards' rows, four workers at most: before any lease
    holder, granted = await table.lease(spec.id, "holder"), clock.now
    assert await usable() == 4
    # Once a rate is told, a piece is worth its cut if it is 8 s (3 s + 5 s) or more.
    for seconds, rows, pieces in [(10, 20_000, 4), (20, 50_000, 2), (30, 80_000, 1)]:
        clock.now = granted + seconds
        await table.renew(holder.token, rows_done=rows)
        assert await usable() == pieces  # 40 s left (5 pieces, 4 at most); 20 s; 7.5 s

    unsplit = {
        **raw,
        "fault": {"lease_s": 30, "split_tail": False},
        "output": {**raw["output"], "uri": str(tmp_path / "whole")},
    }
    whole = parse_job(unsplit).with_id()
    assert await table.intake.submit(whole)
    (status,) = table.status(StatusRequest(job=whole.id)).jobs
    assert status.workers_usable == 1


async def test_a_worker_asking_for_a_next_shard_while_its_own_computes_is_not_idle(
    tmp_path: Path,
) -> None:
    """A worker reads its next shard while one computes (`shards_in_flight`): at the tail
    that spare slot is not an idle worker. No split is asked for it, no second attempt
    given it (either would wait for its own shard), and while a worker of the tier waited
    idle lately, a shard that comes back goes to that one."""
    _store, clock, table, spec, job = await running_job(tmp_path, shards=2, lease_s=30)
    a = await table.lease(spec.id, "a")
    b = await table.lease(spec.id, "b")
    clock.now += 10
    await table.renew(a.token, rows_done=1)  # a straggler, and b at the usual rate
    await table.renew(b.token, rows_done=50)
    assert (await table.lease(spec.id, "b")).status == "wait"  # b's spare slot
    assert not job.shards[0].split_asked
    clock.now += 100  # long past the usual shard time: still no second attempt for b
    assert (await table.lease(spec.id, "b")).status == "wait"
    assert (await table.lease(spec.id, "c")).status == "wait"  # idle: a is asked to split
    assert job.shards[0].split_asked == {a.token}
    await table.release(b.token, "its worker must go", retryable=True)
    assert (await table.lease(spec.id, "a")).status == "wait"  # busy: c waited lately
    back = await table.lease(spec.id, "c")
    assert back.shard is not None and back.shard.index == 1


async def test_a_third_shard_goes_to_a_worker_only_while_two_stay_for_each_other_it_may_have(
    tmp_path: Path,
) -> None:
    """A worker whose small shards leave its pipeline short asks for more than two: it gets
    them while the queue keeps two for each of the tier's other workers (its `max_workers`)
    that hold none yet, not the shards a worker still loading its models would find."""
    write_dataset(tmp_path / "data", rows=600, row_group_size=100)
    write_model(tmp_path / "model.onnx")
    body = job_spec(tmp_path, rows_per_shard=100, workers=(1, 2))
    spec = parse_job(body).with_id()
    table = new_table(MemoryStore(), Clock())
    assert await table.intake.submit(spec)
    a = [await table.lease(spec.id, "a") for _ in range(2)]
    assert all(r.status == "granted" for r in a)
    # Four queued: two of them kept for a second worker.
    more = [(await table.lease(spec.id, "a")).status for _ in range(3)]
    assert more == ["granted", "granted", "wait"]
    assert (await table.lease(spec.id, "b")).status == "granted"
    # Every worker the tier may have holds some: the rest to whoever asks.
    assert (await table.lease(spec.id, "a")).status == "granted"
    alone = {
        **body,
        "resources": {**body["resources"], "max_workers": 1},
        "output": {**body["output"], "uri": str(tmp_path / "alone")},
    }
    one = parse_job(alone).with_id()
    assert await table.intake.submit(one)
    held = [await table.lease(one.id, "a") for _ in range(6)]
    assert [r.status for r in held] == ["granted"] * 6  # no other worker to keep any for


async def test_one_shard_for_two_workers_is_cut_in_halves_for_both_each_row_once(
    tmp_path: Path,
) -> None:
    """A Parquet file of one row group is one shard. A worker with nothing to do has the
    holder, at the usual rate, split it: its rest is cut in two, a half for each."""
    write_dataset(tmp_path / "data", rows=100_000, row_group_size=100_000)
    write_model(tmp_path / "model.onnx")
    spec = parse_job(job_spec(tmp_path, rows_per_shard=100_000, fault={"lease_s": 30})).with_id()
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    holder = await table.lease(spec.id, "holder")
    clock.now += 10
    assert not (await table.renew(holder.token, rows_done=10_000)).split  # 90 s left
    assert (await table.lease(spec.id, "idle")).status == "wait"  # its holder is asked
    assert job.shards[0].split_asked == {holder.token} and job.shards[0].halve_from
    assert (await table.renew(holder.token, rows_done=12_000)).split
    commit_part(spec, holder, rows=12_000, split_at=12_000, worker="holder")
    await table.commit(holder.token)

    part = job.shards[0].record
    assert part.remainder is not None and part.remainder_half is not None
    assert [(r.index, r.row_offset, r.rows) for r in (part.remainder, part.remainder_half)] == [
        (1, 12_000, 44_000),
        (2, 56_000, 44_000),
    ]
    # The first half is kept for the worker it was split for, the second for the holder: a
    # third worker (or one's spare slot) gets neither.
    assert (await table.lease(spec.id, "third")).status == "wait"
    second = await table.lease(spec.id, "holder")
    first = await table.lease(spec.id, "idle")
    assert second.shard is not None and second.shard.index == 2
    assert first.shard is not None and first.shard.index == 1
    assert {job.shards[i].record.split_from for i in (1, 2)} == {0}
    assert_indexes_match_records(job, store)
    for reply in (second, first):  # the second half done first: the order is the input's
        assert reply.shard is not None
        commit_part(spec, reply, rows=reply.shard.rows)
        await table.commit(reply.token)
    assert job.record.state == "SUCCEEDED" and job.record.rows_done == 100_000
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None and [f.shard for f in manifest.files] == [0, 1, 2]


def test_a_rest_cut_in_two_names_both_halves_and_a_master_that_died_creates_them() -> None:
    part = split_part(_record(0, seq=0), 10, index=5, halve_from=20)
    assert part.remainder is not None and part.remainder_half is not None
    assert (part.remainder.row_offset, part.remainder.rows) == (10, 45)
    assert (part.remainder_half.row_offset, part.remainder_half.rows) == (55, 45)
    missing = missing_remainders([part])
    assert [(r.spec.index, r.split_from, r.spec.row_offset) for r in missing] == [
        (5, 0, 10),
        (6, 0, 55),
    ]
    # Too small a rest moves whole; a CSV rest (its rows a guess) is never cut.
    assert split_part(_record(0, seq=0), 90, index=5, halve_from=20).remainder_half is None
    text = ShardRecord(
        job="j", spec=ShardSpec(index=0, path="x.csv", format="csv", rows=100), seq=0
    )
    assert split_part(text, 10, index=5, halve_from=20).remainder_half is None


async def test_the_input_order_puts_the_first_half_and_its_parts_before_the_second(
    tmp_path: Path,
) -> None:
    _store, _clock, table, spec, job = await running_job(tmp_path, shards=1)
    job.shards[0].halve_from = 20  # as an idle worker's ask leaves it
    first = await table.lease(spec.id, "w1")
    commit_part(spec, first, rows=10, split_at=10, worker="w1")
    await table.commit(first.token)  # 0: [0, 10), 1: [10, 55), 2: [55, 100)
    half = await table.lease(spec.id, "w1")
    assert half.shard is not None and half.shard.index in (1, 2)
    other = 3 - half.shard.index
    commit_part(spec, half, rows=5, split_at=5, worker="w1")  # that half split again: 3
    await table.commit(half.token)
    assert job.shards[3].record.split_from == half.shard.index
    order = [s.index for s in in_input_order(job)]
    assert order == ([0, 1, 3, 2] if half.shard.index == 1 else [0, 1, 2, 3])
    assert sorted(await finish_all(table, spec, worker="w1")) == sorted([other, 3])
    assert job.record.rows_done == 100


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cuts=st.lists(
        st.tuples(st.integers(min_value=1, max_value=99), st.booleans()), min_size=1, max_size=12
    )
)
async def test_parts_and_rests_cover_every_row_once_however_they_are_cut(
    tmp_path_factory: pytest.TempPathFactory, cuts: list[tuple[int, bool]]
) -> None:
    """Parts committed at any point of any shard, rests moved whole or cut in two: the DONE
    pieces' rows, in the manifest's order, are the input's rows, each once, in order."""
    tmp_path = tmp_path_factory.mktemp("cuts")
    store, _clock, table, spec, job = await running_job(tmp_path, shards=2)
    for percent, halve in cuts:
        reply = await table.lease(spec.id, "w1")
        if reply.status != "granted":
            break
        assert reply.shard is not None
        job.shards[reply.shard.index].halve_from = 2 if halve else 0
        split_at = max(1, reply.shard.rows * percent // 100)
        whole = split_at >= reply.shard.rows
        commit_part(
            spec,
            reply,
            rows=reply.shard.rows if whole else split_at,
            split_at=0 if whole else split_at,
            worker="w1",
        )
        await table.commit(reply.token)
    await finish_all(table, spec, worker="w1")
    assert job.record.state == "SUCCEEDED"
    records = {r.spec.index: r for r, _ in store.shards.values()}

    def rows_of(index: int) -> list[int]:
        """The rows of a piece and of its rests (the first half's, then the second's)."""
        rec = records[index]
        first = rec.spec.row_groups[0] * 100 + rec.spec.row_offset
        rows = list(range(first, first + (rec.split_at or rec.spec.rows)))
        for rest in (rec.remainder, rec.remainder_half):
            if rest is not None:
                assert records[rest.index].split_from == index
                rows += rows_of(rest.index)
        return rows

    def pieces(index: int) -> list[int]:
        rec = records[index]
        rests = [r.index for r in (rec.remainder, rec.remainder_half) if r is not None]
        return [index, *(i for rest in rests for i in pieces(rest))]

    covered = [row for i in (0, 1) for row in rows_of(i)]
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None
    assert [f.shard for f in manifest.files] == pieces(0) + pieces(1)  # the input's order
    assert covered == list(range(200))


async def test_a_split_is_judged_by_the_rows_a_holder_has_done_by_now_not_those_it_told(
    tmp_path: Path,
) -> None:
    """A holder renews every third of its lease while no worker waits: what it told is old
    when an idle worker comes. At its rate it is nearly done, and halving what is left is
    not worth its cost: no split is asked."""
    clock, table, spec, job = await one_group_job(tmp_path, lease_s=300)
    holder = await table.lease(spec.id, "holder")
    clock.now += 10
    await table.renew(holder.token, rows_done=10_000)  # 1,000 rows a second
    clock.now += 78  # 88,000 rows done by now, at that rate: 6 s left
    assert (await table.lease(spec.id, "idle")).status == "wait"
    assert not job.shards[0].split_asked
