"""Benchmark 11: object stores.

Ebb against moto's S3 server on loopback, behind a proxy that adds a fixed latency to every
request (20 and 50 ms, as a remote store would).

- job throughput with and without prefetch: one worker, Parquet in and out of S3, a stage
  that waits a fixed time per row (so that the CPU is not what is measured); prefetch holds two
  shards at once (the next one is leased and read while the current one computes), without
  it one (EBB_SHARDS_IN_FLIGHT=1).
- a URL column read by the Fetch stage: objects per second against its concurrency.
- a fleet starting at once: 50 workers' first shard reads (the Parquet footer and row groups,
  through the worker's own reader) all at once, and spread by a jittered start (each waits a
  random 0..J s first, EBB_START_JITTER_S): the peak requests per second the store sees.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import threading
import time
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common import envvars
from ebb.common.job import parse_job
from ebb.common.messaging.messages import ShardSpec
from ebb.worker.modelets.fetch import Fetch
from ebb.worker.shardio.reader import read_shard
from tests.objectstore import FaultyProxy, MotoS3, create_bucket, environment, s3, s3_environment

from .common import REPO, Context, Section, median, spread, table

LATENCIES_MS = (20, 50)


def _parquet(rows: int, start: int) -> bytes:
    table = pa.table(
        {"id": np.arange(start, start + rows), "x": np.random.default_rng(start).random(rows)}
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=1_000)
    return buffer.getvalue()


async def _job(ctx: Context, bucket: str, *, rows: int, in_flight: int) -> float:
    """Rows per second of one job, one worker, `in_flight` shards held at once."""
    out = f"s3://{bucket}/out-{uuid.uuid4().hex[:8]}"
    spec = parse_job(
        {
            "name": "s3-bench",
            "input": {"uri": f"s3://{bucket}/in", "format": "parquet", "rows_per_shard": 1_000},
            "pipeline": {
                "code_paths": [str(REPO)],
                "stages": [
                    {
                        "name": "work",
                        "modelet": "bench.modelets:Work",
                        "params": {"ms_per_row": 0.2},
                        "batch_size": 500,
                    }
                ],
            },
            "output": {"uri": out, "carryover": ["id"]},
            "resources": {"min_workers": 1, "max_workers": 1},
            "fault": {"lease_s": 60},
        }
    )
    with environment({envvars.SHARDS_IN_FLIGHT: str(in_flight)}):
        stack = LocalStack(
            StackConfig(
                state_dir=ctx.dir(f"s3-state-{time.monotonic_ns()}"),
                data_roots=[f"s3://{bucket}", str(REPO)],
                max_workers=1,
                log_level="WARNING",
            )
        )
        await stack.start()
        try:
            client = await EbbClient.connect(stack.nats_config)
            try:
                job_id = await client.submit(spec)
                # Timed from the first shard done: the stack's and the stages' start-up is the
                # same in both variants and not what prefetch changes.
                while (await client.job(job_id)).rows_done == 0:  # noqa: ASYNC110 - polls the master
                    await asyncio.sleep(0.05)
                started = time.perf_counter()
                first = (await client.job(job_id)).rows_done
                final = await client.wait(job_id, poll_s=0.05)
                seconds = time.perf_counter() - started
            finally:
                await client.close()
        finally:
            await stack.stop()
    if final.state != "SUCCEEDED" or final.rows_done != rows:
        raise RuntimeError(f"benchmark job ended {final.state}: {final.reason}")
    return (rows - first) / seconds


def _fetch_rate(bucket: str, objects: int, concurrency: int) -> float:
    fetch = Fetch(column="url", output="content", concurrency=concurrency)
    fetch.setup()
    urls = np.array([f"s3://{bucket}/docs/{i}.bin" for i in range(objects)], dtype=object)
    started = time.perf_counter()
    out = fetch.process_columns({"url": urls})
    seconds = time.perf_counter() - started
    assert fetch.pool is not None
    fetch.pool.shutdown()
    assert len(out["content"]) == objects
    return objects / seconds


def _peak_rate(proxy: FaultyProxy, bucket: str, workers: int, jitter_s: float) -> float:
    """Peak requests/s (in 250 ms windows) at the store while `workers` read their first
    shard, each after a random 0..jitter_s wait."""
    shard = ShardSpec(
        index=0,
        path=f"s3://{bucket}/in/part-000.parquet",
        format="parquet",
        rows=1_000,
        row_groups=[0],
    )
    stamps: list[float] = []
    lock = threading.Lock()
    go = threading.Barrier(workers)

    def worker() -> None:
        go.wait()
        if jitter_s:
            time.sleep(random.uniform(0, jitter_s))
        read_shard(shard, None)
        with lock:
            stamps.append(time.perf_counter())

    proxy.seen.clear()
    proxy.arrivals.clear()
    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    arrivals = sorted(proxy.arrivals)
    if not arrivals:
        return 0.0
    window = 0.25
    counts: dict[int, int] = {}
    for a in arrivals:
        slot = int((a - arrivals[0]) / window)
        counts[slot] = counts.get(slot, 0) + 1
    return max(counts.values()) / window


def run(ctx: Context) -> Section:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    rows = ctx.size(24_000, 8_000)
    objects = ctx.size(400, 100)
    fleet = 50 if not ctx.smoke else 8
    jitter_s = 2.0
    moto = MotoS3(process=True).start()
    job_rows: list[list[Any]] = []
    fetch_rows: list[list[Any]] = []
    burst_rows: list[list[Any]] = []
    summary: dict[str, Any] = {}
    try:
        for latency_ms in LATENCIES_MS if not ctx.smoke else LATENCIES_MS[:1]:
            proxy = FaultyProxy(upstream=moto.url, latency_s=latency_ms / 1000).start()
            try:
                with environment(s3_environment(proxy.url)):
                    bucket = f"bench-{uuid.uuid4().hex[:10]}"
                    create_bucket(moto.url, bucket)
                    fs = s3(moto.url)
                    files = 4
                    for f in range(files):
                        per = rows // files
                        fs.pipe_file(f"{bucket}/in/part-{f:03d}.parquet", _parquet(per, f * per))
                    for i in range(objects):
                        fs.pipe_file(f"{bucket}/docs/{i}.bin", os.urandom(4096))
                    # -- prefetch
                    rates: dict[str, list[float]] = {"with prefetch": [], "without": []}
                    # --smoke: the jobs' harness is the other sections' (and test_s3.py's).
                    for r in range(0 if ctx.smoke else ctx.repeats):
                        for name, in_flight in (("with prefetch", 2), ("without", 1)):
                            rate = asyncio.run(_job(ctx, bucket, rows=rows, in_flight=in_flight))
                            rates[name].append(rate)
                            ctx.log(f"  {latency_ms} ms, {name} run {r + 1}: {rate:,.0f} rows/s")
                    with_, without = rates["with prefetch"], rates["without"]
                    if with_ and without:
                        ratio = median(with_) / median(without)
                        job_rows.append(
                            [f"{latency_ms} ms", spread(with_), spread(without), f"{ratio:.2f}x"]
                        )
                        summary[f"prefetch_speedup_{latency_ms}ms"] = ratio
                    # -- URL column
                    for concurrency in (1, 4, 16, 64):
                        runs = [
                            _fetch_rate(bucket, objects, concurrency) for _ in range(ctx.repeats)
                        ]
                        fetch_rows.append([f"{latency_ms} ms", concurrency, spread(runs)])
                    # -- a fleet starting at once
                    at_once = [_peak_rate(proxy, bucket, fleet, 0.0) for _ in range(ctx.repeats)]
                    spread_out = [
                        _peak_rate(proxy, bucket, fleet, jitter_s) for _ in range(ctx.repeats)
                    ]
                    burst_rows.append(
                        [
                            f"{latency_ms} ms",
                            fleet,
                            f"{median(at_once):,.0f}",
                            f"{median(spread_out):,.0f}",
                            f"{median(at_once) / max(median(spread_out), 1e-9):.1f}x",
                        ]
                    )
            finally:
                proxy.stop()
    finally:
        moto.stop()
    return Section(
        title="11. Object stores: prefetch, a URL column, a fleet's start",
        intro=__doc__ or "",
        tables=[
            table(["store latency", "rows/s with prefetch", "rows/s without", "ratio"], job_rows),
            table(["store latency", "Fetch concurrency", "objects/s"], fetch_rows),
            table(
                [
                    "store latency",
                    "workers starting",
                    "peak requests/s, all at once",
                    f"peak requests/s, jittered start (0..{jitter_s:g} s)",
                    "ratio",
                ],
                burst_rows,
            ),
        ],
        notes=[
            f"Jobs: {rows:,} rows in shards of 1,000, one worker, a stage that waits 0.2 ms per "
            f"row. Fetch: {objects} objects of 4 KiB. The fleet: {fleet} threads each reading one "
            "shard through the worker's reader, peak counted in 250 ms windows at the proxy.",
            "The store is moto (a process of its own) behind a Python proxy, on the same cores as "
            "the job: it serves some tens to a few hundred requests per second, and that bounds "
            "the URL column's rate past a few requests in flight and the fleet's peak when all "
            "start at once. A real store serves far more; the ratios measured side by side are "
            "what carry over, not the absolute rates.",
        ],
        summary=summary,
        slug="objectstore",
    )
