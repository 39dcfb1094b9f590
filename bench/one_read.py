"""Benchmark 13: N models on one read against N separate jobs, in wall time and bytes read.

Workload: scoring one dataset with several light models. Four Parquet files as users' tools
write them (`pyarrow.parquet.write_table` defaults: one row group a file at this size), each
row an `id`, 64 float32 `features` and a `label`; four small ONNX MLPs (64 -> 32 -> 1, each
with its own seeded weights), model k reading `features` and writing `p_k`. Every setting
not named is Ebb's default (shards sized for the fleet, the fault policy, each model stage's
processes and threads) but the batch: 1,024 rows, as a light model is served (at the default
32 each branch's cost per batch, in its process and in the router, is what is measured, N
times over on these 2 cores). One worker (`max_workers: 1`).

- N separate jobs: one job per model (a single model stage), run one after another over the
  same data: their total time, and the slowest one's.
- one read, N models: one job whose N model stages all read the rows as read (`after: []`),
  side by side, their columns joined per row into one table.
- one read, N models in one stage: one job of one stage that runs the N models (`models:`)
  in its process, on each batch as it came: models that fit one device, served together.

For N = 2 (models 0 and 1) and N = 4. The separate jobs of N = 2 are the first two of the four
run for N = 4. Each repeat runs the four single jobs, the one-read job of 2 models and that of
4, one after another on one embedded stack (a fresh one each repeat); times are from
submission to the manifest, the worker's start-up included. The target: the one-read job in
at most 1.2x the slowest single job's time, with light models, reading the data once.

Bytes read from the input: the `rchar` (bytes read by system calls) of the job's worker
(/proc/PID/io: every thread's, those that have ended included) less that of its event loop's
thread (imports, NATS) and its router's (rows coming back from the stage processes,
/proc/PID/task/TID/io), sampled every 0.1 s and once more when the job has succeeded, the last
value kept: the threads that read the shards, however short-lived. Models are loaded by the
stage processes, which are not counted. "reads of the input" is that over the input files' size
(footers included: 1.0 is every byte read once).

Before a one-read job's time counts, its output is checked: every row once, and each model's
`p_k` equal, row by row (by `id`, within 1e-5), to that model's own job's.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ebb.client.demo import mlp_onnx
from ebb.client.sdk import EbbClient
from ebb.common.data.layout import MANIFEST
from ebb.common.job import parse_job
from ebb.worker.pipeline.router import ROUTER_THREAD

from .common import Context, PeriodicSampler, Section, ebb_stack, median, run_job, spread, table

FEATURES = 64
HIDDEN = 32
FILES = 4
MODELS = 4
COUNTS = (2, 4)
"""N: the models of a one-read job, and of the separate jobs it is measured against."""
BATCH = 1024
"""Rows a batch of each model stage."""
TARGET = 1.2
"""The one-read job's time over the slowest single job's, at most."""


def write_data(folder: Path, *, rows: int) -> int:
    """The dataset, with pyarrow's default row groups; its size in bytes."""
    rng = np.random.default_rng(0)
    per_file = -(-rows // FILES)
    for f in range(FILES):
        start = f * per_file
        n = min(per_file, rows - start)
        x = rng.standard_normal((n, FEATURES), dtype=np.float32)
        table_ = pa.table(
            {
                "id": np.arange(start, start + n, dtype=np.int64),
                "features": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES),
                "label": rng.integers(0, 2, size=n, dtype=np.int64),
            }
        )
        pq.write_table(table_, folder / f"part-{f}.parquet")
    return sum(p.stat().st_size for p in folder.glob("*.parquet"))


def write_models(folder: Path) -> list[Path]:
    return [
        mlp_onnx(folder / f"model_{k}.onnx", inputs=FEATURES, hidden=HIDDEN, outputs=1, seed=k)
        for k in range(MODELS)
    ]


def job(
    data: Path, models: Mapping[int, Path], out: Path, *, one_stage: bool = False
) -> dict[str, Any]:
    """One job scoring every row with each of `models` (model k writes `p_k`): a single stage
    for one model, else one branch per model on the rows as read, or (`one_stage`) one stage
    running them all in its process."""
    branch: dict[str, Any] = {"after": []} if len(models) > 1 else {}
    shared = {
        "name": "models",
        "models": [
            {"model": str(model), "input": "features", "output": f"p_{k}"}
            for k, model in models.items()
        ],
        "batch_size": BATCH,
    }
    return {
        "name": f"oneread-{len(models)}{'-shared' if one_stage else ''}",
        "input": {"uri": str(data), "format": "parquet"},
        "pipeline": {
            "stages": [shared]
            if one_stage
            else [
                {
                    "name": f"model_{k}",
                    "model": str(model),
                    "input": "features",
                    "output": f"p_{k}",
                    "batch_size": BATCH,
                    **branch,
                }
                for k, model in models.items()
            ]
        },
        "output": {"uri": str(out)},
        "resources": {"min_workers": 1, "max_workers": 1},
    }


def _rchar(path: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"no rchar in {path}")


def _is_worker(p: psutil.Process) -> bool:
    command = p.cmdline()
    return "-m" in command and "ebb.worker" in command


class InputReads(PeriodicSampler):
    """Bytes read by the reading threads of the workers that start while it runs: all a
    worker process read (its ended threads' reads included: a thread that read a shard
    between two samples is not missed) but what its event loop's thread (the main thread)
    and its router's read."""

    def __init__(self, every_s: float = 0.1) -> None:
        super().__init__(every_s)
        self.read: dict[int, int] = {}
        """The last reading of each worker, by pid."""
        # Workers of an earlier job may still be on their way out: not this job's.
        self.earlier = {p.pid for p in psutil.Process().children(recursive=True)}
        self.workers: set[int] = set()

    def sample(self) -> None:
        for p in psutil.Process().children(recursive=True):
            try:
                # A process is only known for a worker once it has exec'd: until then it
                # has its parent's command line.
                if p.pid not in self.earlier and (p.pid in self.workers or _is_worker(p)):
                    self.workers.add(p.pid)
                    self._read(p.pid)
            except (psutil.Error, OSError):
                continue  # it ended between the listing and the reading

    def end(self) -> None:
        """The job has succeeded: its worker has read all it will, and is still there."""
        self.sample()

    def _read(self, pid: int) -> None:
        total = _rchar(f"/proc/{pid}/io")
        for task in Path(f"/proc/{pid}/task").iterdir():
            tid = int(task.name)
            if tid == pid or (task / "comm").read_text().strip() == ROUTER_THREAD:
                total -= _rchar(str(task / "io"))
        self.read[pid] = total

    @property
    def bytes(self) -> int:
        return sum(self.read.values())


@dataclass(frozen=True)
class JobRun:
    seconds: float
    bytes_read: int
    output: pa.Table
    """The job's output, sorted by id."""


async def _run(client: EbbClient, spec: dict[str, Any], rows: int) -> JobRun:
    out = Path(spec["output"]["uri"])
    with InputReads() as reads:
        final, seconds = await run_job(client, parse_job(spec))
    if final.state != "SUCCEEDED" or final.error_rows:
        raise RuntimeError(f"benchmark job {spec['name']}: {final.state} {final.reason}")
    manifest = json.loads((out / MANIFEST).read_text())
    output = pa.concat_tables([pq.read_table(out / f["path"]) for f in manifest["files"]])
    shutil.rmtree(out, ignore_errors=True)
    if output.num_rows != rows:
        raise RuntimeError(f"benchmark job {spec['name']}: {output.num_rows} rows of {rows}")
    if reads.bytes == 0:
        raise RuntimeError(f"benchmark job {spec['name']}: no worker seen reading")
    return JobRun(seconds, reads.bytes, output.sort_by("id"))


def _scores(output: pa.Table, column: str) -> np.ndarray:
    values = output.column(column).combine_chunks()
    if pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type):
        values = pc.list_flatten(values)
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64)


def check_joined(one_read: pa.Table, singles: Sequence[pa.Table]) -> None:
    """The one-read job's output holds each single job's scores, row by row (by id)."""
    ids = one_read.column("id").to_numpy()
    if len(np.unique(ids)) != len(ids):
        raise RuntimeError("the one-read job wrote a row more than once")
    for k, single in enumerate(singles):
        if not np.array_equal(single.column("id").to_numpy(), ids):
            raise RuntimeError(f"the one-read job's rows are not model_{k}'s job's")
        column = f"p_{k}"
        if column not in one_read.column_names:
            raise RuntimeError(f"the one-read job's output has no {column}")
        if not np.allclose(_scores(one_read, column), _scores(single, column), rtol=1e-5):
            raise RuntimeError(f"the one-read job's {column} differs from model_{k}'s job's")


@dataclass
class Measured:
    singles: list[list[JobRun]]
    """Each repeat's single jobs, model by model."""
    one_read: dict[int, list[JobRun]]
    """Each N's one-read job, repeat by repeat."""
    one_stage: dict[int, list[JobRun]]
    """Each N's one-read job with its models in one stage, repeat by repeat."""
    columns: dict[int, list[str]]
    """Each N's one-read output columns."""


async def _repeat(
    ctx: Context, data: Path, models: list[Path], rows: int, measured: Measured
) -> None:
    """One repeat: the single jobs, then each one-read job, on one fresh stack."""
    out = ctx.dir("oneread-out")
    async with ebb_stack(ctx, "oneread", max_workers=1) as (_, client):
        singles = []
        for k, model in enumerate(models):
            spec = job(data, {k: model}, out / f"model_{k}-{time.monotonic_ns()}")
            singles.append(await _run(client, spec, rows))
            ctx.log(f"  model_{k} alone: {singles[-1].seconds:.1f} s")
        measured.singles.append(singles)
        for n in COUNTS:
            spec = job(
                data, dict(enumerate(models[:n])), out / f"oneread-{n}-{time.monotonic_ns()}"
            )
            run = await _run(client, spec, rows)
            check_joined(run.output, [s.output for s in singles[:n]])
            measured.one_read[n].append(run)
            measured.columns[n] = run.output.column_names
            ctx.log(f"  one read, {n} models: {run.seconds:.1f} s")
            spec = job(
                data,
                dict(enumerate(models[:n])),
                out / f"onestage-{n}-{time.monotonic_ns()}",
                one_stage=True,
            )
            run = await _run(client, spec, rows)
            check_joined(run.output, [s.output for s in singles[:n]])
            measured.one_stage[n].append(run)
            ctx.log(f"  one read, {n} models in one stage: {run.seconds:.1f} s")


def run(ctx: Context) -> Section:
    rows = ctx.size(2_000_000, 200_000)
    data = ctx.dir("oneread-data")
    size = write_data(data, rows=rows)
    models = write_models(ctx.dir("oneread-models"))
    measured = Measured(
        singles=[],
        one_read={n: [] for n in COUNTS},
        one_stage={n: [] for n in COUNTS},
        columns={},
    )
    for r in range(ctx.repeats):
        ctx.log(f"  repeat {r + 1}/{ctx.repeats}")
        asyncio.run(_repeat(ctx, data, models, rows, measured))

    def mb(runs: Sequence[int]) -> str:
        return f"{median(runs) / 1e6:,.1f}"

    def reads(runs: Sequence[int]) -> str:
        return f"{median(runs) / size:.2f}"

    rows_out: list[list[Any]] = []
    walls: dict[str, list[float]] = {}
    summary: dict[str, Any] = {"rows": rows, "input_mb": size / 1e6}
    for n in COUNTS:
        total = [sum(j.seconds for j in s[:n]) for s in measured.singles]
        slowest = [max(j.seconds for j in s[:n]) for s in measured.singles]
        separate_read = [sum(j.bytes_read for j in s[:n]) for s in measured.singles]
        one = [j.seconds for j in measured.one_read[n]]
        one_read = [j.bytes_read for j in measured.one_read[n]]
        # Paired by repeat: the variants of one repeat met the same neighbours.
        over_slowest = median([o / s for o, s in zip(one, slowest, strict=True)])
        over_total = median([o / t for o, t in zip(one, total, strict=True)])
        shared = [j.seconds for j in measured.one_stage[n]]
        shared_read = [j.bytes_read for j in measured.one_stage[n]]
        shared_over_slowest = median([o / s for o, s in zip(shared, slowest, strict=True)])
        rows_out += [
            [
                f"{n} separate jobs",
                spread(total),
                spread(slowest),
                f"{median([t / s for t, s in zip(total, slowest, strict=True)]):.2f}x",
                "1.00x",
                mb(separate_read),
                reads(separate_read),
            ],
            [
                f"one read, {n} models",
                spread(one),
                "",
                f"{over_slowest:.2f}x",
                f"{over_total:.2f}x",
                mb(one_read),
                reads(one_read),
            ],
            [
                f"one read, {n} models in one stage",
                spread(shared),
                "",
                f"{shared_over_slowest:.2f}x",
                f"{median([o / t for o, t in zip(shared, total, strict=True)]):.2f}x",
                mb(shared_read),
                reads(shared_read),
            ],
        ]
        walls[f"{n} separate jobs"] = total
        walls[f"one read, {n} models"] = one
        walls[f"one stage, {n} models"] = shared
        summary[f"one_read_over_slowest_{n}"] = over_slowest
        summary[f"one_read_over_total_{n}"] = over_total
        summary[f"one_stage_over_slowest_{n}"] = shared_over_slowest
        summary[f"reads_one_read_{n}"] = median(one_read) / size
        summary[f"reads_separate_{n}"] = median(separate_read) / size
    comparison = table(
        [
            "variant",
            "wall time, s",
            "slowest single job, s",
            "vs slowest single job",
            "vs the separate jobs",
            "MB read from the input",
            "reads of the input",
        ],
        rows_out,
    )
    alone = table(
        ["model alone", "wall time, s", "MB read from the input"],
        [
            [
                f"model_{k}",
                spread([s[k].seconds for s in measured.singles]),
                mb([s[k].bytes_read for s in measured.singles]),
            ]
            for k in range(MODELS)
        ],
    )
    columns = "; ".join(
        f"{n} models: `{', '.join(measured.columns[n])}`" for n in COUNTS if n in measured.columns
    )

    return Section(
        title="13. N models on one read against N separate jobs",
        intro=__doc__ or "",
        tables=[comparison, alone],
        slug="oneread",
        plot={"kind": "bars", "values": walls, "unit": "seconds, whole job(s)"},
        summary=summary,
        notes=[
            f"{rows:,} rows in {FILES} files ({size / 1e6:,.0f} MB); one worker; "
            f"{ctx.repeats} repeat(s), medians (min-max); the ratios are medians of each "
            f"repeat's. Target: the one-read job at most {TARGET:.1f}x the slowest single job. "
            f"The one-read jobs' output columns ({columns}) held each model's scores, equal to "
            "its own job's.",
            f"Over the slowest single job: two models in one stage took "
            f"{summary['one_stage_over_slowest_2']:.2f}x, four "
            f"{summary['one_stage_over_slowest_4']:.2f}x (the target: {TARGET:.1f}x); as "
            f"branches, {summary['one_read_over_slowest_2']:.2f}x and "
            f"{summary['one_read_over_slowest_4']:.2f}x. Each branch is a process of its own "
            "whose rows the router copies in, reads back and joins: on these 2 cores, with "
            "models this light, that costs more than the models do. Light models that fit one "
            "device belong in one stage (`models:`); branches are for models that need their "
            "own processes, batches or devices. Every one-read job read the input once.",
        ],
    )
