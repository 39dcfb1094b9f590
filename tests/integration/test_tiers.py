"""Jobs in tiers, end to end on the embedded stack: the same rows as the pipeline in one tier,
each tier's workers killed without a row lost or doubled, and without the other tier's
committed work done again."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pytest

from ebb.client import EbbClient
from ebb.client.sdk import SubmitError
from ebb.client.stack import LocalStack
from ebb.common import envvars, failpoints, schema
from ebb.common.data.layout import TIERS_DIR
from ebb.common.job import parse_job
from ebb.common.messaging.bus import connect
from ebb.common.messaging.messages import JobStatus
from ebb.common.messaging.snapshot import kv_snapshot
from ebb.common.messaging.subjects import Subjects
from ebb.shard_master.table.records import ShardRecord
from ebb.worker.service import MOST_SHARDS

from ..helpers import (
    embedded_stack,
    job_spec,
    read_output,
    reference_predictions,
    wait_until,
    write_dataset,
    write_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROWS = 6_000
POISON = [17, 2_500, 5_999]


@pytest.fixture
async def stack(tmp_path: Path, prefix: str) -> AsyncIterator[LocalStack]:
    async with embedded_stack(tmp_path, prefix, max_workers=4) as s:
        yield s


@pytest.fixture
async def client(stack: LocalStack) -> AsyncIterator[EbbClient]:
    async with await EbbClient.connect(stack.nats_config) as c:
        yield c


def stages(tmp_path: Path, *, seconds_per_batch: float = 0.0) -> list[dict[str, Any]]:
    """Features (failing on the poison rows), the ONNX model, the top class: the first in
    the prep tier, the other two in the infer tier."""
    first: dict[str, Any] = {"modelet": "ebbtest_modelets:FailOn", "params": {"ids": POISON}}
    if seconds_per_batch:
        first = {
            "modelet": "ebbtest_modelets:Slow",
            "params": {"seconds_per_batch": seconds_per_batch},
        }
    return [
        {"name": "prep", "batch_size": 100, **first},
        {"name": "model", "model": str(tmp_path / "model.onnx"), "batch_size": 200},
        {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 200},
    ]


def tiered(spec: dict[str, Any], *, workers: int = 2) -> dict[str, Any]:
    each = {"min_workers": 1, "max_workers": workers, "cpu": 0.5, "memory_gb": 1}
    return {
        **spec,
        "tiers": [
            {"name": "prep", "stages": ["prep"], "resources": each},
            {"name": "infer", "stages": ["model", "top"], "resources": each},
        ],
    }


def by_id(table: pa.Table) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = table.to_pylist()
    return sorted(rows, key=lambda row: int(row["id"]))


async def run(client: EbbClient, spec: dict[str, Any]) -> JobStatus:
    job_id = await client.submit(parse_job(spec))
    final = await asyncio.wait_for(client.wait(job_id), 240)
    assert final.state == "SUCCEEDED", final.reason
    return final


async def test_a_job_in_two_tiers_writes_the_rows_of_the_same_pipeline_in_one(
    tmp_path: Path, client: EbbClient
) -> None:
    write_dataset(tmp_path / "data", rows=ROWS, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    one = job_spec(tmp_path, name="one", rows_per_shard=1_000, stages=stages(tmp_path))
    one["output"]["uri"] = str(tmp_path / "one")
    two = tiered(job_spec(tmp_path, name="two", rows_per_shard=1_000, stages=stages(tmp_path)))
    two["output"]["uri"] = str(tmp_path / "two")

    single = await run(client, one)
    final = await run(client, two)

    expected, _ = read_output(tmp_path / "one")
    got, manifest = read_output(tmp_path / "two")
    assert got.schema == expected.schema
    assert by_id(got) == by_id(expected)
    assert [r["id"] for r in by_id(got) if r["_error"]] == POISON
    assert (final.rows_done, final.error_rows) == (single.rows_done, single.error_rows)
    # Only the last tier's files are output; the hand-offs are gone with the job's success.
    assert all(TIERS_DIR not in f["path"] for f in manifest["files"])
    assert not (tmp_path / "two" / TIERS_DIR).exists()


async def test_a_later_tier_s_first_stage_reads_a_column_an_earlier_tier_made(
    tmp_path: Path, client: EbbClient
) -> None:
    """The model, first of the infer tier, reads `x`, which the prep tier made: a column of
    the rows handed on, not of the input (whose columns are `id` and `features`)."""
    write_dataset(tmp_path / "data", rows=2_000, row_group_size=500)
    write_model(tmp_path / "model.onnx")
    made: list[dict[str, Any]] = [
        {"name": "pre", "modelet": "ebbtest_modelets:Renamed", "params": {"to": "x"}},
        {"name": "model", "model": str(tmp_path / "model.onnx"), "input": "x"},
        {"name": "post", "modelet": "ebb.worker.modelets:TopClass"},
    ]
    spec = job_spec(tmp_path, rows_per_shard=500, stages=made)
    assert spec["input"]["columns"] == ["id", "features"]
    spec["tiers"] = [
        {"name": "prep", "stages": ["pre"], "resources": {"max_workers": 1, "cpu": 0.5}},
        {"name": "infer", "stages": ["model", "post"], "resources": {"max_workers": 1, "cpu": 0.5}},
    ]

    final = await run(client, spec)

    assert (final.rows_done, final.error_rows) == (2_000, 0)
    got, _ = read_output(tmp_path / "out")
    expected = reference_predictions(tmp_path / "data", tmp_path / "model.onnx")
    assert {r["id"]: r["label"] for r in got.to_pylist()} == {
        i: k for i, (k, _) in expected.items()
    }


def workers_of(stack: LocalStack, tier: str) -> list[psutil.Process]:
    """The live worker processes of `tier`."""
    try:
        children = psutil.Process(stack.processes["controller"].pid).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for process in children:
        try:
            line = " ".join(process.cmdline())
        except psutil.Error:  # ended (a zombie until the controller reaps it)
            continue
        if "ebb.worker" in line and f"--tier {tier}" in line:
            found.append(process)
    return found


async def shard_records(stack: LocalStack, job: str) -> list[ShardRecord]:
    """The job's shard records as the master keeps them (read with its credential)."""
    config = stack.nats_config_for("master")
    nc = await connect(config, name="ebb-test-records")
    try:
        # As the master reads them: nats.py's `keys()` can end its read early and find none
        # (nats-io/nats.py#842, seen here under load).
        entries = await kv_snapshot(
            nc.jetstream(), Subjects(config.prefix).shards_bucket, f"{job}.*"
        )
        records = [schema.decode(ShardRecord, e.value) for e in entries]
    finally:
        await nc.close()
    return sorted(records, key=lambda r: r.spec.index)


@pytest.mark.parametrize("victim", ["prep", "infer"])
async def test_workers_of_either_tier_killed_lose_no_row_and_cost_the_other_tier_nothing(
    tmp_path: Path, stack: LocalStack, client: EbbClient, victim: str
) -> None:
    write_dataset(tmp_path / "data", rows=ROWS, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    spec = tiered(
        job_spec(tmp_path, rows_per_shard=500, stages=stages(tmp_path, seconds_per_batch=0.05))
    )
    job_id = await client.submit(parse_job(spec))
    other = 1 if victim == "prep" else 0

    async def the_other_tier_has_done_some() -> bool:
        status = await client.job(job_id)
        return bool(status.tiers) and status.tiers[other].shards.get("DONE", 0) >= 2

    await wait_until(the_other_tier_has_done_some, timeout=120, what="the other tier's commits")
    before = {r.spec.index: r for r in await shard_records(stack, job_id) if r.state == "DONE"}
    kills = 0
    while kills < 3 and (await client.job(job_id)).state == "RUNNING":
        victims = workers_of(stack, victim)
        if victims:
            try:
                os.kill(victims[0].pid, signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass  # it had just ended
        await asyncio.sleep(1.0)
    final = await asyncio.wait_for(client.wait(job_id), 240)
    assert final.state == "SUCCEEDED", final.reason
    assert kills >= 1 and final.workers_lost.get("capacity", 0) >= 1
    table, _ = read_output(tmp_path / "out")
    ids = table.column("id").to_numpy()
    assert sorted(ids.tolist()) == list(range(ROWS)), "every id exactly once"
    after = {r.spec.index: r for r in await shard_records(stack, job_id)}
    # What either tier had committed stayed as it was: no attempt of it was started again.
    for index, record in before.items():
        assert (after[index].attempts, after[index].done_attempt) == (
            record.attempts,
            record.done_attempt,
        )


async def test_a_slow_tier_holds_the_one_before_back_within_its_bound(
    tmp_path: Path, client: EbbClient
) -> None:
    """The prep tier reads and hands on far faster than the infer tier (one worker, slow)
    computes: the hand-offs waiting never pass twice the infer tier's workers, and the prep
    tier is seen held back."""
    write_dataset(tmp_path / "data", rows=ROWS, row_group_size=500)
    write_model(tmp_path / "model.onnx")
    slow = {"modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 0.05}}
    body = job_spec(
        tmp_path,
        rows_per_shard=500,
        stages=[
            {"name": "prep", "modelet": "ebbtest_modelets:FailOn", "params": {"ids": []}},
            {"name": "slow", "batch_size": 100, **slow},
            {"name": "model", "model": str(tmp_path / "model.onnx"), "batch_size": 200},
        ],
    )
    body["tiers"] = [
        {"name": "prep", "stages": ["prep"], "resources": {"max_workers": 2, "cpu": 0.5}},
        {"name": "infer", "stages": ["slow", "model"], "resources": {"max_workers": 1}},
    ]
    job_id = await client.submit(parse_job(body))
    waiting: list[int] = []
    held = 0

    def seen(status: JobStatus) -> None:
        nonlocal held
        if status.tiers:
            waiting.append(status.tiers[1].shards.get("TODO", 0))
            held += status.tiers[0].held_back

    final = await asyncio.wait_for(client.wait(job_id, poll_s=0.1, on_update=seen), 240)
    assert final.state == "SUCCEEDED", final.reason
    assert held >= 1, "the prep tier was never held back"
    # The bound is on leasing: the prep shards leased before it was reached still hand on
    # after it, as many as the prep workers hold (2 workers, each up to MOST_SHARDS where
    # its shards are small for its pipeline, as these are).
    assert max(waiting) <= 2 * 1 + 2 * MOST_SHARDS
    table, _ = read_output(tmp_path / "out")
    assert table.num_rows == ROWS


async def test_a_hand_off_whose_done_lost_its_answer_reaches_the_output_once(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master's write of a prep shard's DONE (naming its hand-off) lands in KV and its
    answer is lost (a failpoint after the write, in the real store over a real nats-server):
    the master steps down and loads KV again rather than hand out the hand-off's index a
    second time. Every row in the output once, no manifest entry twice."""
    armed = tmp_path / "failpoints"
    armed.mkdir()
    monkeypatch.setenv(envvars.FAILPOINT_DIR, str(armed))
    failpoints.arm(armed, failpoints.MASTER_KV_ANSWER_LOST, when="DONE handoff")
    write_dataset(tmp_path / "data", rows=ROWS, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    spec = tiered(
        job_spec(tmp_path, rows_per_shard=500, stages=stages(tmp_path, seconds_per_batch=0.02))
    )
    async with (
        embedded_stack(tmp_path, prefix, max_workers=4) as stack,
        await EbbClient.connect(stack.nats_config) as client,
    ):
        final = await run(client, spec)
        assert failpoints.fired(armed, failpoints.MASTER_KV_ANSWER_LOST) is not None
        records = await shard_records(stack, final.id)
    assert final.rows_done == ROWS
    table, manifest = read_output(tmp_path / "out")
    assert sorted(table.column("id").to_numpy().tolist()) == list(range(ROWS)), "every id once"
    paths = [f["path"] for f in manifest["files"]]
    assert len(paths) == len(set(paths)), "no manifest entry twice"
    handed = [r.handed_from for r in records if r.handed_from is not None and r.split_from is None]
    assert len(handed) == len(set(handed)), "one hand-off per prep shard"


async def test_a_job_cancelled_between_its_tiers_keeps_its_root_and_its_resume_finishes(
    tmp_path: Path, client: EbbClient
) -> None:
    """Cancelled with its first tier's shards committed and none of its last tier's: its root
    is not let go (its work is under `_tiers`), another job naming it is refused saying so,
    and its resume finishes it, each row once, as for a job of one tier."""
    write_dataset(tmp_path / "data", rows=ROWS, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    gate = tmp_path / "gate"
    held: list[dict[str, Any]] = [
        {"name": "prep", "modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 0}},
        {"name": "hold", "modelet": "ebbtest_modelets:Hold", "params": {"gate": str(gate)}},
        {"name": "model", "model": str(tmp_path / "model.onnx"), "batch_size": 200},
        {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 200},
    ]
    each = {"min_workers": 1, "max_workers": 2, "cpu": 0.5, "memory_gb": 1}
    body = {
        **job_spec(tmp_path, rows_per_shard=1_000, stages=held),
        "tiers": [
            {"name": "prep", "stages": ["prep"], "resources": each},
            {"name": "infer", "stages": ["hold", "model", "top"], "resources": each},
        ],
    }
    job_id = await client.submit(parse_job(body))
    handed = tmp_path / "out" / TIERS_DIR / "prep" / "_commits"
    await wait_until(
        lambda: handed.exists() and any(handed.iterdir()), timeout=120, what="a prep commit"
    )
    await client.cancel(job_id, "a user's wish")
    assert (await client.wait(job_id)).state == "CANCELLED"
    assert not list((tmp_path / "out" / "_commits").glob("*.json")), "the gate held infer"

    other = parse_job({**body, "name": "other"})
    with pytest.raises(SubmitError, match=job_id):
        await client.submit(other)

    gate.write_text("")
    await client.resume(job_id)
    final = await asyncio.wait_for(client.wait(job_id), 240)
    assert final.state == "SUCCEEDED", final.reason
    table, manifest = read_output(tmp_path / "out")
    assert sorted(table.column("id").to_numpy().tolist()) == list(range(ROWS))
    paths = [f["path"] for f in manifest["files"]]
    assert len(paths) == len(set(paths))
