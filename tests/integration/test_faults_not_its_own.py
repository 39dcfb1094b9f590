"""Faults that are not a job's own never fail it: a flaky node, worker churn, workers lost to
the cluster. On the embedded stack, real processes, default fault settings (max_attempts 3)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack
from ebb.common.job import parse_job
from ebb.common.messaging.messages import JobStatus

from ..helpers import (
    command_line,
    embedded_stack,
    job_spec,
    read_output,
    write_dataset,
    write_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
async def stack(tmp_path: Path, prefix: str) -> AsyncIterator[LocalStack]:
    async with embedded_stack(tmp_path, prefix, max_workers=2) as s:
        yield s


@pytest.fixture
async def client(stack: LocalStack) -> AsyncIterator[EbbClient]:
    async with await EbbClient.connect(stack.nats_config) as c:
        yield c


def stages(tmp_path: Path, first: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": "pre", "batch_size": 100, **first},
        {"name": "model", "model": str(tmp_path / "model.onnx"), "batch_size": 200},
        {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 200},
    ]


def exactly_once(tmp_path: Path, rows: int, *, missing: set[int] | None = None) -> None:
    table, _ = read_output(tmp_path / "out")
    ids: list[int] = sorted(table.column("id").to_numpy().tolist())
    assert ids == sorted(set(range(rows)) - (missing or set())), "every id exactly once"


def workers_of(stack: LocalStack) -> list[psutil.Process]:
    try:
        children = psutil.Process(stack.processes["controller"].pid).children()
    except psutil.NoSuchProcess:
        return []
    return [p for p in children if "ebb.worker" in command_line(p)]


async def test_one_flaky_nodes_setup_failure_does_not_fail_the_job(
    tmp_path: Path, client: EbbClient
) -> None:
    rows = 20_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    # Slow enough that the job still runs when the failure is known: one node's failure
    # must not end a job that another worker carries on.
    params = {"marker": str(tmp_path / "ecc"), "seconds_per_batch": 0.05}
    flaky = {"modelet": "ebbtest_modelets:FlakyNode", "params": params}
    spec = job_spec(tmp_path, rows_per_shard=1_000, stages=stages(tmp_path, flaky), workers=(2, 2))
    final = await asyncio.wait_for(client.wait(await client.submit(parse_job(spec))), 240)
    assert final.state == "SUCCEEDED", final.reason
    assert (tmp_path / "ecc.0").exists()  # one worker's pipeline did fail to start
    assert final.workers_lost.get("setup") == 1
    assert final.shards["QUARANTINED"] == 0
    exactly_once(tmp_path, rows)


async def test_a_pipeline_that_cannot_start_anywhere_fails_the_job_naming_the_cause(
    tmp_path: Path, client: EbbClient
) -> None:
    write_dataset(tmp_path / "data", rows=2_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    broken = {"modelet": "ebbtest_modelets:BrokenSetup"}
    spec = job_spec(tmp_path, rows_per_shard=1_000, stages=stages(tmp_path, broken), workers=(2, 2))
    final = await asyncio.wait_for(client.wait(await client.submit(parse_job(spec))), 120)
    assert final.state == "FAILED"
    assert "could not start on 3 workers" in final.reason and "weights not found" in final.reason
    assert final.shards["QUARANTINED"] == 0  # the shards were never to blame


async def test_churn_at_the_default_max_attempts_quarantines_no_healthy_shard(
    tmp_path: Path, stack: LocalStack, client: EbbClient
) -> None:
    """A random worker SIGKILLed about every second for a minute (spot reclaims without
    notice, a node pool being lost): far more lost leases than max_attempts, none a failure."""
    rows = 40_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    slow = {"modelet": "ebbtest_modelets:Slow", "params": {"seconds_per_batch": 0.1}}
    spec = job_spec(
        tmp_path,
        rows_per_shard=1_000,
        stages=stages(tmp_path, slow),
        workers=(2, 2),
        fault={"lease_s": 4},  # max_attempts: the default
    )
    job_id = await client.submit(parse_job(spec))
    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    churn_ends = loop.time() + 60
    kills = 0
    while loop.time() < churn_ends and (await client.job(job_id)).state == "RUNNING":
        victims = workers_of(stack)
        if victims:
            try:
                os.kill(rng.choice(victims).pid, signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass  # it had just ended
        await asyncio.sleep(rng.uniform(0.7, 1.3))
    final: JobStatus = await asyncio.wait_for(client.wait(job_id), 240)
    assert kills >= 20
    assert final.state == "SUCCEEDED", final.reason
    assert final.shards["QUARANTINED"] == 0
    assert final.workers_lost.get("capacity", 0) >= 1 and final.attempts_forgiven >= 1
    exactly_once(tmp_path, rows)


async def test_a_shard_that_kills_its_worker_every_time_is_still_quarantined(
    tmp_path: Path, client: EbbClient
) -> None:
    rows = 6_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    killer = {"modelet": "ebbtest_modelets:KillsItsWorker", "params": {"kill_on": [2_500]}}
    spec = job_spec(
        tmp_path,
        rows_per_shard=1_000,
        stages=stages(tmp_path, killer),
        workers=(2, 2),
        fault={"max_error_fraction": 0.5},
    )
    job_id = await client.submit(parse_job(spec))
    final = await asyncio.wait_for(client.wait(job_id), 240)
    assert final.state == "SUCCEEDED", final.reason
    assert final.shards["QUARANTINED"] == 1 and final.workers_lost.get("crash", 0) >= 3
    exactly_once(tmp_path, rows, missing=set(range(2_000, 3_000)))
