"""Benchmark 19: one Parquet file of one row group, on 1, 2 and 4 workers.

Workload: a file as pyarrow writes it by default (`pq.write_table`: one row group up to
1,048,576 rows), each row an `id` and 64 float32 `features`, scored by an ONNX MLP (64 -> 1024
-> 1024 -> 1024 -> 1) in one model stage with `threads: 1`, so that each worker computes on a
core of its own. Every other setting is Ebb's default (`rows_per_shard` sized for the fleet,
`lease_s` 30, speculation and the liquid tail on): the file is one shard whatever the workers,
since Parquet is cut between row groups only.

- 1 worker: the baseline.
- 2 workers, 4 workers: the second worker finds nothing queued; the master has the holder
  split the shard at its next renewal and cuts the rest in two, a half for each, and again
  while halves are worth it (Dataflow's dynamic work rebalancing). Each half's reader decodes
  the row group from its start up to its first row.
- 2 workers, rests moved whole (`EBB_SPLIT_HALVES=0`): how the liquid tail split before: only
  a straggler's rest moves, so the second worker waits for the end.
- 1 and 2 workers with `batch_size: 256` (the default is 32): the runtime computes this
  light MLP in less CPU a row at 256 rows a batch, so each worker is faster, and a half is
  worth its cut a little later.

Times are from submission to the manifest, the workers' start-up included; the variants run
interleaved, each on a fresh embedded stack. Target: 2 workers in at most 0.6x the time of 1.
This machine has 2 cores: 4 workers share them (two workers a core), so 4 is not faster than 2
here; it shows the splits go on as long as workers are idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.client.demo import mlp_onnx
from ebb.common import envvars
from ebb.common.data.layout import COMMITS_DIR
from ebb.common.job import parse_job

from .common import Context, Section, ebb_stack, median, run_job, spread, table

FEATURES = 64
HIDDEN = 1024
LAYERS = 3
BIG_BATCH = 256
VARIANTS = {
    "1 worker": (1, True, None),
    "2 workers": (2, True, None),
    "4 workers": (4, True, None),
    "2 workers, rests moved whole (before)": (2, False, None),
    f"1 worker, batch_size {BIG_BATCH}": (1, True, BIG_BATCH),
    f"2 workers, batch_size {BIG_BATCH}": (2, True, BIG_BATCH),
}
BASELINE = "1 worker"


def write_data(path: Path, *, rows: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, FEATURES), dtype=np.float32)
    data = pa.table(
        {
            "id": np.arange(rows, dtype=np.int64),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES),
        }
    )
    pq.write_table(data, path)  # pyarrow's defaults: one row group at this size


def job(
    data: Path, model: Path, out: Path, *, workers: int, batch_size: int | None = None
) -> dict[str, Any]:
    batching = {} if batch_size is None else {"batch_size": batch_size}
    return {
        "name": f"onegroup-{workers}",
        "input": {"uri": str(data)},
        "pipeline": {
            "stages": [
                {
                    "name": "model",
                    "model": str(model),
                    "input": "features",
                    "output": "score",
                    "threads": 1,
                    **batching,
                }
            ]
        },
        "output": {"uri": str(out)},  # the rows keep their `id` (a model stage with `output`)
        "resources": {"min_workers": 1, "max_workers": workers},
    }


async def _once(
    ctx: Context,
    data: Path,
    model: Path,
    rows: int,
    variant: tuple[int, bool, int | None],
) -> dict[str, Any]:
    workers, halves, batch_size = variant
    out = ctx.dir(f"onegroup-out-{time.monotonic_ns()}")
    shutil.rmtree(out)
    before = os.environ.get(envvars.SPLIT_HALVES)
    os.environ[envvars.SPLIT_HALVES] = "1" if halves else "0"  # the master inherits it
    try:
        async with ebb_stack(ctx, "onegroup", max_workers=workers) as (_, client):
            final, seconds = await run_job(
                client, parse_job(job(data, model, out, workers=workers, batch_size=batch_size))
            )
    finally:
        if before is None:
            os.environ.pop(envvars.SPLIT_HALVES, None)
        else:
            os.environ[envvars.SPLIT_HALVES] = before
    if final.state != "SUCCEEDED" or final.rows_done != rows:
        raise RuntimeError(f"benchmark job failed: {final.state} {final.reason}")
    commits = [json.loads(p.read_text()) for p in (out / COMMITS_DIR).glob("*.json")]
    busy = {c["worker"] for c in commits if sum(f["rows"] for f in c["files"])}
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "shards": final.shards_total, "workers": len(busy)}


def _baseline(name: str) -> str:
    """The variant `name` is compared with: 1 worker at the same batch size."""
    return next(n for n, v in VARIANTS.items() if v[0] == 1 and v[2] == VARIANTS[name][2])


def run(ctx: Context) -> Section:
    rows = ctx.size(1_000_000, 20_000)
    data = ctx.dir("onegroup-data") / "scores.parquet"
    write_data(data, rows=rows)
    groups = pq.ParquetFile(data).metadata.num_row_groups
    model = mlp_onnx(
        ctx.dir("onegroup-model") / "mlp.onnx",
        inputs=FEATURES,
        hidden=HIDDEN,
        outputs=1,
        layers=LAYERS,
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for r in range(ctx.repeats):
        for name, variant in VARIANTS.items():
            outcome = asyncio.run(_once(ctx, data, model, rows, variant))
            runs[name].append(outcome)
            ctx.log(
                f"  {name} run {r + 1}/{ctx.repeats}: {outcome['seconds']:.1f} s, "
                f"{outcome['shards']} shards, rows committed by {outcome['workers']} workers"
            )
    seconds = {name: [o["seconds"] for o in v] for name, v in runs.items()}
    base = median(seconds[BASELINE])

    def counts(name: str, key: str) -> str:
        return "/".join(str(o[key]) for o in runs[name])

    rows_out = [
        [
            name,
            spread(seconds[name]),
            f"{median(seconds[name]) / median(seconds[_baseline(name)]):.2f}x",
            counts(name, "shards"),
            counts(name, "workers"),
        ]
        for name in VARIANTS
    ]
    headers = [
        "variant",
        "job seconds median (min-max)",
        "time of 1 worker's (same batch_size)",
        "shards (after splits)",
        "workers that committed rows",
    ]
    two = median(seconds["2 workers"]) / base
    big = f"batch_size {BIG_BATCH}"
    two_big = median(seconds[f"2 workers, {big}"]) / median(seconds[f"1 worker, {big}"])
    section = Section(
        title="19. One Parquet file of one row group, on 1, 2 and 4 workers",
        intro=__doc__ or "",
        tables=[table(headers, rows_out)],
        slug="onegroup",
        plot={"kind": "bars", "values": seconds, "unit": "seconds to finish the job"},
        summary={"two_workers_ratio": two, "one_worker_s": base, "two_workers_big_batch": two_big},
    )
    section.notes.append(
        f"{rows:,} rows in {groups} row group{'s' if groups > 1 else ''} "
        f"({data.stat().st_size / 2**20:.0f} MiB); {ctx.repeats} interleaved repeats; "
        f"2 workers took {two:.2f}x the time of 1 (target 0.6x or less), and {two_big:.2f}x with "
        f"{big} (against 1 worker with it). The counts are each run's, in order."
    )
    return section
