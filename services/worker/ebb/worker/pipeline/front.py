"""The modelet pipeline's asyncio front: `run` hands a shard's rows to the router
(ebb.worker.pipeline.router) in chunks and gathers the results, chunk by chunk, into columns in the
rows' order.

Rows are numbered by uid as they go in; results and errors come back as chunks keyed by their
uids, and each is put in its place with one vectorised scatter, so that the cost per row of
the bookkeeping is that of numpy, not of a Python object. Memory is bounded: never more than
`max_inflight` rows are inside the pipeline. A run abandoned before its end (its task
cancelled: a lost lease, a drain) cancels its rows in the router, so that they stop taking
room from the runs that follow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ebb.common.aio import until

from ..chunks.columns import Columns, from_rows, num_rows, scatter, split_metrics, take, to_rows
from .config import PipelineBroken, PipelineConfig, PipelineError, PipelineSetupError
from .router import Router

__all__ = [
    "Outcome",
    "Pipeline",
    "PipelineBroken",
    "PipelineConfig",
    "PipelineError",
    "PipelineSetupError",
    "RunResult",
]

Outcome = tuple[bool, Any]
"""(True, output) for a row that made it through, (False, error message) for one that did not."""


@dataclass
class RunResult:
    """What came out of one `run`: a chunk of one row per input row, in order, and the rows
    that failed with their reasons (their entries in `columns` are zeros or None)."""

    rows: int
    columns: Columns
    errors: dict[int, str] = field(default_factory=dict)
    metrics: Columns = field(default_factory=dict)
    """Each metric's per-row values (`StageSpec.metrics`), by the metric's name: what the
    worker sums up for the rows it writes (those of failed rows are not values)."""

    def outcomes(self) -> list[Outcome]:
        """One Outcome per row: the per-row view (a Python object per row: the slow path)."""
        values = to_rows(self.columns) if self.columns else [None] * self.rows
        return [
            (False, self.errors[i]) if i in self.errors else (True, v) for i, v in enumerate(values)
        ]


class _Run:
    """The results of one `Pipeline.run`, gathered as they come back."""

    def __init__(self, loop: asyncio.AbstractEventLoop, base: int, n: int) -> None:
        self.base = base
        self.n = n
        self.seen = np.zeros(n, dtype=bool)
        self.pieces: list[tuple[np.ndarray, Columns]] = []
        self.errors: dict[int, str] = {}
        self.remaining = n
        self.finished: asyncio.Future[None] = loop.create_future()

    def _new(self, index: np.ndarray) -> np.ndarray:
        """Which of these rows are heard of for the first time (a repeat is dropped)."""
        fresh: np.ndarray = ~self.seen[index]
        self.seen[index] = True
        self.remaining -= int(fresh.sum())
        if self.remaining == 0 and not self.finished.done():
            self.finished.set_result(None)
        return fresh

    def results(self, index: np.ndarray, chunk: Columns) -> None:
        fresh = self._new(index)
        if fresh.all():
            self.pieces.append((index, chunk))
        elif fresh.any():
            self.pieces.append((index[fresh], take(chunk, fresh)))

    def failures(self, index: np.ndarray, messages: list[str]) -> None:
        fresh = self._new(index)
        for i, message, new in zip(index.tolist(), messages, fresh.tolist(), strict=True):
            if new:
                self.errors[i] = message

    def fail_all(self, message: str) -> None:
        left = np.flatnonzero(~self.seen)
        self.failures(left, [message] * len(left))

    def result(self) -> RunResult:
        columns, metrics = split_metrics(scatter(self.pieces, self.n)[0])
        return RunResult(self.n, columns, self.errors, metrics)

    def done_prefix(self) -> int:
        """How many rows from the first have all come back: where a stopped run ends."""
        pending = np.flatnonzero(~self.seen)
        return int(pending[0]) if len(pending) else self.n

    def prefix_result(self, rows: int) -> RunResult:
        """The result of the first `rows` rows (all of which have come back)."""
        pieces = []
        for index, chunk in self.pieces:
            keep = index < rows
            if keep.all():
                pieces.append((index, chunk))
            elif keep.any():
                pieces.append((index[keep], take(chunk, keep)))
        columns, metrics = split_metrics(scatter(pieces, rows)[0])
        errors = {i: m for i, m in self.errors.items() if i < rows}
        return RunResult(rows, columns, errors, metrics)


class RowsBack:
    """How many rows of one run have come back from the first on, read when called (0 before
    the run starts): an attempt's progress within a chunk."""

    def __init__(self) -> None:
        self.run: _Run | None = None

    def __call__(self) -> int:
        return self.run.done_prefix() if self.run is not None else 0


class Pipeline:
    """The asyncio side: `run(rows)` returns every row's result, in order.

    `start` raises PipelineSetupError when the pipeline cannot start; once it has, `run`
    raises PipelineBroken if it stops working (see ebb.worker.pipeline.config)."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self._router: Router | None = None
        self._runs: dict[int, _Run] = {}
        """The runs under way, by their first uid."""
        self._next_uid = 0
        self._inflight = 0
        self._limit = config.inflight_limit()
        self._space = asyncio.Event()
        self._space.set()
        self._ready = asyncio.Event()
        self._fatal: PipelineError | None = None

    @property
    def failed(self) -> str:
        """Why the pipeline cannot serve rows; empty while it can."""
        return str(self._fatal) if self._fatal is not None else ""

    def _raise_if_failed(self) -> None:
        if self._fatal is not None:
            # A fresh exception for each caller: several runs may be told at once.
            raise type(self._fatal)(str(self._fatal))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def threadsafe(fn: Callable[..., None]) -> Callable[..., None]:
            def call(*args: Any) -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(fn, *args)

            return call

        self._router = Router(
            self.config,
            on_results=threadsafe(self._on_results),
            on_errors=threadsafe(self._on_errors),
            on_ready=threadsafe(self._ready.set),
            on_fatal=threadsafe(self._on_fatal),
        )
        self._router.start()
        try:
            await asyncio.wait_for(self._ready.wait(), self.config.start_timeout_s)
        except TimeoutError:
            raise PipelineSetupError(
                f"stages not ready after {self.config.start_timeout_s:g}s"
            ) from None
        self._raise_if_failed()

    async def run(self, rows: Sequence[Any] | pa.Table | Columns) -> list[Outcome]:
        """One Outcome per row, in order (the per-row view of `run_columns`)."""
        return (await self.run_columns(rows)).outcomes()

    async def run_columns(
        self,
        rows: Sequence[Any] | pa.Table | Columns,
        *,
        stop: asyncio.Event | None = None,
        rows_back: RowsBack | None = None,
    ) -> RunResult:
        """Every row's result, in order: rows given as an Arrow table (the fast path: it
        travels as Arrow, and becomes columns in the first stage's processes), a chunk of
        columns, or per-row values.

        `stop`: once it is set, the run ends with the rows that have come back from the first
        on (its `rows` then fewer than were given: a batch boundary, as batches mostly come
        back in order); the rest are not computed. How an attempt that must stop keeps the
        work it has done. `rows_back`: set to tell how far this run has got."""
        self._raise_if_failed()
        router = self._router
        assert router is not None, "start() the pipeline first"
        chunks: Iterator[tuple[int, pa.RecordBatch | Columns, int]]
        if isinstance(rows, pa.Table):
            n = rows.num_rows
            chunks = _table_chunks(rows, self.config.frame_size())
        else:
            columns = rows if isinstance(rows, dict) else from_rows(list(rows))
            n = num_rows(columns) if rows else 0
            chunks = _column_chunks(columns, n, self.config.frame_size())
        base = self._next_uid
        self._next_uid += n
        run = _Run(asyncio.get_running_loop(), base, n)
        self._runs[base] = run
        if rows_back is not None:
            rows_back.run = run
        try:
            for start, chunk, size in chunks:
                while self._inflight and self._inflight + size > self._limit:
                    self._raise_if_failed()  # no room will ever come back
                    self._space.clear()
                    if stop is None:
                        await self._space.wait()
                    else:
                        await until(self._space.wait(), stop)
                    if stop is not None and stop.is_set():
                        break
                if stop is not None and stop.is_set():
                    break
                self._raise_if_failed()
                self._inflight += size
                router.submit(base + start, chunk, size)
            router.flush()
            if n and stop is not None:
                await until(asyncio.shield(run.finished), stop)
            elif n:
                await run.finished
            self._raise_if_failed()
            if run.remaining:
                return run.prefix_result(run.done_prefix())
            return run.result()
        finally:
            del self._runs[base]
            if run.remaining and self._fatal is None and self._router is router:
                # Abandoned (cancelled) before its end: its rows that have not reached a
                # process yet need not be computed, nor hold room in front of the next run.
                router.cancel(base, n)

    def _by_run(self, uids: np.ndarray) -> Iterator[tuple[_Run, np.ndarray | None]]:
        """The runs these uids belong to, each with a mask of its uids (None: all of them).
        Uids of a run no longer awaited (cancelled: a lost lease, a drain) are dropped."""
        if not self._runs or not len(uids):
            return
        bases = np.fromiter(self._runs, dtype=np.int64, count=len(self._runs))
        bases.sort()
        at = np.searchsorted(bases, uids, side="right") - 1
        first = int(at[0])
        if first >= 0 and (at == first).all():
            run = self._runs[int(bases[first])]
            if int(uids.max()) < run.base + run.n:
                yield run, None
                return
        for k in np.unique(at[at >= 0]).tolist():
            run = self._runs[int(bases[k])]
            mask = (at == k) & (uids < run.base + run.n)
            if mask.any():
                yield run, mask

    def _on_results(self, uids: np.ndarray, chunk: Columns) -> None:
        for run, mask in self._by_run(uids):
            if mask is None:
                run.results(uids - run.base, chunk)
            else:
                run.results(uids[mask] - run.base, take(chunk, mask))
        self._returned(len(uids))

    def _on_errors(self, uids: np.ndarray, messages: list[str]) -> None:
        for run, mask in self._by_run(uids):
            if mask is None:
                run.failures(uids - run.base, messages)
            else:
                kept = [m for m, keep in zip(messages, mask.tolist(), strict=True) if keep]
                run.failures(uids[mask] - run.base, kept)
        self._returned(len(uids))

    def _returned(self, n: int) -> None:
        self._inflight = max(0, self._inflight - n)
        if self._inflight + self.config.frame_size() <= self._limit:
            self._space.set()

    def _on_fatal(self, error: PipelineError) -> None:
        self._fatal = error
        self._ready.set()
        self._space.set()
        # Wake every waiter; each `run` sees `_fatal` and raises.
        for run in list(self._runs.values()):
            run.fail_all(str(error))

    def depths(self) -> list[int]:
        return self._router.depths() if self._router else []

    async def stop(self, *, grace_s: float = 10.0) -> None:
        router, self._router = self._router, None
        if router is not None:
            await asyncio.to_thread(router.stop, grace_s)


def _table_chunks(table: pa.Table, size: int) -> Iterator[tuple[int, pa.RecordBatch, int]]:
    start = 0
    for batch in table.to_batches(max_chunksize=size):
        if batch.num_rows:
            yield start, batch, batch.num_rows
            start += batch.num_rows


def _column_chunks(columns: Columns, n: int, size: int) -> Iterator[tuple[int, Columns, int]]:
    for start in range(0, n, size):
        chunk = take(columns, slice(start, start + size))
        yield start, chunk, num_rows(chunk)
