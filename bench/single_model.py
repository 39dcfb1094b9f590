"""Benchmark 1: one model. Ebb against a sequential single-process loop, and against the bound.

Workload: image tagging. Each row holds a compressed 64x64 image; preprocessing decompresses,
crops and normalises it (a stand-in for JPEG decoding), a convolutional network scores 100
classes, postprocessing keeps the best one. Every variant reads the same Parquet files and
writes the same output columns.

- sequential: one process, read -> decode -> model -> postprocess -> write, batch by batch,
  as a data scientist would write it. ONNX Runtime's own threads (the default) use every core
  for the model; "sequential, 1 thread" pins it to one core.
- Ebb, 1 process per stage: one worker, each stage in its own process (pipelining).
- Ebb, 2 model processes: the same, with two processes for the model stage (pipelining and
  intra-node scaling, set by hand).
- Ebb, elastic: from one process per stage, the elastic scheduler free to run 1-2 processes
  per stage, and the model's batch size searched online (adaptive batching).
- Ebb, 2 workers: two workers of one process per stage, sharing the machine (each told half
  its cores).

Ebb's rates are given over the whole job (submission to manifest, start-up included) and in
its steady state (the rows of every shard after the first, over the time from the first shard's
commit to the last's); the comparisons use the steady state, start-up being benchmark 5's.

The bound is what the hardware allows: each stage's cost per item measured alone on one
core, and the machine's cores shared out perfectly: bound = cores / sum(stage costs).
Pipeline efficiency = Ebb / bound.
"""

from __future__ import annotations

import asyncio
import functools
import io
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.common.job import parse_job

from . import workloads
from .common import (
    BENCH_DIR,
    Context,
    Rate,
    Section,
    interleaved_rates,
    job_rate,
    median,
    spread,
    table,
)


def _session(model: Path, threads: int, device: str = "cpu") -> ort.InferenceSession:
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if device == "cuda":
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(model), sess_options=options, providers=providers)


def _top(logits: np.ndarray) -> tuple[list[int], list[float]]:
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    best = p.argmax(axis=1)
    return best.tolist(), p[np.arange(len(best)), best].tolist()


def sequential(
    data: Path, model: Path, out: Path, *, threads: int, batch: int = 64, device: str = "cpu"
) -> float:
    """The baseline: everything in this one process, in order. Returns rows/s."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    session = _session(model, threads, device)
    rows = 0
    for n, path in enumerate(sorted(data.glob("*.parquet"))):
        parquet = pq.ParquetFile(path)
        tables = []
        for record_batch in parquet.iter_batches(batch_size=batch):
            x = np.stack([workloads.decode(b) for b in record_batch.column("image").to_pylist()])
            label, score = _top(session.run(None, {"x": x})[0])
            tables.append(
                pa.table({"id": record_batch.column("id"), "label": label, "score": score})
            )
            rows += record_batch.num_rows
        buffer = io.BytesIO()
        pq.write_table(pa.concat_tables(tables), buffer, compression="zstd")
        (out / f"part-{n:05d}.parquet").write_bytes(buffer.getvalue())
    return rows / (time.perf_counter() - started)


def stage_costs(data: Path, model: Path, sample: int = 2_048) -> dict[str, float]:
    """Seconds per item of each stage, alone, on one core."""
    table_ = pq.read_table(next(iter(sorted(data.glob("*.parquet"))))).slice(0, sample)
    blobs = table_.column("image").to_pylist()
    started = time.perf_counter()
    tensors = [workloads.decode(b) for b in blobs]
    decode_s = (time.perf_counter() - started) / len(blobs)
    session = _session(model, 1)
    session.run(None, {"x": np.stack(tensors[:64])})  # warm up
    started = time.perf_counter()
    logits = [
        session.run(None, {"x": np.stack(tensors[i : i + 64])})[0]
        for i in range(0, len(tensors), 64)
    ]
    model_s = (time.perf_counter() - started) / len(tensors)
    started = time.perf_counter()
    for chunk in logits:
        _top(chunk)
    post_s = (time.perf_counter() - started) / len(tensors)
    started = time.perf_counter()
    for path in sorted(data.glob("*.parquet")):
        pq.read_table(path)
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in data.glob("*.parquet"))
    io_s = (time.perf_counter() - started) / rows
    return {"read": io_s, "decode": decode_s, "model": model_s, "postprocess": post_s}


VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    # name: (decode stage settings, model stage settings, workers)
    "Ebb, 1 process per stage": ({}, {}, 1),
    "Ebb, 2 model processes": ({}, {"workers": 2}, 1),
    "Ebb, elastic": (
        {"min_workers": 1, "max_workers": 2},
        {"min_workers": 1, "max_workers": 2, "batch_size": 256, "adaptive_batch": True},
        1,
    ),
    "Ebb, 2 workers": ({}, {}, 2),
}
"""Pipelining alone; pipelining and intra-node scaling set by hand; the elastic scheduler
(with the adaptive batch size) finding them on its own, from one process per stage; and two
workers of one process per stage sharing the machine. The model's threads are Ebb's default
throughout: its share of its worker's cores."""

GPU_VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "Ebb, GPU model": (
        {"workers": 2},
        {"device": "cuda", "batch_size": 512, "adaptive_batch": True},
        1,
    ),
}


def job(data: Path, model: Path, out: Path, *, variant: str, rows_per_shard: int) -> dict[str, Any]:
    decode, scoring, workers = {**VARIANTS, **GPU_VARIANTS}[variant]
    return {
        "name": "tagging",
        "input": {
            "uri": str(data),
            "format": "parquet",
            "columns": ["image"],
            "rows_per_shard": rows_per_shard,
        },
        "pipeline": {
            "code_paths": [str(BENCH_DIR.parent)],
            "stages": [
                {"name": "decode", "modelet": "bench.modelets:Decode", "batch_size": 64, **decode},
                {"name": "model", "model": str(model), "batch_size": 64, **scoring},
                {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 256},
            ],
        },
        "output": {"uri": str(out), "carryover": ["id"]},
        "resources": {"min_workers": workers, "max_workers": workers},
    }


async def _ebb_once(
    ctx: Context, data: Path, model: Path, *, variant: str, rows_per_shard: int
) -> Rate:
    out = ctx.dir("single-out") / f"ebb-{time.monotonic_ns()}"
    spec = parse_job(job(data, model, out, variant=variant, rows_per_shard=rows_per_shard))
    return await job_rate(ctx, "single", spec, out, max_workers=spec.resources.max_workers)


def _measure_ebb(ctx: Context, data: Path, model: Path, variant: str, rows_per_shard: int) -> Rate:
    rate: Rate = asyncio.run(
        _ebb_once(ctx, data, model, variant=variant, rows_per_shard=rows_per_shard)
    )
    return rate


def _sequential(data: Path, model: Path, out: Path, threads: int, device: str = "cpu") -> Rate:
    value = sequential(data, model, out, threads=threads, device=device)
    return Rate(value, value)  # nothing to start: the whole run is its steady state


def _x(value: float, base: float) -> str:
    return f"{value / base:.2f}x"


def run(ctx: Context) -> Section:
    rows = ctx.size(40_000, 4_000)
    data = workloads.write_images(ctx.dir("images"), rows=rows, files=4)
    model = workloads.tagger(ctx.dir("models") / "tagger.onnx")
    rows_per_shard = ctx.size(5_000, 1_000)
    costs = stage_costs(data, model)
    cores = os.cpu_count() or 1
    bound = cores / sum(costs.values())
    ctx.log("  stage costs (us/item): " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in costs.items()))
    out = ctx.dir("single-out")
    variants: dict[str, Callable[[], Rate]] = {
        "sequential": functools.partial(_sequential, data, model, out / "seq", 0),
        "sequential, 1 thread": functools.partial(_sequential, data, model, out / "seq1", 1),
    }
    for name in VARIANTS:
        variants[name] = functools.partial(_measure_ebb, ctx, data, model, name, rows_per_shard)
    if ctx.device == "cuda":  # the model on the GPU; on a GPU it alone bounds the job
        variants["sequential, GPU"] = functools.partial(
            _sequential, data, model, out / "seqg", 0, "cuda"
        )
        for name in GPU_VARIANTS:
            variants[name] = functools.partial(_measure_ebb, ctx, data, model, name, rows_per_shard)
    whole, steady = interleaved_rates(variants, ctx)
    base = median(steady["sequential"])
    base1 = median(steady["sequential, 1 thread"])
    rows_out = [
        [
            name,
            spread(whole[name]),
            spread(steady[name]),
            _x(median(steady[name]), base),
            _x(median(steady[name]), base1),
            f"{median(steady[name]) / bound:.0%}",
        ]
        for name in variants
    ]
    rows_out.append(
        ["bound (hardware)", "", f"{bound:,.0f}", _x(bound, base), _x(bound, base1), "100%"]
    )
    best = max(median(steady[name]) for name in VARIANTS)
    cost_rows = [[k, f"{v * 1e6:,.0f}", f"{v / sum(costs.values()):.0%}"] for k, v in costs.items()]
    section = Section(
        title="1. One model: Ebb against a sequential loop and the hardware bound",
        intro=__doc__ or "",
        tables=[
            table(
                [
                    "variant",
                    "rows/s, whole job",
                    "rows/s, steady state",
                    "vs sequential",
                    "vs sequential, 1 thread",
                    "of bound",
                ],
                rows_out,
            ),
            table(["stage", "us per item, one core", "share"], cost_rows),
        ],
        slug="single",
        plot={
            "kind": "bars",
            "values": dict(steady),
            "unit": "rows/s (steady state)",
            "line": bound,
            "line_label": "hardware bound",
        },
        summary={
            "rows": rows,
            "bound": bound,
            "efficiency": best / bound,
            "speedup": best / base,
            "speedup_1_thread": best / base1,
            "ebb_rows_per_s": best,
            "ebb_whole_rows_per_s": max(median(whole[name]) for name in VARIANTS),
        },
    )
    section.notes.append(
        f"{rows:,} rows in {rows // rows_per_shard} shards; one worker; the Ebb figures are whole "
        "jobs from submission to the manifest, stage processes' start-up included, on "
        f"{cores} cores. On CPU every stage shares the same cores, so no arrangement of them "
        f"can beat {cores}x a single core: the bound says where that ceiling lies."
    )
    return section
