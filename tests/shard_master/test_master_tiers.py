"""The lease table of a job in tiers: each tier leased on its own, a shard done in one tier
handed to the next as a shard of its own, the output the last tier's, the hand-offs removed,
and a tier held back while the next has too many waiting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ebb.common.data.layout import TIERS_DIR, OutputFile, attempt_dir, tier_root
from ebb.common.data.output import OutputStore, new_commit
from ebb.common.job import JobSpec, parse_job
from ebb.common.messaging.messages import LeaseReply, StatusRequest
from ebb.shard_master.errors import BadRequest, OutputTaken
from ebb.shard_master.table.lease_table import LeaseTable
from ebb.shard_master.table.records import shard_key

from ..helpers import job_spec, write_dataset, write_model
from .test_lease_table import (
    Clock,
    MemoryStore,
    assert_indexes_match_records,
    make_job,
    new_table,
)


def tiered_job(tmp_path: Path, *, shards: int = 3, infer_workers: int = 1) -> JobSpec:
    write_dataset(tmp_path / "data", rows=100 * shards, row_group_size=100)
    write_model(tmp_path / "model.onnx")
    body: dict[str, Any] = job_spec(tmp_path, rows_per_shard=100)
    body["tiers"] = [
        {"name": "prep", "stages": ["preprocess"], "resources": {"max_workers": 4}},
        {
            "name": "infer",
            "stages": ["model", "postprocess"],
            "resources": {"max_workers": infer_workers},
        },
    ]
    return parse_job(body).with_id()


def commit(spec: JobSpec, reply: LeaseReply, *, tier: str, rows: int = 100) -> str:
    """What a worker of `tier` does before `commit`: its file, then its commit record, in
    its tier's root (the output root for the last tier). Returns the file's URL."""
    assert reply.shard is not None
    root = spec.output.uri if tier == spec.last_tier() else tier_root(spec.output.uri, tier)
    store = OutputStore(root)
    ext = "parquet" if tier == spec.last_tier() else "arrow"
    path = f"{attempt_dir(reply.shard.index, reply.attempt)}/part-00000.{ext}"
    store.write_file(path, b"rows")
    store.create_commit(
        new_commit(
            job=spec.id,
            shard=reply.shard.index,
            attempt=reply.attempt,
            files=[OutputFile(path=path, rows=rows)],
            worker="w",
        )
    )
    return store.url(path)


async def lease(
    table: LeaseTable, spec: JobSpec, worker: str, tier: str, *, ready: bool = False
) -> LeaseReply:
    return await table.lease(spec.id, worker, tier=tier, ready=ready)


async def test_a_shard_done_in_a_tier_becomes_a_shard_of_the_next_reading_what_it_committed(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = tiered_job(tmp_path)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]

    early = await lease(table, spec, "i1", "infer")
    assert early.status == "wait"  # nothing handed on yet, but the prep tier has work
    first = await lease(table, spec, "p1", "prep")
    assert first.shard is not None and first.shard.index == 0
    url = commit(spec, first, tier="prep")
    assert (await table.commit(first.token)).status == "done"

    handed = job.shards[3].record
    assert (handed.state, handed.tier, handed.handed_from) == ("TODO", 1, 0)
    assert handed.spec.format == "arrow"
    assert [(p.path, p.rows) for p in handed.spec.parts] == [(url, 100)]
    assert store.shards[shard_key(spec.id, 0)][0].handoff == 3
    assert job.rows_done == 0  # rows handed on are not output yet

    second = await lease(table, spec, "p1", "prep", ready=True)
    assert second.shard is not None and second.shard.index == 1  # never the hand-off
    infer = await lease(table, spec, "i1", "infer")
    assert infer.shard is not None and infer.shard == handed.spec
    status = table.status(StatusRequest(job=spec.id)).jobs[0]
    assert [
        (t.name, t.shards["TODO"], t.shards["DOING"], t.shards["DONE"]) for t in status.tiers
    ] == [
        ("prep", 1, 1, 1),
        ("infer", 0, 1, 0),
    ]
    assert [t.workers_ready for t in status.tiers] == [1, 0]  # p1's pipeline, not i1's
    assert_indexes_match_records(job, store)

    with pytest.raises(BadRequest, match="no tier 'gpu'"):
        await lease(table, spec, "x", "gpu")


async def test_the_job_is_the_last_tiers_output_and_its_hand_offs_go_as_they_are_read(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = tiered_job(tmp_path, shards=2, infer_workers=2)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    prep_root = Path(tier_root(spec.output.uri, "prep"))
    for _ in range(2):
        reply = await lease(table, spec, "p1", "prep")
        commit(spec, reply, tier="prep")
        await table.commit(reply.token)
    assert job.record.state == "RUNNING"  # every shard of the first tier done: not the job

    infer = await lease(table, spec, "i1", "infer")
    assert infer.shard is not None
    source = job.shards[infer.shard.index].record.handed_from
    assert source is not None
    commit(spec, infer, tier="infer", rows=100)
    await table.commit(infer.token)
    assert not (prep_root / attempt_dir(source, 1)).exists()  # read: removed
    assert job.rows_done == 100

    last = await lease(table, spec, "i1", "infer")
    commit(spec, last, tier="infer", rows=100)
    await table.commit(last.token)
    assert job.state == "SUCCEEDED"
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None
    assert (manifest.rows, sorted(f.shard for f in manifest.files)) == (200, [2, 3])
    assert not (Path(spec.output.uri) / TIERS_DIR).exists()
    assert (await lease(table, spec, "p1", "prep")).status == "end"


async def test_a_tier_is_held_back_while_the_next_has_twice_its_workers_of_hand_offs_waiting(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = tiered_job(tmp_path, shards=4, infer_workers=1)  # at most 2 waiting
    assert await table.intake.submit(spec)
    for _ in range(2):
        reply = await lease(table, spec, "p1", "prep")
        commit(spec, reply, tier="prep")
        await table.commit(reply.token)
    held = await lease(table, spec, "p1", "prep")
    assert held.status == "wait"
    status = table.status(StatusRequest(job=spec.id)).jobs[0]
    assert [t.held_back for t in status.tiers] == [True, False]
    assert (await lease(table, spec, "i1", "infer")).status == "granted"
    assert (await lease(table, spec, "p1", "prep")).status == "granted"  # room again


async def test_a_master_that_died_between_a_done_and_its_hand_off_creates_it_on_load(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = tiered_job(tmp_path)
    assert await table.intake.submit(spec)
    reply = await lease(table, spec, "p1", "prep")
    commit(spec, reply, tier="prep")
    await table.commit(reply.token)
    created, _ = store.shards.pop(shard_key(spec.id, 3))  # as if never written

    restarted = new_table(store, Clock())
    await restarted.load()
    again = restarted.jobs[spec.id]
    assert again.shards[3].record == created
    assert again.tiers[1].backlog == 1
    assert_indexes_match_records(again, store)


async def test_a_worker_waiting_on_another_tier_asks_again_at_that_tiers_pace(
    tmp_path: Path,
) -> None:
    """Short shards must not stop and go at the pace of the polls: a worker held back, or
    waiting for hand-offs, asks again after a quarter of the other tier's usual shard time."""
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = tiered_job(tmp_path, shards=8, infer_workers=1)
    assert await table.intake.submit(spec)
    for _ in range(2):
        reply = await lease(table, spec, "p1", "prep")
        clock.now += 2.0  # a prep shard takes 2 s
        commit(spec, reply, tier="prep")
        await table.commit(reply.token)
    infer = await lease(table, spec, "i1", "infer")
    clock.now += 0.8  # an infer shard takes 0.8 s
    commit(spec, infer, tier="infer")
    await table.commit(infer.token)
    commit(spec, second := await lease(table, spec, "i1", "infer"), tier="infer")
    waiting = await lease(table, spec, "i1", "infer")  # nothing handed on: prep's pace
    assert (waiting.status, waiting.retry_after_s) == ("wait", 0.5)
    await table.commit(second.token)
    for _ in range(4):
        reply = await lease(table, spec, "p1", "prep")
        commit(spec, reply, tier="prep")
        await table.commit(reply.token)
    # Four waiting, the bound (the one infer worker gets through 2.5 in a prep shard's
    # time, and one more): infer's pace.
    held = await lease(table, spec, "p1", "prep")
    assert held.status == "wait" and held.retry_after_s == pytest.approx(0.2)


async def test_a_job_of_one_tier_shows_it_and_runs_on_its_workers(tmp_path: Path) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    write_dataset(tmp_path / "data", rows=200, row_group_size=100)
    write_model(tmp_path / "model.onnx")
    body: dict[str, Any] = job_spec(tmp_path, rows_per_shard=100)
    stages = ["preprocess", "model", "postprocess"]
    gpu = {"min_workers": 1, "max_workers": 2, "cpu": 8, "gpu": 1}
    body["tiers"] = [{"name": "gpu", "stages": stages, "resources": gpu}]
    spec = parse_job(body).with_id()
    assert await table.intake.submit(spec)
    # The controller sizes, places and starts (`--tier gpu`) the workers of each tier the
    # status names: a job of one tier names it, or its workers would be the job's
    # `resources`', and would lease for no tier, which the master refuses.
    status = table.status(StatusRequest(job=spec.id)).jobs[0]
    assert [(t.name, t.shards["TODO"]) for t in status.tiers] == [("gpu", 2)]
    with pytest.raises(BadRequest, match="no tier ''"):
        await lease(table, spec, "w", "")
    for _ in range(2):
        reply = await lease(table, spec, "w", "gpu")
        commit(spec, reply, tier="gpu")
        await table.commit(reply.token)
    assert table.jobs[spec.id].state == "SUCCEEDED"


async def test_the_bound_on_hand_offs_waiting_lasts_the_next_tier_a_shard_of_the_one_before(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = tiered_job(tmp_path, shards=12, infer_workers=1)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    prep, infer = job.tiers

    async def done(worker: str, tier: str, seconds: float) -> None:
        reply = await lease(table, spec, worker, tier)
        assert reply.status == "granted"
        clock.now += seconds
        commit(spec, reply, tier=tier)
        await table.commit(reply.token)

    # Before any shard of either tier is done: twice the next tier's workers.
    assert job.handoff_bound(prep) == 2
    await done("p1", "prep", 80.0)
    await done("i1", "infer", 10.0)
    # A prep shard takes 80 s, an infer shard 10 s: a prep shard leased now is handed on
    # 80 s later, by when the one infer worker has got through 8 hand-offs.
    assert job.handoff_bound(prep) == 1 + 8
    for _ in range(8):
        await done("p1", "prep", 80.0)
    assert (infer.counts["TODO"], job.held_back(prep)) == (8, False)
    await done("p1", "prep", 80.0)
    assert (infer.counts["TODO"], job.held_back(prep)) == (9, True)
    assert (await lease(table, spec, "p1", "prep")).status == "wait"
    # Shards that take the next tier longer than the tier before: twice its workers.
    infer.durations.extend([400.0] * 10)
    assert job.handoff_bound(prep) == 2


async def test_each_tier_says_why_it_waits_for_a_place_and_its_own_shard_time(
    tmp_path: Path,
) -> None:
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = tiered_job(tmp_path)
    assert await table.intake.submit(spec)
    job = table.jobs[spec.id]
    reply = await lease(table, spec, "p1", "prep")
    clock.now += 12.0
    commit(spec, reply, tier="prep")
    await table.commit(reply.token)
    job.wait_for_placement("infer", "gpu_type NVIDIA-H100: no node of its pools has that GPU")
    status = table.status(StatusRequest(job=spec.id)).jobs[0]
    assert [(t.name, t.waiting) for t in status.tiers] == [
        ("prep", ""),
        ("infer", "gpu_type NVIDIA-H100: no node of its pools has that GPU"),
    ]
    assert status.waiting == "tier infer: gpu_type NVIDIA-H100: no node of its pools has that GPU"
    assert [t.shard_s for t in status.tiers] == [12.0, 0.0]
    assert status.shard_s == 0.0  # a job with tiers: each tier's own
    job.wait_for_placement("infer", "")
    assert table.status(StatusRequest(job=spec.id)).jobs[0].waiting == ""
    with pytest.raises(BadRequest, match="no tier 'gpu'"):
        job.wait_for_placement("gpu", "why")


@pytest.mark.parametrize("tiered", [True, False], ids=["in tiers", "in one tier"])
async def test_a_job_cancelled_between_its_tiers_commits_keeps_its_root_for_its_resume(
    tmp_path: Path, tiered: bool
) -> None:
    """Cancelled once its first tier committed and before its last did: the root holds its
    work (`_tiers/<tier>/_commits`) as it would its output's. Another job naming the root is
    refused, saying whose it is; the first one's resume runs it to the end, each row once.
    As for a job in one tier that committed a shard."""
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    if tiered:
        spec = tiered_job(tmp_path, shards=2)
        other = tiered_job(tmp_path, shards=2)
    else:
        spec = make_job(tmp_path, shards=2)
        other = make_job(tmp_path, shards=2)
    first = spec.tier_names()[0]
    assert await table.intake.submit(spec)
    reply = await lease(table, spec, "w1", first)
    commit(spec, reply, tier=first)
    assert (await table.commit(reply.token)).status == "done"
    await table.lifecycle.cancel(spec.id, "a user's wish")

    owner = OutputStore(spec.output.uri).owner_record()
    assert owner is not None and owner.job == spec.id and not owner.released
    with pytest.raises(OutputTaken, match=spec.id):
        await table.intake.submit(other)

    resumed = await table.lifecycle.resume(spec.id)
    assert resumed.state == "RUNNING"
    job = table.jobs[spec.id]
    for tier in spec.tier_names():
        while (reply := await lease(table, spec, "w2", tier)).status == "granted":
            commit(spec, reply, tier=tier)
            await table.commit(reply.token)
    assert job.record.state == "SUCCEEDED" and job.record.rows_done == 200
    manifest = OutputStore(spec.output.uri).read_manifest()
    assert manifest is not None and manifest.rows == 200
    paths = [f.path for f in manifest.files]
    assert len(paths) == len(set(paths)) == 2


async def test_a_job_in_tiers_resubmitted_to_a_master_without_its_records_is_refused(
    tmp_path: Path,
) -> None:
    """Its first tier's commits are in the root, the master that numbered them is gone: a
    later tier's shards would be numbered otherwise, and adopting a record for another shard
    would lose rows. Refused, saying what to do, before anything is planned."""
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    spec = tiered_job(tmp_path, shards=2)
    assert await table.intake.submit(spec)
    reply = await lease(table, spec, "w1", "prep")
    commit(spec, reply, tier="prep")
    assert (await table.commit(reply.token)).status == "done"

    forgetful = new_table(MemoryStore(), Clock())
    with pytest.raises(OutputTaken, match="carries on only from the master's state"):
        await forgetful.intake.submit(spec)
