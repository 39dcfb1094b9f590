"""What every benchmark shares: the run context, timing, medians, tables, plots, the stack."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import psutil

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common.data.layout import COMMITS_DIR
from ebb.common.job import JobSpec
from ebb.common.messaging.messages import JobStatus

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent


@dataclass
class Context:
    quick: bool
    """Small sizes, for a look in a few minutes."""
    workdir: Path
    """Scratch space for datasets, models and outputs."""
    docs: Path
    """Where the report and its plots go."""
    repeats: int = 3
    device: str = "cpu"
    log: Callable[[str], None] = print

    smoke: bool = False
    """Tiny sizes: proves the harness runs end to end (the test suite); measures nothing."""

    def size(self, full: int, quick: int) -> int:
        if self.smoke:
            return max(1, quick // 4)
        return quick if self.quick else full

    def dir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass
class Section:
    """One benchmark's findings, as they go into docs/benchmarks.md."""

    title: str
    intro: str
    tables: list[str] = field(default_factory=list)
    plots: list[tuple[str, str]] = field(default_factory=list)
    """(file name under docs/img, caption)."""
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    """Headline numbers, for the smoke test and the console."""
    plot: dict[str, Any] = field(default_factory=dict)
    """What to draw: {"kind": "bars", "values": {label: [runs]}, "unit": ..., "line": ...}
    or {"kind": "scale", "workers": [...], "ops": [...], "p50": [...], "p99": [...]}
    or {"kind": "lines", "runs": {run: {name: [...]}}, "x": name, "xlabel": ...}."""
    slug: str = ""


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> str:
    """`median (min-max)` for a table cell."""
    return f"{median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def interleaved(
    variants: dict[str, Callable[[], float]], repeats: int, log: Callable[[str], None]
) -> dict[str, list[float]]:
    """Run each variant `repeats` times, alternating A B A B..., so that a noisy neighbour
    hurts every variant alike. Each callable returns one measurement."""
    results: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats):
        for name, run in variants.items():
            value = run()
            results[name].append(value)
            log(f"  {name} run {r + 1}/{repeats}: {value:,.2f}")
    return results


@contextlib.contextmanager
def stopwatch() -> Iterator[Callable[[], float]]:
    start = time.perf_counter()
    yield lambda: time.perf_counter() - start


def gpu() -> str | None:
    """ "cuda" when ONNX Runtime can use a GPU here (onnxruntime-gpu and a driver), else None."""
    import onnxruntime as ort

    return "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else None


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    memory = psutil.virtual_memory().total / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB, Python {platform.python_version()}"


class PeriodicSampler:
    """Takes a sample every `every_s` seconds, on a thread of its own, while in its `with`
    block. `begin` and `end` run on that thread before the first sample and after the last."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def begin(self) -> None:
        """Before the first sample (nothing, unless a sampler needs it)."""

    def sample(self) -> None:
        raise NotImplementedError

    def end(self) -> None:
        """After the last sample (nothing, unless a sampler needs it)."""

    def _run(self) -> None:
        self.begin()
        while not self._stop.wait(self.every_s):
            self.sample()
        self.end()


@contextlib.asynccontextmanager
async def ebb_stack(
    ctx: Context,
    name: str,
    *,
    max_workers: int,
    worker_grace_s: float = 10.0,
    pin_cpus: bool = False,
    gateway: Path | None = None,
    gateway_replicas: int = 1,
) -> AsyncIterator[tuple[LocalStack, EbbClient]]:
    """The embedded stack (nats-server, master, controller as processes; the Batch API
    gateway with this configuration), and a client."""
    stack = LocalStack(
        StackConfig(
            state_dir=ctx.dir(f"{name}-state-{time.monotonic_ns()}"),
            data_roots=[str(ctx.workdir), str(REPO)],
            max_workers=max_workers,
            worker_grace_s=worker_grace_s,
            pin_cpus=pin_cpus,
            log_level="WARNING",
            gateway=gateway,
            gateway_replicas=gateway_replicas,
        )
    )
    await stack.start()
    try:
        client = await EbbClient.connect(stack.nats_config)
        try:
            yield stack, client
        finally:
            await client.close()
    finally:
        await stack.stop()


async def run_job(client: EbbClient, spec: JobSpec) -> tuple[JobStatus, float]:
    """Submit and wait; (final status, seconds from submit to the end)."""
    started = time.perf_counter()
    job_id = await client.submit(spec)
    final = await client.wait(job_id, poll_s=0.2)
    return final, time.perf_counter() - started


async def job_rate(ctx: Context, name: str, spec: JobSpec, out: Path, *, max_workers: int) -> Rate:
    """Run `spec` on a fresh embedded stack; its rates. The output is removed afterwards."""
    async with ebb_stack(ctx, name, max_workers=max_workers) as (_, client):
        final, seconds = await run_job(client, spec)
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"benchmark job failed: {final.reason}")
    rate = Rate(final.rows_done / seconds, steady_rate(out))
    shutil.rmtree(out, ignore_errors=True)
    return rate


def steady_rate(out: Path) -> float:
    """Rows/s between the first and the last shard commit of a job (start-up excluded): the
    rows of every shard but the first, over the time from the first commit to the last."""
    records = [json.loads(p.read_text()) for p in (out / COMMITS_DIR).glob("*.json")]
    records.sort(key=lambda r: r["committed_at"])
    if len(records) < 2:
        return float("nan")
    rows = sum(int(f["rows"]) for r in records[1:] for f in r["files"])
    return rows / float(records[-1]["committed_at"] - records[0]["committed_at"])


@dataclass(frozen=True)
class Rate:
    """A job's throughput: over the whole job, and in its steady state."""

    whole: float
    steady: float


def rates_table(
    whole: Mapping[str, Sequence[float]],
    steady: Mapping[str, Sequence[float]],
    *,
    base: str,
    against: str,
) -> str:
    """Each variant's rates over the whole job and in steady state, and each as a multiple of
    `base`'s (the column headed `against`: "vs plain loop", say)."""
    base_whole, base_steady = median(whole[base]), median(steady[base])
    rows = [
        [
            name,
            spread(whole[name]),
            spread(steady[name]),
            f"{median(whole[name]) / base_whole:.2f}x",
            f"{median(steady[name]) / base_steady:.2f}x",
        ]
        for name in whole
    ]
    headers = ["variant", "rows/s, whole job", "rows/s, steady state"]
    return table([*headers, f"{against}, whole job", f"{against}, steady state"], rows)


def interleaved_rates(
    variants: Mapping[str, Callable[[], Rate]], ctx: Context, unit: str = "rows/s"
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each variant's Rate `ctx.repeats` times, interleaved like `interleaved`:
    (whole-job rates, steady-state rates) by variant."""
    whole: dict[str, list[float]] = {name: [] for name in variants}
    steady: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(ctx.repeats):
        for name, measure in variants.items():
            rate = measure()
            whole[name].append(rate.whole)
            steady[name].append(rate.steady)
            ctx.log(
                f"  {name} run {r + 1}/{ctx.repeats}: {rate.whole:,.0f} {unit} whole job, "
                f"{rate.steady:,.0f} steady"
            )
    return whole, steady


class GpuSampler(PeriodicSampler):
    """The GPU's busy share, sampled every 100 ms by pynvml while in use."""

    def __init__(self) -> None:
        super().__init__(every_s=0.1)
        self.samples: list[float] = []
        self._handle: Any = None

    def begin(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def sample(self) -> None:
        import pynvml

        self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0)

    def end(self) -> None:
        import pynvml

        pynvml.nvmlShutdown()
