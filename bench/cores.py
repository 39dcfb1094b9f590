"""Benchmark 12: every byte read once, every core used once. An MLP over 256 features, a
million rows in Parquet as pyarrow writes it, Ebb with 1 and 2 workers against a plain loop.

Workload: embeddings scoring. Parquet files of 50,000 rows, each one row group (what
`pyarrow.parquet.write_table` writes by default for files of that size), an id and 256
float32 features a row, 1M rows; `rows_per_shard: 10000` asked. Preprocessing standardises
the features, a TorchScript MLP (256 -> 1024 -> 1024 -> 16) scores them, the output keeps the
id and the 16 scores. Every setting not named is Ebb's default: the model stage's threads
(its share of the worker's cores), chunks, batching waits.

- plain loop: one process, `iter_batches` -> standardise (numpy, vectorised) -> forward
  (torch with its default threads) -> write, file by file: timed from its first read to its
  last write, and as a whole process (interpreter, imports and model load included), which is
  what Ebb's whole job is compared with.
- Ebb, per-row modelet: preprocessing written per row (`process(row)`), as most modelets are.
- Ebb, columnar modelet: the same step on a batch's columns (`process_columns`).
- each with 1 worker and 2 workers on the local backend, whole job from submission to the
  manifest (the workers' start-up included, the stack's not); and 2 workers pinned to cores
  of their own (`--pin-cpus`).

Read amplification is the bytes read for every shard of the job over the input's size
(the workers' reader, run over the planner's shards in this process). The CPU split is
where the CPU of Ebb's runs went, sampled from the processes while they ran: the model stage,
the preprocessing stage, the worker's router thread, the rest of the worker (its start-up,
leases, reading and decoding Parquet, writing), and its fork server (which imports the stages'
runtimes once, at start-up, for every stage process it forks). The worker's start-up is its
CPU when its model stage has computed for half a second (imports, connecting, reading the job,
the first chunk). "router + worker after start-up vs model" is the worker's own share: what
reading, moving and writing the rows costs against the model's CPU (the target is 10% or
less).
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ebb.common.job import InputSpec, parse_job
from ebb.shard_master.planning.planner import plan_shards
from ebb.worker.pipeline.router import ROUTER_THREAD
from ebb.worker.shardio.reader import ShardReader

from .common import (
    BENCH_DIR,
    REPO,
    Context,
    PeriodicSampler,
    Rate,
    Section,
    ebb_stack,
    interleaved_rates,
    median,
    run_job,
    spread,
    table,
)

FEATURES = 256
ROWS_PER_FILE = 50_000
ROWS_PER_SHARD = 10_000
MEAN, STD = 0.5, 0.29
BATCH = 4_096


def write_data(folder: Path, *, rows: int) -> int:
    """The dataset, one row group a file; its size in bytes."""
    rng = np.random.default_rng(0)
    for f, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        n = min(ROWS_PER_FILE, rows - start)
        x = rng.random((n, FEATURES), dtype=np.float32)
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES)
        ids = np.arange(start, start + n, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": features}), folder / f"part-{f:03d}.parquet")
    return sum(p.stat().st_size for p in folder.glob("*.parquet"))


def write_model(path: Path) -> Path:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 16),
    ).eval()
    torch.jit.save(torch.jit.script(model), str(path))
    return path


def plain_loop(data: Path, model_path: Path, out: Path) -> float:
    """The baseline as a data scientist writes it, in this process; rows/s from the model's
    load to the last write."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = torch.jit.load(str(model_path))  # type: ignore[no-untyped-call]
    rows = 0
    for n, path in enumerate(sorted(data.glob("*.parquet"))):
        tables = []
        for b in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
            x = pc.list_flatten(b.column("x")).to_numpy().reshape(-1, FEATURES)
            x = (x - np.float32(MEAN)) / np.float32(STD)
            with torch.inference_mode():
                y = model(torch.from_numpy(x)).numpy()
            scores = pa.FixedSizeListArray.from_arrays(pa.array(y.ravel()), y.shape[1])
            tables.append(pa.table({"id": b.column("id"), "scores": scores}))
            rows += b.num_rows
        pq.write_table(pa.concat_tables(tables), out / f"part-{n:05d}.parquet")
    return rows / (time.perf_counter() - started)


def _plain(data: Path, model: Path, out: Path) -> Rate:
    value = plain_loop(data, model, out / f"plain-{time.monotonic_ns()}")
    return Rate(value, value)


def _plain_process(data: Path, model: Path, out: Path, rows: int) -> Rate:
    """The plain loop as a user runs it: `python script.py`, timed from start to exit."""
    target = out / f"plain-process-{time.monotonic_ns()}"
    code = (
        "import sys; from pathlib import Path; from bench.cores import plain_loop; "
        "plain_loop(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))"
    )
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, str(data), str(model), str(target)],
        check=True,
        cwd=REPO,
    )
    value = rows / (time.perf_counter() - started)
    return Rate(value, value)


def job(data: Path, model: Path, out: Path, *, workers: int, columnar: bool) -> dict[str, Any]:
    return {
        "name": "mlp-256",
        "input": {"uri": str(data), "format": "parquet", "rows_per_shard": ROWS_PER_SHARD},
        "pipeline": {
            "code_paths": [str(BENCH_DIR.parent)],
            "stages": [
                {
                    "name": "preprocess",
                    "modelet": f"bench.modelets:{'Standardize' if columnar else 'StandardizeRow'}",
                    "params": {"mean": MEAN, "std": STD, "column": "x"},
                    "batch_size": BATCH,
                },
                {"name": "model", "model": str(model), "batch_size": BATCH},
            ],
        },
        "output": {"uri": str(out), "carryover": ["id"]},
        "resources": {"min_workers": workers, "max_workers": workers},
    }


class CpuSampler(PeriodicSampler):
    """CPU seconds of the processes under this one, by part of Ebb, sampled while a job
    runs: the last reading of each process and thread counts (one that ends between two
    samples loses its last fraction of a second). A worker's start-up is its CPU (every
    thread but the router) when its model stage has computed for half a second: imports,
    connecting, reading the job, and the first chunk's read."""

    def __init__(self, every_s: float = 0.25) -> None:
        super().__init__(every_s)
        self.seconds: dict[tuple[int, int], tuple[str, float]] = {}
        self.startup: dict[int, float] = {}
        """Per worker process: its CPU as its model stage began computing."""
        self._worker_of: dict[int, int | None] = {}

    def sample(self) -> None:
        for p in psutil.Process().children(recursive=True):
            try:
                self._read(p)
            except (psutil.Error, OSError):
                continue
        for (pid, _), (part, seconds) in list(self.seconds.items()):
            worker = self._worker_of.get(pid)
            if part == "stage model" and seconds >= 0.5 and worker and worker not in self.startup:
                self.startup[worker] = sum(
                    s
                    for (p, _), (name, s) in self.seconds.items()
                    if p == worker and name == "worker"
                )

    def _read(self, p: psutil.Process) -> None:
        comm = Path(f"/proc/{p.pid}/comm").read_text().strip()
        if comm.startswith("ebb:"):
            t = p.cpu_times()
            self.seconds[(p.pid, 0)] = (f"stage {comm[4:]}", t.user + t.system)
            if p.pid not in self._worker_of:
                self._worker_of[p.pid] = next(
                    (a.pid for a in p.parents() if _is_worker(" ".join(a.cmdline()))), None
                )
            return
        cmdline = " ".join(p.cmdline())
        if "forkserver" in cmdline:
            t = p.cpu_times()
            self.seconds[(p.pid, 0)] = ("fork server", t.user + t.system)
        elif _is_worker(cmdline):
            for thread in p.threads():
                name = Path(f"/proc/{p.pid}/task/{thread.id}/comm").read_text().strip()
                part = "router" if name == ROUTER_THREAD else "worker"
                self.seconds[(p.pid, thread.id)] = (part, thread.user_time + thread.system_time)

    def split(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for part, seconds in self.seconds.values():
            out[part] += seconds
        out["worker start-up"] = sum(self.startup.values())
        return dict(out)


def _is_worker(cmdline: str) -> bool:
    """A worker process (its fork server preloads ebb.worker modules too)."""
    return "ebb.worker" in cmdline and "forkserver" not in cmdline


async def _ebb(
    ctx: Context,
    data: Path,
    model: Path,
    cpu: dict[str, Any],
    *,
    workers: int,
    columnar: bool,
    pinned: bool,
) -> Rate:
    """One run of the job on Ebb; where its CPU went goes into `cpu`."""
    out = ctx.dir("cores-out") / f"ebb-{time.monotonic_ns()}"
    spec = parse_job(job(data, model, out, workers=workers, columnar=columnar))
    async with ebb_stack(ctx, "cores", max_workers=workers, pin_cpus=pinned) as (_, client):
        with CpuSampler() as sampler:
            final, seconds = await run_job(client, spec)
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"benchmark job failed: {final.reason}")
    cpu.update(sampler.split())
    cpu["wall"] = seconds
    return Rate(final.rows_done / seconds, float("nan"))


def read_amplification(data: Path, size: int) -> float:
    """Bytes the worker's reader reads for every shard of the job, over the input's size."""

    def rchar() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        raise RuntimeError("no rchar in /proc/self/io")

    shards = plan_shards(InputSpec(uri=str(data), format="parquet", rows_per_shard=ROWS_PER_SHARD))
    before = rchar()
    for shard in shards:
        reader = ShardReader(shard, None)
        while reader.next() is not None:
            pass
    return (rchar() - before) / size


def run(ctx: Context) -> Section:
    rows = ctx.size(1_000_000, 200_000)
    data = ctx.dir("cores-data")
    size = write_data(data, rows=rows)
    model = write_model(ctx.dir("models") / "mlp256.pt")
    amplification = read_amplification(data, size)
    ctx.log(f"  read amplification {amplification:.3f}x")
    out = ctx.dir("cores-out")
    cpu: dict[str, dict[str, Any]] = defaultdict(dict)

    def ebb(name: str, *, workers: int, columnar: bool, pinned: bool = False) -> Callable[[], Rate]:
        """Variant `name`: the job on Ebb so; where its CPU went goes into `cpu[name]`."""
        split = cpu[name]  # now: the CPU table lists the variants in this order
        return lambda: asyncio.run(
            _ebb(ctx, data, model, split, workers=workers, columnar=columnar, pinned=pinned)
        )

    variants: dict[str, Callable[[], Rate]] = {
        "plain loop, whole process": functools.partial(_plain_process, data, model, out, rows),
        "plain loop, loop only": functools.partial(_plain, data, model, out),
    }
    for workers in (1, 2):
        for columnar in (False, True):
            name = f"Ebb, {workers} worker{'s' if workers > 1 else ''}, " + (
                "columnar modelet" if columnar else "per-row modelet"
            )
            variants[name] = ebb(name, workers=workers, columnar=columnar)
    pinned = "Ebb, 2 workers, columnar modelet, pinned"
    variants[pinned] = ebb(pinned, workers=2, columnar=True, pinned=True)
    whole, steady = interleaved_rates(variants, ctx)
    del steady  # the plain loop has no steady state apart from its whole
    base = median(whole["plain loop, whole process"])
    rates = table(
        ["variant", "rows/s, whole job", "vs plain loop (whole process)"],
        [[name, spread(v), f"{median(v) / base:.2f}x"] for name, v in whole.items()],
    )
    parts = ["stage model", "stage preprocess", "router", "worker", "fork server"]
    split_rows = []
    for name, seconds in cpu.items():
        total = sum(seconds.get(p, 0.0) for p in parts)
        startup = seconds.get("worker start-up", 0.0)
        own = seconds.get("router", 0.0) + seconds.get("worker", 0.0) - startup
        split_rows.append(
            [
                name,
                *(
                    f"{seconds.get(p, 0.0):.1f} s ({seconds.get(p, 0.0) / total:.0%})"
                    for p in parts
                ),
                f"{startup:.1f} s",
                f"{own / seconds['stage model']:.0%}",
                f"{total / seconds['wall']:.2f}",
            ]
        )
    split = table(
        [
            "variant (last run)",
            "model",
            "preprocess",
            "router",
            "worker",
            "fork server",
            "of it the worker's start-up",
            "router + worker after start-up vs model",
            "cores busy",
        ],
        split_rows,
    )
    one = median(whole["Ebb, 1 worker, columnar modelet"])
    two = median(whole["Ebb, 2 workers, columnar modelet"])
    return Section(
        title="12. Every byte read once, every core used once: an MLP over 256 features",
        intro=__doc__ or "",
        tables=[rates, split],
        slug="cores",
        plot={"kind": "bars", "values": dict(whole), "unit": "rows/s (whole job)"},
        summary={
            "rows": rows,
            "read_amplification": amplification,
            "ebb_1_worker_vs_plain": one / base,
            "ebb_2_workers_vs_1": two / one,
        },
        notes=[
            f"{rows:,} rows in {rows // ROWS_PER_FILE} files of one {ROWS_PER_FILE:,}-row row "
            f"group ({size / 1e6:,.0f} MB); read amplification {amplification:.2f}x (bytes read "
            f"over the input's size, footers included); {os.cpu_count()} cores, shared by the "
            'workers with the master, the controller and nats-server. "cores busy" is the '
            "CPU seconds of the job's processes over its wall time."
        ],
    )
