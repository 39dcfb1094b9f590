"""Benchmark 4: how many workers one shard master coordinates, and at what cost.

Simulated workers (asyncio clients, 50 per NATS connection) run the real protocol against a
real master and nats-server, as Ebb's worker does: two shards held at once (one computing,
the next leased ahead), each held for the time its rows take at the single-model
benchmark's rate, renewed at a third of the lease period (60 s, the default) with the same
jitter, and committed with its commit record. The job gives each worker 200,000 rows (a
minute of work at a few thousand rows a second), from a real Parquet file in row groups of
10,000 rows, cut two ways:

- before: `rows_per_shard: 10000`, the old default (20 shards a worker);
- after: no `rows_per_shard`, shards sized for the fleet (`fleet_shard_rows`: four a worker
  here, packed from whole row groups).

For each we count every request the master answers (leases, the "wait"s of workers with
nothing left at the end, renewals, commits) per million rows, and the master's share of a
worker's time: a shard's requests' latencies (its lease, renewals and commit) over the time
its rows take, as if the worker waited for each of them in turn. A real worker overlaps its
renewals and its next lease with its work, so this is an upper bound.

Time is compressed where it can be, to keep the section to minutes: shards held, the lease
period and the waits all run faster by one factor, so every count stays what it would be,
and the master sees more requests a second than a real fleet would send it, up to 300. A
fleet that would send more runs in real time: a thousand workers do. Each configuration runs
once.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common.data.layout import OutputFile
from ebb.common.data.output import OutputStore, new_commit
from ebb.common.errors import RemoteError
from ebb.common.job import parse_job
from ebb.common.messaging import bus
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.messages import LeaseReply
from ebb.shard_master.planning.sizing import fleet_shard_rows
from ebb.shard_master.service import MasterConfig
from ebb.worker.leases import renew_after

from .common import BENCH_DIR, Context, Section, median, table

WORKERS_PER_CONNECTION = 50
ROWS_PER_WORKER = 200_000
BEFORE_ROWS = 10_000
"""The old default rows_per_shard, and the file's row group: every sizing cuts whole groups."""
LEASE_S = 60.0
"""The default lease period."""
SHARDS_IN_FLIGHT = 2
"""As the worker by default: the next shard is leased while one computes."""
LOAD_CAP = 300.0
"""Requests a second the master may see at most because time is compressed."""
MAX_COMPRESSION = 20.0
ASSUMED_RATE = 3_000.0
"""Rows a second a worker computes when the single-model benchmark did not run."""
SIZINGS = {"fixed": "10,000 rows (before)", "fleet": "sized for the fleet (after)"}


@dataclass
class Tally:
    """What the simulated workers of one run saw."""

    latency: dict[str, list[float]] = field(
        default_factory=lambda: {"lease": [], "wait": [], "renew": [], "commit": []}
    )
    """Seconds each request took, by kind: "lease" a granted one, "wait" one answered
    "wait" or "end"."""
    shards: int = 0
    rows: int = 0
    lost: int = 0
    """Leases lost (renewed or committed too late): none, unless the master fell behind."""

    def p(self, kind: str, q: float) -> float:
        values = self.latency[kind]
        return float(np.percentile(values, q)) * 1000 if values else float("nan")

    @property
    def requests(self) -> int:
        return sum(len(v) for v in self.latency.values())


@dataclass(frozen=True)
class Timing:
    """Simulated time: `compression` times faster than real time."""

    rows_per_s: float
    """A worker's real rate."""
    compression: float

    def compute_s(self, rows: int) -> float:
        """Seconds (compressed) that `rows` take, give or take a fifth: rows' costs vary,
        and workers in lockstep would send their requests in bursts no real fleet sends."""
        return rows / self.rows_per_s / self.compression * random.uniform(0.8, 1.2)

    def of(self, seconds: float) -> float:
        """Real seconds as simulated ones."""
        return seconds / self.compression


class SimulatedWorker:
    """One worker's use of the protocol, without its pipeline."""

    def __init__(
        self,
        name: str,
        master: MasterClient,
        *,
        job: str,
        store: OutputStore,
        timing: Timing,
        tally: Tally,
    ) -> None:
        self.name = name
        self.master = master
        self.job = job
        self.store = store
        self.timing = timing
        self.tally = tally
        self.compute = asyncio.Lock()
        """One shard computes at a time; the other held waits for it."""

    async def run(self) -> None:
        slots = asyncio.Semaphore(SHARDS_IN_FLIGHT)
        holding: set[asyncio.Task[None]] = set()
        while True:
            await slots.acquire()
            t0 = time.perf_counter()
            reply = await self.master.lease(self.job, self.name)
            took = time.perf_counter() - t0
            if reply.status == "granted" and reply.shard is not None:
                self.tally.latency["lease"].append(took)
                task = asyncio.create_task(self.hold(reply), name=f"{self.name}-shard")
                holding.add(task)
                task.add_done_callback(holding.discard)
                task.add_done_callback(lambda _: slots.release())
                continue
            self.tally.latency["wait"].append(took)
            slots.release()
            if reply.status == "end":
                break
            await asyncio.sleep(self.timing.of(reply.retry_after_s) * random.uniform(0.8, 1.2))
        if holding:
            await asyncio.gather(*holding)

    async def hold(self, reply: LeaseReply) -> None:
        """Hold a shard: wait for the one before it, compute it, commit it; renewed all along."""
        assert reply.shard is not None
        loop = asyncio.get_running_loop()
        rows = reply.shard.rows
        seconds = self.timing.compute_s(rows)
        started: float | None = None

        def done() -> int:
            if started is None:
                return 0
            return int(rows * min(1.0, (loop.time() - started) / seconds))

        renewer = asyncio.create_task(self.renewer(reply, done), name=f"{self.name}-renewer")
        try:
            async with self.compute:
                started = loop.time()
                await asyncio.sleep(seconds)
            record = new_commit(
                job=self.job,
                shard=reply.shard.index,
                attempt=reply.attempt,
                files=[OutputFile(path=f"sim/{reply.shard.index}", rows=rows)],
                worker=self.name,
            )
            await asyncio.to_thread(self.store.create_commit, record)
            t0 = time.perf_counter()
            try:
                await self.master.commit(reply.token, worker=self.name, rows=rows, error_rows=0)
            except RemoteError as e:
                if not e.lease_lost:
                    raise
                self.tally.lost += 1
                return
            self.tally.latency["commit"].append(time.perf_counter() - t0)
            self.tally.shards += 1
            self.tally.rows += rows
        finally:
            renewer.cancel()
            await asyncio.wait([renewer])

    async def renewer(self, reply: LeaseReply, done: Callable[[], int]) -> None:
        """Renew at a third of the lease period (or sooner, as the master asks), the first
        time exactly, then a little early (by up to a fifth), as the worker's `LeaseKeeper`
        does."""
        loop = asyncio.get_running_loop()
        renew_at = loop.time() + renew_after(reply.lease_s, reply.renew_in_s)
        while True:
            await asyncio.sleep(max(0.0, renew_at - loop.time()))
            sent = loop.time()
            t0 = time.perf_counter()
            try:
                renewed = await self.master.renew(reply.token, worker=self.name, rows_done=done())
            except RemoteError as e:
                if e.lease_lost:
                    return
                raise
            self.tally.latency["renew"].append(time.perf_counter() - t0)
            after = renew_after(renewed.lease_s, renewed.renew_in_s)
            renew_at = sent + after * random.uniform(0.8, 1.0)


def _input(ctx: Context, workers: int, rows_per_worker: int) -> Path:
    """The job's input: `rows_per_worker` rows a worker, in row groups of BEFORE_ROWS (nulls:
    the workers read nothing, the planner only the footer)."""
    path = ctx.dir(f"scale-data-{workers}") / "in.parquet"
    if not path.exists():
        rows = rows_per_worker * workers
        column = pa.nulls(rows, pa.int8())
        pq.write_table(pa.table({"id": column}), path, row_group_size=BEFORE_ROWS)
    return path


def _compression(
    *, workers: int, shard_rows: int, rows_per_worker: int, rate: float, longest_s: float
) -> float:
    """How much faster than real time a run may go: as far as keeps the master below
    LOAD_CAP requests a second, at most MAX_COMPRESSION; further only if a worker's rows
    would take longer than `longest_s`. A real fleet sends two requests a shard, and at the
    end one a `wait_retry_s` from each worker left with nothing to do."""
    shard_s = shard_rows / rate
    real_load = workers * max(2 / shard_s, 1 / MasterConfig().wait_retry_s)
    factor = min(MAX_COMPRESSION, max(1.0, LOAD_CAP / real_load))
    return max(factor, rows_per_worker / rate / longest_s)


async def _measure(
    ctx: Context,
    *,
    workers: int,
    sizing: str,
    rows_per_worker: int,
    rate: float,
    longest_s: float,
) -> dict[str, float]:
    data = _input(ctx, workers, rows_per_worker)
    total_rows = rows_per_worker * workers
    shard_rows = BEFORE_ROWS if sizing == "fixed" else fleet_shard_rows(total_rows, workers)
    compression = _compression(
        workers=workers,
        shard_rows=shard_rows,
        rows_per_worker=rows_per_worker,
        rate=rate,
        longest_s=longest_s,
    )
    root = ctx.dir(f"scale-{workers}-{sizing}-{time.monotonic_ns()}")
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
        source: dict[str, Any] = {"uri": str(data)}
        if sizing == "fixed":
            source["rows_per_shard"] = BEFORE_ROWS
        spec = parse_job(
            {
                "name": "scale",
                "input": source,
                "pipeline": {"stages": [{"modelet": "ebb.worker.modelets:Identity"}]},
                "output": {"uri": str(root / "out")},
                "resources": {"max_workers": workers},
                # Every simulated worker runs at one rate, so neither would act in real
                # time; and their thresholds (5 s at least) are not compressed.
                "fault": {
                    "lease_s": LEASE_S / compression,
                    "speculative": False,
                    "split_tail": False,
                },
            }
        ).with_id()
        async with await EbbClient.connect(stack.nats_config) as submitter:
            planned = time.perf_counter()
            await submitter.submit(spec, accept_timeout_s=600)
            planning_s = time.perf_counter() - planned
            accepted = await submitter.job(spec.id)
        shards = accepted.shards_total
        store = OutputStore(spec.output.uri)
        tally = Tally()
        timing = Timing(rows_per_s=rate, compression=compression)
        sims = [
            SimulatedWorker(
                f"sim-{n}",
                clients[n // WORKERS_PER_CONNECTION],
                job=spec.id,
                store=store,
                timing=timing,
                tally=tally,
            )
            for n in range(workers)
        ]
        started = time.perf_counter()
        await asyncio.gather(*(sim.run() for sim in sims))
        elapsed = time.perf_counter() - started
        if tally.rows != total_rows:
            raise RuntimeError(f"{tally.rows:,} rows committed of {total_rows:,}")
        protocol_s = sum(sum(tally.latency[k]) for k in ("lease", "renew", "commit"))
        shard_s = total_rows / shards / rate  # real time
        return {
            "shards": shards,
            "shard_rows": total_rows / shards,
            "compression": compression,
            "planning_shards_per_s": shards / planning_s,
            "ops_per_s": tally.requests / elapsed,
            "ops_per_mrow": tally.requests / total_rows * 1e6,
            "renews_per_mrow": len(tally.latency["renew"]) / total_rows * 1e6,
            "waits_per_mrow": len(tally.latency["wait"]) / total_rows * 1e6,
            "share": protocol_s / tally.shards / shard_s,
            "lost": tally.lost,
            "lease_p50_ms": tally.p("lease", 50),
            "lease_p99_ms": tally.p("lease", 99),
            "renew_p50_ms": tally.p("renew", 50),
            "renew_p99_ms": tally.p("renew", 99),
            "commit_p50_ms": tally.p("commit", 50),
            "commit_p99_ms": tally.p("commit", 99),
        }
    finally:
        for nc in connections:
            await nc.close()
        await stack.stop()


def _ms(m: dict[str, float], op: str) -> str:
    p50, p99 = m[f"{op}_p50_ms"], m[f"{op}_p99_ms"]
    return "-" if p50 != p50 else f"{p50:.1f} / {p99:.1f}"


def run(ctx: Context, *, rows_per_s_per_worker: float | None) -> Section:
    sizes = [10] if ctx.smoke else [10, 100] if ctx.quick else [10, 100, 1_000]
    rows_per_worker = ctx.size(ROWS_PER_WORKER, 80_000)
    rate = rows_per_s_per_worker or ASSUMED_RATE
    longest_s = 5.0 if ctx.smoke else 30.0 if ctx.quick else 90.0
    repeats = 1  # each run's figures are over thousands of requests; its minutes are many
    results: dict[tuple[int, str], list[dict[str, float]]] = {
        (w, s): [] for w in sizes for s in SIZINGS
    }
    for r in range(repeats):
        for workers in sizes:
            for sizing in SIZINGS:
                result = asyncio.run(
                    _measure(
                        ctx,
                        workers=workers,
                        sizing=sizing,
                        rows_per_worker=rows_per_worker,
                        rate=rate,
                        longest_s=longest_s,
                    )
                )
                ctx.log(
                    f"  {workers} workers, {sizing} ({result['shards']:,.0f} shards) run "
                    f"{r + 1}/{repeats}: {result['ops_per_mrow']:,.0f} requests per million "
                    f"rows, master's share {result['share']:.3%}, "
                    f"time x{result['compression']:.1f}"
                )
                results[(workers, sizing)].append(result)
    rows = []
    summary: dict[str, float] = {}
    series: dict[str, dict[str, list[float]]] = {
        label: {"ops_per_mrow": [], "share": []} for label in SIZINGS.values()
    }
    lost = 0.0
    for workers in sizes:
        for sizing, label in SIZINGS.items():
            runs = results[(workers, sizing)]
            m = {k: median([r[k] for r in runs]) for k in runs[0]}
            lost += sum(r["lost"] for r in runs)
            series[label]["ops_per_mrow"].append(m["ops_per_mrow"])
            series[label]["share"].append(m["share"] * 100)
            summary[f"ops_per_mrow_{sizing}_{workers}"] = m["ops_per_mrow"]
            summary[f"share_{sizing}_{workers}"] = m["share"]
            summary[f"ops_per_s_{sizing}_{workers}"] = m["ops_per_s"]
            rows.append(
                [
                    f"{workers:,}",
                    f"{m['shard_rows']:,.0f}" + (" (before)" if sizing == "fixed" else " (after)"),
                    f"{m['shards']:,.0f}",
                    f"{m['ops_per_mrow']:,.0f} ({m['renews_per_mrow']:,.0f} / "
                    f"{m['waits_per_mrow']:,.0f})",
                    f"{m['share']:.3%}",
                    f"x{m['compression']:.1f}",
                    f"{m['ops_per_s']:,.0f}",
                    _ms(m, "lease"),
                    _ms(m, "renew"),
                    _ms(m, "commit"),
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
                    "rows a shard",
                    "shards",
                    "requests per million rows (renewals / waits)",
                    "master's share of a worker's time",
                    "time compressed",
                    "requests/s, as run",
                    "lease p50 / p99 ms",
                    "renew p50 / p99 ms",
                    "commit p50 / p99 ms",
                    "planning shards/s",
                ],
                rows,
            )
        ],
        summary=summary,
        slug="scale",
        plot={"kind": "scale", "workers": sizes, "series": series},
    )
    source = (
        "as the single-model benchmark measured it in this run"
        if rows_per_s_per_worker
        else "assumed: the single-model benchmark did not run in this run, and "
        "`python -m bench --only single,scale` measures it"
    )
    renewals = 1e6 * SHARDS_IN_FLIGHT / (rate * LEASE_S / 3 * 0.9)
    section.notes.append(
        f"A worker computes {rate:,.0f} rows/s ({source}). A 10,000-row shard takes "
        f"{BEFORE_ROWS / rate:.1f} s, so the master's latencies count against little work; "
        "shards sized for the fleet hold more rows for the same requests. A shard is renewed "
        f"only once held longer than a third of the lease ({LEASE_S / 3:.0f} s), counting the "
        "time it waits for the one ahead of it. A bigger job gets bigger shards (up to "
        "1,048,576 rows), and renewals take over: two leases held a worker, each renewed every "
        f"{LEASE_S / 3 * 0.8:.0f} to {LEASE_S / 3:.0f} s, are about {renewals:,.0f} requests "
        "per million rows at this rate, whatever the shards' size."
    )
    section.notes.append(
        "Waits: at the end of the job a worker left with nothing to do (no shard queued, no "
        "straggler to split, nothing to speculate on) asks again every "
        f"{min(5.0, LEASE_S / 10):g} s, a tenth of the lease at most 5 s, until the last shard "
        "is committed; once the queue is empty a worker may still hold two shards (one "
        "computing, one leased ahead). The controller, which drains a job's workers beyond its "
        "shards left (down to `min_workers`), is not simulated: it would stop some of those "
        "workers sooner."
    )
    section.notes.append(
        "Latencies are wall-clock. Where time is compressed the master answers more requests "
        "a second than a real fleet of that size would send it, so they are upper bounds. The "
        "simulated workers, nats-server and master share this machine's cores, so "
        "the highest concurrencies measure the machine as much as the master."
        + (f" {lost:,.0f} leases were lost (renewed or committed late)." if lost else "")
    )
    return section
