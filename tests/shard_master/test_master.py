"""The shard master against a real nats-server: the lease protocol, fencing, durability, intake."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY

from ebb.client.sdk import EbbClient, SubmitError, SubmitPending
from ebb.common import schema
from ebb.common.data.layout import (
    OWNER,
    OutputFile,
    OutputOwner,
    attempt_dir,
    claim_path,
    commit_path,
)
from ebb.common.data.output import OutputStore, new_commit
from ebb.common.errors import RemoteError
from ebb.common.job import JobSpec, parse_job
from ebb.common.messaging import provision
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.embedded import EmbeddedNats
from ebb.common.messaging.messages import ErrorReply, LeaseReply, LeaseRequest, ResumeRequest
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.snapshot import kv_snapshot
from ebb.common.messaging.subjects import Subjects
from ebb.shard_master.election import KEY, Leadership
from ebb.shard_master.errors import Deposed
from ebb.shard_master.service import MasterConfig, ShardMaster
from ebb.shard_master.table.intake import REASON_CHARS, REJECTIONS_KEPT, JobIntake
from ebb.shard_master.table.moves import PERSISTED_PERIODS
from ebb.shard_master.table.ownership import spec_mismatch
from ebb.shard_master.table.records import shard_key
from ebb.worker.leases import LeaseKeeper, LeaseState
from ebb.worker.service import Worker, WorkerConfig

from ..helpers import ASSETS, job_spec, wait_until, write_dataset, write_model

pytestmark = pytest.mark.timeout(120)


class Master:
    """A ShardMaster running in this event loop, that a test can stop and start again."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.service: ShardMaster | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> ShardMaster:
        self.service = ShardMaster(self.config)
        self.task = asyncio.create_task(self.service.run())
        ready = asyncio.create_task(self.service.ready.wait())
        await asyncio.wait([ready, self.task], return_when=asyncio.FIRST_COMPLETED)
        if self.task.done():
            ready.cancel()
            self.task.result()
        return self.service

    async def stop(self) -> None:
        if self.service is not None and self.task is not None:
            self.service.request_stop()
            await self.task
            self.service = self.task = None

    async def __aenter__(self) -> Master:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


@pytest.fixture
async def master(nats_config: NatsConfig, tmp_path: Path) -> AsyncIterator[Master]:
    m = Master(
        MasterConfig(
            nats=nats_config,
            id="test-master",
            data_roots=[str(tmp_path), str(ASSETS)],
            leader_ttl_s=3.0,
            speculate_after_s=0.2,
            lease_grace_s=0.5,
            reaper_interval_s=0.05,
        )
    )
    async with m:
        yield m


@pytest.fixture
async def client(nats_config: NatsConfig, master: Master) -> AsyncIterator[EbbClient]:
    async with await EbbClient.connect(nats_config) as c:
        yield c


@pytest.fixture
def subjects(prefix: str) -> Subjects:
    return Subjects(prefix)


@pytest.fixture
def api(client: EbbClient, nats_config: NatsConfig) -> MasterClient:
    # A few quick tries on "no responders" and timeouts, as every real client makes: a master
    # just (re)started, on a loaded machine, may not be heard on its first request.
    return MasterClient(client.nc, nats_config, backoff=Backoff(first_s=0.1, attempts=4))


def make_job(
    tmp_path: Path, *, rows: int = 3_000, rows_per_shard: int = 1_000, **fault: Any
) -> JobSpec:
    write_dataset(tmp_path / "data", rows=rows, row_group_size=rows_per_shard)
    write_model(tmp_path / "model.onnx")
    return parse_job(job_spec(tmp_path, rows_per_shard=rows_per_shard, fault=fault)).with_id()


def commit_record(spec: JobSpec, reply: LeaseReply, rows: int = 1_000) -> None:
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
            files=[OutputFile(path=path, rows=rows)],
            worker="w",
        )
    )


async def shards(api: MasterClient, job: str) -> dict[str, int]:
    return (await api.job(job)).shards


async def test_lease_renew_commit(tmp_path: Path, client: EbbClient, api: MasterClient) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    assert await shards(api, spec.id) == {"TODO": 3, "DOING": 0, "DONE": 0, "QUARANTINED": 0}

    reply = await api.lease(spec.id, "w1")
    assert reply.status == "granted" and reply.shard is not None
    assert (reply.shard.index, reply.attempt) == (0, 1)
    assert (await api.renew(reply.token, worker="w1")).lease_s == 10.0

    with pytest.raises(RemoteError) as e:
        await api.commit(reply.token, worker="w1", rows=1_000, error_rows=0)
    assert e.value.code == "no_commit_record"

    commit_record(spec, reply)
    assert (await api.commit(reply.token, worker="w1", rows=1_000, error_rows=0)).status == "done"
    assert (
        await api.commit(reply.token, worker="w1", rows=1_000, error_rows=0)
    ).status == "already_done"
    status = await api.job(spec.id)
    assert status.shards["DONE"] == 1 and status.rows_done == 1_000


async def test_a_lease_token_used_by_another_worker_is_refused_and_changes_nothing(
    tmp_path: Path, client: EbbClient, api: MasterClient, nc: NATS, subjects: Subjects
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    held = await api.lease(spec.id, "w1")
    assert held.shard is not None
    # The holder wrote its output and commit record: a commit would now make the shard DONE.
    commit_record(spec, held)
    kv = await nc.jetstream().key_value(subjects.shards_bucket)
    key = shard_key(spec.id, held.shard.index)
    before = await kv.get(key)

    # Another worker that learnt the token (it saw the reply, say) uses it as its own.
    for call in (
        api.renew(held.token, worker="thief"),
        api.commit(held.token, worker="thief", rows=1_000, error_rows=0),
        api.release(held.token, "mine now", worker="thief", retryable=False),
        api.release(held.token, "mine now", worker="thief", retryable=True),
    ):
        with pytest.raises(RemoteError) as e:
            await call
        assert e.value.code == "not_holder"
        assert "not granted to worker 'thief'" in e.value.message

    # Not a byte of the shard's record moved, and the holder carries on.
    after = await kv.get(key)
    assert (after.revision, after.value) == (before.revision, before.value)
    (status,) = (await api.status(spec.id, include_leases=True)).jobs
    (lease,) = status.leases
    assert (lease.worker, lease.attempt) == ("w1", 1)
    assert status.workers_busy == ["w1"]  # told without the leases too
    assert (await api.status(spec.id)).jobs[0].workers_busy == ["w1"]
    assert (await api.renew(held.token, worker="w1")).lease_s == 10.0
    assert (await api.commit(held.token, worker="w1", rows=1_000, error_rows=0)).status == "done"


async def test_the_lease_protocol_is_asked_on_the_callers_own_subject(
    tmp_path: Path, client: EbbClient, api: MasterClient, nc: NATS, subjects: Subjects
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    before = await api.job(spec.id)
    # A lease asked on one worker's subject for another worker: refused.
    asked = schema.encode(LeaseRequest(job=spec.id, worker="w1"))
    reply = await nc.request(subjects.worker_op("lease", "thief"), asked, timeout=5)
    error = schema.decode(ErrorReply, reply.data)
    assert error.code == "bad_request" and "for worker 'w1'" in error.message
    # The subject without a worker (which named no caller) says where to ask instead.
    for op in ("lease", "renew", "commit", "release"):
        reply = await nc.request(subjects.master(op), asked, timeout=5)
        error = schema.decode(ErrorReply, reply.data)
        assert error.code == "bad_request"
        assert f"{subjects.prefix}.master.{op}.<worker id>" in error.message
    assert await api.job(spec.id) == before


async def test_the_whole_job_ends_with_a_manifest_of_winners(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    # A losing attempt's folder, which must be collected as garbage.
    OutputStore(spec.output.uri).write_file(f"{attempt_dir(1, 7)}/part-00000.parquet", b"x")
    for _ in range(3):
        reply = await api.lease(spec.id, "w1")
        commit_record(spec, reply)
        await api.commit(reply.token, worker="w1", rows=1_000, error_rows=0)
    assert (await api.lease(spec.id, "w1")).status == "end"
    final = await client.wait(spec.id)
    assert final.state == "SUCCEEDED"
    manifest = json.loads(Path(final.manifest).read_text())
    assert [f["path"] for f in manifest["files"]] == [
        f"{attempt_dir(i, 1)}/part-00000.parquet" for i in range(3)
    ]
    assert manifest["rows"] == 3_000
    assert not (tmp_path / "out" / attempt_dir(1, 7)).exists()


async def test_an_expired_token_can_neither_renew_nor_commit(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=1_000, lease_s=0.5)
    await client.submit(spec)
    zombie = await api.lease(spec.id, "zombie")
    # Nobody renews: the lease expires and the shard goes back to the queue.
    await wait_until(lambda: _is_todo(api, spec.id), timeout=10, what="the lease to expire")

    for call in (
        api.renew(zombie.token, worker="zombie"),
        api.commit(zombie.token, worker="zombie", rows=1, error_rows=0),
    ):
        with pytest.raises(RemoteError) as e:
            await call
        assert e.value.code == "stale_token"

    fresh = await api.lease(spec.id, "w2")
    assert fresh.shard == zombie.shard and fresh.attempt == 2
    # The zombie wakes up, writes its files and a commit record, and commits: refused, and the
    # shard stays with its current holder.
    commit_record(spec, zombie)
    with pytest.raises(RemoteError) as e:
        await api.commit(zombie.token, worker="zombie", rows=1, error_rows=0)
    assert e.value.code == "stale_token"
    assert (await shards(api, spec.id))["DOING"] == 1
    # The holder finds the commit record (the zombie's attempt won the race to create it) and
    # reports it: the shard is done exactly once, with the zombie's files.
    assert (await api.commit(fresh.token, worker="w2", rows=1, error_rows=0)).status == "done"
    final = await client.wait(spec.id)
    manifest = json.loads(Path(final.manifest).read_text())
    assert [f["attempt"] for f in manifest["files"]] == [1]


async def _is_todo(api: MasterClient, job: str) -> bool:
    return (await shards(api, job))["TODO"] == 1


async def test_poisoned_shard_is_quarantined_and_fails_the_job(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=3_000, max_attempts=2)
    await client.submit(spec)
    states = []
    for expected in (0, 1, 2, 0):  # a poisoned shard goes to the back of the queue
        reply = await api.lease(spec.id, "w1")
        assert reply.shard is not None and reply.shard.index == expected
        poisoned = expected == 0
        if poisoned:
            states.append(
                (
                    await api.release(reply.token, "model crashed", worker="w1", retryable=False)
                ).state
            )
    assert states == ["TODO", "QUARANTINED"]
    # One shard in three lost is far over the 1% of rows allowed to fail: the job fails now,
    # without waiting for the rest.
    final = await client.wait(spec.id)
    assert final.state == "FAILED"
    assert "1000 failed rows exceed max_error_fraction 0.01" in final.reason
    assert "shard 0 quarantined: model crashed" in final.reason


async def test_retryable_release_goes_to_the_tail(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    first = await api.lease(spec.id, "w1")
    assert (await api.release(first.token, "draining", worker="w1", retryable=True)).state == "TODO"
    order = []
    for _ in range(3):
        reply = await api.lease(spec.id, "w1")
        assert reply.shard is not None
        order.append((reply.shard.index, reply.attempt))
    assert order == [(1, 1), (2, 1), (0, 2)]


async def test_a_retried_lease_request_gets_the_same_lease(
    tmp_path: Path, client: EbbClient, nc: NATS, subjects: Subjects
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    request = schema.encode(LeaseRequest(job=spec.id, worker="w1", request_id="r-1"))
    subject = subjects.worker_op("lease", "w1")
    first = schema.decode(LeaseReply, (await nc.request(subject, request, timeout=5)).data)
    again = schema.decode(LeaseReply, (await nc.request(subject, request, timeout=5)).data)
    assert first.token == again.token


async def test_malformed_requests_get_an_error_and_change_nothing(
    tmp_path: Path, client: EbbClient, api: MasterClient, nc: NATS, subjects: Subjects
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    before = await api.job(spec.id)
    for op, payload in [
        ("lease", b"\x00garbage"),
        ("lease", msgpack.packb({"v": 1, "job": spec.id})),
        ("commit", msgpack.packb({"v": 1, "token": 12})),
        ("renew", msgpack.packb({"v": 42, "token": "x"})),
        ("release", msgpack.packb({"v": 1, "token": "not:a:real:token:at", "reason": "x"})),
    ]:
        reply = await nc.request(subjects.worker_op(op, "w1"), payload, timeout=5)
        error = schema.decode(ErrorReply, reply.data)
        assert error.code in ("bad_request", "stale_token"), (op, error)
    after = await api.job(spec.id)
    assert after == before


async def test_a_malformed_job_message_is_dropped_counted_and_changes_nothing(
    client: EbbClient, api: MasterClient, nc: NATS, subjects: Subjects
) -> None:
    def invalid() -> float:
        return REGISTRY.get_sample_value("ebb_invalid_messages_total", {"source": "submit"}) or 0.0

    before = invalid()
    js = nc.jetstream()
    await js.publish(subjects.submit, b"\x93not a map", headers={"Nats-Msg-Id": "junk-1"})
    await js.publish(subjects.submit, b"{json?", headers={"Content-Type": "application/json"})
    await wait_until(lambda: invalid() - before >= 2, timeout=10, what="both messages refused")
    consumer = await js.consumer_info(subjects.jobs_stream, "ebb-master")
    assert consumer.num_pending == 0 and consumer.num_ack_pending == 0
    assert (await api.status()).jobs == []
    await assert_no_job_records(nc, subjects)


async def assert_no_job_records(nc: NATS, subjects: Subjects) -> None:
    # Not nats.py's `keys()`, which can end its read early and find none
    # (nats-io/nats.py#842): this check would then pass whatever is there.
    assert await kv_snapshot(nc.jetstream(), subjects.jobs_bucket, ">") == []


async def test_a_bad_spec_is_rejected_with_its_reason(
    tmp_path: Path, client: EbbClient, api: MasterClient, nc: NATS, subjects: Subjects
) -> None:
    spec = make_job(tmp_path)
    # The client validates too; a raw publisher is trusted by nobody.
    body = spec.to_dict()
    body["id"] = "bad-spec"
    body["pipeline"]["stages"][0]["batch_size"] = -4
    body["v"] = 1
    await nc.jetstream().publish(subjects.submit, msgpack.packb(body))
    reason = await wait_until(lambda: _rejection(api, "bad-spec"), timeout=10, what="the rejection")
    assert "pipeline.stages[0].batch_size: must be > 0" in reason

    missing = replace(spec, id="no-input", input=replace(spec.input, uri=str(tmp_path / "none")))
    with pytest.raises(SubmitError, match="does not exist"):
        await client.submit(missing)

    outside = replace(spec, id="outside", output=replace(spec.output, uri="/elsewhere/out"))
    with pytest.raises(SubmitError, match="outside the allowed data roots"):
        await client.submit(outside)
    assert (await api.status()).jobs == []
    await assert_no_job_records(nc, subjects)


async def test_rejections_are_remembered_within_bounds(
    tmp_path: Path, api: MasterClient, nc: NATS, subjects: Subjects
) -> None:
    """More refused submissions than are kept, each with a reason that quotes a 20 kB path:
    the newest are kept, their reasons cut, and the status reply that carries them all fits in
    one NATS message."""
    body = make_job(tmp_path).to_dict()
    body["v"] = 1
    body["output"]["uri"] = "/elsewhere/" + "x" * 20_000
    count = REJECTIONS_KEPT + 44
    js = nc.jetstream()
    for n in range(count):
        await js.publish(subjects.submit, msgpack.packb({**body, "id": f"bad-{n:04d}"}))
    last = f"bad-{count - 1:04d}"
    reason = await wait_until(lambda: _rejection(api, last), timeout=60, what="the last one")
    assert "outside the allowed data roots" in reason and len(reason) == REASON_CHARS
    reply = await api.status()
    assert len(reply.rejected) == REJECTIONS_KEPT
    assert set(reply.rejected) == {f"bad-{n:04d}" for n in range(count - REJECTIONS_KEPT, count)}
    assert all(len(r) <= REASON_CHARS for r in reply.rejected.values())
    assert reply.jobs == []


async def _rejection(api: MasterClient, job: str) -> str:
    try:
        return (await api.status(job)).rejected.get(job, "")
    except RemoteError as e:
        assert e.code == "not_found"
        return ""


async def test_another_jobs_output_folder_is_refused_saying_what_it_holds(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path)
    store = OutputStore(spec.output.uri)
    assert store.claim("someone-else", fields={})[0].job == "someone-else"
    # A job of another stack that never said how it ended: what the root holds is counted.
    with pytest.raises(SubmitError) as e:
        await client.submit(spec)
    said = str(e.value)
    assert "holds the unfinished output of job someone-else (0 shards committed; it is " in said
    assert "`ebb run JOB.yaml --resume` finishes it on this machine" in said

    store.create_commit(new_commit(job="someone-else", shard=0, attempt=1, files=[], worker="w"))
    store.record_end("someone-else", state="FAILED", shards_done=2, shards_total=3, rows_done=2000)
    with pytest.raises(SubmitError) as e:
        await client.submit(replace(spec, id=f"{spec.id}-2"))
    said = str(e.value)
    assert "unfinished output of job someone-else (FAILED, 2 of 3 shards, 2,000 rows" in said
    assert "`ebb run JOB.yaml --resume` finishes it" in said

    store.reclaim("someone-else")
    store.record_end("someone-else", state="SUCCEEDED", shards_done=3, shards_total=3, rows_done=3)
    with pytest.raises(SubmitError) as e:
        await client.submit(replace(spec, id=f"{spec.id}-3"))
    said = str(e.value)
    assert "complete output of job someone-else (SUCCEEDED, 3 of 3 shards, 3 rows" in said
    assert "nothing to finish" in said and "resume" not in said


async def test_replace_removes_only_a_failed_or_cancelled_jobs_output_and_only_the_one_named(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path)
    out = Path(spec.output.uri)
    store = OutputStore(spec.output.uri)
    store.claim("someone-else", fields={})
    store.write_file("data/shard=00000/attempt=1/part-00000.parquet", b"rows")
    store.create_commit(new_commit(job="someone-else", shard=0, attempt=1, files=[], worker="w"))

    async def refused(job_id: str, named: str) -> str:
        with pytest.raises(SubmitError) as e:
            await client.submit(replace(spec, id=job_id), replace_output_of=named)
        assert store.owner() == "someone-else" and (out / commit_path(0)).exists()
        return " ".join(str(e.value).split())

    said = await refused(f"{spec.id}-1", "someone-else")  # it never said how it ended
    assert "how that job ended was never recorded" in said and "--resume" in said
    store.record_end("someone-else", state="FAILED", shards_done=1, shards_total=3, rows_done=9)
    said = await refused(f"{spec.id}-2", "another-job")
    assert "belongs to job someone-else now, not to job another-job whose output" in said

    await client.submit(spec, replace_output_of="someone-else")
    assert (await api.job(spec.id)).state == "RUNNING"
    owner = store.owner_record()
    assert owner is not None
    assert (owner.job, owner.took_over_from, owner.replaced, owner.removing) == (
        spec.id,
        "someone-else",
        True,
        False,
    )
    assert not (out / commit_path(0)).exists() and not (out / "data").exists()

    # A job still running is not replaced (a complete output never is: tests/client).
    with pytest.raises(SubmitError) as e:
        await client.submit(replace(spec, id=f"{spec.id}-3"), replace_output_of=spec.id)
    assert f"is being written by job {spec.id} (RUNNING" in str(e.value)
    assert f"cancel it first (`ebb cancel {spec.id}`)" in str(e.value)
    assert store.owner() == spec.id and (await api.job(spec.id)).state == "RUNNING"


async def test_a_replacement_cut_short_is_finished_when_its_job_is_submitted_again(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    """A master that died after claiming the root to replace its output, before all of it
    was removed: the job's submission comes back (it was never acked) and finishes it."""
    spec = make_job(tmp_path)
    out = Path(spec.output.uri)
    store = OutputStore(spec.output.uri)
    store.claim("failed", fields={})
    store.create_commit(new_commit(job="failed", shard=0, attempt=1, files=[], worker="w"))
    owner = store.record_end("failed", state="FAILED", shards_done=1, shards_total=3, rows_done=9)
    assert owner is not None
    claim = OutputOwner(
        job=spec.id, generation=1, took_over_from="failed", replaced=True, removing=True
    )
    (out / claim_path(1)).parent.mkdir()
    (out / claim_path(1)).write_text(json.dumps(schema.dump(claim)))

    await client.submit(spec)  # no header: the claim is its own already
    assert (await api.job(spec.id)).state == "RUNNING"
    assert not (out / commit_path(0)).exists()
    after = store.owner_record()
    assert after is not None and (after.job, after.removing) == (spec.id, False)


async def test_a_job_that_committed_nothing_lets_the_next_job_take_its_output_folder(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    await api.lease(spec.id, "w1")  # it ran, but committed nothing
    assert (await api.cancel(spec.id)).state == "CANCELLED"
    owner = OutputStore(spec.output.uri).owner_record()
    assert owner is not None and owner.released and owner.state == "CANCELLED"

    second = replace(spec, id=f"{spec.id}-2")
    await client.submit(second)
    assert (await api.job(second.id)).state == "RUNNING"
    owner = OutputStore(spec.output.uri).owner_record()
    assert owner is not None
    assert (owner.job, owner.took_over_from, owner.released) == (second.id, spec.id, False)
    # The first job let go of the folder: it cannot come back into it.
    with pytest.raises(RemoteError) as e:
        await client.resume(spec.id)
    assert e.value.code == "not_resumable" and f"belongs to job {second.id} now" in e.value.message


async def test_a_job_carries_on_in_its_own_output_only_computing_the_same_rows(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    """As `ebb run --resume` on a new stack does: the same id, its earlier output kept. What
    decides the rows must be as it was; how fast they are computed may change."""
    spec = make_job(tmp_path)
    changed = replace(spec, input=replace(spec.input, rows_per_shard=500))
    OutputStore(spec.output.uri).claim(spec.id, fields=changed.output_fields())
    with pytest.raises(SubmitError) as e:
        await client.submit(spec)
    assert "computed with another spec: input.rows_per_shard differs (500 then, 1000 now)" in str(
        e.value
    )

    again = replace(spec, id=f"{spec.id}-2", output=replace(spec.output, uri=str(tmp_path / "o2")))
    OutputStore(again.output.uri).claim(again.id, fields=again.output_fields())
    faster = [
        replace(s, batch_size=8, batch_wait_s=0.5, workers=2, max_workers=4)
        for s in again.pipeline.stages
    ]
    await client.submit(replace(again, pipeline=replace(again.pipeline, stages=faster)))
    assert (await api.job(again.id)).state == "RUNNING"


async def test_an_output_claimed_by_an_earlier_version_is_carried_on_with_the_same_spec(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    """An owner record with only a digest of whole sections (no fields) still admits the spec
    it was made from, and refuses another one saying why it cannot name the field."""
    spec = make_job(tmp_path)

    def as_an_earlier_version_claimed_it(job: JobSpec) -> None:
        out = Path(job.output.uri)
        out.mkdir(parents=True)
        record = {"job": job.id, "claimed_at": 1.0, "spec_digest": job.whole_sections_digest()}
        (out / OWNER).write_text(json.dumps(record))

    as_an_earlier_version_claimed_it(spec)
    await client.submit(spec)
    assert (await api.job(spec.id)).state == "RUNNING"

    second = replace(spec, id=f"{spec.id}-2", output=replace(spec.output, uri=str(tmp_path / "o2")))
    as_an_earlier_version_claimed_it(second)
    faster = _every_stage(second, batch_size=7)
    with pytest.raises(SubmitError, match="keeps only a digest of the input, pipeline and"):
        await client.submit(faster)


def _stage(spec: JobSpec, index: int, **changes: Any) -> JobSpec:
    stages = list(spec.pipeline.stages)
    stages[index] = replace(stages[index], **changes)
    return replace(spec, pipeline=replace(spec.pipeline, stages=stages))


def _every_stage(spec: JobSpec, **changes: Any) -> JobSpec:
    stages = [replace(s, **changes) for s in spec.pipeline.stages]
    return replace(spec, pipeline=replace(spec.pipeline, stages=stages))


# Each: how the spec changes between two runs into one output, and what the refusal names
# ("": none, the run carries on). make_job's pipeline: Features, model.onnx, TopClass.
SPEC_CHANGES: dict[str, tuple[Callable[[JobSpec], JobSpec], str]] = {
    "shards cut otherwise": (
        lambda s: replace(s, input=replace(s.input, rows_per_shard=7)),
        "input.rows_per_shard differs (1000 then, 7 now)",
    ),
    "another model, run otherwise": (
        lambda s: _stage(s, 1, model="/elsewhere/other.onnx", dtype="float16", threads=4),
        "pipeline.stages[1].dtype and pipeline.stages[1].model differ",
    ),
    "a modelet's parameters": (
        lambda s: _stage(s, 0, params={"columns": ["x"], "scale": 2}),
        "pipeline.stages[0].params.columns and pipeline.stages[0].params.scale differ",
    ),
    "a stage dropped": (
        lambda s: replace(s, pipeline=replace(s.pipeline, stages=s.pipeline.stages[:2])),
        "pipeline.stages[2].dtype, pipeline.stages[2].fanin, ",
    ),
    "another output column": (
        lambda s: replace(s, output=replace(s.output, carryover=["id"])),
        'output.carryover differs (["id", "customer"] then, ["id"] now)',
    ),
    "batching and placement": (
        lambda s: _every_stage(
            s, batch_size=1, batch_wait_s=1.0, device="cuda", workers=2, max_workers=3, name=""
        ),
        "",
    ),
    "the output moved, cut in smaller files": (
        lambda s: replace(s, output=replace(s.output, uri="/moved/out", max_rows_per_file=10)),
        "",
    ),
    "resources and fault policy": (
        lambda s: replace(
            s,
            resources=replace(s.resources, max_workers=8, cpu=4.0),
            fault=replace(s.fault, lease_s=5.0, batch_timeout_s=9.0, max_attempts=9),
            priority=3,
        ),
        "",
    ),
}


@pytest.mark.parametrize("case", list(SPEC_CHANGES))
def test_a_spec_may_carry_on_in_its_output_only_computing_the_same_rows(
    tmp_path: Path, case: str
) -> None:
    change, said = SPEC_CHANGES[case]
    spec = make_job(tmp_path)
    owner = OutputOwner(job=spec.id, output_fields=spec.output_fields())
    new = change(spec)
    refusal = spec_mismatch("out/", owner, new, new.output_fields())
    if said:
        assert said in refusal
    else:
        assert refusal == ""
        assert new.output_digest() == spec.output_digest()


async def test_submitting_twice_runs_one_job(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    await client.submit(spec)
    assert [j.id for j in (await api.status()).jobs] == [spec.id]
    assert (await shards(api, spec.id))["TODO"] == 3


async def test_json_submission_from_any_nats_client(
    tmp_path: Path, client: EbbClient, api: MasterClient, nc: NATS, subjects: Subjects
) -> None:
    spec = make_job(tmp_path)
    payload = json.dumps({**spec.to_dict(), "id": "from-json"}).encode()
    await nc.jetstream().publish(
        subjects.submit, payload, headers={"Content-Type": "application/json"}
    )
    status = await wait_until(lambda: _running(api, "from-json"), timeout=10, what="the job")
    assert status.state == "RUNNING"


async def _job_or_none(api: MasterClient, job: str) -> Any:
    try:
        return await api.job(job)
    except RemoteError:
        return None


async def _running(api: MasterClient, job: str) -> Any:
    """The job once it runs: its record is SUBMITTED for a moment while it is planned."""
    status = await _job_or_none(api, job)
    return status if status is not None and status.state != "SUBMITTED" else None


async def test_cancel_voids_every_lease(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    held = await api.lease(spec.id, "w1")
    assert (await api.cancel(spec.id)).state == "CANCELLED"
    assert (await api.lease(spec.id, "w2")).status == "end"
    with pytest.raises(RemoteError) as e:
        await api.renew(held.token, worker="w1")
    assert e.value.code == "job_ended"


async def test_a_restarted_master_resumes_every_lease(
    tmp_path: Path, master: Master, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    held = await api.lease(spec.id, "w1")
    done = await api.lease(spec.id, "w1")
    commit_record(spec, done)
    await api.commit(done.token, worker="w1", rows=1_000, error_rows=0)

    await master.stop()
    restarted = await master.start()
    assert restarted.table is not None
    status = await api.job(spec.id)
    assert status.shards == {"TODO": 1, "DOING": 1, "DONE": 1, "QUARANTINED": 0}
    # The lease survived, with a fresh full period, and its holder carries on.
    assert (await api.renew(held.token, worker="w1")).lease_s == 10.0
    commit_record(spec, held)
    assert (await api.commit(held.token, worker="w1", rows=1_000, error_rows=0)).status == "done"
    assert (await api.lease(spec.id, "w1")).attempt == 1


async def test_speculative_attempt_at_the_tail_first_commit_wins(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=2_000)
    await client.submit(spec)
    slow = await api.lease(spec.id, "slow")
    fast = await api.lease(spec.id, "fast")
    commit_record(spec, fast)
    await api.commit(fast.token, worker="fast", rows=1_000, error_rows=0)
    # Nothing left in the queue: the idle worker gets a second attempt of the straggler, once
    # it has run longer than the other shards did.
    backup = await wait_until(
        lambda: _granted(api, spec.id, "fast"), timeout=10, what="a speculative lease"
    )
    assert backup.speculative and backup.shard == slow.shard and backup.attempt == 2
    commit_record(spec, backup)
    assert (
        await api.commit(backup.token, worker="fast", rows=1_000, error_rows=0)
    ).status == "done"
    # That was the last shard: the job is over, and the straggler's late commit is void.
    with pytest.raises(RemoteError) as e:
        await api.commit(slow.token, worker="slow", rows=1_000, error_rows=0)
    assert e.value.code == "job_ended"
    final = await client.wait(spec.id)
    assert final.state == "SUCCEEDED" and final.rows_done == 2_000


async def _granted(api: MasterClient, job: str, worker: str) -> LeaseReply | None:
    reply = await api.lease(job, worker)
    return reply if reply.status == "granted" else None


async def test_a_worker_that_committed_and_died_is_not_redone(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    # One attempt allowed: before, an expiry here quarantined the shard and then deleted the
    # output its attempt had committed.
    spec = make_job(tmp_path, rows=1_000, lease_s=0.5, max_attempts=1)
    await client.submit(spec)
    reply = await api.lease(spec.id, "dies-after-commit-record")
    commit_record(spec, reply)  # ...and the worker dies before telling the master
    final = await asyncio.wait_for(client.wait(spec.id), 30)
    assert final.state == "SUCCEEDED", final.reason
    manifest = json.loads(Path(final.manifest).read_text())
    assert [(f["shard"], f["attempt"]) for f in manifest["files"]] == [(0, 1)]
    assert (tmp_path / "out" / attempt_dir(0, 1) / "part-00000.parquet").exists()


async def test_ending_a_job_does_not_stop_other_jobs_leases_from_expiring(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    first = make_job(tmp_path / "a", rows=1_000, lease_s=0.3)
    second = make_job(tmp_path / "b", rows=1_000, lease_s=0.3)
    await client.submit(first)
    await client.submit(second)
    await api.lease(first.id, "w1")
    await api.lease(second.id, "w2")
    await api.cancel(first.id)  # its lease is still in the expiry heap
    await wait_until(lambda: _is_todo(api, second.id), timeout=10, what="the second's expiry")


async def test_a_message_that_breaks_validation_in_odd_ways_only_rejects_itself(
    tmp_path: Path, client: EbbClient, api: MasterClient, nc: NATS, subjects: Subjects
) -> None:
    spec = make_job(tmp_path)
    (tmp_path / "afile").write_text("not a folder")
    bad_bodies = [
        {**spec.to_dict(), "id": "nul-byte", "output": {"uri": str(tmp_path / "o\x00ut")}},
        {
            **spec.to_dict(),
            "id": "under-a-file",
            "output": {"uri": str(tmp_path / "afile" / "out")},
        },
        {**spec.to_dict(), "id": "nan-lease", "fault": {"lease_s": float("nan")}},
    ]
    for body in bad_bodies:
        await nc.jetstream().publish(subjects.submit, msgpack.packb({**body, "v": 1}))
    for body in bad_bodies:
        job_id = str(body["id"])
        reason = await wait_until(
            functools.partial(_rejection, api, job_id), timeout=10, what=f"{job_id} refused"
        )
        assert reason
    # ...and the master still takes good jobs.
    await client.submit(spec)
    assert (await api.job(spec.id)).state == "RUNNING"
    assert await _rejection(api, "nan-lease") == "fault.lease_s: expected a finite number, got nan"


async def test_two_jobs_cannot_share_an_output_folder(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    first = make_job(tmp_path)
    await client.submit(first)
    second = replace(first, id="second-job")
    with pytest.raises(SubmitError) as e:
        await client.submit(second)
    said = str(e.value)
    assert f"is being written by job {first.id} (RUNNING, 0 of 3 shards, 0 rows committed" in said
    assert f"`ebb cancel {first.id}`" in said


async def test_submit_returns_once_the_job_is_planned_even_when_planning_is_slow(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    # Thousands of shards take the master longer to plan and persist than the client waits
    # for the acceptance event before it asks for the status instead.
    spec = make_job(tmp_path, rows=20_000, rows_per_shard=2)
    # The second submission is a duplicate that arrives while the first is being planned.
    first, second = await asyncio.gather(client.submit(spec), client.submit(spec))
    assert first == second == spec.id
    status = await api.job(spec.id)
    assert status.state == "RUNNING"
    assert status.shards["TODO"] == 10_000


async def test_another_jobs_commit_record_quarantines_the_shard_with_the_reason(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=2_000, max_error_fraction=1.0)
    await client.submit(spec)
    # A straggler of a job that wrote into this output root before has left a record for
    # each shard: no attempt of ours can ever create one.
    straggler = replace(spec, id="straggler-job")
    committing = await api.lease(spec.id, "w1")
    commit_record(straggler, committing)
    with pytest.raises(RemoteError) as e:
        await api.commit(committing.token, worker="w1", rows=1_000, error_rows=0)
    assert e.value.code == "quarantined"
    assert "belongs to job straggler-job" in e.value.message
    # A worker that hands the shard back as retryable (its record lost the race to create)
    # does not send it round again.
    releasing = await api.lease(spec.id, "w2")
    commit_record(straggler, releasing)
    reply = await api.release(releasing.token, "commit not taken", worker="w2", retryable=True)
    assert reply.state == "QUARANTINED"
    final = await client.wait(spec.id)
    assert final.state == "FAILED"
    assert "shard 1 quarantined: the commit record of shard 1" in final.reason
    assert "belongs to job straggler-job" in final.reason


async def test_a_restarted_master_keeps_a_lease_no_longer_than_its_deadline_plus_a_grace(
    tmp_path: Path, master: Master, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=1_000, lease_s=2)
    await client.submit(spec)
    await api.lease(spec.id, "gone")  # ...and its holder is never heard of again
    await master.stop()
    loop = asyncio.get_running_loop()
    # The lease as KV records it: PERSISTED_PERIODS periods (renewals are not all written).
    deadline = loop.time() + 2 * PERSISTED_PERIODS
    await wait_until(lambda: loop.time() > deadline, timeout=10, what="the lease's deadline")
    await master.start()
    # Not a fresh full period: a master that restarts more often than a lease lasts would
    # otherwise keep the shard from everyone forever.
    (lease,) = (await api.status(spec.id, include_leases=True)).jobs[0].leases
    assert lease.expires_in_s <= master.config.lease_grace_s
    await wait_until(lambda: _is_todo(api, spec.id), timeout=10, what="the lease to expire")


async def test_speculation_survives_a_master_restart(
    tmp_path: Path, master: Master, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=2_000)
    await client.submit(spec)
    slow = await api.lease(spec.id, "slow")
    fast = await api.lease(spec.id, "fast")
    commit_record(spec, fast)
    await api.commit(fast.token, worker="fast", rows=1_000, error_rows=0)
    # The shard times that speculation compares with, and the straggler's age, are not lost.
    await master.stop()
    await master.start()
    backup = await wait_until(
        lambda: _granted(api, spec.id, "fast"), timeout=5, what="a speculative lease"
    )
    assert backup.speculative and backup.shard == slow.shard


async def test_a_worker_keeps_reporting_its_commit_record_through_a_long_master_outage(
    tmp_path: Path, master: Master, client: EbbClient, nats_config: NatsConfig
) -> None:
    spec = make_job(tmp_path, rows=1_000, lease_s=1)
    await client.submit(spec)
    worker = Worker(WorkerConfig(nats=nats_config, job=spec.id, id="w1"))
    master_api = MasterClient(client.nc, nats_config, backoff=Backoff(first_s=0.05, max_s=0.2))
    keeper = LeaseKeeper(master_api, worker="w1")
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    reply = await master_api.lease(spec.id, "w1")
    assert reply.shard is not None
    commit_record(spec, reply)  # the worker's record exists...
    await master.stop()  # ...and the master goes away before it hears of it
    record = OutputStore(spec.output.uri).read_commit(reply.shard.index)
    assert record is not None
    active = keeper.hold(reply, sent_at=sent_at)
    reporting = asyncio.create_task(worker.reports.commit(master_api, active, record))
    active.task = reporting
    renewer = asyncio.create_task(keeper.renewer())
    try:
        # The renewer tries (every 0.1s) and fails, well past the lease's deadline.
        await wait_until(
            lambda: loop.time() > active.deadline + 1, timeout=10, what="the deadline to pass"
        )
        assert active.state is LeaseState.COMMITTED and not reporting.done()
        await master.start()
        # The report, or the master's own look at the output once the restored lease runs
        # out (the renewer may then learn first that the lease is over): done either way.
        final = await asyncio.wait_for(client.wait(spec.id), 20)
        assert final.state == "SUCCEEDED" and final.rows_done == 1_000
    finally:
        renewer.cancel()
        reporting.cancel()
        await asyncio.wait([renewer, reporting])


async def test_a_submission_a_dead_master_never_acked_is_taken_up_at_once(
    tmp_path: Path,
    master: Master,
    client: EbbClient,
    api: MasterClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_job(tmp_path)
    planning = asyncio.Event()

    async def dies_while_planning(_intake: JobIntake, _spec: JobSpec, **_: str) -> bool:
        planning.set()
        await asyncio.Event().wait()  # until the master is gone
        return False

    monkeypatch.setattr(JobIntake, "submit", dies_while_planning)
    submitting = asyncio.create_task(client.submit(spec))
    try:
        await wait_until(planning.is_set, timeout=10, what="the master to take the job")
        await master.stop()  # mid-planning: the message is taken but never acked
        monkeypatch.undo()
        await master.start()
        # Not after the stream's ack_wait (two minutes).
        assert await asyncio.wait_for(asyncio.shield(submitting), 20) == spec.id
    finally:
        submitting.cancel()
        await asyncio.wait([submitting])
    assert (await api.job(spec.id)).state == "RUNNING"


async def test_a_submission_no_master_accepts_in_time_is_said_to_be_queued_and_then_runs(
    tmp_path: Path, nats_config: NatsConfig, nc: NATS, subjects: Subjects
) -> None:
    spec = make_job(tmp_path)
    config = MasterConfig(nats=nats_config, id="late", data_roots=[str(tmp_path), str(ASSETS)])
    # The stack's stream exists, but its master is away (restarting, say).
    await provision.ensure_jetstream(nc.jetstream(), subjects, leader_ttl_s=config.leader_ttl_s)
    async with await EbbClient.connect(nats_config) as client:
        with pytest.raises(SubmitPending) as e:
            await client.submit(spec, accept_timeout_s=1.5)
        assert e.value.job_id == spec.id
        assert "is queued" in str(e.value) and "runs once" in str(e.value)
        async with Master(config):
            final = await wait_until(
                lambda: _running(MasterClient(nc, nats_config), spec.id),
                timeout=20,
                what="the queued job to be accepted and planned",
            )
    assert final.state == "RUNNING"


async def test_a_lone_master_leads_again_after_a_nats_outage_longer_than_its_ttl(
    tmp_path: Path, nats_server: EmbeddedNats, nats_config: NatsConfig
) -> None:
    spec = make_job(tmp_path)
    config = MasterConfig(
        nats=nats_config, id="lone", data_roots=[str(tmp_path), str(ASSETS)], leader_ttl_s=1.0
    )
    async with Master(config) as master:
        assert master.service is not None and master.task is not None
        service, task = master.service, master.task
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(nats_server.stop)
        outage_over = loop.time() + 3 * config.leader_ttl_s  # past the TTL: it cannot lead on
        await wait_until(
            lambda: task.done() or (not service.ready.is_set() and loop.time() > outage_over),
            timeout=30,
            what="the master to notice it no longer leads",
        )
        await asyncio.to_thread(nats_server.start)
        await wait_until(
            lambda: task.done() or service.ready.is_set(),
            timeout=60,
            what="the master to lead again",
        )
        assert not task.done(), task.exception()
        async with await EbbClient.connect(nats_config) as client:
            await client.submit(spec)
            assert (await client.job(spec.id)).state == "RUNNING"


async def test_a_refresh_written_though_its_reply_was_lost_is_not_a_deposition(
    nc: NATS, subjects: Subjects
) -> None:
    await provision.ensure_jetstream(nc.jetstream(), subjects, leader_ttl_s=0.9)
    kv = await nc.jetstream().key_value(subjects.leader_bucket)
    ours = Leadership(kv, holder="m", ttl_s=0.9)
    await ours.acquire()
    # Our refresh went through, but its reply never came back (a server killed under it):
    # the next refresh meets a revision it has not seen.
    landed = await kv.update(KEY, ours.value, last=ours.revision)
    keepalive = asyncio.create_task(ours.keepalive())
    try:
        await wait_until(
            lambda: keepalive.done() or ours.revision > landed,
            timeout=10,
            what="the leader to refresh past its own lost write",
        )
        assert not keepalive.done(), keepalive.exception()
        # A restarted process under the same id takes the key back: this one is deposed.
        restarted = Leadership(kv, holder="m", ttl_s=0.9)
        await restarted.acquire()
        with pytest.raises(Deposed):
            await asyncio.wait_for(keepalive, 10)
    finally:
        keepalive.cancel()
        await asyncio.wait([keepalive])


async def test_a_master_that_cannot_set_up_on_nats_keeps_trying_and_then_leads(
    tmp_path: Path, nats_config: NatsConfig, nc: NATS, subjects: Subjects, prefix: str
) -> None:
    """Set-up failing (here: a stream already holds the submission subject, so the jobs
    stream cannot be made) is retried with backoff, never the end of the master."""
    js = nc.jetstream()
    await js.add_stream(name=f"{prefix}-squatter", subjects=[subjects.submit])
    config = MasterConfig(nats=nats_config, id="patient", data_roots=[str(tmp_path)])

    def failures() -> float:
        return REGISTRY.get_sample_value("ebb_master_setup_failures_total") or 0.0

    before = failures()
    service = ShardMaster(config)
    task = asyncio.create_task(service.run())
    try:
        await wait_until(lambda: failures() >= before + 2, timeout=30, what="failed set-ups")
        assert not task.done() and not service.ready.is_set()
        await js.delete_stream(f"{prefix}-squatter")
        await wait_until(
            lambda: task.done() or service.ready.is_set(), timeout=30, what="the master to lead"
        )
        assert not task.done(), task.exception()
    finally:
        service.request_stop()
        await asyncio.wait_for(task, 30)


# -- resume --------------------------------------------------------------------------------


async def test_resume_of_a_failed_job_keeps_its_commits_and_retries_the_rest(
    tmp_path: Path, master: Master, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=4_000, max_attempts=2)
    await client.submit(spec)
    done = await api.lease(spec.id, "w1")
    commit_record(spec, done)
    assert (await api.commit(done.token, worker="w1", rows=1_000, error_rows=0)).status == "done"
    poisoned = await api.lease(spec.id, "w1")
    zombie = await api.lease(spec.id, "w2")  # its holder will outlive the job's first run
    once = await api.lease(spec.id, "w1")  # shard 3: fails once, and stays TODO
    assert (
        await api.release(poisoned.token, "disk error", worker="w1", retryable=False)
    ).state == "TODO"
    assert (
        await api.release(once.token, "disk error", worker="w1", retryable=False)
    ).state == "TODO"
    again = await api.lease(spec.id, "w1")
    assert again.shard == poisoned.shard
    assert (await api.release(again.token, "disk error", worker="w1", retryable=False)).state == (
        "QUARANTINED"
    )
    failed = await client.wait(spec.id)
    assert failed.state == "FAILED" and "shard 1 quarantined: disk error" in failed.reason

    # A restarted master knows the ended job from KV alone, and resumes it from there.
    await master.stop()
    await master.start()
    reply = await client.resume(spec.id)
    assert (reply.state, reply.shards_done, reply.shards_retried, reply.shards_todo) == (
        "RUNNING",
        1,
        1,
        3,
    )
    status = await api.job(spec.id)
    assert status.state == "RUNNING" and status.reason == "" and status.finished_at == 0
    assert status.shards == {"TODO": 3, "DOING": 0, "DONE": 1, "QUARANTINED": 0}
    # The first run's leases stay void: a zombie can neither renew nor commit.
    for op in (
        api.renew(zombie.token, worker="w2"),
        api.commit(zombie.token, worker="w2", rows=1_000, error_rows=0),
    ):
        with pytest.raises(RemoteError) as e:
            await op
        assert e.value.code == "stale_token"
    # Only the unfinished shards are handed out, as attempts after every earlier one, each
    # with a fresh max_attempts: shard 3 failed once in the first run, and may fail once more.
    leased = {}
    for _ in range(3):
        reply_ = await api.lease(spec.id, "w3")
        assert reply_.shard is not None
        leased[reply_.shard.index] = reply_
    assert sorted((i, r.attempt) for i, r in leased.items()) == [(1, 3), (2, 2), (3, 2)]
    assert (
        await api.release(leased[3].token, "flaky", worker="w3", retryable=False)
    ).state == "TODO"
    leased[3] = await api.lease(spec.id, "w3")
    for reply_ in leased.values():
        commit_record(spec, reply_)
        assert (
            await api.commit(reply_.token, worker="w3", rows=1_000, error_rows=0)
        ).status == "done"
    final = await client.wait(spec.id)
    assert final.state == "SUCCEEDED" and final.rows_done == 4_000
    manifest = json.loads(Path(final.manifest).read_text())
    assert sorted((f["shard"], f["attempt"]) for f in manifest["files"]) == [
        (0, 1),
        (1, 3),
        (2, 2),
        (3, 3),
    ]


async def test_a_resume_retried_after_its_reply_was_lost_is_answered_not_refused(
    tmp_path: Path, master: Master, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=2_000)
    await client.submit(spec)
    done = await api.lease(spec.id, "w1")
    commit_record(spec, done)
    await api.commit(done.token, worker="w1", rows=1_000, error_rows=0)
    assert (await api.cancel(spec.id)).state == "CANCELLED"
    # The first request is taken, and its reply goes nowhere (as when the client's
    # connection drops just then); the master that took it is replaced before any retry.
    request = ResumeRequest(job=spec.id, key="k-1")
    await client.nc.publish(
        api.subjects.master("resume"), schema.encode(request), reply="_INBOX.ebb.client.lost"
    )

    async def resumed() -> bool:
        return (await api.job(spec.id)).state == "RUNNING"

    await wait_until(resumed, timeout=15, what="the lost request to resume the job")
    await master.stop()
    await master.start()
    # The retry (same key) is told what happened; nothing is reopened twice.
    again = await api.resume(spec.id, key="k-1")
    assert (again.state, again.repeated, again.shards_done, again.shards_todo) == (
        "RUNNING",
        True,
        1,
        1,
    )
    # Another request (another key) is a new wish, refused for a running job.
    with pytest.raises(RemoteError) as e:
        await api.resume(spec.id, key="k-2")
    assert e.value.code == "not_resumable"
    last = await api.lease(spec.id, "w2")
    assert last.shard is not None and last.shard.index == 1
    commit_record(spec, last)
    await api.commit(last.token, worker="w2", rows=1_000, error_rows=0)
    assert (await client.wait(spec.id)).state == "SUCCEEDED"
    # Still answered once the job has ended, as the outcome it led to.
    late = await api.resume(spec.id, key="k-1")
    assert (late.state, late.repeated, late.shards_done) == ("SUCCEEDED", True, 2)


async def test_resume_of_a_cancelled_job_runs_it_again(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=2_000)
    await client.submit(spec)
    held = await api.lease(spec.id, "w1")
    assert (await api.cancel(spec.id)).state == "CANCELLED"
    reply = await client.resume(spec.id)
    assert (reply.state, reply.shards_done, reply.shards_retried, reply.shards_todo) == (
        "RUNNING",
        0,
        0,
        2,
    )
    with pytest.raises(RemoteError):
        await api.renew(held.token, worker="w1")
    for _ in range(2):
        again = await api.lease(spec.id, "w1")
        commit_record(spec, again)
        await api.commit(again.token, worker="w1", rows=1_000, error_rows=0)
    assert (await client.wait(spec.id)).state == "SUCCEEDED"


async def test_resume_refuses_a_running_a_succeeded_and_an_unknown_job(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=1_000)
    await client.submit(spec)
    with pytest.raises(RemoteError) as e:
        await client.resume(spec.id)
    assert e.value.code == "not_resumable"
    assert f"job {spec.id} is RUNNING: only a FAILED or CANCELLED job" in e.value.message
    reply = await api.lease(spec.id, "w1")
    commit_record(spec, reply)
    await api.commit(reply.token, worker="w1", rows=1_000, error_rows=0)
    assert (await client.wait(spec.id)).state == "SUCCEEDED"
    with pytest.raises(RemoteError) as e:
        await client.resume(spec.id)
    assert e.value.code == "not_resumable" and "is SUCCEEDED" in e.value.message
    assert (await api.job(spec.id)).state == "SUCCEEDED"
    with pytest.raises(RemoteError) as e:
        await client.resume("no-such-job")
    assert e.value.code == "not_found" and "no job 'no-such-job'" in e.value.message


async def test_a_job_forgotten_after_its_retention_cannot_be_resumed(
    tmp_path: Path, client: EbbClient, master: Master
) -> None:
    spec = make_job(tmp_path, rows=1_000)
    await client.submit(spec)
    await client.cancel(spec.id)
    assert master.service is not None and master.service.table is not None
    table = master.service.table
    gone = await table.lifecycle.forget_ended(now=time.time() + 10, retention_s=1.0)
    assert gone == [spec.id]
    with pytest.raises(RemoteError) as e:
        await client.resume(spec.id)
    assert e.value.code == "not_found" and "forgotten" in e.value.message


async def test_a_master_deposed_inside_a_request_campaigns_again(
    tmp_path: Path,
    master: Master,
    client: EbbClient,
    api: MasterClient,
    nc: NATS,
    subjects: Subjects,
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    held = await api.lease(spec.id, "w1")
    assert held.shard is not None and master.service is not None and master.task is not None
    service, task, first = master.service, master.task, master.service.table
    # Someone else writes the shard's record: the master's next write of it is refused.
    kv = await nc.jetstream().key_value(subjects.shards_bucket)
    key = shard_key(spec.id, held.shard.index)
    await kv.put(key, (await kv.get(key)).value or b"")
    with pytest.raises(RemoteError) as e:
        await api.release(held.token, "busy", worker="w1", retryable=True)
    assert e.value.code == "not_leader"
    # It steps down and leads again, its state read anew from KV; it does not exit.
    await wait_until(
        lambda: task.done() or (service.ready.is_set() and service.table not in (None, first)),
        timeout=30,
        what="the master to step down and lead again with a new table",
    )
    assert not task.done(), task.exception()
    assert (await api.release(held.token, "busy", worker="w1", retryable=True)).state == "TODO"
    assert (await api.lease(spec.id, "w2")).status == "granted"


async def test_the_controllers_word_of_a_lost_worker_frees_its_shards_at_once(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    spec = make_job(tmp_path, rows=2_000, lease_s=600)  # leases that would hold ten minutes
    await client.submit(spec)
    held = [await api.lease(spec.id, "w1") for _ in range(2)]
    told = await api.worker_ended(spec.id, "w1", kind="capacity", blame=False, reason="Evicted")
    assert (told.released, told.forgiven) == ([h.shard.index for h in held if h.shard], 2)
    status = await api.job(spec.id)
    assert status.shards["DOING"] == 0 and status.attempts_forgiven == 2
    assert status.workers_lost == {"capacity": 1}
    again = await api.lease(spec.id, "w2")
    assert again.status == "granted" and again.attempt == 2
    with pytest.raises(RemoteError) as e:  # the lost worker's token is void
        await api.renew(held[0].token, worker="w1")
    assert e.value.code == "stale_token"
    with pytest.raises(RemoteError) as e:
        await api.worker_ended("no-such-job", "w1", kind="crash", blame=True)
    assert e.value.code == "not_found"


async def test_the_controllers_word_of_where_a_job_cannot_run_is_in_its_status(
    tmp_path: Path, client: EbbClient, api: MasterClient
) -> None:
    """Kept in memory, shown until the controller says otherwise; with the median shard time
    the controller's placement policy reads."""
    spec = make_job(tmp_path, rows=2_000)
    await client.submit(spec)
    status = await api.job(spec.id)
    assert (status.waiting, status.shard_s) == ("", 0.0)  # no shard done: not known
    reason = "pool offline: no node of the cluster is in the offline pool"
    await api.placement(spec.id, "", reason)
    assert (await api.job(spec.id)).waiting == reason
    await api.placement(spec.id, "", reason)  # told again: the same
    assert (await client.job(spec.id)).waiting == reason
    await api.placement(spec.id, "", "")
    assert (await api.job(spec.id)).waiting == ""
    held = await api.lease(spec.id, "w1")
    commit_record(spec, held)
    await api.commit(held.token, worker="w1", rows=1_000, error_rows=0)
    assert (await api.job(spec.id)).shard_s > 0
    with pytest.raises(RemoteError) as e:
        await api.placement(spec.id, "gpu", reason)
    assert e.value.code == "bad_request"  # the job has no tiers
    with pytest.raises(RemoteError) as e:
        await api.placement("no-such-job", "", reason)
    assert e.value.code == "not_found"
    # An ended job waits for nothing.
    await api.placement(spec.id, "", reason)
    await api.cancel(spec.id)
    await api.placement(spec.id, "", reason)
    assert (await api.job(spec.id)).waiting == ""
