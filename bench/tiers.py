"""Benchmark 14: what the hand-off between tiers costs, on one machine.

Workload: Parquet files as users' tools write them (`pyarrow.parquet.write_table` defaults),
each row an `id` and 64 float32 `features`; a pipeline of two stages: `prep`, the built-in
`Features` modelet (the features as one float32 vector a row: what a preprocessing stage
hands a model), and `model`, an ONNX MLP (64 -> 32 -> 1). Batches of 1,024 rows; every other
setting Ebb's default. The same pipeline three ways, on one embedded stack each repeat, one
after another:

- one tier, one worker: both stages in one worker;
- one tier, two workers: the same, two workers (the machine's two cores);
- two tiers: `prep` in a tier of one worker, `model` in a tier of one worker: the first
  tier's shards commit Arrow IPC hand-offs under the output root's `_tiers/`, which the
  second tier's shards read (docs/tiers.md).

Times are from submission to the manifest, worker start-up included; rows/s are the job's
rows over that. Bytes moved per row: the first tier's hand-off files (their bytes as the
master counted them when it recorded its shards done, `TierStatus.bytes_done`, the last the
job's status showed), over the rows; each is written once and read once. Beside them, the
input's bytes per row and the output's. Before a run counts, its output is checked: every id
once, the model's scores equal to the one-tier job's (within 1e-6).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.client.demo import mlp_onnx
from ebb.client.sdk import EbbClient
from ebb.common.data.layout import MANIFEST
from ebb.common.job import parse_job
from ebb.common.messaging.messages import JobStatus

from .common import Context, Section, ebb_stack, median, spread, table

FEATURES = 64
HIDDEN = 32
FILES = 16
BATCH = 1024
VARIANTS = ("one tier, one worker", "one tier, two workers", "two tiers")


def write_data(folder: Path, *, rows: int) -> int:
    """The dataset, with pyarrow's default row groups; its size in bytes."""
    rng = np.random.default_rng(0)
    per_file = -(-rows // FILES)
    for f in range(FILES):
        start = f * per_file
        n = min(per_file, rows - start)
        x = rng.standard_normal((n, FEATURES), dtype=np.float32)
        pq.write_table(
            pa.table(
                {
                    "id": np.arange(start, start + n, dtype=np.int64),
                    "features": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES),
                }
            ),
            folder / f"part-{f}.parquet",
        )
    return sum(p.stat().st_size for p in folder.glob("*.parquet"))


def job(data: Path, model: Path, out: Path, variant: str) -> dict[str, Any]:
    workers = 2 if variant == "one tier, two workers" else 1
    spec: dict[str, Any] = {
        "name": f"tiers-{variant.replace(' ', '-').replace(',', '')}",
        "input": {"uri": str(data), "format": "parquet"},
        "pipeline": {
            "stages": [
                {
                    "name": "prep",
                    "modelet": "ebb.worker.modelets:Features",
                    "params": {"columns": ["features"]},
                    "batch_size": BATCH,
                },
                {"name": "model", "model": str(model), "batch_size": BATCH},
            ]
        },
        "output": {"uri": str(out), "carryover": ["id"]},
        "resources": {"min_workers": workers, "max_workers": workers},
    }
    if variant == "two tiers":
        one = {"min_workers": 1, "max_workers": 1}
        spec["tiers"] = [
            {"name": "prep", "stages": ["prep"], "resources": one},
            {"name": "model", "stages": ["model"], "resources": one},
        ]
    return spec


@dataclass(frozen=True)
class Run:
    seconds: float
    handoff_bytes: int
    output_bytes: int
    scores: np.ndarray
    """The model's score of each row, by id."""


async def _run(client: EbbClient, spec: dict[str, Any], rows: int) -> Run:
    out = Path(spec["output"]["uri"])
    started = time.perf_counter()
    job_id = await client.submit(parse_job(spec))
    seen: list[JobStatus] = []

    def keep(status: JobStatus) -> None:
        if status.tiers:
            seen.append(status)

    final = await client.wait(job_id, poll_s=0.2, on_update=keep)
    seconds = time.perf_counter() - started
    if final.state != "SUCCEEDED" or final.error_rows:
        raise RuntimeError(f"benchmark job {spec['name']}: {final.state} {final.reason}")
    manifest = json.loads((out / MANIFEST).read_text())
    output = pa.concat_tables([pq.read_table(out / f["path"]) for f in manifest["files"]])
    output_bytes = sum((out / f["path"]).stat().st_size for f in manifest["files"])
    shutil.rmtree(out, ignore_errors=True)
    ids = output.column("id").to_numpy()
    if output.num_rows != rows or not np.array_equal(np.sort(ids), np.arange(rows)):
        raise RuntimeError(f"benchmark job {spec['name']}: not every id once")
    scores = np.empty(rows, dtype=np.float64)
    column: Any = output.column("prediction").combine_chunks()
    if pa.types.is_fixed_size_list(column.type) or pa.types.is_list(column.type):
        column = column.flatten()
    scores[ids] = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
    handoff = seen[-1].tiers[0].bytes_done if seen else 0
    if "tiers" in spec and handoff == 0:
        raise RuntimeError(f"benchmark job {spec['name']}: no hand-off seen")
    return Run(seconds, handoff, output_bytes, scores)


async def _repeat(
    ctx: Context, data: Path, model: Path, rows: int, runs: dict[str, list[Run]]
) -> None:
    async with ebb_stack(ctx, "tiers", max_workers=2) as (_, client):
        for variant in VARIANTS:
            out = ctx.workdir / f"tiers-out-{len(runs[variant])}"
            run = await _run(client, job(data, model, out, variant), rows)
            if runs[VARIANTS[0]]:
                reference = runs[VARIANTS[0]][0].scores
                if not np.allclose(run.scores, reference, atol=1e-6):
                    raise RuntimeError(f"{variant}: scores differ from the one-tier job's")
            runs[variant].append(run)
            ctx.log(f"  {variant}: {run.seconds:.1f} s")


def run(ctx: Context) -> Section:
    rows = ctx.size(1_000_000, 200_000)
    data = ctx.dir("tiers-data")
    size = write_data(data, rows=rows)
    model = mlp_onnx(
        ctx.dir("tiers-model") / "model.onnx", inputs=FEATURES, hidden=HIDDEN, outputs=1, seed=0
    )
    runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
    for r in range(ctx.repeats):
        ctx.log(f"  repeat {r + 1}/{ctx.repeats}")
        asyncio.run(_repeat(ctx, data, model, rows, runs))

    base = [r.seconds for r in runs[VARIANTS[0]]]
    rows_out: list[list[Any]] = []
    summary: dict[str, Any] = {"rows": rows, "input_bytes_per_row": size / rows}
    for variant in VARIANTS:
        seconds = [r.seconds for r in runs[variant]]
        # Paired by repeat: the variants of one repeat met the same neighbours.
        ratio = median([s / b for s, b in zip(seconds, base, strict=True)])
        handoff = median([r.handoff_bytes for r in runs[variant]]) / rows
        output = median([r.output_bytes for r in runs[variant]]) / rows
        rate = median([rows / s for s in seconds])
        rows_out.append(
            [
                variant,
                spread(seconds),
                f"{rate:,.0f}",
                f"{ratio:.2f}x",
                f"{handoff:,.0f}" if handoff else "-",
                f"{size / rows:,.0f}",
                f"{output:,.0f}",
            ]
        )
        key = variant.replace(" ", "_").replace(",", "")
        summary[f"seconds_{key}"] = median(seconds)
        summary[f"over_one_worker_{key}"] = ratio
        if handoff:
            summary["handoff_bytes_per_row"] = handoff
    comparison = table(
        [
            "variant",
            "wall time, s",
            "rows/s",
            "time vs one tier, one worker",
            "hand-off bytes/row (written, read)",
            "input bytes/row",
            "output bytes/row",
        ],
        rows_out,
    )
    handoff = summary.get("handoff_bytes_per_row", 0.0)
    two = summary["over_one_worker_two_tiers"]
    extra_us = (summary["seconds_two_tiers"] - summary["seconds_one_tier_one_worker"]) / rows * 1e6
    summary["handoff_us_per_row"] = extra_us
    two_workers = summary["over_one_worker_one_tier_two_workers"]
    return Section(
        title="14. What the hand-off between tiers costs",
        intro=__doc__ or "",
        tables=[comparison],
        slug="tiers",
        plot={
            "kind": "bars",
            "values": {v: [r.seconds for r in runs[v]] for v in VARIANTS},
            "unit": "seconds, whole job",
        },
        summary=summary,
        notes=[
            f"{rows:,} rows in {FILES} files ({size / 1e6:,.0f} MB); {ctx.repeats} repeat(s), "
            "medians (min-max); ratios are medians of each repeat's. Every run's scores equal "
            "the one-tier job's.",
            f"Two tiers (a worker each) took {two:.2f}x the time of one tier with one worker, "
            f"and one tier with two workers {two_workers:.2f}x: the same two cores, one way "
            f"with a hand-off of {handoff:,.0f} bytes a row written and read back (the 64 "
            "floats the first tier hands on, 256 bytes, and the id and error columns), the "
            "other without. The difference, "
            f"{extra_us:.1f} µs a row, is what the hand-off costs here: its bytes, the tiers' "
            "workers each starting their own pipeline, and the pipeline's fill and drain (the "
            "second tier starts on the first shard the first commits; the last shard of each "
            "runs alone). The whole one-tier job costs "
            f"{summary['seconds_one_tier_one_worker'] / rows * 1e6:.1f} µs a row; a model "
            "worth a GPU costs hundreds. On a cluster each tier has its own nodes, and the "
            "hand-off buys what one pod shape cannot: CPUs for the first tier that the GPU "
            "nodes have not (section 15).",
        ],
    )
