"""The worker: lease a shard, read it, run it through the pipeline, write, commit, repeat.

Agents (tasks of one supervisor):
- leaser:  leases shards and runs each in its own task, up to `shards_in_flight` at once, so
           the next shard is leased and read while the current one computes (prefetch),
           once the models have loaded (before, it would only wait behind the first); more
           where shards are smaller than the pipeline's rows in flight (`shards_to_hold`).
           One shard's attempt is `attempt.run_attempt`; its commit is then reported here.
- renewer: renews every held lease at about a third of its period, telling the rows done;
           a lease the master refuses (expired, superseded, job over) is lost, and its
           shard's task is cancelled; a renewal answered with `split` stops the shard's
           attempt at its next batch, which commits what it has done (ebb.worker.leases).
- gauges:  the pipeline's queue depths and its devices' utilisation (ebb.worker.session).

SIGTERM drains in stages: stop leasing; let shards in flight finish within the grace period;
`split_reserve_s` before its end, stop those still computing and commit the rows each has
done as a part of its shard (the master queues the rest first); release (retryable) whatever
is still unfinished at its end; stop the stage processes; exit 0.

The stage processes start (models load) while the first shard is leased and read
(ebb.worker.session). A pipeline that cannot start here, or that breaks later, is no shard's fault:
its shards go back retryable, and the worker drains and exits EXIT_SETUP (cannot start here)
or EXIT_FAILED (broke), with the reason as its termination message, shards held or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import re
import socket
import time
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS

from ebb.common import metrics as metrics_server
from ebb.common.aio import sleep_or_stop, until
from ebb.common.data.output import OutputStore
from ebb.common.errors import BusError, ErrorCode, RemoteError, SpecError
from ebb.common.job import parse_job
from ebb.common.messaging import auth, bus
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.messages import TERMINAL_JOB_STATES, LeaseReply
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import check_worker_id
from ebb.common.runner import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_SETUP, GRACE_S
from ebb.common.supervisor import Supervisor

from . import metrics
from .attempt import AttemptStopped, RepeatedMistake, run_attempt
from .leases import LeaseState, StopCause
from .pipeline.front import Pipeline, PipelineError, PipelineSetupError
from .reports import Reports
from .resources import cpus, devices
from .session import JobSession, pipeline_config
from .shardio.handoff import tier_view
from .shardio.reader import CHUNK_ROWS

log = logging.getLogger(__name__)


def default_worker_id() -> str:
    # One subject token: a host name's dots (and anything else) become dashes.
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()).strip("-_") or "worker"
    return f"{host[:100]}-{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    nats: NatsConfig = field(default_factory=NatsConfig)
    job: str
    id: str = field(default_factory=default_worker_id)
    tier: str = ""
    """The tier of the job this worker runs (`JobSpec.tiers`); "" for a job without tiers."""
    shards_in_flight: int = 2
    """Shards held at once: one computing while the next is leased and read; more while
    shards this small leave the pipeline without rows (`shards_to_hold`). 1: no prefetch."""
    chunk_rows: int = CHUNK_ROWS
    """Rows of a shard read (and in the pipeline) at once: a shard of any size, a Parquet row
    group of a million rows, say, goes through in chunks, its memory bounded."""
    start_jitter_s: float = 0.0
    """Before the first lease, wait a random time up to this: a fleet started at once does not
    hit the store (and the master) in one burst."""
    shutdown_grace_s: float = GRACE_S
    """On SIGTERM, time for shards in flight to finish. A shard that has not finished
    `split_reserve_s` before its end stops and commits the rows it has done (a part of the
    shard; the master queues the rest first); one with none done is released."""
    split_reserve_s: float = 5.0
    """The end of the grace period kept for writing and committing parts (at most half of
    it): the drain asks shards still computing to stop this long before the grace runs out."""
    stage_stop_grace_s: float = 10.0
    release_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check_worker_id(self.id)


MOST_SHARDS = 4
"""Shards a worker holds at most: the planner sizes a job's shards four to a worker, so
holding more would take its fleet's share."""


def shards_to_hold(*, least: int, pipeline_rows: int, shard_rows: int) -> int:
    """Shards to hold at once: `least` (two: one computing, the next read ahead), or as many
    as fill the pipeline's rows in flight (`PipelineConfig.inflight_limit`) and one more
    where the job's shards are that small, up to MOST_SHARDS. An llm stage keeps its engine
    fed from the rows it holds: two shards of a 1,536-prompt job (384 rows each) left vLLM
    short of rows while their longest answers ran, each shard committing only with its last
    row. `least` 1 (no prefetch) stays 1."""
    if least < 2:
        return least
    filling = -(-pipeline_rows // max(1, shard_rows)) + 1
    return max(least, min(MOST_SHARDS, filling))


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.supervisor = Supervisor("worker", cancel_timeout_s=config.shutdown_grace_s + 10)
        self.draining = asyncio.Event()
        self.exit_code = EXIT_OK
        self.fatal_reason = ""
        """Why the worker gave up on this job (with a non-zero exit_code): its termination
        message."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.shards_done = 0
        self.reports = Reports(worker=config.id, timeout_s=config.release_timeout_s)

    def request_drain(self) -> None:
        """Stop leasing and wind down gracefully (SIGTERM)."""
        if not self.draining.is_set():
            log.info("draining: no new shards; finishing those in flight")
        self.draining.set()

    async def run(self) -> int:
        try:
            # Replies come to an inbox of this worker's own: with a credential of its own
            # (ebb.common.messaging.auth), no other worker may listen there.
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
        master = MasterClient(nc, self.config.nats)
        try:
            status = await master.job(self.config.job, include_spec=True)
        except RemoteError as e:
            log.error("job %s: %s", self.config.job, e)
            return EXIT_CONFIG
        if status.state in TERMINAL_JOB_STATES or status.spec is None:
            log.info("job %s is %s: nothing to do", status.id, status.state)
            return EXIT_OK
        try:
            job = parse_job(status.spec)
            spec, ends = tier_view(job, self.config.tier)
        except SpecError as e:
            log.error("job %s: %s", self.config.job, e)
            self.fatal_reason = str(e)
            return EXIT_CONFIG
        cores = cpus.detect()
        gpus = devices.visible()
        try:
            config = pipeline_config(spec, cores=cores, gpus=gpus)
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
        session = JobSession(
            spec=spec,
            pipeline=Pipeline(config),
            master=master,
            worker=self.config.id,
            cores=cores,
            gpus=gpus,
            on_failed_start=self._give_up,
            tier=self.config.tier,
            ends=ends,
        )
        log.info("worker %s on job %s", self.config.id, spec.id)
        try:
            async with self.supervisor as sup:
                sup.spawn("leaser", self.leaser(session))
                sup.spawn("renewer", session.leases.renewer())
                sup.spawn("gauges", session.gauges())
                await sup.wait()
        finally:
            await session.close(grace_s=self.config.stage_stop_grace_s)
        log.info("worker %s exits after %d shards", self.config.id, self.shards_done)
        return self.exit_code

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

    async def leaser(self, session: JobSession) -> None:
        held_at_most = self.config.shards_in_flight
        slots = asyncio.Semaphore(held_at_most)
        loop = asyncio.get_running_loop()
        if self.config.start_jitter_s > 0:
            pause = random.uniform(0, self.config.start_jitter_s)  # noqa: S311
            await sleep_or_stop(pause, self.draining)
        try:
            while not self.draining.is_set():
                if self._tasks and not session.ready:
                    # The next shard is leased once the models have loaded: leased before,
                    # it would only wait behind the first, and a worker of the job starting
                    # beside this one would find nothing left (a job of two shards on two
                    # workers ran on one).
                    await until(session.started(), self.draining)
                    if not session.ready:
                        break  # the start failed (the worker drains), or a drain began
                if not await until(slots.acquire(), self.draining):
                    break
                if self.draining.is_set():
                    slots.release()
                    break
                sent_at = loop.time()
                try:
                    reply = await self._lease(session)
                except RemoteError as e:
                    slots.release()
                    if e.code == ErrorCode.NOT_FOUND:
                        log.error("job %s is unknown to the master: stopping", session.spec.id)
                        break
                    log.warning("lease refused (%s); retrying", e)
                    await sleep_or_stop(session.master.backoff.delay(0) * 5, self.draining)
                    continue
                if reply is None or reply.status == "end":
                    slots.release()
                    break
                if reply.status == "wait":
                    slots.release()
                    pause = reply.retry_after_s * random.uniform(0.8, 1.2)  # noqa: S311
                    await sleep_or_stop(pause, self.draining)
                    continue
                if reply.shard is not None:
                    wanted = shards_to_hold(
                        least=self.config.shards_in_flight,
                        pipeline_rows=session.pipeline.config.inflight_limit(),
                        shard_rows=reply.shard.rows,
                    )
                    for _ in range(wanted - held_at_most):
                        slots.release()  # room for shards this small: more may be held
                    held_at_most = max(held_at_most, wanted)
                task = asyncio.create_task(
                    self._work(session, reply, sent_at),
                    name=f"shard-{reply.shard.index if reply.shard else '?'}",
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(lambda _: slots.release())
            await self._finish_in_flight(session)
        finally:
            for task in self._tasks:
                task.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks)
        self.supervisor.request_stop()

    async def _lease(self, session: JobSession) -> LeaseReply | None:
        """Ask for a shard. If draining starts while the request is out, the master may have
        granted one already: wait (briefly) for the answer and hand such a shard straight
        back, instead of leaving a lease nobody holds to expire and count as a failure."""
        request = asyncio.ensure_future(
            session.master.lease(
                session.spec.id, self.config.id, ready=session.ready, tier=session.tier
            )
        )
        reply = await until(asyncio.shield(request), self.draining)
        if reply is not None:
            return reply
        try:
            late = await asyncio.wait_for(request, self.config.release_timeout_s)
        except (TimeoutError, RemoteError, BusError):
            return None
        if late.status == "granted" and late.shard is not None:
            await self.reports.release_token(
                session.master,
                late.token,
                late.shard.index,
                reason="worker draining",
                retryable=True,
            )
        return None

    async def _finish_in_flight(self, session: JobSession) -> None:
        """Wait for the shards in flight. On a drain, within the grace period: those that
        cannot finish in it stop at their next batch and commit what they have done, and any
        still running at its end are released."""
        if not self._tasks:
            return
        if self.draining.is_set():
            grace = self.config.shutdown_grace_s
            reserve = min(self.config.split_reserve_s, grace / 2)
            _, pending = await asyncio.wait(self._tasks, timeout=grace - reserve)
            if pending:
                session.leases.split_all(StopCause.DRAIN)
                log.info("grace period ending: committing the rows done of %d shards", len(pending))
                _, pending = await asyncio.wait(pending, timeout=reserve)
            for task in pending:
                log.info("grace period over: releasing %s", task.get_name())
                task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def _work(self, session: JobSession, reply: LeaseReply, sent_at: float) -> None:
        active = session.leases.hold(reply, sent_at=sent_at, task=asyncio.current_task())
        index = active.shard.index
        started = time.perf_counter()
        try:
            record = await run_attempt(
                session.spec,
                active.shard,
                active.attempt,
                pipeline=session,
                store=OutputStore(session.spec.output.uri),
                worker_id=self.config.id,
                chunk_rows=self.config.chunk_rows,
                stop=active.stop,
                progress=active.progress,
                ends=session.ends,
                kept_reads=session.kept_reads,
            )
            await self.reports.commit(session.master, active, record)
            if record.split_at:
                metrics.SHARDS.labels("split").inc()
                cause = active.stop_cause or StopCause.DRAIN
                metrics.ROWS_KEPT.labels(cause.name.lower()).inc(record.split_at)
            else:
                metrics.SHARDS.labels("done").inc()
                metrics.SHARD_SECONDS.observe(time.perf_counter() - started)
            self.shards_done += 1
        except AttemptStopped:
            # Told to stop before a row was done: nothing to keep. Back unharmed.
            reason = (active.stop_cause or StopCause.DRAIN).value
            await self.reports.release(session.master, active, reason, retryable=True)
            metrics.SHARDS.labels("released").inc()
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
            await self.reports.release(
                session.master, active, "worker shutting down", retryable=True
            )
            metrics.SHARDS.labels("released").inc()
            raise
        except RepeatedMistake as e:
            # Every row of the job would fail so: the job fails now, not as its rows.
            log.error("shard %d: %s; the job fails", index, e)
            await self.reports.release(session.master, active, str(e), retryable=True, mistake=True)
            metrics.SHARDS.labels("failed").inc()
        except PipelineError as e:
            # Every shard would fail the same way here, and none by its own fault: stop, and
            # hand this one back unharmed.
            self._give_up(e)
            reason = f"worker's pipeline failed: {e}"
            await self.reports.release(session.master, active, reason, retryable=True)
            metrics.SHARDS.labels("released").inc()
        except Exception as e:
            log.exception("shard %d attempt %d failed", index, active.attempt)
            # Past the commit record the shard is done whatever happens here: hand it back
            # unharmed, and the master takes the record as the shard's output.
            reason = f"{type(e).__name__}: {e}"
            await self.reports.release(session.master, active, reason, retryable=active.committed)
            metrics.SHARDS.labels("failed").inc()
        finally:
            session.leases.drop(active)
