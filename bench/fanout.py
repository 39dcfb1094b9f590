"""Benchmark 2: two models with a fan-out, as stages of their own or together in one stage.

A detector scores a 4x4 grid over each 64x64 image; every cell above a threshold (set so that
images hold about four objects, anywhere from none to a dozen) is cropped, and a classifier
labels each crop. The results of an image's crops come back together into one row.

- one stage: a single modelet decodes a batch, runs the detector on it, crops, runs the
  classifier on all the crops of the batch, and assembles the rows, in one process.
- multi-stage: decode -> detector -> crops (fan-out) -> classifier -> summary (fan-in), each a
  stage of its own, with the elastic scheduler free to give any stage up to 2 processes.
  The classifier batches crops across images, whatever images they came from.

Both run as Ebb jobs over the same data, on one worker; only the pipeline differs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
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

OBJECTS_PER_IMAGE = 4


def threshold(data: Path, detector: Path, sample: int = 1_024) -> float:
    """The score above which an image holds OBJECTS_PER_IMAGE cells on average."""
    blobs = pq.read_table(sorted(data.glob("*.parquet"))[0]).column("image").to_pylist()[:sample]
    session = ort.InferenceSession(str(detector), providers=["CPUExecutionProvider"])
    scores = session.run(None, {"x": np.stack([workloads.decode_full(b) for b in blobs])})[0]
    cells = workloads.CELLS * workloads.CELLS
    return float(np.quantile(scores, 1 - OBJECTS_PER_IMAGE / cells))


def pipeline(
    kind: str, detector: Path, classifier: Path, cut: float, device: str = "cpu"
) -> dict[str, Any]:
    gpu = {"device": device, "threads": 0} if device == "cuda" else {"threads": 1}
    if kind.startswith("one stage"):
        stages: list[dict[str, Any]] = [
            {
                "name": "detect-and-classify",
                "modelet": "bench.modelets:DetectAndClassify",
                "params": {
                    "detector": str(detector),
                    "classifier": str(classifier),
                    "threshold": cut,
                    "device": device,
                },
                "batch_size": 64,
            }
        ]
    else:
        scale = {"min_workers": 1, "max_workers": 2}
        stages = [
            {"name": "decode", "modelet": "bench.modelets:DecodeFull", "batch_size": 64, **scale},
            {
                "name": "detector",
                "model": str(detector),
                "input": "image",
                "output": "scores",
                **gpu,
                "batch_size": 64,
                **scale,
            },
            {
                "name": "crops",
                "modelet": "bench.modelets:Crops",
                "params": {"threshold": cut},
                "fanout": True,
                "batch_size": 64,
            },
            {
                "name": "classifier",
                "model": str(classifier),
                **gpu,
                "batch_size": 256,
                **scale,
            },
            {
                "name": "summary",
                "modelet": "bench.modelets:Summarise",
                "fanin": True,
                "batch_size": 64,
            },
        ]
    return {"code_paths": [str(BENCH_DIR.parent)], "stages": stages}


async def _once(
    ctx: Context, data: Path, kind: str, stages: dict[str, Any], rows_per_shard: int
) -> Rate:
    out = ctx.dir("fanout-out") / f"{kind.replace(' ', '-')}-{time.monotonic_ns()}"
    spec = parse_job(
        {
            "name": "detect-classify",
            "input": {
                "uri": str(data),
                "format": "parquet",
                "columns": ["image"],
                "rows_per_shard": rows_per_shard,
            },
            "pipeline": stages,
            "output": {"uri": str(out), "carryover": ["id"]},
        }
    )
    return await job_rate(ctx, "fanout", spec, out, max_workers=1)


def run(ctx: Context) -> Section:
    rows = ctx.size(24_000, 2_000)
    data = workloads.write_images(ctx.dir("images-fanout"), rows=rows, files=4, seed=7)
    detector = workloads.detector(ctx.dir("models") / "detector.onnx")
    classifier = workloads.crop_classifier(ctx.dir("models") / "classifier.onnx")
    cut = threshold(data, detector)
    rows_per_shard = ctx.size(3_000, 500)
    kinds = {k: pipeline(k, detector, classifier, cut) for k in ("one stage", "multi-stage")}
    if ctx.device == "cuda":
        kinds["one stage, GPU"] = pipeline("one stage", detector, classifier, cut, "cuda")
        kinds["multi-stage, GPU"] = pipeline("multi-stage", detector, classifier, cut, "cuda")

    def measure(kind: str, stages: dict[str, Any]) -> Callable[[], Rate]:
        return lambda: asyncio.run(_once(ctx, data, kind, stages, rows_per_shard))

    variants = {kind: measure(kind, stages) for kind, stages in kinds.items()}
    whole, steady = interleaved_rates(variants, ctx, unit="images/s")
    base = median(steady["one stage"])
    speedup = median(steady["multi-stage"]) / base
    section = Section(
        title="2. Two models with a fan-out: one stage against a multi-stage pipeline",
        intro=__doc__ or "",
        tables=[
            table(
                ["pipeline", "images/s, whole job", "images/s, steady state", "vs one stage"],
                [
                    [k, spread(whole[k]), spread(steady[k]), f"{median(steady[k]) / base:.2f}x"]
                    for k in kinds
                ],
            )
        ],
        slug="fanout",
        plot={"kind": "bars", "values": dict(steady), "unit": "images/s (steady state)"},
        summary={"rows": rows, "speedup": speedup},
    )
    section.notes.append(
        f"{rows:,} images, about {OBJECTS_PER_IMAGE} crops each (threshold {cut:.3f}); whole "
        "jobs, start-up included, on one worker."
    )
    return section
