"""Benchmark 3: a straggler. Small shards, speculation and the liquid tail against an even split.

Four workers; one runs at half speed (EBB_BENCH_SLOWDOWN=2, a flag of this benchmark that
makes its stage sleep twice as long per row). The work per row is simulated (a wait, not a
computation), so that four workers on this machine's two cores do not compete for them: the
benchmark measures how work is handed out, not the CPU. Each worker holds one shard at a
time (`--shards-in-flight 1`: with the default prefetch a worker would hold two of the four).

- static split: the rows cut into four equal shards, one per worker, neither speculation nor
  the liquid tail: the job ends when the slow worker finishes its quarter.
- static split + liquid tail: the same four shards; when a fast worker finds nothing left,
  the master asks the slow one, on its next renewal, to commit the rows it has done, and
  the rest becomes a shard at the head of the queue, for the idle worker; a holder at the
  usual rate whose rest is worth two workers has it cut in two, a half for the idle worker
  and a half for itself, and so on while workers are idle.
- static split + liquid tail, rests moved whole (before): the same, with the master's
  `EBB_SPLIT_HALVES=0`: only the straggler's rest moves, whole, as the liquid tail did before
  it cut rests in two.
- small shards + speculation: 64 shards leased as workers ask for them, the slow worker
  simply taking fewer; at the end a shard still running well past the usual shard time (and
  5 s at least) is run again on an idle worker, and the first commit wins.
- small shards + liquid tail: the same 64 shards, the liquid tail instead of speculation.
- sized for the fleet: no `rows_per_shard`, so four shards or more a worker (16 here), with
  speculation and the liquid tail: the defaults.

Workers tell the master the rows they have done in their renewals (every third of the lease
period), counted after each chunk they write: the benchmark sets `EBB_CHUNK_ROWS` to a row
group of the input (the default, 65,536 rows, is more than this whole job, so a worker
would tell nothing before its shard's end). The lease period is 15 s, a quarter of the
default: the liquid tail's ask rides on a renewal (here within 5 s, by default within 20 s),
and the master splits only when the rest gains more than two thirds of the period elsewhere
(here 10 s, by default 40 s). So what it does here, it does at the default period to jobs
whose quarters take four times as long (96 s rather than 24 s); to this job's quarters, at
the default period, it would do nothing. A shorter period costs more renewals (section 4
counts them), and a worker that cannot reach the master for a whole period loses its shard.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common import envvars
from ebb.common.data.layout import COMMITS_DIR
from ebb.common.job import parse_job
from ebb.common.messaging.natsconfig import nats_environment

from .common import REPO, Context, Section, median, spread, table

WORKERS = 4
SLOWDOWN = 2.0
SLOW_WORKER = "w0"
MS_PER_ROW = 4.0
LEASE_S = 15.0
ROW_GROUPS = 64
"""The input's row groups: every variant's shards are whole row groups of it."""


@dataclass(frozen=True)
class Variant:
    shards: int | None
    """Equal shards; None: no `rows_per_shard` (sized for the fleet)."""
    speculative: bool
    split_tail: bool
    halves: bool = True
    """The master cuts a rest in two for an idle worker (EBB_SPLIT_HALVES); False: a split
    moves a straggler's rest whole, as the liquid tail did before."""


VARIANTS = {
    "static split": Variant(WORKERS, speculative=False, split_tail=False),
    "static split + liquid tail, rests moved whole (before)": Variant(
        WORKERS, speculative=False, split_tail=True, halves=False
    ),
    "static split + liquid tail": Variant(WORKERS, speculative=False, split_tail=True),
    "small shards + speculation": Variant(ROW_GROUPS, speculative=True, split_tail=False),
    "small shards + liquid tail": Variant(ROW_GROUPS, speculative=False, split_tail=True),
    "sized for the fleet, both (the defaults)": Variant(None, speculative=True, split_tail=True),
}
STATIC = "static split"
DYNAMIC = "small shards + speculation"
LIQUID = "static split + liquid tail"


@dataclass(frozen=True)
class Outcome:
    """One run of one variant."""

    seconds: float
    """From submission to the manifest, the workers' start-up included."""
    planned: int
    """Shards the job was planned into."""
    splits: int
    """Parts committed: shards the liquid tail split (a rest moved whole, or cut in two)."""
    rests_taken_back: int
    """Rests of split shards that the slow worker ran itself."""
    second_attempts: int
    """Shards whose winning attempt was not the first (speculation won)."""


def spec(data: Path, out: Path, *, rows: int, variant: Variant) -> dict[str, Any]:
    source: dict[str, Any] = {"uri": str(data)}
    if variant.shards is not None:
        source["rows_per_shard"] = -(-rows // variant.shards)
    return {
        "name": "stragglers",
        "input": source,
        "pipeline": {
            "code_paths": [str(REPO)],
            "stages": [
                {
                    "name": "work",
                    "modelet": "bench.modelets:Work",
                    "params": {"ms_per_row": MS_PER_ROW},
                    "batch_size": 50,
                }
            ],
        },
        "output": {"uri": str(out), "carryover": ["id"]},
        "resources": {"min_workers": WORKERS, "max_workers": WORKERS},
        "fault": {
            "lease_s": LEASE_S,
            "speculative": variant.speculative,
            "split_tail": variant.split_tail,
        },
    }


def _outcome(out: Path, seconds: float, planned: int) -> Outcome:
    records = [json.loads(p.read_text()) for p in (out / COMMITS_DIR).glob("*.json")]
    splits = sum(1 for r in records if r.get("split_at"))
    return Outcome(
        seconds=seconds,
        planned=planned,
        splits=splits,
        rests_taken_back=sum(
            1 for r in records if r["shard"] >= planned and r["worker"] == SLOW_WORKER
        ),
        second_attempts=sum(1 for r in records if r["attempt"] > 1),
    )


async def _once(ctx: Context, data: Path, rows: int, chunk_rows: int, variant: Variant) -> Outcome:
    root = ctx.dir(f"straggle-{time.monotonic_ns()}")
    before = os.environ.get(envvars.SPLIT_HALVES)
    os.environ[envvars.SPLIT_HALVES] = "1" if variant.halves else "0"  # the master inherits it
    stack = LocalStack(
        StackConfig(
            state_dir=root / "state",
            data_roots=[str(ctx.workdir), str(REPO)],
            controller=False,  # the benchmark starts the workers, one of them slowed down
            log_level="WARNING",
        )
    )
    try:
        await stack.start()
    finally:
        if before is None:
            os.environ.pop(envvars.SPLIT_HALVES, None)
        else:
            os.environ[envvars.SPLIT_HALVES] = before
    workers: list[asyncio.subprocess.Process] = []
    try:
        client = await EbbClient.connect(stack.nats_config)
        try:
            job = parse_job(spec(data, root / "out", rows=rows, variant=variant))
            started = time.perf_counter()
            job_id = await client.submit(job)
            planned = (await client.job(job_id)).shards_total  # before any worker starts
            base_env = {
                **os.environ,
                envvars.LOG_LEVEL: "WARNING",
                envvars.CHUNK_ROWS: str(chunk_rows),
            }
            for n in range(WORKERS):
                name = f"w{n}"
                env = {
                    **base_env,
                    **nats_environment(stack.worker_nats_config(name)),
                    "EBB_BENCH_SLOWDOWN": str(SLOWDOWN if name == SLOW_WORKER else 1.0),
                }
                args = ["-m", "ebb.worker", "--job", job_id, "--id", name]
                workers.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        *args,
                        "--shards-in-flight",
                        "1",
                        env=env,
                        stdout=asyncio.subprocess.DEVNULL,
                    )
                )
            final = await client.wait(job_id, poll_s=0.1)
            seconds = time.perf_counter() - started
            if final.state != "SUCCEEDED":
                raise RuntimeError(f"benchmark job failed: {final.reason}")
            return _outcome(root / "out", seconds, planned)
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
    rows = ctx.size(24_000, 4_096)
    group = max(1, rows // ROW_GROUPS)
    data = ctx.dir("straggle-data") / "rows.parquet"
    pq.write_table(pa.table({"id": np.arange(rows)}), data, row_group_size=group)
    outcomes: dict[str, list[Outcome]] = {k: [] for k in VARIANTS}
    for r in range(ctx.repeats):
        for name, variant in VARIANTS.items():
            outcome = asyncio.run(_once(ctx, data, rows, group, variant))
            outcomes[name].append(outcome)
            ctx.log(
                f"  {name} run {r + 1}/{ctx.repeats}: {outcome.seconds:.2f} s, "
                f"{outcome.planned} shards, {outcome.splits} split "
                f"({outcome.rests_taken_back} rests run by the slow worker), "
                f"{outcome.second_attempts} won by a second attempt"
            )
    seconds = {k: [o.seconds for o in v] for k, v in outcomes.items()}
    static = median(seconds[STATIC])
    work = rows * MS_PER_ROW / 1000
    ideal = work / (WORKERS - 1 + 1 / SLOWDOWN)

    def counts(name: str, field: str) -> str:
        return "/".join(str(getattr(o, field)) for o in outcomes[name])

    rows_out = [
        [
            name,
            counts(name, "planned"),
            spread(seconds[name]),
            f"{1 - median(seconds[name]) / static:.0%}",
            counts(name, "splits"),
            counts(name, "rests_taken_back"),
            counts(name, "second_attempts"),
        ]
        for name in VARIANTS
    ]
    rows_out.append(
        [
            "ideal (perfect balance, no overhead)",
            "",
            f"{ideal:.1f}",
            f"{1 - ideal / static:.0%}",
            "",
            "",
            "",
        ]
    )
    headers = [
        "variant",
        "shards",
        "job seconds median (min-max)",
        "shorter than static",
        "splits",
        "rests the slow worker ran",
        "won by a second attempt",
    ]
    dynamic = median(seconds[DYNAMIC])
    liquid = median(seconds[LIQUID])
    section = Section(
        title="3. A straggler: small shards, speculation and the liquid tail against an even split",
        intro=__doc__ or "",
        tables=[table(headers, rows_out)],
        slug="stragglers",
        plot={
            "kind": "bars",
            "values": seconds,
            "unit": "seconds to finish the job",
            "line": ideal,
            "line_label": "ideal",
        },
        summary={
            "static_s": static,
            "dynamic_s": dynamic,
            "liquid_s": liquid,
            "reduction": 1 - dynamic / static,
            "liquid_reduction": 1 - liquid / static,
        },
    )
    section.notes.append(
        f"{rows:,} rows of {MS_PER_ROW:g} ms each ({work:.0f} s of work), in {ROW_GROUPS} row "
        f"groups of {group:,} rows; {WORKERS} workers, one {SLOWDOWN:g}x slower; "
        f"EBB_CHUNK_ROWS={group} ({group * MS_PER_ROW / 1000:g} s of work on a fast worker). "
        "Times run from submission to the manifest, workers' start-up included. The counts "
        "(shards, splits, rests, second attempts) are each run's, in order."
    )
    if any(o.rests_taken_back for runs in outcomes.values() for o in runs):
        section.notes.append(
            "A split's rest goes to the head of the queue, not to the worker whose request "
            "caused the split: the slow worker asks for a shard as soon as its part is "
            "committed, while the idle one asks again only after its wait, so the slow one "
            "can take its own rest back, and be split again."
        )
    return section
