"""The lease table on its own: an in-memory record store and a clock the test moves.

What the master does over NATS is tested in test_master.py against a real nats-server; here
every transition is driven directly, so expiry, speculation and a restart take no real time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ebb.common.data.layout import CommitRecord, OutputFile, attempt_dir
from ebb.common.data.output import OutputStore, new_commit
from ebb.common.job import JobSpec, parse_job
from ebb.common.messaging.messages import JobEvent, JobState, LeaseReply, ShardState, StatusRequest
from ebb.shard_master.errors import (
    Deposed,
    IllegalTransition,
    JobEnded,
    StaleToken,
    StateUnsure,
    StoreUnavailable,
)
from ebb.shard_master.table.jobs import Job
from ebb.shard_master.table.lease_table import LeaseTable
from ebb.shard_master.table.moves import PERSISTED_PERIODS
from ebb.shard_master.table.records import JobRecord, ShardRecord, shard_key
from ebb.shard_master.table.transitions import (
    JOB_STATES,
    SHARD_STATES,
    TRANSITIONS,
)

from ..helpers import job_spec, write_dataset, write_model


class MemoryStore:
    """The RecordStore contract in memory: revisions, compare-and-set, Deposed on a conflict.

    Every call suspends once before it acts, as a real store's round trip does, so that what
    the table does while a write is on its way is what it does in service (a section that holds
    only with no suspension in it would pass here and fail there). `lose_answer`: a write of a
    record it says True of lands, and its caller hears StateUnsure, as when KV's answer is lost
    to a timeout (once: it is cleared when it fires)."""

    def __init__(self) -> None:
        self.jobs: dict[str, tuple[JobRecord, int]] = {}
        self.shards: dict[str, tuple[ShardRecord, int]] = {}
        self._revision = itertools.count(1)
        self.lose_answer: Callable[[ShardRecord], bool] | None = None

    def _answer(self, record: ShardRecord, revision: int) -> int:
        if self.lose_answer is not None and self.lose_answer(record):
            self.lose_answer = None
            raise StateUnsure(f"the write of shard {record.spec.index} lost its answer")
        return revision

    async def create_job(self, record: JobRecord) -> int | None:
        await asyncio.sleep(0)
        if record.id in self.jobs:
            return None
        self.jobs[record.id] = (record, revision := next(self._revision))
        return revision

    async def update_job(self, record: JobRecord, *, last: int) -> int:
        await asyncio.sleep(0)
        if self.jobs[record.id][1] != last:
            raise Deposed(f"job {record.id} was written by someone else")
        self.jobs[record.id] = (record, revision := next(self._revision))
        return revision

    async def get_job(self, job: str) -> tuple[JobRecord, int] | None:
        await asyncio.sleep(0)
        return self.jobs.get(job)

    async def create_shard(self, record: ShardRecord) -> int | None:
        await asyncio.sleep(0)
        key = shard_key(record.job, record.spec.index)
        if key in self.shards:
            return None
        self.shards[key] = (record, revision := next(self._revision))
        return self._answer(record, revision)

    async def update_shard(self, record: ShardRecord, *, last: int) -> int:
        await asyncio.sleep(0)
        key = shard_key(record.job, record.spec.index)
        if self.shards[key][1] != last:
            raise Deposed(f"shard {key} was written by someone else")
        self.shards[key] = (record, revision := next(self._revision))
        return self._answer(record, revision)

    async def load_jobs(self) -> list[tuple[JobRecord, int]]:
        await asyncio.sleep(0)
        return list(self.jobs.values())

    async def load_shards(self, job: str) -> list[tuple[ShardRecord, int]]:
        await asyncio.sleep(0)
        return [entry for key, entry in self.shards.items() if key.startswith(f"{job}.")]

    async def forget_job(self, job: str) -> None:
        await asyncio.sleep(0)
        self.jobs.pop(job, None)
        for key in [k for k in self.shards if k.startswith(f"{job}.")]:
            del self.shards[key]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def new_table(
    store: MemoryStore,
    clock: Clock,
    events: list[JobEvent] | None = None,
    *,
    wall_clock: Callable[[], float] = time.time,
) -> LeaseTable:
    sink = events.append if events is not None else (lambda _event: None)
    return LeaseTable(
        store=store,
        epoch=1,
        on_event=sink,
        clock=clock,
        wall_clock=wall_clock,
        speculate_after_s=5.0,
        lease_grace_s=2.0,
    )


def make_job(tmp_path: Path, *, shards: int = 3, **fault: object) -> JobSpec:
    write_dataset(tmp_path / "data", rows=100 * shards, row_group_size=100)
    write_model(tmp_path / "model.onnx")
    return parse_job(job_spec(tmp_path, rows_per_shard=100, fault=dict(fault))).with_id()


def commit_record(
    spec: JobSpec, reply: LeaseReply, *, rows: int = 100, row_errors: dict[str, int] | None = None
) -> None:
    """What a worker does before `commit`: write its file and create the commit record."""
    assert reply.shard is not None
    store = OutputStore(spec.output.uri)
    path = f"{attempt_dir(reply.shard.index, reply.attempt)}/part-00000.parquet"
    store.write_file(path, b"data")
    store.create_commit(
        new_commit(
            job=spec.id,
            shard=reply.shard.index,
            attempt=reply.attempt,
            files=[OutputFile(path=path, rows=rows, error_rows=sum((row_errors or {}).values()))],
            worker="w",
            row_errors=row_errors,
        )
    )


def assert_indexes_match_records(job: Job, store: MemoryStore) -> None:
    """Every index the job keeps is what its shard records, in memory and stored, say."""
    for shard in job.shards:
        stored, revision = store.shards[shard_key(job.id, shard.index)]
        # A DONE shard's metrics live in KV and in the job's merge, not in its record in memory.
        assert (replace(stored, metrics={}, row_errors={}), revision) == (
            shard.record,
            shard.revision,
        )
    records = [s.record for s in job.shards]
    assert +job.counts == Counter(r.state for r in records)
    assert job.doing == {r.spec.index for r in records if r.state == "DOING"}
    last = len(job.tiers) - 1
    for at, tier in enumerate(job.tiers):
        mine = [r for r in records if r.tier == at]
        assert +tier.counts == Counter(r.state for r in mine)
        assert tier.doing == {r.spec.index for r in mine if r.state == "DOING"}
        queued = [i for i in tier.todo if job.shards[i].record.state == "TODO"]
        assert sorted(queued) == sorted(r.spec.index for r in mine if r.state == "TODO")
        assert [job.shards[i].record.seq for i in queued] == sorted(
            job.shards[i].record.seq for i in queued
        )
        assert tier.rows_done == sum(r.rows for r in mine if r.state == "DONE")
    assert job.rows_done == sum(r.rows for r in records if r.state == "DONE" and r.tier == last)
    assert job.quarantined_rows == sum(r.spec.rows for r in records if r.state == "QUARANTINED")
    for shard in job.shards:
        assert set(shard.deadlines) == {lease.token for lease in shard.record.leases}


@pytest.mark.parametrize(
    ("old", "new"),
    [(o, n) for o, n in itertools.product(SHARD_STATES, SHARD_STATES) if n not in TRANSITIONS[o]],
)
async def test_an_illegal_move_is_refused_before_anything_is_written(
    tmp_path: Path, old: ShardState, new: ShardState
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    # Two shards, so that shard 0 ending leaves the job running.
    spec = make_job(tmp_path, shards=2, max_attempts=1, max_error_fraction=1.0)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    shard = job.shards[0]
    # Put the shard in `old` the way the table would: through its one transition point.
    if old != "TODO":
        reply = await table.lease(spec.id, "w1")
        if old == "DONE":
            commit_record(spec, reply)
            await table.commit(reply.token)
        elif old == "QUARANTINED":
            await table.release(reply.token, "poison", retryable=False)
    assert shard.record.state == old
    stored = dict(store.shards)
    indexes = (Counter(job.counts), set(job.doing), list(job.tiers[0].todo))

    async with shard.lock:
        with pytest.raises(IllegalTransition):
            await table.moves.apply(job, shard, replace(shard.record, state=new))

    assert store.shards == stored
    assert shard.record.state == old
    assert (Counter(job.counts), set(job.doing), list(job.tiers[0].todo)) == indexes


@pytest.mark.parametrize("new", [n for n in JOB_STATES if n != "RUNNING"])
async def test_an_illegal_move_of_a_job_is_refused_before_anything_is_written(
    tmp_path: Path, new: JobState
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1)
    assert await table.intake.submit(spec)
    await table.lifecycle.cancel(spec.id, "stop")  # only a resume moves it again
    job = table.jobs[spec.id]
    stored = dict(store.jobs)
    with pytest.raises(IllegalTransition, match=f"from CANCELLED to {new}"):
        await table.lifecycle.move(job, replace(job.record, state=new))
    assert store.jobs == stored and job.state == "CANCELLED"


async def test_every_move_of_a_job_keeps_its_indexes_equal_to_its_records(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    events: list[JobEvent] = []
    table = new_table(store, clock, events)
    spec = make_job(tmp_path, shards=4, max_attempts=2, max_error_fraction=1.0)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    assert_indexes_match_records(job, store)

    a, b, c, d = [await table.lease(spec.id, f"w{i}") for i in range(4)]
    assert [r.shard.index for r in (a, b, c, d) if r.shard] == [0, 1, 2, 3]
    assert job.counts["DOING"] == 4
    assert_indexes_match_records(job, store)

    await table.renew(a.token)
    commit_record(spec, a)
    assert (await table.commit(a.token)).status == "done"
    assert_indexes_match_records(job, store)
    assert (await table.release(b.token, "busy", retryable=True)).state == "TODO"
    assert (await table.release(c.token, "bad row", retryable=False)).state == "TODO"
    assert_indexes_match_records(job, store)
    # Both went to the tail in the order they came back, after their first seq.
    assert [job.shards[i].record.seq for i in job.tiers[0].todo] == [4, 5]
    assert list(job.tiers[0].todo) == [1, 2]

    retry = await table.lease(spec.id, "w5")
    assert retry.shard is not None and retry.shard.index == 1 and retry.attempt == 2
    assert (await table.release(d.token, "bad", retryable=False)).state == "TODO"
    again = await table.lease(spec.id, "w6")  # shard 2, its second failure quarantines it
    assert (await table.release(again.token, "bad", retryable=False)).state == "QUARANTINED"
    assert_indexes_match_records(job, store)
    assert job.shards[2].record.errors == ["bad row", "bad"]
    assert progress_rows(events) == [100]


def progress_rows(events: list[JobEvent]) -> list[int]:
    return [e.rows_done for e in events if e.kind == "progress"]


async def test_an_expired_lease_goes_to_the_tail_and_the_last_one_quarantines(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=2, lease_s=30, max_attempts=2, max_error_fraction=1.0)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    first = await table.lease(spec.id, "w1")
    assert table.expiries.next_expiry() == clock.now + 30

    clock.now += 29.9
    assert await table.reaper.expire_due() == 0
    await table.renew(first.token)  # a renewal moves the deadline a full period on
    clock.now += 29.9
    assert await table.reaper.expire_due() == 0
    clock.now += 0.2
    assert await table.reaper.expire_due() == 1
    assert job.shards[0].record.state == "TODO"
    assert list(job.tiers[0].todo) == [1, 0]  # the tail
    assert job.shards[0].record.errors == ["lease of attempt 1 expired (worker w1)"]
    with pytest.raises(StaleToken):
        await table.renew(first.token)
    assert_indexes_match_records(job, store)

    await table.lease(spec.id, "w2")  # shard 1
    second = await table.lease(spec.id, "w3")
    assert second.shard is not None and second.shard.index == 0
    clock.now += 31
    assert await table.reaper.expire_due() == 2
    assert [s.record.state for s in job.shards] == ["QUARANTINED", "TODO"]
    assert_indexes_match_records(job, store)


async def test_an_idle_worker_gets_a_speculative_attempt_and_the_first_commit_wins(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=2, lease_s=600)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    fast = await table.lease(spec.id, "fast")
    slow = await table.lease(spec.id, "slow")
    clock.now += 2
    commit_record(spec, fast)
    await table.commit(fast.token)
    assert list(job.tiers[0].durations) == [2]

    # Running 4 s is not long past the usual 2 s yet: speculation waits speculate_after_s.
    clock.now += 2
    assert (await table.lease(spec.id, "fast")).status == "wait"
    clock.now += 2
    assert (await table.lease(spec.id, "slow")).status == "wait"  # never its own shard
    backup = await table.lease(spec.id, "fast")
    assert backup.speculative and backup.shard is not None and backup.shard.index == 1
    assert backup.attempt == 2
    assert_indexes_match_records(job, store)

    commit_record(spec, backup)
    assert (await table.commit(backup.token)).status == "done"
    assert job.ended and job.record.state == "SUCCEEDED"
    with pytest.raises(JobEnded):  # the losing attempt's leases went with the job
        await table.commit(slow.token)
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None
    assert sorted((f.shard, f.attempt) for f in manifest.files) == [(0, 1), (1, 2)]


async def test_a_restarted_table_keeps_each_lease_no_longer_than_its_deadline_plus_a_grace(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=3, lease_s=60)
    assert await table.intake.submit(spec)
    held = await table.lease(spec.id, "w1")
    await table.lease(spec.id, "w2")
    await table.release((await table.lease(spec.id, "w3")).token, "busy", retryable=True)

    restarted_clock = Clock()
    restarted_clock.now = 5.0
    restarted = new_table(store, restarted_clock)
    await restarted.load()
    job = restarted.jobs[spec.id]
    assert_indexes_match_records(job, store)
    assert list(job.tiers[0].todo) == [2]
    left = job.shards[0].deadlines[held.token] - restarted_clock.now
    assert 60 - 1 < left <= 60  # what it had left (nearly all of it); never more than a period
    # The restarted table carries on where the first left off: fencing, queue order, seq.
    await restarted.renew(held.token)
    nxt = await restarted.lease(spec.id, "w4")
    assert nxt.shard is not None and nxt.shard.index == 2 and nxt.attempt == 2


async def test_renewals_are_written_to_kv_only_when_its_record_runs_short(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1, lease_s=30)
    assert await table.intake.submit(spec)
    held = await table.lease(spec.id, "w1")
    key = shard_key(spec.id, 0)
    revisions = [store.shards[key][1]]
    for _ in range(6):  # a worker's pace: every third of a period
        clock.now += 10
        await table.renew(held.token)
        revisions.append(store.shards[key][1])
        # Every renewal moves the deadline a full period on, written or not.
        assert table.jobs[spec.id].shards[0].deadlines[held.token] == clock.now + 30
    assert len(set(revisions)) - 1 == 3  # every other renewal written, not each
    # A master taking over from KV now gives the live worker more than the third of a
    # period it needs to hear the worker's next renewal; never more than a period.
    restarted_clock = Clock()
    restarted = new_table(store, restarted_clock)
    await restarted.load()
    left = restarted.jobs[spec.id].shards[0].deadlines[held.token] - restarted_clock.now
    assert 10 < left <= 30
    await restarted.renew(held.token)


async def test_a_record_someone_else_wrote_deposes_the_table(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1)
    assert await table.intake.submit(spec)
    reply = await table.lease(spec.id, "w1")
    key = shard_key(spec.id, 0)
    record, revision = store.shards[key]
    await store.update_shard(record, last=revision)  # another master's write
    job = table.jobs[spec.id]
    # Late enough in the lease that the renewal is written (see PERSISTED_PERIODS).
    clock.now += spec.fault.lease_s * 0.7
    with pytest.raises(Deposed):
        await table.renew(reply.token)
    assert job.shards[0].revision == revision
    assert job.counts["DOING"] == 1


async def test_jobs_ended_past_the_retention_are_forgotten_and_others_kept(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    specs = []
    for k in range(3):
        spec = dataclasses.replace(make_job(tmp_path / f"j{k}", shards=2), id=f"job-{k}")
        assert await table.intake.submit(spec)
        specs.append(spec)
    await table.lifecycle.cancel("job-0", "done with it")
    await table.lifecycle.cancel("job-1", "done with it")
    ended_at = store.jobs["job-0"][0].finished_at
    assert ended_at > 0
    # Not yet: ended less than the retention ago.
    assert await table.lifecycle.forget_ended(now=ended_at + 10, retention_s=60) == []
    gone = await table.lifecycle.forget_ended(now=ended_at + 61, retention_s=60)
    assert sorted(gone) == ["job-0", "job-1"]
    assert set(table.jobs) == {"job-2"}  # the running job stays, whatever its age
    assert set(store.jobs) == {"job-2"}
    assert all(key.startswith("job-2.") for key in store.shards)
    assert [j.id for j in table.status(StatusRequest()).jobs] == ["job-2"]


async def test_forgetting_goes_a_bounded_number_of_jobs_a_pass(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    for k in range(7):
        spec = dataclasses.replace(make_job(tmp_path / f"j{k}", shards=2), id=f"job-{k}")
        assert await table.intake.submit(spec)
        await table.lifecycle.cancel(spec.id, "done with it")
    ended_at = max(record.finished_at for record, _ in store.jobs.values())
    first = await table.lifecycle.forget_ended(now=ended_at + 61, retention_s=60, limit=3)
    second = await table.lifecycle.forget_ended(now=ended_at + 61, retention_s=60, limit=3)
    third = await table.lifecycle.forget_ended(now=ended_at + 61, retention_s=60, limit=3)
    assert (len(first), len(second), len(third)) == (3, 3, 1)
    assert sorted(first + second + third) == [f"job-{k}" for k in range(7)]
    assert table.jobs == {} and store.jobs == {} and store.shards == {}


async def test_status_comes_a_page_at_a_time_in_id_order(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    for k in (3, 1, 4, 2, 0):
        spec = dataclasses.replace(make_job(tmp_path / f"j{k}", shards=1), id=f"job-{k}")
        assert await table.intake.submit(spec)
    first = table.status(StatusRequest(limit=2))
    assert [j.id for j in first.jobs] == ["job-0", "job-1"] and first.next == "job-1"
    second = table.status(StatusRequest(limit=2, after=first.next))
    assert [j.id for j in second.jobs] == ["job-2", "job-3"]
    last = table.status(StatusRequest(limit=2, after=second.next))
    assert [j.id for j in last.jobs] == ["job-4"] and last.next == ""


async def test_a_lease_renewed_without_a_write_still_expires_when_its_worker_goes_silent(
    tmp_path: Path,
) -> None:
    """A renewal early in the lease is not written to KV (PERSISTED_PERIODS), but it still
    moves the deadline the reaper waits for: a worker killed right after it loses the lease a
    period later, not never (the shard would stay DOING and its job never end)."""
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1, lease_s=30, max_attempts=3)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    held = await table.lease(spec.id, "w1")
    written = store.shards[shard_key(spec.id, 0)][1]
    clock.now += 10
    await table.renew(held.token)  # a third of the way in: not written
    assert store.shards[shard_key(spec.id, 0)][1] == written
    clock.now += 20.1  # the first deadline passes: renewed, not due
    assert await table.reaper.expire_due() == 0
    assert table.expiries.next_expiry() == pytest.approx(clock.now + 9.9)
    clock.now += 10  # the worker said nothing since: the renewed deadline passes
    assert await table.reaper.expire_due() == 1
    assert job.shards[0].record.state == "TODO"
    assert job.shards[0].record.errors == ["lease of attempt 1 expired (worker w1)"]


async def test_an_expiry_the_store_refuses_is_retried_later_not_at_once(tmp_path: Path) -> None:
    """A NATS server down or a stream electing its leader: the expiry is kept and tried
    again after a backoff that grows, not in a loop that spins the master."""
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1, lease_s=30, max_attempts=3)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    await table.lease(spec.id, "w1")
    writes = store.update_shard

    async def refused(record: ShardRecord, *, last: int) -> int:
        raise StoreUnavailable("no server heard the write")

    store.update_shard = refused  # type: ignore[method-assign]
    clock.now += 31
    failed_at = clock.now
    assert await table.reaper.expire_due() == 0
    first_retry = table.expiries.next_expiry()
    assert first_retry is not None and first_retry > failed_at
    assert await table.reaper.expire_due() == 0  # not yet: nothing is tried before the retry time
    clock.now = first_retry
    assert await table.reaper.expire_due() == 0
    second_retry = table.expiries.next_expiry()
    assert second_retry is not None
    assert second_retry - first_retry > first_retry - failed_at  # backing off
    # Nothing changed while the store was away.
    assert [s.record.state for s in job.shards] == ["DOING"]

    store.update_shard = writes  # type: ignore[method-assign]
    clock.now = second_retry
    assert await table.reaper.expire_due() == 1
    assert [s.record.state for s in job.shards] == ["TODO"]
    assert_indexes_match_records(job, store)


async def test_a_worker_the_cluster_took_gives_its_shards_back_at_once_without_penalty(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1)  # max_attempts: the default, 3
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    for _ in range(10):  # far more losses than max_attempts, each one forgiven
        reply = await table.lease(spec.id, "w1")
        assert reply.shard is not None and reply.shard.index == 0
        told = await table.reaper.worker_ended(
            spec.id, "w1", kind="capacity", blame=False, reason="preempted"
        )
        assert (told.released, told.forgiven) == ([0], 1)
        # Back in the queue at once, with no lease left to run out.
        assert job.shards[0].record.state == "TODO" and job.shards[0].deadlines == {}
    record = job.shards[0].record
    assert (record.failures, record.losses) == (0, 10)
    assert "worker w1 was lost (capacity: preempted)" in record.errors[-1]
    assert job.record.workers_lost == {"capacity": 1}  # one worker, told ten times
    assert job.record.attempts_forgiven == 10
    status = table.status(StatusRequest(job=spec.id)).jobs[0]
    assert (status.workers_lost, status.attempts_forgiven) == ({"capacity": 1}, 10)
    assert_indexes_match_records(job, store)


async def test_word_of_a_worker_is_idempotent(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=2)
    assert await table.intake.submit(spec)
    await table.lease(spec.id, "w1")
    await table.lease(spec.id, "w1")
    first = await table.reaper.worker_ended(
        spec.id, "w1", kind="capacity", blame=False, reason="gone"
    )
    assert first.released == [0, 1]
    stored = (dict(store.shards), dict(store.jobs))
    again = await table.reaper.worker_ended(
        spec.id, "w1", kind="capacity", blame=False, reason="gone"
    )
    assert (again.released, again.forgiven) == ([], 0)
    assert (dict(store.shards), dict(store.jobs)) == stored


async def test_a_jobs_most_common_row_errors_are_its_shards_summed_and_kept_when_it_ends(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=2, max_error_fraction=1.0)
    assert await table.intake.submit(spec)
    first = await table.lease(spec.id, "w1")
    commit_record(spec, first, row_errors={"no such customer": 7, "a NaN": 1})
    await table.commit(first.token)
    told = table.status(StatusRequest(job=spec.id)).jobs[0].row_errors
    assert list(told.items()) == [("no such customer", 7), ("a NaN", 1)]
    second = await table.lease(spec.id, "w1")
    commit_record(spec, second, row_errors={"a NaN": 9, "no such customer": 1})
    await table.commit(second.token)
    job = table.jobs[spec.id]
    assert job.ended and job.record.row_errors == {"a NaN": 10, "no such customer": 8}
    ended = table.status(StatusRequest(job=spec.id)).jobs[0]
    assert list(ended.row_errors) == ["a NaN", "no such customer"]  # the most common first


async def test_a_drained_worker_is_counted_apart_from_the_lost(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=2)
    assert await table.intake.submit(spec)
    await table.reaper.worker_ended(spec.id, "w1", kind="drained", blame=False, reason="told")
    await table.reaper.worker_ended(spec.id, "w2", kind="capacity", blame=False, reason="gone")
    status = table.status(StatusRequest(job=spec.id)).jobs[0]
    assert (status.workers_lost, status.workers_drained) == ({"capacity": 1}, 1)


async def test_a_worker_that_crashed_on_its_shards_counts_against_them(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    for attempt in range(1, 4):
        reply = await table.lease(spec.id, f"w{attempt}")
        assert reply.shard is not None and reply.shard.index == 0
        await table.reaper.worker_ended(
            spec.id, f"w{attempt}", kind="oom", blame=True, reason="OOM"
        )
    record = store.shards[shard_key(spec.id, 0)][0]  # the job ended with it: nothing else ran
    assert (record.state, record.failures, record.losses) == ("QUARANTINED", 3, 0)
    assert (job.state, job.record.attempts_forgiven, job.record.workers_lost) == (
        "FAILED",
        0,
        {"oom": 3},
    )


async def test_a_shard_that_takes_down_every_worker_is_quarantined_at_the_loss_cap(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1)
    assert spec.fault.worker_loss_cap() == 15  # 5 x the default max_attempts
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    for n in range(15):
        reply = await table.lease(spec.id, f"w{n}")
        assert reply.shard is not None and reply.shard.index == 0
        await table.reaper.worker_ended(
            spec.id, f"w{n}", kind="capacity", blame=False, reason="killed"
        )
    record = store.shards[shard_key(spec.id, 0)][0]
    assert (record.state, record.failures, record.losses) == ("QUARANTINED", 0, 15)
    assert "15 workers were lost while computing it" in record.errors[-1]
    assert job.record.workers_lost == {"capacity": 15}


async def test_a_lease_that_expires_with_no_word_still_counts_as_a_failure(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1, lease_s=30)
    assert await table.intake.submit(spec)
    await table.lease(spec.id, "w1")
    clock.now += 31
    assert await table.reaper.expire_due() == 1
    record = table.jobs[spec.id].shards[0].record
    assert (record.failures, record.losses) == (1, 0)


async def test_ready_workers_are_counted_from_their_leases_and_renewals(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=3)
    assert await table.intake.submit(spec)
    first = await table.lease(spec.id, "w1")  # not ready yet: its stages are starting
    assert table.status(StatusRequest(job=spec.id)).jobs[0].workers_ready == 0
    await table.renew(first.token, caller="w1", ready=True)
    await table.lease(spec.id, "w2", ready=True)
    await table.lease(spec.id, "w2", ready=True)
    assert table.status(StatusRequest(job=spec.id)).jobs[0].workers_ready == 2


class BlockingOutput(OutputStore):
    """An output whose commit records are read only once the test lets them."""

    entered: asyncio.Event
    proceed: threading.Event
    loop: asyncio.AbstractEventLoop

    def read_commit(self, shard: int) -> CommitRecord | None:
        self.loop.call_soon_threadsafe(self.entered.set)
        self.proceed.wait(timeout=30)
        return super().read_commit(shard)


def blocking_outputs(loop: asyncio.AbstractEventLoop) -> tuple[type[BlockingOutput], Any]:
    entered, proceed = asyncio.Event(), threading.Event()
    opener = type(
        "Opener", (BlockingOutput,), {"entered": entered, "proceed": proceed, "loop": loop}
    )
    return opener, proceed


async def test_a_commit_racing_a_cancel_and_a_resume_is_not_taken_for_a_deposition(
    tmp_path: Path,
) -> None:
    """A commit reading its record (slowly: an object store) when the job is cancelled and
    resumed: the cancel waits for it, so its write is of the first run, never a write with a
    revision the resume replaced (which the store would take for another master)."""
    store, clock = MemoryStore(), Clock()
    opener, proceed = blocking_outputs(asyncio.get_running_loop())
    table = LeaseTable(
        store=store, epoch=1, on_event=lambda _e: None, clock=clock, open_output=opener
    )
    spec = make_job(tmp_path, shards=2)
    proceed.set()
    assert await table.intake.submit(spec)
    proceed.clear()
    reply = await table.lease(spec.id, "w1")
    commit_record(spec, reply)
    committing = asyncio.create_task(table.commit(reply.token))
    await opener.entered.wait()
    cancelling = asyncio.create_task(table.lifecycle.cancel(spec.id, "changed my mind"))
    for _ in range(20):  # every turn the loop takes, the cancel waits for the commit's lock
        await asyncio.sleep(0)
    assert not cancelling.done()
    proceed.set()
    assert (await committing).status == "done"
    assert (await cancelling).state == "CANCELLED"
    job = table.jobs[spec.id]
    assert job.record.shards_done == 1  # the commit came first, and counts
    resumed = await table.lifecycle.resume(spec.id)
    assert (resumed.state, resumed.shards_done, resumed.shards_todo) == ("RUNNING", 1, 1)
    # The first run's token is void in the second.
    with pytest.raises(StaleToken):
        await table.renew(reply.token)


async def test_an_ended_job_records_exactly_the_commits_that_came_before_its_end(
    tmp_path: Path,
) -> None:
    """A commit waiting for its shard's lock when the job is cancelled: either it comes first
    and the ended job counts it, or it finds the job ended; never a DONE written into a job
    whose final record does not count it."""
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=2)
    assert await table.intake.submit(spec)
    first = await table.lease(spec.id, "w1")
    commit_record(spec, first)
    shard = table.jobs[spec.id].shards[0]
    await shard.lock.acquire()  # a transition of the shard under way
    committing = asyncio.create_task(table.commit(first.token))  # in the queue for the lock
    for _ in range(5):
        await asyncio.sleep(0)
    cancelling = asyncio.create_task(table.lifecycle.cancel(spec.id, "stop"))
    for _ in range(5):
        await asyncio.sleep(0)
    shard.lock.release()
    assert (await committing).status == "done"
    assert (await cancelling).state == "CANCELLED"
    final = store.jobs[spec.id][0]
    done = [r for r, _ in store.shards.values() if r.state == "DONE"]
    assert (final.shards_done, len(done)) == (1, 1)
    late = await table.lease(spec.id, "w2")
    assert late.status == "end"


async def test_a_crash_with_several_shards_held_makes_each_a_suspect_leased_alone(
    tmp_path: Path,
) -> None:
    """A worker computes one shard while it reads the next, and under load the rows of both
    are in its pipeline: a crash names neither. Each becomes a suspect, leased only to a
    worker holding nothing, which gets nothing more while it holds it; the next crash is
    then the suspect's own, and the healthy one commits with no failure counted."""
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=4, max_error_fraction=1.0)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    first = await table.lease(spec.id, "w1")
    clock.now += 0.5
    second = await table.lease(spec.id, "w1")
    assert [first.shard.index, second.shard.index] == [0, 1]  # type: ignore[union-attr]
    told = await table.reaper.worker_ended(spec.id, "w1", kind="crash", blame=True, reason="-11")
    assert (told.released, told.forgiven) == ([0, 1], 0)
    records = [store.shards[shard_key(spec.id, i)][0] for i in (0, 1)]
    assert [(r.state, r.failures, r.losses, r.suspect) for r in records] == [
        ("TODO", 0, 1, True),
        ("TODO", 0, 1, True),
    ]

    busy = await table.lease(spec.id, "w2")
    assert busy.shard is not None and busy.shard.index == 2
    passed_over = await table.lease(spec.id, "w2")  # holds shard 2: no suspect for it
    assert passed_over.shard is not None and passed_over.shard.index == 3
    suspect = await table.lease(spec.id, "w3")  # holds nothing
    assert suspect.shard is not None and suspect.shard.index == 0
    nothing_more = await table.lease(spec.id, "w3")
    assert nothing_more.status == "wait"
    assert (await table.lease(spec.id, "w2")).status == "wait"  # nor for w2, holding two
    assert job.shards[1].record.state == "TODO"

    told = await table.reaper.worker_ended(spec.id, "w3", kind="crash", blame=True, reason="-11")
    assert (told.released, told.forgiven) == ([0], 0)
    record = store.shards[shard_key(spec.id, 0)][0]
    assert (record.failures, record.losses) == (1, 1)  # alone, the crash was its own

    healthy = await table.lease(spec.id, "w4")
    assert healthy.shard is not None and healthy.shard.index == 1
    commit_record(spec, healthy)
    assert (await table.commit(healthy.token)).status == "done"
    record = store.shards[shard_key(spec.id, 1)][0]
    assert (record.state, record.failures) == ("DONE", 0)


async def test_a_shard_that_crashes_every_worker_it_meets_is_quarantined_after_max_attempts(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = make_job(tmp_path, shards=1, max_error_fraction=1.0)
    assert await table.intake.submit(spec)
    for n in range(3):
        reply = await table.lease(spec.id, f"w{n}")
        assert reply.shard is not None
        await table.reaper.worker_ended(spec.id, f"w{n}", kind="oom", blame=True, reason="oom")
    record = store.shards[shard_key(spec.id, 0)][0]
    assert (record.state, record.failures, record.losses) == ("QUARANTINED", 3, 0)


async def test_a_restarted_table_reads_lease_times_by_the_wall_clock_they_were_written_on(
    tmp_path: Path,
) -> None:
    """A master taking over 50 s after a grant gives the lease what its record has left plus
    the grace, and knows the attempt has run 50 s; one taking over long after the record ran
    out gives it the grace alone."""
    store, clock, wall = MemoryStore(), Clock(), Clock()
    wall.now = 1_700_000_000.0
    table = new_table(store, clock, wall_clock=wall)
    spec = make_job(tmp_path, shards=1, lease_s=60)
    assert await table.intake.submit(spec)
    held = await table.lease(spec.id, "w1")
    (lease,) = store.shards[shard_key(spec.id, 0)][0].leases
    assert (lease.granted_at, lease.expires_at) == (wall.now, wall.now + 60 * PERSISTED_PERIODS)
    for later, left in ((50.0, 60 * PERSISTED_PERIODS - 50 + 2), (200.0, 2.0)):
        restarted_clock, restarted_wall = Clock(), Clock()
        restarted_wall.now = wall.now + later
        restarted = new_table(store, restarted_clock, wall_clock=restarted_wall)
        await restarted.load()
        shard = restarted.jobs[spec.id].shards[0]
        assert shard.deadlines[held.token] - restarted_clock.now == left
        assert restarted_clock.now - shard.granted[held.token] == later


async def test_a_jobs_times_are_on_the_wall_clock_and_its_retention_runs_from_its_end(
    tmp_path: Path,
) -> None:
    store, clock, wall = MemoryStore(), Clock(), Clock()
    wall.now = 1_700_000_000.0
    table = new_table(store, clock, wall_clock=wall)
    spec = make_job(tmp_path, shards=1)
    assert await table.intake.submit(spec)
    reply = await table.lease(spec.id, "w1")
    commit_record(spec, reply)
    wall.now += 3_600  # an hour's work
    await table.commit(reply.token)
    record = store.jobs[spec.id][0]
    assert (record.state, record.submitted_at, record.finished_at) == (
        "SUCCEEDED",
        1_700_000_000.0,
        1_700_003_600.0,
    )
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None and manifest.created_at == wall.now
    kept = await table.lifecycle.forget_ended(now=wall.now + 60, retention_s=60)
    assert kept == [] and spec.id in table.jobs
    gone = await table.lifecycle.forget_ended(now=wall.now + 61, retention_s=60)
    assert gone == [spec.id] and table.jobs == {} and store.jobs == {}
