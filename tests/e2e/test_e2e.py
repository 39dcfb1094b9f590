"""End to end on the embedded stack: nats-server, master, controller and workers as real
processes, exactly as `ebb run` starts them. Faults are real too: SIGKILL."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack
from ebb.common import envvars, failpoints
from ebb.common.data.layout import COMMITS_DIR
from ebb.common.errors import BusError
from ebb.common.job import parse_job
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.messages import JobStatus

from ..helpers import (
    committed_files,
    embedded_stack,
    job_spec,
    read_output,
    reference_predictions,
    wait_until,
    write_dataset,
    write_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
async def stack(tmp_path: Path, prefix: str) -> AsyncIterator[LocalStack]:
    async with embedded_stack(tmp_path, prefix, max_workers=3) as s:
        yield s


@pytest.fixture
async def client(stack: LocalStack) -> AsyncIterator[EbbClient]:
    c = await EbbClient.connect(stack.nats_config)
    try:
        yield c
    finally:
        await c.close()


def slow_stages(tmp_path: Path, seconds_per_batch: float) -> list[dict[str, Any]]:
    return [
        {
            "name": "slow",
            "modelet": "ebbtest_modelets:Slow",
            "params": {"seconds_per_batch": seconds_per_batch},
            "batch_size": 100,
        },
        {"name": "model", "model": str(tmp_path / "model.onnx"), "batch_size": 200},
        {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 200},
    ]


def assert_exactly_once(tmp_path: Path, rows: int) -> Any:
    table, manifest = read_output(tmp_path / "out")
    ids = table.column("id").to_numpy()
    assert len(ids) == rows
    assert sorted(ids.tolist()) == list(range(rows)), "every id exactly once"
    assert {f["path"] for f in manifest["files"]} == committed_files(tmp_path / "out")
    return table


async def test_fifty_thousand_rows_on_three_workers_exactly_once(
    tmp_path: Path, client: EbbClient
) -> None:
    rows = 60_000
    write_dataset(tmp_path / "data", rows=rows, files=3, row_group_size=5_000)
    write_model(tmp_path / "model.onnx")
    # A shard takes a second or more (50 batches of 20 ms): long enough that the workers
    # that started first cannot take all twelve before the last is up on a busy machine.
    stages = slow_stages(tmp_path, seconds_per_batch=0.02)
    spec = parse_job(job_spec(tmp_path, rows_per_shard=5_000, workers=(3, 3), stages=stages))
    job_id = await client.submit(spec)
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert (final.rows_done, final.error_rows, final.shards["DONE"]) == (rows, 0, 12)

    table = assert_exactly_once(tmp_path, rows)
    assert table.column("_error").null_count == rows
    # The carryover columns come through untouched...
    for row in table.slice(0, 2_000).to_pylist():
        assert row["customer"] == f"customer-{row['id']:07d}"
    # ...and every prediction is what the model gives on that row, run directly.
    expected = reference_predictions(tmp_path / "data", tmp_path / "model.onnx")
    for row in table.select(["id", "label", "score"]).to_pylist():
        label, score = expected[row["id"]]
        assert row["label"] == label
        assert row["score"] == pytest.approx(score, rel=1e-5)
    # Three workers shared the work.
    workers = {
        json.loads(p.read_text())["worker"] for p in (tmp_path / "out" / COMMITS_DIR).glob("*.json")
    }
    assert len(workers) == 3


def _pid_of(worker_id: str) -> int | None:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "ebb.worker" in cmdline and worker_id in cmdline:
            return int(proc.pid)
    return None


async def test_sigkill_of_a_worker_holding_a_lease_loses_nothing(
    tmp_path: Path, client: EbbClient
) -> None:
    rows = 20_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=2_000)
    write_model(tmp_path / "model.onnx")
    spec = parse_job(
        job_spec(
            tmp_path,
            rows_per_shard=2_000,
            stages=slow_stages(tmp_path, 0.05),
            workers=(2, 2),
            fault={"lease_s": 3},
        )
    )
    job_id = await client.submit(spec)

    async def a_held_lease() -> Any:
        status = (await client.master.status(job_id, include_leases=True)).jobs[0]
        for lease in status.leases:
            pid = _pid_of(lease.worker)
            if pid is not None:
                return lease, pid
        return None

    lease, pid = await wait_until(a_held_lease, timeout=60, what="a worker holding a lease")
    # Its stage processes (and the fork server they came from) must not outlive it.
    worker = psutil.Process(pid)
    descendants = worker.children(recursive=True)
    (server,) = [p for p in worker.children() if "forkserver" in " ".join(p.cmdline())]
    # The controller told it the job's model runtime, which it imported once for every stage.
    assert "onnxruntime" in " ".join(server.cmdline())
    os.kill(pid, signal.SIGKILL)
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert_exactly_once(tmp_path, rows)
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, f"processes of the killed worker still running: {alive}"
    # The killed worker's shard was done again, by another attempt.
    record = json.loads(
        (tmp_path / "out" / COMMITS_DIR / f"shard={lease.shard:05d}.json").read_text()
    )
    assert record["attempt"] > lease.attempt or record["worker"] != lease.worker


async def test_workers_killed_again_and_again_from_outside_do_not_fail_the_job(
    tmp_path: Path, client: EbbClient
) -> None:
    """More SIGKILLs than the crash-loop guard's limit (5) and than max_attempts (the default,
    3): a worker killed from outside (an operator, a spot reclaim) has done nothing wrong, so
    the job goes on and ends exactly once."""
    rows = 40_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    spec = parse_job(
        job_spec(
            tmp_path,
            rows_per_shard=1_000,
            stages=slow_stages(tmp_path, 0.05),
            workers=(2, 2),
            fault={"lease_s": 3},
        )
    )
    job_id = await client.submit(spec)
    killed: set[int] = set()

    async def a_fresh_lease_holder() -> Any:
        status = (await client.master.status(job_id, include_leases=True)).jobs[0]
        for lease in status.leases:
            pid = _pid_of(lease.worker)
            if pid is not None and pid not in killed:
                return pid
        return None

    for _ in range(6):
        pid = await wait_until(a_fresh_lease_holder, timeout=60, what="a worker holding a lease")
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert_exactly_once(tmp_path, rows)


async def _under_way(tmp_path: Path, client: EbbClient, rows: int) -> str:
    """A job of 12 slow shards on two workers, submitted; returns once a few are done."""
    write_dataset(tmp_path / "data", rows=rows, row_group_size=rows // 12)
    write_model(tmp_path / "model.onnx")
    stages = slow_stages(tmp_path, 0.03)
    spec = parse_job(job_spec(tmp_path, rows_per_shard=rows // 12, stages=stages, workers=(2, 2)))
    job_id = await client.submit(spec)

    async def some_done() -> bool:
        done = (await client.job(job_id)).shards.get("DONE", 0)
        return 2 <= done < 12

    await wait_until(some_done, timeout=60, what="a few shards done")
    return job_id


async def test_master_killed_and_restarted_mid_job_loses_nothing(
    tmp_path: Path, stack: LocalStack, client: EbbClient
) -> None:
    rows = 24_000
    job_id = await _under_way(tmp_path, client, rows)
    await stack.kill("master")
    assert stack.processes["master"].returncode == -signal.SIGKILL
    # Nobody answers now; workers keep computing, their renewals and commits wait.
    probe = MasterClient(client.nc, stack.nats_config, backoff=Backoff(attempts=1))
    with pytest.raises(BusError, match="NoResponders"):
        await probe.status()
    await stack.restart("master")
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == rows
    assert_exactly_once(tmp_path, rows)


async def test_nats_killed_and_restarted_mid_job_loses_nothing(
    tmp_path: Path, stack: LocalStack, client: EbbClient
) -> None:
    """nats-server SIGKILLed mid-job (what JetStream acknowledged is on disk) and started
    again on its store: master, controller, workers and client reconnect on their own."""
    rows = 24_000
    job_id = await _under_way(tmp_path, client, rows)
    await asyncio.to_thread(stack.nats.kill)
    await asyncio.to_thread(stack.nats.start)
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == rows
    assert_exactly_once(tmp_path, rows)
    # Every service lived through it: none exited (the stack restarts nothing here).
    assert all(p.returncode is None for p in stack.processes.values())
    # A reply the master sent to a request the killed server delivered goes out on the new
    # server, which knows no such request: its response permission refuses it (the asker,
    # having timed out, asks again). Only that is forgiven; any other violation still fails.
    stack.nats.violations[:] = [
        v for v in stack.nats.violations if not _reply_across_the_restart(v)
    ]


def _reply_across_the_restart(violation: str) -> bool:
    return "Publish Violation" in violation and 'Subject "_INBOX.' in violation


@pytest.mark.parametrize(
    "point", [failpoints.WORKER_AFTER_COMMIT_RECORD, failpoints.MASTER_AFTER_RECORDING_DONE]
)
async def test_a_kill_between_the_commit_record_and_the_masters_reply_loses_nothing(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """The narrowest window of exactly-once, hit on purpose (ebb.common.failpoints): a
    worker killed with its commit record written but the master not told (the shard's next
    holder must find the record and report it, not redo the shard), or the master killed
    with the shard recorded DONE but its reply not sent (the worker's retry, to the next
    master, must be told the shard is done)."""
    armed = tmp_path / "failpoints"
    armed.mkdir()
    monkeypatch.setenv(envvars.FAILPOINT_DIR, str(armed))
    rows = 12_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages = slow_stages(tmp_path, 0.03)
    spec = parse_job(
        job_spec(
            tmp_path, rows_per_shard=1_000, stages=stages, workers=(2, 2), fault={"lease_s": 3}
        )
    )
    async with (
        embedded_stack(tmp_path, prefix, max_workers=2) as stack,
        await EbbClient.connect(stack.nats_config) as client,
    ):
        job_id = await client.submit(spec)
        await wait_until(
            lambda: _done_at_least(client, job_id, 1),
            timeout=60,
            what="a first shard done",
        )
        failpoints.arm(armed, point)
        pid = await wait_until(
            lambda: failpoints.fired(armed, point), timeout=60, what=f"{point} to fire"
        )
        await wait_until(lambda: _gone(pid), timeout=10, what=f"pid {pid} to die")
        if point == failpoints.MASTER_AFTER_RECORDING_DONE:
            await asyncio.wait_for(stack.processes["master"].wait(), 10)
            await stack.restart("master")
        final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.rows_done == rows
    assert_exactly_once(tmp_path, rows)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _done_at_least(client: EbbClient, job_id: str, n: int) -> bool:
    return (await client.job(job_id)).shards.get("DONE", 0) >= n


async def test_rows_that_make_the_model_raise_become_error_rows(
    tmp_path: Path, client: EbbClient
) -> None:
    rows = 10_000
    bad = [5, 777, 9_999]
    write_dataset(tmp_path / "data", rows=rows, row_group_size=2_500)
    write_model(tmp_path / "model.onnx")
    stages = [
        {
            "name": "pick",
            "modelet": "ebbtest_modelets:FailOn",
            "params": {"ids": bad},
            "batch_size": 64,
        },
        {"name": "model", "model": str(tmp_path / "model.onnx"), "batch_size": 256},
        {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 256},
    ]
    spec = parse_job(job_spec(tmp_path, rows_per_shard=2_500, stages=stages, workers=(2, 2)))
    final = await client.wait(await client.submit(spec))
    assert final.state == "SUCCEEDED", final.reason
    assert final.error_rows == len(bad)
    table = assert_exactly_once(tmp_path, rows)
    errors = {r["id"]: r for r in table.to_pylist() if r["_error"] is not None}
    assert sorted(errors) == bad
    assert "stage 'pick': ValueError: cannot score row 777" in errors[777]["_error"]
    assert errors[777]["label"] is None and errors[777]["customer"] == "customer-0000777"


async def test_too_many_failing_rows_fail_the_job(tmp_path: Path, client: EbbClient) -> None:
    write_dataset(tmp_path / "data", rows=4_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    stages: list[dict[str, Any]] = [
        {"modelet": "ebbtest_modelets:FailOn", "params": {"ids": list(range(0, 4_000, 10))}},
        {"model": str(tmp_path / "model.onnx")},
    ]
    spec = parse_job(job_spec(tmp_path, rows_per_shard=1_000, stages=stages))
    final = await client.wait(await client.submit(spec))
    assert final.state == "FAILED"
    assert "exceed max_error_fraction 0.01" in final.reason


async def test_a_pipeline_that_cannot_start_fails_the_job_with_its_reason(
    tmp_path: Path, client: EbbClient
) -> None:
    write_dataset(tmp_path / "data", rows=2_000, row_group_size=1_000)
    spec = parse_job(
        job_spec(
            tmp_path,
            rows_per_shard=1_000,
            stages=[{"modelet": "ebbtest_modelets:BrokenSetup"}],
            fault={"max_attempts": 2},
        )
    )
    final: JobStatus = await asyncio.wait_for(client.wait(await client.submit(spec)), 120)
    assert final.state == "FAILED"
    assert "weights not found" in final.reason
    # The workers that met it said why they exit, as a pod's termination message.
    said = list((tmp_path / "state" / "logs" / "workers").glob("*.termination"))
    assert said and all("weights not found" in p.read_text() for p in said)


async def test_a_csv_job_types_every_shard_alike_and_keeps_line_breaks_in_values(
    tmp_path: Path, client: EbbClient
) -> None:
    rows, oops = 3_000, 2_500
    notes = [f'said "hi"\non two lines ({i})' if i % 5 == 0 else f"note {i}" for i in range(rows)]
    (tmp_path / "data").mkdir()
    with (tmp_path / "data" / "rows.csv").open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["id", "weight", "score", "note"])
        for i in range(rows):
            # weight: whole numbers in the first shards, fractions in the last ones.
            weight = i if i < 2_000 else i / 4
            writer.writerow([i, weight, "oops" if i == oops else i / 10, notes[i]])
    spec = job_spec(
        tmp_path,
        rows_per_shard=500,
        stages=[{"modelet": "ebb.worker.modelets:Features", "params": {"columns": ["id"]}}],
        workers=(2, 2),
        carryover=["id", "weight", "score", "note"],
    )
    spec["input"] = {
        "uri": str(tmp_path / "data"),
        "format": "csv",
        "rows_per_shard": 500,
        "newlines_in_values": True,
        "column_types": {"score": "double"},
    }
    job_id = await client.submit(parse_job(spec))
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert (final.rows_done, final.error_rows, final.shards["DONE"]) == (rows, 1, 6)
    # The job as the workers read it: every column typed at planning.
    planned = await client.master.job(job_id, include_spec=True)
    assert planned.spec is not None
    assert planned.spec["input"]["column_types"] == {
        "id": "int64",
        "weight": "double",
        "score": "double",
        "note": "string",
    }
    _, manifest = read_output(tmp_path / "out")
    schemas = {str(pq.read_schema(tmp_path / "out" / f["path"])) for f in manifest["files"]}
    assert len(schemas) == 1  # every part file alike: the output reads as one table
    table = assert_exactly_once(tmp_path, rows)
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert [by_id[i]["note"] for i in range(rows)] == notes
    assert by_id[1_999]["weight"] == 1_999.0 and by_id[2_001]["weight"] == 2_001 / 4
    assert "column 'score': 'oops' is not double" in by_id[oops]["_error"]
    assert by_id[oops]["prediction"] is None and by_id[oops + 1]["prediction"] == [oops + 1]


async def test_a_shard_of_a_big_row_group_goes_through_in_chunks_exactly_once(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row group of 20,000 rows, shards of 5,000 asked: one shard, read once, in chunks of
    3,000 rows (EBB_CHUNK_ROWS), each written as it comes; every row exactly once, in order."""
    rows = 20_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=rows)
    write_model(tmp_path / "model.onnx")
    spec = parse_job(job_spec(tmp_path, rows_per_shard=5_000))
    monkeypatch.setenv(envvars.CHUNK_ROWS, "3000")  # the workers' environment, from the stack's
    async with (
        embedded_stack(tmp_path, prefix, max_workers=1) as stack,
        await EbbClient.connect(stack.nats_config) as client,
    ):
        final = await client.wait(await client.submit(spec))
    assert final.state == "SUCCEEDED", final.reason
    assert (final.shards_total, final.rows_done) == (1, rows)
    table = assert_exactly_once(tmp_path, rows)
    assert table.column("id").to_pylist() == list(range(rows))  # in order, chunk after chunk
    files = committed_files(tmp_path / "out")
    assert len(files) == 7  # ceil(20,000 / 3,000) chunks, a file each
