"""The worker: lease a shard, read it, run it through the pipeline, write, commit, repeat.

Agents (tasks of one supervisor):
- leaser:  leases shards and runs each in its own task, up to `shards_in_flight` at once, so
           the next shard is leased and read while the current one computes (prefetch).
- renewer: renews every held lease at about a third of its period; a lease the master
           refuses (expired, superseded, job over) is lost, and its shard's task is cancelled
           (leases.py).

SIGTERM drains in stages: stop leasing; let shards in flight finish within the grace period;
release (retryable) whatever is still unfinished; stop the stage processes; exit 0.

The stage processes start (models load) while the first shard is leased and read. Once they
are ready, every lease and renew request says so (the master learns the job's pipeline can
start somewhere). A pipeline that cannot start here, or that breaks later, is no shard's fault:
its shards go back retryable, and the worker drains and exits EXIT_SETUP (cannot start here)
or EXIT_FAILED (broke), with the reason as its termination message, shards held or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import random
import re
import socket
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import nats.errors
import numpy as np
import pyarrow as pa
from nats.aio.client import Client as NATS

from ebb.common import auth, bus, failpoints
from ebb.common import metrics as metrics_server
from ebb.common.aio import sleep_or_stop, until
from ebb.common.api import MasterClient
from ebb.common.bus import NatsConfig
from ebb.common.errors import BusError, ErrorCode, RemoteError
from ebb.common.messages import TERMINAL_JOB_STATES, LeaseReply
from ebb.common.output import CommitRecord, OutputFile, OutputStore, new_commit
from ebb.common.runner import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_SETUP
from ebb.common.spec import JobSpec, parse_job
from ebb.common.subjects import check_worker_id
from ebb.common.supervisor import Supervisor

from . import cpus, devices, metrics
from .columns import scatter
from .elastic import DeviceMonitor
from .leases import ActiveLease, LeaseKeeper, LeaseState
from .pipeline import Pipeline, PipelineConfig, PipelineError, PipelineSetupError, RunResult
from .reader import CHUNK_ROWS, ShardData, ShardReader
from .writer import build_output, write_attempt

log = logging.getLogger(__name__)


def _output(
    data: ShardData, good: np.ndarray, result: RunResult, spec: JobSpec
) -> tuple[pa.Table, int]:
    """The shard's output table: the pipeline's results (for the rows that went in, `good`)
    put back among the shard's rows, and the rows that could not be read as errors."""
    n = data.table.num_rows
    results, errors = result.columns, dict(result.errors)
    if len(good) != n:
        errors = {int(good[i]): why for i, why in errors.items()}
        errors.update(data.bad_rows)
        results, _ = scatter([(good, results)], n) if results else ({}, None)
    return build_output(data.table, results, errors, spec.output)


def _inputs(data: ShardData, spec: JobSpec | None) -> tuple[pa.Table, np.ndarray]:
    """A chunk's rows as the pipeline takes them (its input columns, the rows that could be
    read), and the positions of those rows in the chunk."""
    assert spec is not None
    inputs = data.table
    if spec.input.columns is not None:
        inputs = inputs.select(spec.input.columns)
    good = np.arange(data.table.num_rows, dtype=np.int64)
    if data.bad_rows:
        good = good[~np.isin(good, np.fromiter(data.bad_rows, dtype=np.int64))]
        inputs = inputs.take(pa.array(good, type=pa.int64()))
    return inputs, good


_CHUNKS_IN_FLIGHT = 2
"""Chunks of a shard in the pipeline at once (`Worker._computed`)."""


def default_worker_id() -> str:
    # One subject token: a host name's dots (and anything else) become dashes.
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()).strip("-_") or "worker"
    return f"{host[:100]}-{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    nats: NatsConfig = field(default_factory=NatsConfig)
    job: str
    id: str = field(default_factory=default_worker_id)
    shards_in_flight: int = 2
    """Shards held at once: one computing while the next is leased and read."""
    chunk_rows: int = CHUNK_ROWS
    """Rows of a shard read (and in the pipeline) at once: a shard of any size, a Parquet row
    group of a million rows, say, goes through in chunks, its memory bounded."""
    start_jitter_s: float = 0.0
    """Before the first lease, wait a random time up to this: a fleet started at once does not
    hit the store (and the master) in one burst."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM, time for shards in flight to finish before they are released."""
    stage_stop_grace_s: float = 10.0
    release_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check_worker_id(self.id)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.supervisor = Supervisor("worker", cancel_timeout_s=config.shutdown_grace_s + 10)
        self.draining = asyncio.Event()
        self.exit_code = EXIT_OK
        self.fatal_reason = ""
        """Why the worker gave up on this job (with a non-zero exit_code): its termination
        message."""
        self.spec: JobSpec | None = None
        self.pipeline: Pipeline | None = None
        self.pipeline_ready = False
        """The stage processes have started: lease and renew requests say so."""
        self._pipeline_started: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.shards_done = 0
        self.cores = 1.0
        """The cores this worker may use (cpus.py)."""
        self.gpus: tuple[str, ...] | None = None
        """The GPUs it may use (devices.py; None: nothing says)."""

    def request_drain(self) -> None:
        """Stop leasing and wind down gracefully (SIGTERM)."""
        if not self.draining.is_set():
            log.info("draining: no new shards; finishing those in flight")
        self.draining.set()

    async def run(self) -> int:
        try:
            # Replies come to an inbox of this worker's own: with a credential of its own
            # (ebb.common.auth), no other worker may listen there.
            own_inbox = auth.worker_inbox(self.config.nats.prefix, self.config.id)
            nc = await bus.connect(
                dataclasses.replace(self.config.nats, inbox_prefix=own_inbox),
                name=f"ebb-worker-{self.config.id}",
                stop=self.draining,
            )
        except bus.ConnectAborted as e:
            log.info("%s", e)
            return EXIT_OK
        metrics_server.set_readiness(
            lambda: (nc.is_connected, "connected" if nc.is_connected else "NATS not connected")
        )
        try:
            return await self._run(nc)
        finally:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await nc.drain()

    async def _run(self, nc: NATS) -> int:
        self.master = MasterClient(nc, self.config.nats)
        self.keeper = LeaseKeeper(
            self.master, worker=self.config.id, ready=lambda: self.pipeline_ready
        )
        try:
            status = await self.master.job(self.config.job, include_spec=True)
        except RemoteError as e:
            log.error("job %s: %s", self.config.job, e)
            return EXIT_CONFIG
        if status.state in TERMINAL_JOB_STATES or status.spec is None:
            log.info("job %s is %s: nothing to do", status.id, status.state)
            return EXIT_OK
        self.spec = spec = parse_job(status.spec)
        memory = spec.fault.worker_memory_gb
        self.cores = cores = cpus.detect()
        self.gpus = gpus = devices.visible()
        try:
            stages = devices.spread(spec.pipeline.stages, gpus)
        except ValueError as e:
            # Not this job's fault everywhere: a node with the GPUs may run it.
            log.error("job %s: %s", spec.id, e)
            self.fatal_reason = f"pipeline cannot start: {e}"
            return EXIT_SETUP
        log.info(
            "%g cores for this worker%s",
            cores,
            f", GPUs {','.join(gpus)}" if gpus else "" if gpus is None else ", no GPU",
        )
        self.pipeline = Pipeline(
            PipelineConfig(
                stages=stages,
                code_paths=spec.pipeline.code_paths,
                batch_timeout_s=spec.fault.batch_timeout_s,
                memory_limit_bytes=int(memory * 2**30) if memory else None,
                cpus=cores,
                gpus=gpus,
            )
        )
        # Stage processes start (models load) while the first shard is leased and read.
        self._pipeline_started = asyncio.create_task(self._start_pipeline(), name="pipeline-start")
        self._pipeline_started.add_done_callback(self._pipeline_start_ended)
        log.info("worker %s on job %s", self.config.id, spec.id)
        try:
            async with self.supervisor as sup:
                sup.spawn("leaser", self.leaser())
                sup.spawn("renewer", self.keeper.renewer())
                sup.spawn("gauges", self.gauges())
                await sup.wait()
        finally:
            if not self._pipeline_started.done():
                self._pipeline_started.cancel()
            await asyncio.wait([self._pipeline_started])
            await self.pipeline.stop(grace_s=self.config.stage_stop_grace_s)
        log.info("worker %s exits after %d shards", self.config.id, self.shards_done)
        return self.exit_code

    async def _start_pipeline(self) -> None:
        assert self.pipeline is not None
        started = time.perf_counter()
        await self.pipeline.start()
        log.debug("stage processes ready in %.2fs", time.perf_counter() - started)
        self.pipeline_ready = True
        # Tell the master now, not at the next renewal, which a long first shard may put
        # off for a third of a lease.
        self.keeper.renew_soon()

    def _pipeline_start_ended(self, task: asyncio.Task[None]) -> None:
        """A failed start stops the worker whether or not a shard waits for the pipeline
        (the master may have none to give, or only `wait`): it must say so, and promptly.
        Looking at the exception here also retrieves it, once and for all."""
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self._give_up(error)

    def _give_up(self, error: BaseException) -> None:
        """The pipeline cannot serve here: drain, and exit saying why (the first cause)."""
        if self.fatal_reason:
            return
        if isinstance(error, PipelineSetupError):
            # Maybe this node's fault (a GPU, a disk), maybe the job's: the controller
            # tells, from how the job's other workers fare.
            self.exit_code = EXIT_SETUP
            self.fatal_reason = f"pipeline cannot start: {error}"
        else:
            self.exit_code = EXIT_FAILED
            self.fatal_reason = f"pipeline failed: {type(error).__name__}: {error}"
        log.error("%s", self.fatal_reason)
        self.request_drain()

    # -- leasing ---------------------------------------------------------------------------

    async def leaser(self) -> None:
        assert self.spec is not None
        slots = asyncio.Semaphore(self.config.shards_in_flight)
        loop = asyncio.get_running_loop()
        if self.config.start_jitter_s > 0:
            pause = random.uniform(0, self.config.start_jitter_s)  # noqa: S311
            await sleep_or_stop(pause, self.draining)
        try:
            while not self.draining.is_set():
                if not await until(slots.acquire(), self.draining):
                    break
                if self.draining.is_set():
                    slots.release()
                    break
                sent_at = loop.time()
                try:
                    reply = await self._lease()
                except RemoteError as e:
                    slots.release()
                    if e.code == ErrorCode.NOT_FOUND:
                        log.error("job %s is unknown to the master: stopping", self.spec.id)
                        break
                    log.warning("lease refused (%s); retrying", e)
                    await sleep_or_stop(self.master.backoff.delay(0) * 5, self.draining)
                    continue
                if reply is None or reply.status == "end":
                    slots.release()
                    break
                if reply.status == "wait":
                    slots.release()
                    pause = reply.retry_after_s * random.uniform(0.8, 1.2)  # noqa: S311
                    await sleep_or_stop(pause, self.draining)
                    continue
                task = asyncio.create_task(
                    self._work(reply, sent_at),
                    name=f"shard-{reply.shard.index if reply.shard else '?'}",
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(lambda _: slots.release())
            await self._finish_in_flight()
        finally:
            for task in self._tasks:
                task.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks)
        self.supervisor.request_stop()

    async def _lease(self) -> LeaseReply | None:
        """Ask for a shard. If draining starts while the request is out, the master may have
        granted one already: wait (briefly) for the answer and hand such a shard straight
        back, instead of leaving a lease nobody holds to expire and count as a failure."""
        assert self.spec is not None
        request = asyncio.ensure_future(
            self.master.lease(self.spec.id, self.config.id, ready=self.pipeline_ready)
        )
        reply = await until(asyncio.shield(request), self.draining)
        if reply is not None:
            return reply
        try:
            late = await asyncio.wait_for(request, self.config.release_timeout_s)
        except (TimeoutError, RemoteError, BusError):
            return None
        if late.status == "granted" and late.shard is not None:
            await self._release_token(
                late.token, late.shard.index, reason="worker draining", retryable=True
            )
        return None

    async def _finish_in_flight(self) -> None:
        if not self._tasks:
            return
        if self.draining.is_set():
            _, pending = await asyncio.wait(self._tasks, timeout=self.config.shutdown_grace_s)
            for task in pending:
                log.info("grace period over: releasing %s", task.get_name())
                task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def _work(self, reply: LeaseReply, sent_at: float) -> None:
        active = self.keeper.hold(reply, sent_at=sent_at, task=asyncio.current_task())
        index = active.shard.index
        started = time.perf_counter()
        try:
            await self._process(active)
            metrics.SHARDS.labels("done").inc()
            metrics.SHARD_SECONDS.observe(time.perf_counter() - started)
            self.shards_done += 1
        except asyncio.CancelledError:
            if active.state is LeaseState.LOST:
                # We cancelled ourselves because the lease is gone: not an error, not a stop.
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                log.warning(
                    "shard %d: lease lost (%s); abandoning attempt %d",
                    index,
                    active.lost_reason,
                    active.attempt,
                )
                metrics.SHARDS.labels("lost").inc()
                return
            await self._release(active, "worker shutting down", retryable=True)
            metrics.SHARDS.labels("released").inc()
            raise
        except PipelineError as e:
            # Every shard would fail the same way here, and none by its own fault: stop, and
            # hand this one back unharmed.
            self._give_up(e)
            await self._release(active, f"worker's pipeline failed: {e}", retryable=True)
            metrics.SHARDS.labels("released").inc()
        except Exception as e:
            log.exception("shard %d attempt %d failed", index, active.attempt)
            # Past the commit record the shard is done whatever happens here: hand it back
            # unharmed, and the master takes the record as the shard's output.
            reason = f"{type(e).__name__}: {e}"
            await self._release(active, reason, retryable=active.committed)
            metrics.SHARDS.labels("failed").inc()
        finally:
            self.keeper.drop(active)

    async def _process(self, active: ActiveLease) -> None:
        spec = self.spec
        assert spec is not None and self.pipeline is not None and self._pipeline_started
        shard = active.shard
        store = OutputStore(spec.output.uri)
        existing = await asyncio.to_thread(store.read_commit, shard.index)
        if existing is not None and existing.job == spec.id:
            log.info(
                "shard %d: attempt %d committed before; reporting it", shard.index, existing.attempt
            )
            await self._commit(active, existing)
            return
        columns = None
        if spec.input.columns is not None:
            columns = list(dict.fromkeys([*spec.input.columns, *spec.output.carryover]))
        reader = ShardReader(
            shard,
            columns,
            column_types=spec.input.column_types,
            newlines_in_values=spec.input.newlines_in_values,
            chunk_rows=self.config.chunk_rows,
        )
        started = time.perf_counter()
        files: list[OutputFile] = []
        rows = error_rows = 0
        try:
            # Closed on the way out whatever happens here, not when it is collected: its
            # runs still under way must end with this attempt.
            async with contextlib.aclosing(self._computed(reader)) as computed:
                async for data, good, result in computed:
                    table, errors = await asyncio.to_thread(_output, data, good, result, spec)
                    files += await asyncio.to_thread(
                        write_attempt,
                        store,
                        table,
                        shard=shard.index,
                        attempt=active.attempt,
                        error_rows=errors,
                        fmt=spec.output.format,
                        max_rows_per_file=spec.output.max_rows_per_file,
                        first_part=len(files),
                    )
                    rows += table.num_rows
                    error_rows += errors
        finally:
            reader.close()
        record = new_commit(
            job=spec.id,
            shard=shard.index,
            attempt=active.attempt,
            files=files,
            worker=self.config.id,
        )
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
        await self._commit(active, record)

    async def _computed(
        self, reader: ShardReader
    ) -> AsyncGenerator[tuple[ShardData, np.ndarray, RunResult], None]:
        """Each chunk of the shard with its results, in order. Two chunks are in the pipeline
        at once, the next read while they compute: the pipeline never runs dry between
        chunks, and the shard's memory is a few chunks whatever its size."""
        assert self.pipeline is not None and self._pipeline_started is not None
        window: deque[tuple[ShardData, np.ndarray, asyncio.Task[RunResult]]] = deque()
        try:
            while (data := await asyncio.to_thread(reader.next)) is not None:
                inputs, good = _inputs(data, self.spec)
                await asyncio.shield(self._pipeline_started)
                # The rows travel as Arrow and become columns in the first stage's processes.
                window.append((data, good, asyncio.create_task(self.pipeline.run_columns(inputs))))
                if len(window) >= _CHUNKS_IN_FLIGHT:
                    done, good_rows, run = window.popleft()
                    yield done, good_rows, await run
            while window:
                done, good_rows, run = window.popleft()
                yield done, good_rows, await run
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

    async def _commit(self, active: ActiveLease, record: CommitRecord) -> None:
        """Report the commit record to the master, retrying through master restarts and
        store hiccups. The record already decides the shard's output; this only tells."""
        active.mark_committed()
        attempt = 0
        while True:
            try:
                reply = await self.master.commit(
                    active.token,
                    worker=self.config.id,
                    rows=record.rows,
                    error_rows=record.error_rows,
                )
                break
            except RemoteError as e:
                if e.lease_lost:
                    # The record stands: whoever holds the shard now will find and report it.
                    log.info("shard %d: commit refused (%s)", active.shard.index, e)
                    return
                if not e.retryable:
                    raise
                delay = self.master.backoff.delay(attempt)
                log.warning(
                    "shard %d: commit not taken (%s); retrying in %.1fs",
                    active.shard.index,
                    e,
                    delay,
                )
                attempt += 1
                await asyncio.sleep(delay)
        log.info(
            "shard %d attempt %d %s: %d rows, %d errors",
            active.shard.index,
            active.attempt,
            reply.status,
            record.rows,
            record.error_rows,
        )

    async def _release(self, active: ActiveLease, reason: str, *, retryable: bool) -> None:
        active.release()
        await self._release_token(
            active.token, active.shard.index, reason=reason, retryable=retryable
        )

    async def _release_token(self, token: str, shard: int, *, reason: str, retryable: bool) -> None:
        """Hand a shard back. Shielded and bounded: it must happen even while we are being
        cancelled, and must not hold up a shutdown if the master is unreachable."""

        async def release() -> None:
            try:
                await asyncio.wait_for(
                    self.master.release(token, reason, worker=self.config.id, retryable=retryable),
                    self.config.release_timeout_s,
                )
            except (RemoteError, BusError, TimeoutError) as e:
                log.info("release of shard %d not confirmed (%s); its lease will expire", shard, e)

        await asyncio.shield(release())

    async def gauges(self) -> None:
        """Publish the pipeline's queue depths and its devices' utilisation (sampled)."""
        assert self.spec is not None and self.pipeline is not None
        stages = self.spec.pipeline.stages
        names = [s.name for s in stages]
        used = sorted({"cpu", *(s.device for s in stages)})
        if self.gpus and any(d.startswith("cuda") for d in used):
            used = ["cpu", *(f"cuda:{i}" for i in range(len(self.gpus)))]
        # NVML's start-up can take a while.
        monitor = await asyncio.to_thread(
            functools.partial(DeviceMonitor, cores=self.cores, gpus=self.gpus)
        )
        while True:
            for name, depth in zip(names, self.pipeline.depths(), strict=False):
                metrics.QUEUE_DEPTH.labels(name).set(depth)
            metrics.LEASES_HELD.set(len(self.keeper.leases))
            monitor.sample(time.monotonic())
            for device in used:
                metrics.DEVICE_UTILIZATION.labels(device).set(monitor.busy(device))
            await asyncio.sleep(1.0)
