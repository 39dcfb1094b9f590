"""Benchmark 8: what the pipeline itself costs per row.

Three pass-through stages (each in its own process, as a real preprocess -> model ->
postprocess pipeline would be) carry rows of an id and a 16-float feature vector, in-process
(no NATS, no shards, no output files): every microsecond measured is the pipeline's own
hand-offs, batching and bookkeeping. Two forms of the same stages, side by side:

- columnar: `process_columns`, the batch as a map of arrays (Ebb's data plane);
- per row: `process_batch(rows)`, through the adapter that builds a Python object per row and
  back (the form every modelet had before the columnar data plane).
"""

from __future__ import annotations

import asyncio
import functools
import time

import numpy as np
import pyarrow as pa

from ebb.common.job import StageSpec
from ebb.worker.pipeline.front import Pipeline, PipelineConfig

from .common import BENCH_DIR, Context, Rate, Section, interleaved_rates, median, spread, table

FEATURES = 16
BATCH = 1_024


def rows_table(n: int) -> pa.Table:
    rng = np.random.default_rng(0)
    flat = rng.normal(size=n * FEATURES).astype(np.float32)
    return pa.table(
        {
            "id": np.arange(n, dtype=np.int64),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(flat), FEATURES),
        }
    )


def stages(modelet: str) -> list[StageSpec]:
    return [StageSpec(name=f"s{k}", modelet=modelet, batch_size=BATCH) for k in range(3)]


async def _through(data: pa.Table, modelet: str) -> float:
    pipeline = Pipeline(PipelineConfig(stages=stages(modelet), code_paths=[str(BENCH_DIR.parent)]))
    await pipeline.start()
    try:
        started = time.perf_counter()
        result = await pipeline.run_columns(data)
        seconds = time.perf_counter() - started
    finally:
        await pipeline.stop()
    if result.errors:
        raise RuntimeError(
            f"{len(result.errors)} rows failed: {next(iter(result.errors.values()))}"
        )
    return data.num_rows / seconds


def _rate(data: pa.Table, modelet: str) -> Rate:
    value = asyncio.run(_through(data, modelet))
    return Rate(value, value)


def run(ctx: Context) -> Section:
    rows = ctx.size(1_000_000, 200_000)
    data = rows_table(rows)
    variants = {
        "columnar (process_columns)": functools.partial(
            _rate, data, "ebb.worker.modelets:Identity"
        ),
        "per row (process_batch)": functools.partial(_rate, data, "bench.modelets:PassRows"),
    }
    rates, _ = interleaved_rates(variants, ctx)
    columnar = median(rates["columnar (process_columns)"])
    body = [
        [
            name,
            spread(rates[name]),
            f"{1e9 / median(rates[name]):,.0f}",
            f"{median(rates[name]) / columnar:.2f}x",
        ]
        for name in variants
    ]
    return Section(
        title="8. The pipeline's own cost per row",
        intro=__doc__ or "",
        tables=[table(["stages", "rows/s", "ns per row", "vs columnar"], body)],
        slug="overhead",
        plot={"kind": "bars", "values": dict(rates), "unit": "rows/s"},
        summary={"rows": rows, "columnar_rows_per_s": columnar},
        notes=[
            f"{rows:,} rows, batches of {BATCH:,}, three stage processes and the router thread "
            "on this machine's cores; ns per row is wall time over rows."
        ],
    )
