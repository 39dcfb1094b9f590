"""Retention through the service: the shard master as a process on a real nats-server, one job
run to completion by a real worker and 2,000 more that end (cancelled: no worker needed).
While they are kept, `status` answers them a page at a time, every page far below NATS's
largest message; once past their retention (the master restarted with a short one, which
also loads all 2,000 from KV), every key of theirs is gone, the master holds no job, and the
finished job's output is as it was."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
from nats.aio.client import Client as NATS

from ebb.client.sdk import EbbClient
from ebb.common import schema
from ebb.common.job import parse_job
from ebb.common.messaging.bus import parse_reply
from ebb.common.messaging.messages import StatusReply, StatusRequest
from ebb.common.messaging.natsconfig import NatsConfig, nats_environment
from ebb.common.messaging.snapshot import kv_snapshot
from ebb.common.messaging.subjects import Subjects

from ..helpers import ASSETS, free_port, job_spec, wait_until, write_dataset, write_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ENDED = 2_000  # four full status pages and one part-filled: paging at every boundary
AT_ONCE = 100  # submissions and cancellations in flight together
PAGE = 500  # the master's status page (ebb.shard_master.table.status.STATUS_PAGE)


class MasterProcess:
    """`python -m ebb.shard_master`, started and stopped by the test."""

    def __init__(self, nats_config: NatsConfig, root: Path) -> None:
        self.env = {**os.environ, **nats_environment(nats_config), "EBB_LOG_LEVEL": "WARNING"}
        self.root = root
        self.metrics_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *, retention_s: float) -> None:
        args = ["--id", "m", "--data-root", str(self.root), "--data-root", str(ASSETS)]
        args += ["--job-retention", str(retention_s), "--leader-ttl", "2"]
        args += ["--metrics-port", str(self.metrics_port)]
        with open(self.root / "master.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ebb.shard_master", *args],
                env=self.env,
                stdout=log,
                stderr=log,
            )

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            assert self.process.wait(timeout=60) == 0
            self.process = None

    def jobs_held(self) -> float | None:
        """The jobs the master holds in memory, as its own gauge ebb_jobs says (all states)."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
            ) as r:
                text = r.read().decode()
        except OSError:
            return None
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("ebb_jobs{")
        )

    async def ready(self) -> None:
        """Until its /readyz says it leads (a restarted one may first stand by until the
        previous one's leader key runs out)."""

        def answers() -> bool:
            try:
                url = f"http://127.0.0.1:{self.metrics_port}/readyz"
                with urllib.request.urlopen(url, timeout=5) as r:
                    return bool(r.read().decode().strip() == "leading")
            except OSError:
                return False

        async def ready() -> bool:
            assert self.process is not None and self.process.poll() is None, "master exited"
            return await asyncio.to_thread(answers)

        await wait_until(ready, timeout=60, interval=0.2, what="the master ready")

    def rss(self) -> int:
        assert self.process is not None
        return int(psutil.Process(self.process.pid).memory_info().rss)


@pytest.fixture
def master_process(nats_config: NatsConfig, tmp_path: Path) -> Iterator[MasterProcess]:
    m = MasterProcess(nats_config, tmp_path)
    try:
        yield m
    finally:
        if m.process is not None:
            m.process.kill()
            m.process.wait(timeout=30)


@pytest.fixture
async def ebb(nats_config: NatsConfig) -> AsyncIterator[EbbClient]:
    async with await EbbClient.connect(nats_config) as client:
        yield client


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


async def pages(nc: NATS, subjects: Subjects) -> list[tuple[int, StatusReply]]:
    """Every status page as it comes over the wire: its size in bytes, and its reply."""
    out: list[tuple[int, StatusReply]] = []
    after = ""
    while True:
        msg = await nc.request(
            subjects.master("status"), schema.encode(StatusRequest(after=after)), timeout=30
        )
        reply = parse_reply(msg.data, StatusReply)
        out.append((len(msg.data), reply))
        after = reply.next
        if not after:
            return out


async def test_thousands_of_ended_jobs_are_paged_then_forgotten_and_outputs_stay(
    tmp_path: Path,
    nats_config: NatsConfig,
    prefix: str,
    master_process: MasterProcess,
    ebb: EbbClient,
) -> None:
    subjects = Subjects(prefix)
    master_process.start(retention_s=3600)
    await master_process.ready()
    write_dataset(tmp_path / "data", rows=1_000, row_group_size=500)
    write_model(tmp_path / "model.onnx")
    # One job run to the end by a real worker: its output is what retention must not touch.
    done = await ebb.submit(parse_job(job_spec(tmp_path, rows_per_shard=500)))
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ebb.worker",
        "--job",
        done,
        "--id",
        "w1",
        env={**os.environ, **nats_environment(nats_config), "EBB_LOG_LEVEL": "WARNING"},
    )
    assert await worker.wait() == 0
    final = await asyncio.wait_for(ebb.wait(done), 60)
    assert final.state == "SUCCEEDED" and final.rows_done == 1_000
    output = snapshot(tmp_path / "out")
    assert any(name.endswith(".parquet") for name in output)

    # ENDED more that end: submitted, then cancelled.
    async def end_one(k: int) -> str:
        spec = parse_job(job_spec(tmp_path, output_uri=str(tmp_path / "ended" / f"{k:04d}")))
        job = await ebb.submit(spec.with_id())
        await ebb.cancel(job, "ended for the retention test")
        return job

    ended: list[str] = []
    for start in range(0, ENDED, AT_ONCE):
        ended += await asyncio.gather(*(end_one(k) for k in range(start, start + AT_ONCE)))
    kept = {done, *ended}

    # Kept: every job answered once, a page at a time, each page far below 1 MiB.
    answered = await pages(ebb.nc, subjects)
    assert [len(r.jobs) for _, r in answered[:-1]] == [PAGE] * (len(answered) - 1)
    ids = [j.id for _, r in answered for j in r.jobs]
    assert sorted(ids) == sorted(kept) and len(ids) == len(kept)
    largest = max(size for size, _ in answered)
    assert largest < ebb.nc.max_payload // 4, largest
    assert {j.id for j in (await ebb.status()).jobs} == kept  # the SDK gathers the pages
    assert master_process.jobs_held() == len(kept)
    rss_kept = master_process.rss()

    # Past their retention: a master with a short one loads them all (it leads once they are
    # loaded), then forgets each as soon as it ended over a second ago by the wall clock.
    master_process.stop()
    master_process.start(retention_s=1.0)
    await master_process.ready()

    async def forgotten() -> bool:
        return master_process.jobs_held() == 0

    await wait_until(forgotten, timeout=120, interval=0.5, what="every ended job forgotten")
    js = ebb.nc.jetstream()
    for bucket in (subjects.jobs_bucket, subjects.shards_bucket):
        # Not nats.py's `keys()`, which can end its read early and find none
        # (nats-io/nats.py#842): this check would then pass whatever is left.
        left = [e.key for e in await kv_snapshot(js, bucket, ">")]
        assert left == [], (bucket, len(left), left[:5])
    reply = await ebb.status()
    assert reply.jobs == []
    assert snapshot(tmp_path / "out") == output  # the finished job's output, untouched
    rss_forgotten = master_process.rss()
    print(
        f"master RSS: {rss_kept / 2**20:.0f} MiB with {len(kept)} jobs kept, "
        f"{rss_forgotten / 2**20:.0f} MiB after loading and forgetting them"
    )
    master_process.stop()
