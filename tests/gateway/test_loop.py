"""The reconcile loop's scheduling (ebb.gateway.batches) on a real nats-server: it reads the
index of live batches, not every batch ever made; one batch's long step holds no other; an
index entry whose batch ended or never came is dropped; records the index lacks are found
once at start. The steps are a recording double here: what a step does is
tests/gateway/test_batches.py's and test_faults.py's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig

from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.provision import ensure_bucket
from ebb.common.messaging.subjects import Subjects
from ebb.gateway.batches import ORPHAN_S, BatchRunner
from ebb.gateway.config import ApiKey, CatalogueModel, GatewayConfig
from ebb.gateway.records import BatchRecord, Records
from ebb.gateway.store import FileStore

pytestmark = [pytest.mark.usefixtures("_no_leftover_tasks"), pytest.mark.timeout(60)]


class Steps:
    """Ends each batch it is given at once, but the ones in `held`, which wait for `go`."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self.taken: list[str] = []
        self.held: set[str] = set()
        self.go = asyncio.Event()

    async def take(self, record: BatchRecord, revision: int) -> None:
        self.taken.append(record.id)
        if record.id in self.held:
            await self.go.wait()
        await self.records.update_batch(record.moved("completed"), last=revision)


def batch(owner: str, batch_id: str) -> BatchRecord:
    now = int(time.time())
    return BatchRecord(
        id=batch_id,
        owner=owner,
        endpoint="/v1/chat/completions",
        input_file_id="file-x",
        completion_window="24h",
        status="validating",
        created_at=now,
        expires_at=now + 86400,
    )


@pytest.fixture
async def records(nc: NATS, prefix: str) -> Records:
    js = nc.jetstream()
    subjects = Subjects(prefix)
    buckets = (subjects.gateway_files_bucket, subjects.gateway_batches_bucket)
    files, batches = [await ensure_bucket(js, KeyValueConfig(bucket=b, history=1)) for b in buckets]
    return Records(js, files=files, batches=batches, buckets=buckets)


@contextlib.asynccontextmanager
async def running(
    records: Records, nc: NATS, nats_config: NatsConfig, tmp_path: Path
) -> AsyncIterator[tuple[BatchRunner, Steps]]:
    runner = BatchRunner(
        config=GatewayConfig(
            root=str(tmp_path),
            models={"m": CatalogueModel(stage={"llm": {"model": "/models/m"}})},
            keys=[ApiKey(owner="alice", key="sk-a")],
        ),
        records=records,
        store=FileStore(str(tmp_path)),
        master=MasterClient(nc, nats_config),
        nc=nc,
        nats=nats_config,
        poll_s=0.2,
        sweep_s=0.2,
        max_steps=2,
    )
    steps = Steps(records)
    runner.steps = steps  # type: ignore[assignment]
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        yield runner, steps
    finally:
        steps.go.set()
        stop.set()
        await task


async def until(condition: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_long_step_holds_only_its_own_batch(
    records: Records, nc: NATS, nats_config: NatsConfig, tmp_path: Path
) -> None:
    ids = ["batch_a", "batch_b", "batch_c", "batch_d"]
    for batch_id in ids:
        await records.add_live("alice", batch_id)
        await records.create_batch(batch("alice", batch_id))

    async def ended(batch_id: str) -> bool:
        found = await records.get_batch("alice", batch_id)
        return found is not None and found[0].status == "completed"

    async with running(records, nc, nats_config, tmp_path) as (_, steps):
        steps.held = {"batch_a"}  # the first in id order: a 200 MB file, say
        # Two places, one held by batch_a: the other three go through the second.
        for batch_id in ids[1:]:
            await until(lambda b=batch_id: ended(b))
        assert not await ended("batch_a")
        steps.go.set()
        await until(lambda: ended("batch_a"))
        # Ended batches leave the index: a pass reads only what is live.
        await until(lambda: _live(records, set()))
    assert steps.taken.count("batch_a") == 1


async def test_the_index_is_repaired_at_start_and_by_its_passes(
    records: Records, nc: NATS, nats_config: NatsConfig, tmp_path: Path
) -> None:
    # A batch from before the index (a record alone), one ended whose index entry stayed,
    # an entry whose record never came (its replica died in between), and a fresh one.
    await records.create_batch(batch("alice", "batch_old"))
    done = batch("bob", "batch_done")
    revision = await records.create_batch(done)
    await records.add_live("bob", "batch_done")
    await records._batches.update(  # ended without its entry dropped
        done.key, _dumped(done.moved("completed")), last=revision
    )
    stale = time.time() - ORPHAN_S - 1
    await records._batches.put("live.carol.batch_orphan", str(stale).encode())
    await records.add_live("dave", "batch_coming")  # its record about to be written
    async with running(records, nc, nats_config, tmp_path) as (_, steps):
        await until(lambda: _live(records, {("dave", "batch_coming")}))
        await records.create_batch(batch("dave", "batch_coming"))
        await until(lambda: _live(records, set()))
    assert sorted(steps.taken) == ["batch_coming", "batch_old"]


async def _live(records: Records, expected: set[tuple[str, str]]) -> bool:
    return {(b.owner, b.id) for b in await records.live()} == expected


def _dumped(record: Any) -> bytes:
    from ebb.gateway.records import _dump

    return _dump(record)


async def test_the_sweep_removes_expired_files_dead_entries_and_writers_leftovers(
    records: Records, nc: NATS, nats_config: NatsConfig, tmp_path: Path
) -> None:
    from ebb.gateway.records import Expiring, FileRecord

    now = int(time.time())
    files = tmp_path / "files" / "alice"
    files.mkdir(parents=True)

    def kept(file_id: str, expires_at: int) -> FileRecord:
        (files / file_id).write_bytes(b"{}\n")
        return FileRecord(
            id=file_id,
            owner="alice",
            bytes=3,
            created_at=now - 10,
            filename="in.jsonl",
            purpose="batch",
            path=f"files/alice/{file_id}",
            expires_at=expires_at,
        )

    gone, staying = kept("file-gone", now - 1), kept("file-staying", now + 7200)
    for record in (gone, staying):
        await records.create_file(record)
    # A file from before the index (its record alone), and an entry whose record never came.
    legacy = kept("file-legacy", now - 5)
    await records._files.create("alice.file-legacy", _dumped(legacy))
    await records._files.put(f"exp.{now // 3600}.alice.file-never", b"")
    # What writers killed mid-file left, and what one is writing now.
    stale, fresh = files / "file-x.tmp-0badf00d", files / "file-y.tmp-c0ffee00"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(stale, (now - 7200, now - 7200))

    async def swept() -> bool:
        entries = {(e.owner, e.id) for e in await records.expiring()}
        return entries == {("alice", "file-staying")} and not stale.exists()

    async with running(records, nc, nats_config, tmp_path):
        await until(swept)
    assert await records.get_file("alice", "file-gone") is None
    assert await records.get_file("alice", "file-legacy") is None
    assert await records.get_file("alice", "file-staying") is not None
    assert sorted(p.name for p in files.iterdir()) == ["file-staying", fresh.name]
    assert Expiring("alice", "file-staying", (now + 7200) // 3600) in await records.expiring()
