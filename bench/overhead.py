"""Benchmark 8: what the pipeline itself costs per row.

Three pass-through stages (each in its own process, as a real preprocess -> model ->
postprocess pipeline would be) carry rows of an id and a 16-float feature vector, in-process
(no NATS, no shards, no output files): every microsecond measured is the pipeline's own
hand-offs, batching and bookkeeping. Two forms of the same stages, side by side:

- columnar: `process_columns`, the batch as a map of arrays (Ebb's data plane);
- per row: `process_batch(rows)`, through the adapter that builds a Python object per row and
  back (the form every modelet had before the columnar data plane).

The adapter alone: the same pass-through modelet's per-row form and columnar form called
in this process on batches of 4,096 rows (no pipeline, no processes), for rows of three
shapes: what turning a batch into a dict per row and the rows back into columns costs.
"""

from __future__ import annotations

import asyncio
import functools
import time

import numpy as np
import pyarrow as pa

from ebb.common.job import StageSpec
from ebb.worker.chunks.columns import Columns
from ebb.worker.modelets import builtins
from ebb.worker.modelets.api import columns_callable
from ebb.worker.pipeline.front import Pipeline, PipelineConfig

from .common import BENCH_DIR, Context, Rate, Section, interleaved_rates, median, spread, table
from .modelets import PassRows

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


ADAPTER_BATCH = 4_096


def shapes(n: int) -> dict[str, Columns]:
    """Batches of `n` rows as a stage receives them, by the shape of their rows."""
    rng = np.random.default_rng(0)
    ids = np.arange(n, dtype=np.int64)
    wide: Columns = {f"n{i}": rng.normal(size=n) for i in range(8)}
    wide["name"] = np.array([f"customer-{i}" for i in range(n)], dtype=object)
    wide["features"] = rng.normal(size=(n, FEATURES)).astype(np.float32)
    return {
        "an id and 16 floats": {"id": ids, "features": wide["features"]},
        "256 floats": {"x": rng.normal(size=(n, 256)).astype(np.float32)},
        "10 columns (8 numbers, a string, 16 floats)": wide,
    }


def adapter_ns(batch: Columns, modelet: object, repeats: int) -> float:
    """CPU nanoseconds per row of a modelet's columnar function on `batch` (median)."""
    run = columns_callable(modelet, type(modelet).__name__)
    times = []
    for _ in range(repeats):
        started = time.process_time()
        run(batch)
        times.append(time.process_time() - started)
    return median(times) / len(next(iter(batch.values()))) * 1e9


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
    adapter = []
    for shape, batch in shapes(ADAPTER_BATCH).items():
        per_row = adapter_ns(batch, PassRows(), repeats=25)
        columnar = adapter_ns(batch, builtins.Identity(), repeats=25)
        adapter.append([shape, f"{per_row:,.0f}", f"{columnar:,.0f}"])
    return Section(
        title="8. The pipeline's own cost per row",
        intro=__doc__ or "",
        tables=[
            table(["stages", "rows/s", "ns per row", "vs columnar"], body),
            table(
                ["rows of (the adapter alone)", "per row, ns a row", "columnar, ns a row"], adapter
            ),
        ],
        slug="overhead",
        plot={"kind": "bars", "values": dict(rates), "unit": "rows/s"},
        summary={"rows": rows, "columnar_rows_per_s": columnar},
        notes=[
            f"{rows:,} rows, batches of {BATCH:,}, three stage processes and the router thread "
            "on this machine's cores; ns per row is wall time over rows."
        ],
    )
