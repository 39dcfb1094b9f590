"""The lease table's durable form: snapshots of the KV buckets are complete."""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig

from ebb.common.messaging import provision
from ebb.common.messaging.messages import ShardSpec
from ebb.common.messaging.snapshot import kv_snapshot
from ebb.common.messaging.subjects import Subjects
from ebb.shard_master.kv import Store
from ebb.shard_master.table.records import JobRecord, ShardRecord


async def test_snapshots_taken_under_load_hold_every_live_key_and_only_those(nc: NATS) -> None:
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket="snap", history=1))
    for i in range(300):
        await kv.put(f"job.{i:04d}", f"v{i}".encode())
    for i in range(300):  # a second revision of every key: only the last counts
        await kv.put(f"job.{i:04d}", f"w{i}".encode())
    await kv.delete("job.0007")
    await kv.put("other.0001", b"not matched")
    want = {f"w{i}".encode() for i in range(300)} - {b"w7"}

    # Many snapshots at once keep the event loop busy while messages arrive, which is when a
    # snapshot that trusts counters taken with messages in flight ends early.
    snapshots = await asyncio.gather(*(kv_snapshot(js, "snap", "job.*") for _ in range(40)))
    for entries in snapshots:
        assert {e.value for e in entries} == want
        assert len(entries) == len(want)
        assert {e.key for e in entries} == {f"job.{i:04d}" for i in range(300)} - {"job.0007"}
    revisions = {e.value: e.revision for e in snapshots[0]}
    assert revisions[b"w0"] == (await kv.get("job.0000")).revision
    assert await kv_snapshot(js, "snap", "nothing.*") == []
    # Every consumer a snapshot made is gone.
    assert (await js.stream_info("KV_snap")).state.consumer_count == 0


async def provisioned_store(nc: NATS, subjects: Subjects) -> Store:
    """A Store over freshly provisioned buckets of `subjects`."""
    js = nc.jetstream()
    await provision.ensure_jetstream(js, subjects, leader_ttl_s=5.0)
    return Store(
        js,
        jobs=await js.key_value(subjects.jobs_bucket),
        shards=await js.key_value(subjects.shards_bucket),
        buckets=(subjects.jobs_bucket, subjects.shards_bucket),
    )


async def test_a_forgotten_job_leaves_no_record_of_itself_or_its_shards(nc: NATS) -> None:

    subjects = Subjects("forget")
    store = await provisioned_store(nc, subjects)
    for job in ("old", "older", "kept"):
        assert await store.create_job(JobRecord(id=job, spec={}))
        for index in range(3):
            spec = ShardSpec(index=index, path="/x", format="parquet", rows=1)
            assert await store.create_shard(ShardRecord(job=job, spec=spec))
    await store.forget_job("old")
    assert sorted(r.id for r, _ in await store.load_jobs()) == ["kept", "older"]
    assert await store.load_shards("old") == []
    assert len(await store.load_shards("older")) == 3  # a name it begins: not its shards
    assert await store.get_job("old") is None


async def test_a_job_stored_before_pools_were_placed_reads_as_its_pool_meant_then(
    nc: NATS,
) -> None:

    subjects = Subjects("pools")
    store = await provisioned_store(nc, subjects)

    def spec(pool: str) -> dict[str, object]:
        tier = {"name": "model", "stages": ["m"], "resources": {"pool": pool, "gpu": 1}}
        return {"name": "j", "resources": {"pool": pool, "cpu": 2}, "tiers": [tier]}

    # Before, every spec was stored with the default of then, `offline`, which placed workers
    # on the offline pool first and on lent mixed nodes after: `any` now.
    assert await store.create_job(JobRecord(id="before", spec=spec("offline")))
    # Now `offline` is asked for, and means the offline pool only.
    assert await store.create_job(JobRecord(id="now", spec=spec("offline"), pools_placed=True))
    found = await store.get_job("before")
    assert found is not None
    before, revision = found
    assert before.pools_placed
    assert before.spec["resources"] == {"pool": "any", "cpu": 2}
    assert before.spec["tiers"][0]["resources"] == {"pool": "any", "gpu": 1}
    loaded = {r.id: r for r, _ in await store.load_jobs()}
    assert loaded["before"] == before
    assert loaded["now"].spec == spec("offline")
    # Written back as read: the next update stores the pool it meant.
    await store.update_job(before, last=revision)
    raw = await (await nc.jetstream().key_value(subjects.jobs_bucket)).get("before")
    assert raw.value is not None and b"offline" not in raw.value


async def test_a_jobs_stream_from_before_owners_takes_their_subjects_and_keeps_its_jobs(
    nc: NATS,
) -> None:
    subjects = Subjects("before")
    js = nc.jetstream()
    # As the previous version made it: one subject, a submission waiting in it.
    await js.add_stream(
        StreamConfig(
            name=subjects.jobs_stream,
            subjects=[subjects.submit],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
        )
    )
    await js.publish(subjects.submit, b"waiting", headers={"Nats-Msg-Id": "j1"})
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await js.publish(subjects.owner_submit("team-a"), b"nobody takes it", timeout=1)
    await provision.ensure_jetstream(js, subjects, leader_ttl_s=5.0)
    info = await js.stream_info(subjects.jobs_stream)
    assert info.config.subjects == [subjects.submit, subjects.owners_submit]
    assert info.state.messages == 1  # the one waiting, kept
    ack = await js.publish(subjects.owner_submit("team-a"), b"a team's")
    assert ack.stream == subjects.jobs_stream and ack.seq == 2
    await provision.ensure_jetstream(js, subjects, leader_ttl_s=5.0)  # once is enough
    assert (await js.stream_info(subjects.jobs_stream)).config.subjects == info.config.subjects
