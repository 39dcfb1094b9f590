"""A worker as a real process (`python -m ebb.worker`) against a real master, when its pipeline
cannot start: what it tells the master, what it hands back, and how it exits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ebb.client.sdk import EbbClient
from ebb.common import envvars, schema
from ebb.common.job import JobSpec, parse_job
from ebb.common.messaging.natsconfig import NatsConfig, nats_environment
from ebb.common.messaging.subjects import Subjects
from ebb.common.runner import EXIT_OK, EXIT_SETUP
from ebb.shard_master.service import MasterConfig, ShardMaster
from ebb.shard_master.table.records import ShardRecord, shard_key

from ..helpers import ASSETS, command_line, job_spec, wait_until, write_dataset, write_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
async def master(nats_config: NatsConfig, tmp_path: Path) -> AsyncIterator[ShardMaster]:
    # No speculation: a worker with nothing to do is told to wait, not given a copy of a
    # shard someone else holds.
    config = MasterConfig(
        nats=nats_config,
        id="m",
        data_roots=[str(tmp_path), str(ASSETS)],
        speculate_after_s=3600.0,
    )
    service = ShardMaster(config)
    task = asyncio.create_task(service.run(), name="master")
    ready = asyncio.create_task(service.ready.wait())
    await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()
    try:
        yield service
    finally:
        service.request_stop()
        await task


@pytest.fixture
async def client(nats_config: NatsConfig, master: ShardMaster) -> AsyncIterator[EbbClient]:
    async with await EbbClient.connect(nats_config) as c:
        yield c


@contextlib.asynccontextmanager
async def worker_process(
    nats_config: NatsConfig,
    job: str,
    folder: Path,
    *,
    worker_id: str = "w1",
    cores: set[int] | None = None,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`python -m ebb.worker` on `job`, its output in folder/ID.log, its termination message
    in folder/ID.termination; killed on the way out if it is still running. `cores`: the
    only cores it may run on (its affinity mask, from its first instruction)."""
    env = {
        **os.environ,
        **nats_environment(nats_config),
        envvars.TERMINATION_LOG: str(folder / f"{worker_id}.termination"),
    }
    with open(folder / f"{worker_id}.log", "wb") as log:
        pinned = (
            ["-c", f"import os, runpy; os.sched_setaffinity(0, {cores!r}); {_RUN_AS_MAIN}"]
            if cores is not None
            else ["-m", "ebb.worker"]
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            *pinned,
            "--job",
            job,
            "--id",
            worker_id,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield process
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


_RUN_AS_MAIN = "import sys; runpy.run_module('ebb.worker', run_name='__main__', alter_sys=True)"


def broken_job(tmp_path: Path, *, rows: int, gate: Path | None = None, **fault: Any) -> JobSpec:
    """A job whose only stage fails its set-up (once `gate` exists, if given), over shards of
    1,000 rows."""
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    params = {"gate": str(gate)} if gate is not None else {}
    stages = [{"name": "broken", "modelet": "ebbtest_modelets:BrokenSetup", "params": params}]
    return parse_job(
        job_spec(tmp_path, rows_per_shard=1_000, stages=stages, fault=fault or None)
    ).with_id()


async def shard_records(client: EbbClient, job: str, shards: int) -> list[ShardRecord]:
    kv = await client.nc.jetstream().key_value(Subjects(client.config.prefix).shards_bucket)
    records = []
    for index in range(shards):
        entry = await kv.get(shard_key(job, index))
        assert entry.value is not None
        records.append(schema.decode(ShardRecord, entry.value))
    return records


async def test_a_worker_whose_pipeline_cannot_start_hands_its_shards_back_unharmed_and_exits_4(
    tmp_path: Path, nats_config: NatsConfig, client: EbbClient
) -> None:
    gate = tmp_path / "gate"
    spec = broken_job(tmp_path, rows=2_000, gate=gate)
    await client.submit(spec)
    async with worker_process(nats_config, spec.id, tmp_path) as worker:

        async def a_shard_held() -> bool:
            status = (await client.master.status(spec.id, include_leases=True)).jobs[0]
            return [lease.worker for lease in status.leases] == ["w1"]

        # One shard while the models load: the next is leased once they have.
        await wait_until(a_shard_held, timeout=60, what="the worker to lease a shard")
        gate.touch()  # now its stage fails to set up
        code = await asyncio.wait_for(worker.wait(), 60)
    assert code == EXIT_SETUP, (tmp_path / "w1.log").read_text()
    assert "weights not found" in (tmp_path / "w1.termination").read_text()
    # Not the shards' fault: back in the queue, no attempt counted against them.
    records = await shard_records(client, spec.id, 2)
    for record in records:
        assert (record.state, record.failures) == ("TODO", 0)
    assert sorted(record.attempts for record in records) == [0, 1]  # the one it leased


async def test_a_worker_leases_its_next_shard_once_its_models_have_loaded(
    tmp_path: Path, nats_config: NatsConfig, client: EbbClient
) -> None:
    """Two shards, two workers, models that load slowly: the second worker, started a
    moment after the first, gets the second shard. Leased at once as the first worker's
    next, it sat behind the first one's while the second worker had nothing to do."""
    write_dataset(tmp_path / "data", rows=2_000, row_group_size=1_000)
    gate = tmp_path / "gate"
    stages = [
        {"name": "slow", "modelet": "ebbtest_modelets:GatedSetup", "params": {"gate": str(gate)}}
    ]
    spec = parse_job(job_spec(tmp_path, rows_per_shard=1_000, stages=stages)).with_id()
    await client.submit(spec)

    async def holders_are(expected: list[str]) -> bool:
        status = (await client.master.status(spec.id, include_leases=True)).jobs[0]
        return sorted(lease.worker for lease in status.leases) == expected

    async with worker_process(nats_config, spec.id, tmp_path, worker_id="w1") as first:
        await wait_until(
            lambda: holders_are(["w1"]), timeout=60, what="the first worker to lease a shard"
        )
        async with worker_process(nats_config, spec.id, tmp_path, worker_id="w2") as second:
            await wait_until(
                lambda: holders_are(["w1", "w2"]),
                timeout=60,
                what="each worker to hold a shard while the models load",
            )
            gate.touch()
            codes = await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), 120)
    assert list(codes) == [EXIT_OK, EXIT_OK], (tmp_path / "w2.log").read_text()
    final = await client.master.job(spec.id)
    assert (final.state, final.rows_done) == ("SUCCEEDED", 2_000)


async def test_a_worker_whose_pipeline_cannot_start_says_so_with_no_shard_to_work_on(
    tmp_path: Path, nats_config: NatsConfig, client: EbbClient
) -> None:
    """The job's only shard is held by someone else: the master tells the worker to wait, and
    no shard of its own ever waits for its pipeline. It must still notice, and say so."""
    spec = broken_job(tmp_path, rows=1_000, lease_s=600)
    await client.submit(spec)
    held = await client.master.lease(spec.id, "other")
    assert held.shard is not None
    async with worker_process(nats_config, spec.id, tmp_path) as worker:
        code = await asyncio.wait_for(worker.wait(), 60)
    log = (tmp_path / "w1.log").read_text()
    assert code == EXIT_SETUP, log
    assert "weights not found" in (tmp_path / "w1.termination").read_text()
    assert "never retrieved" not in log


async def test_a_worker_tells_the_master_its_pipeline_is_ready_at_once(
    tmp_path: Path, nats_config: NatsConfig, client: EbbClient
) -> None:
    """Leases of 600 s are renewed every 200 s: the master hears that the pipeline started
    from a renewal made for that, while the first shard still computes, and from every
    request after it."""
    write_dataset(tmp_path / "data", rows=3_000, row_group_size=1_000)
    entered, gate = tmp_path / "entered", tmp_path / "gate"
    stages = [
        {
            "name": "gated",
            "modelet": "ebbtest_modelets:Gated",
            "params": {"entered": str(entered), "gate": str(gate), "then": str(gate)},
            "batch_size": 100,
        }
    ]
    spec = parse_job(
        job_spec(tmp_path, rows_per_shard=1_000, stages=stages, fault={"lease_s": 600})
    ).with_id()
    asked: list[tuple[str, bool]] = []

    async def record(msg: Any) -> None:
        op = msg.subject.split(".")[-2]
        if op in ("lease", "renew"):
            asked.append((op, bool(schema.unpack(msg.data).get("ready", False))))

    subjects = Subjects(nats_config.prefix)
    watch = await client.nc.subscribe(subjects.worker_op("*", "w1"), cb=record)
    try:
        await client.submit(spec)
        async with worker_process(nats_config, spec.id, tmp_path) as worker:
            # Its first shard's first batch runs (held), so its pipeline is up.
            await wait_until(entered.exists, timeout=60, what="the first batch to run")
            await wait_until(
                lambda: ("renew", True) in asked, timeout=60, what="a renewal saying ready"
            )
            gate.touch()
            code = await asyncio.wait_for(worker.wait(), 60)
        assert code == EXIT_OK, (tmp_path / "w1.log").read_text()
    finally:
        await watch.unsubscribe()
    assert (await client.master.job(spec.id)).state == "SUCCEEDED"
    ready = [r for _, r in asked]
    assert ready == sorted(ready), asked  # never "not ready" once it said "ready"
    assert ("lease", True) in asked, asked


_HUNG_PIPELINE = """
import asyncio, sys
from ebb.common.job import StageSpec
from ebb.worker.pipeline.front import Pipeline, PipelineConfig

async def main():
    stage = StageSpec(name="hang", modelet="hang_modelet:Hang", params={"marker": sys.argv[1]},
                      batch_size=4)
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[sys.argv[2]]))
    await pipeline.start()
    await pipeline.run([{"x": n} for n in range(4)])

asyncio.run(main())
"""

_HANG_MODELET = """
import time

class Hang:
    def __init__(self, marker):
        self.marker = marker

    def process_batch(self, rows):
        open(self.marker, "w").close()
        time.sleep(3600)
"""


async def test_a_stage_hung_in_user_code_goes_when_its_worker_is_killed(tmp_path: Path) -> None:
    """A worker SIGKILLed while a stage process hangs in a batch (before the batch timeout):
    the stage process, and the fork server it was forked from, leave with it."""
    (tmp_path / "hang_modelet.py").write_text(_HANG_MODELET)
    marker = tmp_path / "in-batch"
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HUNG_PIPELINE,
        str(marker),
        str(tmp_path),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        await wait_until(marker.exists, timeout=60, what="the stage to be in its batch")
        descendants = psutil.Process(worker.pid).children(recursive=True)
        assert descendants, "a fork server and a stage process"
    finally:
        worker.kill()
        await worker.wait()

    def all_gone() -> bool:
        return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in descendants)

    try:
        await wait_until(all_gone, timeout=30, what="the worker's processes to leave with it")
    finally:
        for p in descendants:
            with contextlib.suppress(psutil.Error):
                p.kill()


async def test_a_worker_confined_to_one_core_runs_every_stage_process_on_one_thread(
    tmp_path: Path, nats_config: NatsConfig, client: EbbClient
) -> None:
    write_dataset(tmp_path / "data", rows=4_000, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    spec = parse_job(job_spec(tmp_path, rows_per_shard=1_000)).with_id()
    await client.submit(spec)
    async with worker_process(nats_config, spec.id, tmp_path, cores={0}) as worker:
        server = await wait_until(
            lambda: next(
                (
                    p
                    for p in psutil.Process(worker.pid).children()
                    if "forkserver" in command_line(p)
                ),
                None,
            ),
            timeout=60,
            what="the worker's fork server",
        )
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        final = await asyncio.wait_for(client.wait(spec.id), 120)
        await asyncio.wait_for(worker.wait(), 60)
    assert final.state == "SUCCEEDED", final.reason
    log = (tmp_path / "w1.log").read_text()
    # Its modelet processes' BLAS and OpenMP pools: one thread; its model: one thread.
    assert b"OMP_NUM_THREADS=1" in environ and b"OPENBLAS_NUM_THREADS=1" in environ
    assert "1 cores for this worker" in log and "stage model process 0: 1 thread(s)" in log, log
