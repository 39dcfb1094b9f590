"""Benchmark 4: how many workers one shard master coordinates, and at what cost.

Simulated workers (asyncio clients, 50 per NATS connection) run the real protocol against a
real master and nats-server: lease -> hold half -> renew -> hold half -> create the commit
record -> commit. The job has 20 shards per worker (at most 20,000), planned from a real
Parquet file. We report lease-protocol operations per second, per-operation latency, and the
coordination overhead: the protocol's time per shard relative to processing a 10,000-row shard
at the single-model benchmark's measured rate.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common import bus
from ebb.common.api import MasterClient
from ebb.common.bus import Backoff
from ebb.common.layout import OutputFile
from ebb.common.output import OutputStore, new_commit
from ebb.common.spec import parse_job

from .common import BENCH_DIR, Context, Section, median, table

WORKERS_PER_CONNECTION = 50
ROWS_PER_SHARD = 10_000
HOLD_S = 0.05


@dataclass
class Latencies:
    ops: dict[str, list[float]] = field(
        default_factory=lambda: {"lease": [], "renew": [], "commit": []}
    )
    shards: int = 0

    def p(self, op: str, q: float) -> float:
        values = self.ops[op]
        return float(np.percentile(values, q)) * 1000 if values else float("nan")


async def _simulated_worker(
    n: int, master: MasterClient, job: str, store: OutputStore, stats: Latencies
) -> None:
    name = f"sim-{n}"
    while True:
        t0 = time.perf_counter()
        reply = await master.lease(job, name)
        stats.ops["lease"].append(time.perf_counter() - t0)
        if reply.status == "end":
            return
        if reply.status == "wait" or reply.shard is None:
            await asyncio.sleep(reply.retry_after_s)
            continue
        await asyncio.sleep(HOLD_S / 2)
        t0 = time.perf_counter()
        await master.renew(reply.token, worker=name)
        stats.ops["renew"].append(time.perf_counter() - t0)
        await asyncio.sleep(HOLD_S / 2)
        record = new_commit(
            job=job,
            shard=reply.shard.index,
            attempt=reply.attempt,
            files=[OutputFile(path=f"sim/{reply.shard.index}", rows=ROWS_PER_SHARD)],
            worker=name,
        )
        await asyncio.to_thread(store.create_commit, record)
        t0 = time.perf_counter()
        await master.commit(reply.token, worker=name, rows=ROWS_PER_SHARD, error_rows=0)
        stats.ops["commit"].append(time.perf_counter() - t0)
        stats.shards += 1


async def _measure(ctx: Context, workers: int) -> dict[str, float]:
    shards = min(20 * workers, 20_000)
    root = ctx.dir(f"scale-{workers}-{time.monotonic_ns()}")
    pq.write_table(pa.table({"id": np.arange(shards)}), root / "in.parquet", row_group_size=shards)
    stack = LocalStack(
        StackConfig(
            state_dir=root / "state",
            data_roots=[str(ctx.workdir), str(BENCH_DIR)],
            controller=False,
            log_level="WARNING",
            # Simulated workers share connections, many to one, which a credential per
            # worker forbids; the master's work per request is the same either way.
            auth=False,
        )
    )
    await stack.start()
    connections = []
    try:
        config = stack.nats_config
        for _ in range(math.ceil(workers / WORKERS_PER_CONNECTION)):
            connections.append(await bus.connect(config, name="bench-sim"))
        clients = [
            MasterClient(nc, config, backoff=Backoff(first_s=0.05, max_s=1.0)) for nc in connections
        ]
        spec = parse_job(
            {
                "name": "scale",
                "input": {"uri": str(root / "in.parquet"), "rows_per_shard": 1},
                "pipeline": {"stages": [{"modelet": "ebb.worker.modelets:Identity"}]},
                "output": {"uri": str(root / "out")},
                "fault": {"lease_s": 30, "speculative": False},
            }
        ).with_id()
        async with await EbbClient.connect(stack.nats_config) as submitter:
            planned = time.perf_counter()
            await submitter.submit(spec, accept_timeout_s=600)
            planning_s = time.perf_counter() - planned
        store = OutputStore(spec.output.uri)
        stats = Latencies()
        started = time.perf_counter()
        await asyncio.gather(
            *(
                _simulated_worker(n, clients[n // WORKERS_PER_CONNECTION], spec.id, store, stats)
                for n in range(workers)
            )
        )
        elapsed = time.perf_counter() - started
        ops = sum(len(v) for v in stats.ops.values())
        return {
            "workers": workers,
            "shards": stats.shards,
            "planning_shards_per_s": shards / planning_s,
            "ops_per_s": ops / elapsed,
            "shards_per_s": stats.shards / elapsed,
            "lease_p50_ms": stats.p("lease", 50),
            "lease_p99_ms": stats.p("lease", 99),
            "renew_p50_ms": stats.p("renew", 50),
            "renew_p99_ms": stats.p("renew", 99),
            "commit_p50_ms": stats.p("commit", 50),
            "commit_p99_ms": stats.p("commit", 99),
            "protocol_ms_per_shard": stats.p("lease", 50)
            + stats.p("renew", 50)
            + stats.p("commit", 50),
        }
    finally:
        for nc in connections:
            await nc.close()
        await stack.stop()


def run(ctx: Context, *, rows_per_s_per_worker: float | None) -> Section:
    sizes = [10, 100] if ctx.quick else [10, 100, 1_000]
    results: dict[int, list[dict[str, float]]] = {w: [] for w in sizes}
    repeats = 1 if ctx.quick else ctx.repeats
    for r in range(repeats):
        for workers in sizes:
            result = asyncio.run(_measure(ctx, workers))
            ctx.log(
                f"  {workers} workers run {r + 1}/{repeats}: {result['ops_per_s']:,.0f} ops/s, "
                f"lease p99 {result['lease_p99_ms']:.1f} ms"
            )
            results[workers].append(result)
    shard_s = ROWS_PER_SHARD / rows_per_s_per_worker if rows_per_s_per_worker else float("nan")
    rows = []
    summary: dict[str, float] = {}
    plot: dict[str, Any] = {"kind": "scale", "workers": sizes, "ops": [], "p50": [], "p99": []}
    for workers in sizes:
        m = {k: median([r[k] for r in results[workers]]) for k in results[workers][0]}
        plot["ops"].append(m["ops_per_s"])
        plot["p50"].append(m["lease_p50_ms"])
        plot["p99"].append(m["lease_p99_ms"])
        overhead = (
            m["protocol_ms_per_shard"] / 1000 / shard_s if shard_s == shard_s else float("nan")
        )
        summary[f"ops_per_s_{workers}"] = m["ops_per_s"]
        summary[f"overhead_{workers}"] = overhead
        rows.append(
            [
                workers,
                f"{m['ops_per_s']:,.0f}",
                f"{m['shards_per_s']:,.0f}",
                f"{m['lease_p50_ms']:.1f} / {m['lease_p99_ms']:.1f}",
                f"{m['renew_p50_ms']:.1f} / {m['renew_p99_ms']:.1f}",
                f"{m['commit_p50_ms']:.1f} / {m['commit_p99_ms']:.1f}",
                f"{overhead:.3%}" if overhead == overhead else "-",
                f"{m['planning_shards_per_s']:,.0f}",
            ]
        )
    section = Section(
        title="4. Shard master at scale",
        intro=__doc__ or "",
        tables=[
            table(
                [
                    "simulated workers",
                    "protocol ops/s",
                    "shards/s",
                    "lease p50 / p99 ms",
                    "renew p50 / p99 ms",
                    "commit p50 / p99 ms",
                    "coordination overhead",
                    "planning shards/s",
                ],
                rows,
            )
        ],
        summary=summary,
        slug="scale",
        plot=plot,
    )
    rate = (
        f"({shard_s:.1f} s)"
        if shard_s == shard_s
        else "(not measured in this run: `python -m bench --only single,scale` measures both)"
    )
    section.notes.append(
        f"Coordination overhead = (lease + renew + commit median latency) / the time one worker "
        f"takes for a {ROWS_PER_SHARD:,}-row shard at the single-model benchmark's rate {rate}. "
        "The simulated workers, nats-server and master share this machine's cores, so the "
        "highest concurrencies measure the machine as much as the master."
    )
    return section
