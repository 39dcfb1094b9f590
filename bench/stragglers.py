"""Benchmark 3: a straggler. Dynamic leasing by the shard master against an even static split.

Four workers; one runs at half speed (EBB_BENCH_SLOWDOWN=2, a flag of this benchmark that
makes its stage sleep twice as long per row). The work per row is simulated (a wait, not a
computation), so that four workers on this machine's two cores do not compete for them: the
benchmark measures how work is handed out, not the CPU.

- static split: the rows cut into four equal shards, one per worker, no speculation: the job
  ends when the slow worker finishes its quarter.
- shard master: small shards leased as workers ask for them, with speculative re-execution of
  the last stragglers: the slow worker simply takes fewer shards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common.natsconfig import nats_environment
from ebb.common.spec import parse_job

from .common import REPO, Context, Section, median, spread, table

WORKERS = 4
SLOWDOWN = 2.0


def spec(
    data: Path, out: Path, *, rows: int, shards: int, speculative: bool, ms_per_row: float
) -> dict[str, Any]:
    return {
        "name": "stragglers",
        "input": {"uri": str(data), "rows_per_shard": -(-rows // shards)},
        "pipeline": {
            "code_paths": [str(REPO)],
            "stages": [
                {
                    "name": "work",
                    "modelet": "bench.modelets:Work",
                    "params": {"ms_per_row": ms_per_row},
                    "batch_size": 50,
                }
            ],
        },
        "output": {"uri": str(out), "carryover": ["id"]},
        "resources": {"min_workers": WORKERS, "max_workers": WORKERS},
        "fault": {"speculative": speculative, "lease_s": 30},
    }


async def _once(
    ctx: Context, data: Path, rows: int, *, shards: int, speculative: bool, ms_per_row: float
) -> float:
    root = ctx.dir(f"straggle-{time.monotonic_ns()}")
    stack = LocalStack(
        StackConfig(
            state_dir=root / "state",
            data_roots=[str(ctx.workdir), str(REPO)],
            controller=False,  # the benchmark starts the workers, one of them slowed down
            log_level="WARNING",
        )
    )
    await stack.start()
    workers: list[asyncio.subprocess.Process] = []
    try:
        client = await EbbClient.connect(stack.nats_config)
        try:
            job = parse_job(
                spec(
                    data,
                    root / "out",
                    rows=rows,
                    shards=shards,
                    speculative=speculative,
                    ms_per_row=ms_per_row,
                )
            )
            started = time.perf_counter()
            job_id = await client.submit(job)
            base_env = {**os.environ, "EBB_LOG_LEVEL": "WARNING"}
            for n in range(WORKERS):
                env = {
                    **base_env,
                    **nats_environment(stack.worker_nats_config(f"w{n}")),
                    "EBB_BENCH_SLOWDOWN": str(SLOWDOWN if n == 0 else 1.0),
                }
                # One shard at a time: with prefetch a worker would hold two of the four.
                args = [
                    "-m",
                    "ebb.worker",
                    "--job",
                    job_id,
                    "--id",
                    f"w{n}",
                    "--shards-in-flight",
                    "1",
                ]
                workers.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable, *args, env=env, stdout=asyncio.subprocess.DEVNULL
                    )
                )
            final = await client.wait(job_id, poll_s=0.1)
            seconds = time.perf_counter() - started
            if final.state != "SUCCEEDED":
                raise RuntimeError(f"benchmark job failed: {final.reason}")
            return seconds
        finally:
            await client.close()
    finally:
        for w in workers:
            if w.returncode is None:
                w.send_signal(signal.SIGTERM)
        for w in workers:
            await w.wait()
        await stack.stop()


def run(ctx: Context) -> Section:
    rows = ctx.size(24_000, 4_000)
    ms_per_row = 1.0
    data = ctx.dir("straggle-data") / "rows.parquet"
    pq.write_table(pa.table({"id": np.arange(rows)}), data)
    variants = {  # name: (shards, speculative)
        "static split (4 shards)": (WORKERS, False),
        "shard master (64 shards)": (64, True),
    }
    results: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(ctx.repeats):
        for name, (shards, speculative) in variants.items():
            seconds = asyncio.run(
                _once(
                    ctx, data, rows, shards=shards, speculative=speculative, ms_per_row=ms_per_row
                )
            )
            results[name].append(seconds)
            ctx.log(f"  {name} run {r + 1}/{ctx.repeats}: {seconds:.2f} s")
    static = median(results["static split (4 shards)"])
    dynamic = median(results["shard master (64 shards)"])
    work = rows * ms_per_row / 1000
    ideal = work / (WORKERS - 1 + 1 / SLOWDOWN)
    rows_out = [[k, spread(v), f"{1 - median(v) / static:.0%}"] for k, v in results.items()]
    rows_out.append(
        ["ideal (perfect balance, no overhead)", f"{ideal:.1f}", f"{1 - ideal / static:.0%}"]
    )
    section = Section(
        title="3. A straggler: dynamic shard assignment against an even split",
        intro=__doc__ or "",
        tables=[
            table(["assignment", "job seconds median (min-max)", "shorter than static"], rows_out)
        ],
        slug="stragglers",
        plot={"kind": "bars", "values": dict(results), "unit": "seconds to finish the job"},
        summary={"static_s": static, "dynamic_s": dynamic, "reduction": 1 - dynamic / static},
    )
    section.notes.append(
        f"{rows:,} rows of {ms_per_row:g} ms each ({work:.0f} s of work); {WORKERS} workers, one "
        f"{SLOWDOWN:g}x slower. Times run from submission to the manifest, workers' start-up "
        "included."
    )
    return section
