"""One attempt at a shard: read it, run it through the pipeline, write its output, commit.

`run_attempt` knows nothing of the master or of NATS: it ends with the shard's commit record,
which decides the shard's output, and leaves telling the master to its caller.

An attempt told to stop (`stop`: its worker must go, or the master wants the rest of the shard
run elsewhere) keeps what it has done: it reads no further, takes the rows that have come
back from the pipeline from the first on, writes them, and commits them as a part of the shard
(`CommitRecord.split_at`); the master makes the rest a shard of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator
from typing import Protocol

import numpy as np
import pyarrow as pa

from ebb.common import failpoints
from ebb.common.data.layout import CommitRecord, OutputFile, most_common_errors
from ebb.common.data.output import OutputStore, new_commit
from ebb.common.job import JobSpec, accumulators
from ebb.common.messaging.messages import ShardSpec

from . import metrics
from .chunks.columns import scatter, take_rows
from .llm.provenance import generation_records
from .pipeline.front import RowsBack, RunResult
from .progress import AttemptProgress
from .shardio import handoff
from .shardio.handoff import WHOLE_JOB, TierEnds
from .shardio.reader import CHUNK_ROWS, KeptReads, ShardData, ShardReader
from .shardio.writer import build_output, write_attempt

log = logging.getLogger(__name__)

_CHUNKS_IN_FLIGHT = 2
"""Chunks of a shard in the pipeline at once (`_computed`)."""
_MESSAGES_KEPT = 1_000
"""Distinct row errors an attempt counts at most: past it only the most common half stay
(rows that each fail their own way, `cannot score row 17`, would otherwise be a message a
row)."""


class Runner(Protocol):
    """What runs a shard's rows: a started `Pipeline`, or one that waits for its start.
    Once `stop` is set, a run ends with the rows that have come back from the first on."""

    async def run_columns(
        self,
        rows: pa.Table,
        *,
        stop: asyncio.Event | None = None,
        rows_back: RowsBack | None = None,
    ) -> RunResult: ...


class AttemptStopped(Exception):
    """The attempt was told to stop before any row of it was done: nothing to commit."""


class RepeatedMistake(Exception):
    """Every row of the shard's first chunk failed alike, of a mistake in the spec or its
    code: every row of the job would repeat it (the worker fails the job rather than write
    it as that many error rows)."""


MISTAKE_MIN_ROWS = 8
"""A first chunk of fewer rows (a tiny shard) is never taken for a repeated mistake: too few
rows to tell one from bad data."""
_MISTAKE = re.compile(
    # A row error as the stage process words it: a modelet or model that raised one of the
    # errors a wrong column, key, type or shape raises (never a RuntimeError: a device's
    # fault words itself so, and it is the node's, not the spec's), or a metric that cannot
    # read its column. ONNX Runtime's InvalidArgument: an input the model refuses.
    r"stage '(?P<stage>[^']*)': (?:(?:TypeError|KeyError|ValueError|AttributeError|IndexError"
    r"|NameError|ImportError|ModuleNotFoundError|NotImplementedError|InvalidArgument): "
    r"|metric '(?P<metric>[^']*)': )"
)


def repeated_mistake(
    spec: JobSpec, errors: dict[int, str], rows: int, *, ends: TierEnds = WHOLE_JOB
) -> str:
    """What to tell of the error every one of a first chunk's `rows` failed with, if they
    all failed with one and it is a mistake's (a spec's or its code's, not the data's),
    naming the field of the job's spec to look at (in a tier's view, by the stage's place in
    the job: `ends.job_stages`); "" otherwise."""
    if rows < MISTAKE_MIN_ROWS or len(errors) < rows:
        return ""
    messages = set(errors.values())
    if len(messages) != 1:
        return ""
    (message,) = messages
    found = _MISTAKE.match(message)
    if found is None:
        return ""
    places = ends.job_stages or {s.name: i for i, s in enumerate(spec.pipeline.stages)}
    if found["stage"] not in places:
        return message
    field = f"pipeline.stages[{places[found['stage']]}]"
    if found["metric"]:
        field += f".metrics.{found['metric']}"
    return f"{message} (the spec's {field})"


async def run_attempt(
    spec: JobSpec,
    shard: ShardSpec,
    attempt: int,
    *,
    pipeline: Runner,
    store: OutputStore,
    worker_id: str,
    chunk_rows: int = CHUNK_ROWS,
    stop: asyncio.Event | None = None,
    progress: AttemptProgress | None = None,
    ends: TierEnds = WHOLE_JOB,
    kept_reads: KeptReads | None = None,
) -> CommitRecord:
    """Attempt `attempt` at `shard`, to its commit record: ours, or the record of whichever
    attempt of this job committed first (an earlier one found before anything ran, or one
    that won the race to create it: ours is then garbage).

    `stop`: once set, the attempt commits the rows done so far as a part of the shard (or
    raises AttemptStopped if there are none). `progress`: how far it has got, kept up to date
    for the renewals to tell. `ends`: where the rows of the worker's tier come from and go
    (ebb.worker.shardio.handoff): a tier before the last hands its rows on (`store` is the
    tier's root, and what is committed there is the next tier's input); a tier after the first
    reads the hand-off of the tier before, whose metric values it carries. Only the last tier
    reduces metrics, over the rows it writes, so that they count the job's output.
    `kept_reads`: the worker's reader kept open by its last part, taken if it reads on into
    this shard; this attempt's own is kept there if it commits a part."""
    if shard.is_handoff != ends.reads_handoff:
        raise ValueError(
            f"shard {shard.index} is {'a hand-off' if shard.is_handoff else 'input'}, "
            f"and this worker's tier reads {'hand-offs' if ends.reads_handoff else 'input'}"
        )
    existing = await asyncio.to_thread(store.read_commit, shard.index)
    if existing is not None and existing.job == spec.id:
        log.info(
            "shard %d: attempt %d committed before; reporting it", shard.index, existing.attempt
        )
        return existing
    columns = None
    if spec.input.columns is not None and not ends.reads_handoff:
        columns = list(dict.fromkeys([*spec.input.columns, *spec.output.carryover]))
    reader = ShardReader(
        shard,
        columns,
        column_types=spec.input.column_types,
        newlines_in_values=spec.input.newlines_in_values,
        chunk_rows=chunk_rows,
        kept=kept_reads.take(shard, columns) if kept_reads is not None else None,
    )
    started = time.perf_counter()
    files: list[OutputFile] = []
    rows = error_rows = rows_in = 0
    own_metrics = spec.pipeline.all_metrics()
    carried = ends.carried_metrics
    every_metric = {**carried, **own_metrics}
    partials: dict[str, accumulators.Partial] = {}
    error_counts: Counter[str] = Counter()
    try:
        # Closed on the way out whatever happens here, not when it is collected: its
        # runs still under way must end with this attempt.
        async with contextlib.aclosing(
            _computed(reader, pipeline, spec, ends, stop=stop, progress=progress)
        ) as computed:
            async for data, good, result in computed:
                if not rows_in and (
                    mistake := repeated_mistake(spec, result.errors, result.rows, ends=ends)
                ):
                    raise RepeatedMistake(
                        f"all {result.rows:,} rows of shard {shard.index}'s first chunk failed "
                        f"with {mistake}"
                    )
                values = _metric_values(own_metrics, ends, data, good, result)
                if every_metric and ends.reduces_metrics:
                    partials = accumulators.merge_named(
                        every_metric, partials, _partials(every_metric, values, good, result)
                    )
                table, errors, messages = await asyncio.to_thread(
                    _output,
                    data,
                    good,
                    result,
                    spec,
                    ends,
                    metric_values=values,
                )
                files += await asyncio.to_thread(
                    write_attempt,
                    store,
                    table,
                    shard=shard.index,
                    attempt=attempt,
                    error_rows=errors,
                    fmt="arrow" if ends.hands_on else spec.output.format,
                    max_rows_per_file=spec.output.max_rows_per_file,
                    first_part=len(files),
                )
                rows += table.num_rows
                error_rows += errors
                error_counts.update(messages)
                if len(error_counts) > _MESSAGES_KEPT:  # rows that each fail their own way
                    error_counts = Counter(dict(error_counts.most_common(_MESSAGES_KEPT // 2)))
                rows_in += data.table.num_rows
                if progress is not None:
                    progress.wrote(rows_in)
        whole = reader.exhausted and rows_in == reader.rows_read
        if not whole and rows_in and kept_reads is not None:
            # Its rest may come back to this worker (a half of it is kept for the holder):
            # read on from here rather than decode the row group again from its start.
            kept_reads.put(reader.keep_from(rows_in))
    finally:
        log.debug("shard %d: %d rows decoded", shard.index, reader.rows_decoded)
        reader.close()
    if not whole and not rows_in:
        raise AttemptStopped(f"shard {shard.index}: stopped before any row was done")
    generation = await asyncio.to_thread(generation_records, spec.pipeline.stages)
    record = new_commit(
        job=spec.id,
        shard=shard.index,
        attempt=attempt,
        files=files,
        worker=worker_id,
        split_at=0 if whole else rows_in,
        metrics=partials,
        generation=generation,
        row_errors=most_common_errors(error_counts),
    )
    failpoints.hit(failpoints.WORKER_BEFORE_COMMIT_RECORD, detail=str(shard.index))
    won, record = await asyncio.to_thread(store.create_commit, record)
    log.debug(
        "shard %d: %d rows read, computed and written in %.2fs",
        shard.index,
        rows,
        time.perf_counter() - started,
    )
    if not won:
        log.info(
            "shard %d: attempt %d committed first; ours is garbage", shard.index, record.attempt
        )
    metrics.ROWS.inc(rows)
    metrics.ERROR_ROWS.inc(error_rows)
    failpoints.hit(failpoints.WORKER_AFTER_COMMIT_RECORD, detail=str(shard.index))
    return record


async def _computed(
    reader: ShardReader,
    pipeline: Runner,
    spec: JobSpec,
    ends: TierEnds,
    *,
    stop: asyncio.Event | None = None,
    progress: AttemptProgress | None = None,
) -> AsyncGenerator[tuple[ShardData, np.ndarray, RunResult], None]:
    """Each chunk of the shard with its results, in order. Two chunks are in the pipeline
    at once, the next read while they compute: the pipeline never runs dry between
    chunks, and the shard's memory is a few chunks whatever its size.

    Once `stop` is set no chunk is read, and the last chunk given may be the first rows of
    one (those done when the stop came); nothing follows it."""
    window: deque[tuple[ShardData, np.ndarray, asyncio.Task[RunResult]]] = deque()
    try:
        while not (stop is not None and stop.is_set()):
            data = await asyncio.to_thread(reader.next)
            if data is None:
                break
            if ends.reads_handoff:
                data = handoff.read_handoff(data.table)
            inputs, good = _inputs(data, spec, ends)
            # The rows travel as Arrow and become columns in the first stage's processes.
            rows_back = RowsBack()
            if progress is not None:
                progress.computing.append(rows_back)
            computing = pipeline.run_columns(inputs, stop=stop, rows_back=rows_back)
            window.append((data, good, asyncio.create_task(computing)))
            if len(window) < _CHUNKS_IN_FLIGHT:
                continue
            done, good_rows, result = await _next_done(window)
            if result.rows < len(good_rows):
                if (part := _done_part(done, good_rows, result)) is not None:
                    yield part
                return
            yield done, good_rows, result
        while window:
            done, good_rows, result = await _next_done(window)
            if result.rows < len(good_rows):
                if (part := _done_part(done, good_rows, result)) is not None:
                    yield part
                return
            yield done, good_rows, result
    finally:
        # Cancelled (the lease lost, a drain) or failed: the runs still under way end
        # too, and their rows leave the pipeline (Pipeline.run_columns cancels them).
        for _, _, run in window:
            run.cancel()
        if window:
            await asyncio.wait([run for _, _, run in window])
            for _, _, run in window:
                if not run.cancelled():
                    run.exception()  # retrieved: the first failure is what we raise


async def _next_done(
    window: deque[tuple[ShardData, np.ndarray, asyncio.Task[RunResult]]],
) -> tuple[ShardData, np.ndarray, RunResult]:
    done, good, run = window.popleft()
    return done, good, await run


def _done_part(
    data: ShardData, good: np.ndarray, result: RunResult
) -> tuple[ShardData, np.ndarray, RunResult] | None:
    """The first rows of a chunk whose run stopped short: up to the first row that went in
    and did not come back (unreadable rows before it are error rows, done as they are).
    None if that is no row at all."""
    upto = int(good[result.rows])
    if upto == 0:
        return None
    bad = {i: why for i, why in data.bad_rows.items() if i < upto}
    return ShardData(data.table.slice(0, upto), bad), good[: result.rows], result


def _inputs(data: ShardData, spec: JobSpec, ends: TierEnds) -> tuple[pa.Table, np.ndarray]:
    """A chunk's rows as the pipeline takes them (its input columns, or a hand-off's
    results; the rows that could be read, or did not fail in a tier before), and the
    positions of those rows in the chunk."""
    inputs = data.table
    if ends.reads_handoff:
        inputs = handoff.pipeline_inputs(inputs)
    elif spec.input.columns is not None:
        inputs = inputs.select(spec.input.columns)
    good = np.arange(data.table.num_rows, dtype=np.int64)
    if data.bad_rows:
        good = good[~np.isin(good, np.fromiter(data.bad_rows, dtype=np.int64))]
        inputs = take_rows(inputs, good)
    return inputs, good


def _metric_values(
    own: dict[str, accumulators.MetricSpec],
    ends: TierEnds,
    data: ShardData,
    good: np.ndarray,
    result: RunResult,
) -> dict[str, np.ndarray]:
    """Every metric's values for each row of the chunk (NaN where a row did not go in): this
    tier's from the run, the tiers' before from the hand-off read."""
    n = data.table.num_rows
    went_in = good[: result.rows]
    carried = list(ends.carried_metrics)
    values = handoff.metric_values(data.table, carried) if ends.reads_handoff and carried else {}
    for name, spec in own.items():
        if name not in result.metrics:
            # No row of the chunk came through (every one an error row): no values at all.
            values[name] = np.full((n, 2) if spec.labelled else n, np.nan)
            continue
        got = np.asarray(result.metrics[name], dtype=np.float64)[: result.rows]
        full = np.full((n, *got.shape[1:]), np.nan)
        full[went_in] = got
        values[name] = full
    return values


def _partials(
    specs: dict[str, accumulators.MetricSpec],
    values: dict[str, np.ndarray],
    good: np.ndarray,
    result: RunResult,
) -> dict[str, accumulators.Partial]:
    """The metrics' partials over the rows of a run that came through (a failed row's values
    are not values, nor are those of a row that failed in a tier before): exactly the rows
    this attempt writes without error."""
    ok = np.ones(result.rows, dtype=bool)
    ok[np.fromiter(result.errors, dtype=np.int64, count=len(result.errors))] = False
    if not ok.any():
        return {}
    rows = good[: result.rows][ok]
    return accumulators.reduce_named(specs, {n: values[n][rows] for n in specs})


def _output(
    data: ShardData,
    good: np.ndarray,
    result: RunResult,
    spec: JobSpec,
    ends: TierEnds,
    *,
    metric_values: dict[str, np.ndarray],
) -> tuple[pa.Table, int, Counter[str]]:
    """The shard's output table: the pipeline's results (for the rows that went in, `good`)
    put back among the shard's rows, and the rows that could not be read as errors; its
    number of error rows, and its errors' messages counted. A tier that hands its rows on
    carries their `metric_values` to the next."""
    n = data.table.num_rows
    results, errors = result.columns, dict(result.errors)
    if len(good) != n:
        errors = {int(good[i]): why for i, why in errors.items()}
        errors.update(data.bad_rows)
        results, _ = scatter([(good, results)], n) if results else ({}, None)
    rows = handoff.carried(data.table) if ends.reads_handoff else data.table
    messages = Counter(errors.values())
    if ends.hands_on:
        metrics = handoff.metric_columns(metric_values)
        table, count = handoff.handoff_table(rows, results, errors, spec.output, metrics=metrics)
    else:
        table, count = build_output(rows, results, errors, spec.output)
    return table, count, messages
