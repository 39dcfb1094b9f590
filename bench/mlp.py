"""Benchmark 7: a million rows through a small MLP (TorchScript), Ebb against a plain loop.

Workload: tabular scoring, the demo's shape at scale. Each row holds 16 float features, a
customer name and an id; preprocessing standardises the features, a TorchScript MLP
(16 -> 64 -> 4) scores four classes, postprocessing keeps the best one with its probability,
and the output carries the id and the name over.

- plain loop: one process, read a batch of 4,096 rows -> preprocess -> forward -> postprocess
  -> write, file by file, vectorised with numpy and torch as a data scientist would write it
  (torch on one thread: this model is too small to gain from more).
- Ebb, 1 and 2 workers: the same three steps as a job (preprocess, model and postprocess each
  in their own process, rows as columnar chunks), on the local backend, the model's threads
  Ebb's default (its share of its worker's cores).

The model here costs a few microseconds per row, so this measures what Ebb costs per row
(leases, stage hand-offs, commit) far more than it measures inference: the least favourable
case for a pipeline, and the one that shows its overhead.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ebb.client.demo import CLASSES, FEATURES, feature_table
from ebb.common.job import parse_job

from .common import (
    BENCH_DIR,
    Context,
    Rate,
    Section,
    interleaved_rates,
    job_rate,
    median,
    rates_table,
)

MEAN, STD = 2.0, 3.0
WORKERS = 2


def write_data(folder: Path, *, rows: int, files: int = 4) -> Path:
    per_file = -(-rows // files)
    for f in range(files):
        start = f * per_file
        n = min(per_file, rows - start)
        table_ = feature_table(n, seed=f, start_id=start)
        pq.write_table(table_, folder / f"part-{f:03d}.parquet", row_group_size=25_000)
    return folder


def write_model(path: Path, *, seed: int = 0) -> Path:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, len(CLASSES))
    ).eval()
    torch.jit.save(torch.jit.script(model), str(path))
    return path


def plain_loop(data: Path, model_path: Path, out: Path, *, batch: int = 4_096) -> float:
    """The baseline, in this process. Returns rows/s."""
    import torch

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.perf_counter()
        model = torch.jit.load(str(model_path))  # type: ignore[no-untyped-call]
        labels = np.asarray(CLASSES)
        rows = 0
        for n, path in enumerate(sorted(data.glob("*.parquet"))):
            tables = []
            for b in pq.ParquetFile(path).iter_batches(batch_size=batch):
                features = pc.list_flatten(b.column("features")).to_numpy().reshape(-1, FEATURES)
                x = torch.from_numpy((features - np.float32(MEAN)) / np.float32(STD))
                with torch.inference_mode():
                    p = torch.softmax(model(x), dim=1).numpy()
                best = p.argmax(axis=1)
                tables.append(
                    pa.table(
                        {
                            "id": b.column("id"),
                            "customer": b.column("customer"),
                            "label": labels[best],
                            "score": p[np.arange(len(best)), best].astype(np.float64),
                        }
                    )
                )
                rows += b.num_rows
            pq.write_table(pa.concat_tables(tables), out / f"part-{n:05d}.parquet")
        return rows / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)


def job(
    data: Path, model: Path, out: Path, *, rows_per_shard: int, workers: int = WORKERS
) -> dict[str, Any]:
    return {
        "name": "mlp-scoring",
        "input": {
            "uri": str(data),
            "format": "parquet",
            "columns": ["features"],
            "rows_per_shard": rows_per_shard,
        },
        "pipeline": {
            "code_paths": [str(BENCH_DIR.parent)],
            "stages": [
                {
                    "name": "preprocess",
                    "modelet": "bench.modelets:Standardize",
                    "params": {"mean": MEAN, "std": STD},
                    "batch_size": 4_096,
                },
                {"name": "model", "model": str(model), "batch_size": 4_096},
                {
                    "name": "postprocess",
                    "modelet": "ebb.worker.modelets:TopClass",
                    "params": {"labels": CLASSES},
                    "batch_size": 4_096,
                },
            ],
        },
        "output": {"uri": str(out), "carryover": ["id", "customer"]},
        "resources": {"min_workers": workers, "max_workers": workers},
    }


async def _ebb_once(
    ctx: Context, data: Path, model: Path, rows_per_shard: int, workers: int
) -> Rate:
    out = ctx.dir("mlp-out") / f"ebb-{time.monotonic_ns()}"
    spec = parse_job(job(data, model, out, rows_per_shard=rows_per_shard, workers=workers))
    return await job_rate(ctx, "mlp", spec, out, max_workers=workers)


def _ebb(ctx: Context, data: Path, model: Path, rows_per_shard: int, workers: int) -> Rate:
    rate: Rate = asyncio.run(_ebb_once(ctx, data, model, rows_per_shard, workers))
    return rate


def _plain(data: Path, model: Path, out: Path) -> Rate:
    value = plain_loop(data, model, out)
    return Rate(value, value)


def run(ctx: Context) -> Section:
    rows = ctx.size(1_000_000, 100_000)
    rows_per_shard = ctx.size(50_000, 10_000)
    data = write_data(ctx.dir("mlp-data"), rows=rows)
    model = write_model(ctx.dir("models") / "mlp.pt")
    variants = {
        "plain loop": functools.partial(_plain, data, model, ctx.dir("mlp-out") / "plain"),
        "Ebb, 1 worker": functools.partial(_ebb, ctx, data, model, rows_per_shard, 1),
        f"Ebb, {WORKERS} workers": functools.partial(
            _ebb, ctx, data, model, rows_per_shard, WORKERS
        ),
    }
    whole, steady = interleaved_rates(variants, ctx)
    base_whole = median(whole["plain loop"])
    ebb = f"Ebb, {WORKERS} workers"
    return Section(
        title="7. A million rows through a small MLP: Ebb against a plain loop",
        intro=__doc__ or "",
        tables=[rates_table(whole, steady, base="plain loop", against="vs plain loop")],
        slug="mlp",
        plot={"kind": "bars", "values": dict(whole), "unit": "rows/s (whole job)"},
        summary={
            "rows": rows,
            "plain_rows_per_s": base_whole,
            "ebb_rows_per_s": median(whole[ebb]),
            "ratio": median(whole[ebb]) / base_whole,
        },
        notes=[
            f"{rows:,} rows in {rows // rows_per_shard} shards of {rows_per_shard:,}; Ebb's whole "
            "job runs from submission to the manifest, start-up of the stack excluded, the "
            "workers' start-up included (each imports torch for its model stage: about 2 s of "
            f"CPU on this machine); 1 or {WORKERS} workers of 3 stage processes each share "
            "this machine's cores with the master, the controller and nats-server."
        ],
    )
