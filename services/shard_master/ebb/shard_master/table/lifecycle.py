"""How a job's state changes once it is in the table: it settles, ends, is resumed, and is
forgotten past its retention.

Every change of a job's state goes through `JobLifecycle.move`, which checks it against the
job transition map (`ebb.shard_master.table.transitions`), writes the record (compare-and-set), and
only then shows it in memory, as `ShardMoves.apply` does for shards.

Ending a job takes every lock of its shards, in index order (nothing else holds two): a
shard transition under way (a commit reading its record from the output, say) finishes
first, and every one after finds the job ended. An ended job holds no shards, and resuming
it gives it new ones: a transition that waited for the lock of a shard of the first run
finds, under that lock, that the shard is not the job's any more (`LeaseTable` checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

from ebb.common.data.layout import most_common_errors
from ebb.common.messaging.messages import TERMINAL_JOB_STATES, CancelReply, JobState, ResumeReply

from ..errors import Deposed, JobNotFound, NotResumable
from . import jobmetrics
from .context import TableContext
from .finish import failure_reason, write_manifest
from .jobs import Job, visible
from .moves import load_with_successors
from .records import JobRecord, ShardRecord
from .tracking import PENDING
from .transitions import check_job_transition, reopen

log = logging.getLogger(__name__)

_FINISH_TRIES = 5
FORGET_PER_PASS = 500
"""Jobs past their retention forgotten in one reaper pass at most..."""
FORGET_AT_ONCE = 32
"""...their purges this many jobs at a time (each job: two requests to NATS)."""


class JobLifecycle:
    def __init__(self, context: TableContext) -> None:
        self._context = context

    async def move(self, job: Job, record: JobRecord) -> None:
        """Move a job to its new record, in another state (caller holds what keeps the job
        from changing under it): the one place a job's state changes. The move is checked
        against the job transition map, written to KV (compare-and-set), and only then shown."""
        check_job_transition(job.state, record.state)
        job.revision = await self._context.store.update_job(record, last=job.revision)
        if record.state in TERMINAL_JOB_STATES:
            # Before the end shows (a client that sees it may stop this very master, as `ebb
            # run` stops its stack): the next job to name the root learns from it how this
            # one ended.
            await self._record_end_in_output(job, record)
        job.record = record
        self._context.publish_job_gauges()

    # -- outcomes --------------------------------------------------------------------------

    async def settle(self, job: Job) -> None:
        """Fail the job if errors crossed its threshold; finish it if every shard is settled.

        Level-triggered: safe to call any time, again and again (the reaper does, so that a
        finalisation interrupted by an I/O error is retried). Never raises but Deposed: a job
        that cannot be finished (its manifest cannot be written) fails after a few tries.
        """
        try:
            await self._settle(job)
            job.finish_failures = 0
        except Deposed:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to finish is retried, then fails the job
            job.finish_failures += 1
            log.warning("job %s: could not finish (try %d): %s", job.id, job.finish_failures, e)
            if job.finish_failures >= _FINISH_TRIES:
                try:
                    async with job.lock:
                        if job.state == "RUNNING":
                            await self.end(job, "FAILED", f"could not finish the job: {e}")
                except Deposed:
                    raise
                except Exception:
                    log.exception("job %s: could not record its failure either", job.id)

    async def _settle(self, job: Job) -> None:
        async with job.lock:
            if job.state != "RUNNING":
                return
            errors = job.error_rows + job.quarantined_rows
            budget = job.spec.fault.max_error_fraction * max(job.record.rows_total, 1)
            if errors > budget:
                await self.end(job, "FAILED", failure_reason(job, errors))
            elif job.settled:
                if job.counts["DONE"] == 0:
                    await self.end(job, "FAILED", failure_reason(job, errors))
                else:
                    await self._succeed(job)

    async def _succeed(self, job: Job) -> None:
        manifest = await write_manifest(
            job,
            self._context.open_output(job.spec.output.uri),
            created_at=self._context.wall_clock(),
        )
        await self.end(job, "SUCCEEDED", "", manifest=manifest)

    async def end(self, job: Job, state: JobState, reason: str, *, manifest: str = "") -> None:
        """Persist a terminal state (caller holds the job's lock), every shard lock held."""
        async with contextlib.AsyncExitStack() as held:
            for shard in list(job.shards):
                await held.enter_async_context(shard.lock)
            record = replace(
                job.record,
                state=state,
                reason=reason,
                finished_at=self._context.wall_clock(),
                shards_total=job.shards_total,
                shards_done=job.counts["DONE"],
                shards_quarantined=job.counts["QUARANTINED"],
                rows_done=job.rows_done,
                error_rows=job.error_rows,
                manifest=manifest,
                metrics=jobmetrics.results(job),
                row_errors=most_common_errors(job.errors),
                # In the same write as the SUCCEEDED: the run is due whatever happens next.
                mlflow_run=PENDING
                if state == "SUCCEEDED" and job.spec.tracking.mlflow_uri is not None
                else job.record.mlflow_run,
            )
            await self.move(job, record)
            log.info("job %s %s %s", job.id, state, reason)
            self._context.event(job, "state")
            job.release_shards()

    async def _record_end_in_output(self, job: Job, record: JobRecord) -> None:
        """Tell the job's output root how the job ended; if nothing is committed there, the
        job lets go of it. Best effort: a root that never hears of the end keeps its owner."""
        uri = job.spec.output.uri
        try:
            output = self._context.open_output(uri)
            owner = await asyncio.to_thread(
                output.record_end,
                job.id,
                state=record.state,
                shards_done=record.shards_done,
                shards_total=record.shards_total,
                rows_done=record.rows_done,
            )
        except (OSError, ValueError, ImportError) as e:  # a store's error, or a bad record
            log.warning("job %s: could not record its end in %s: %s", job.id, uri, e)
            return
        if owner is not None and owner.released:
            log.info("job %s committed nothing: %s is free for another job", job.id, uri)

    async def cancel(
        self, job_id: str, reason: str, *, state: JobState = "CANCELLED", owner: str | None = None
    ) -> CancelReply:
        """End a job that has not ended: CANCELLED (a user's wish) or FAILED (the controller
        found it cannot run). Its leases are void from now on. `owner`: the team asking,
        whose own jobs alone it finds (None: any job)."""
        job = self._context.find(job_id, owner=owner)
        async with job.lock:
            if not job.ended:
                await self.end(job, state, reason)
        return CancelReply(state=job.record.state)

    # -- a second run ----------------------------------------------------------------------

    async def resume(self, job_id: str, *, key: str = "", owner: str | None = None) -> ResumeReply:
        """Re-open a FAILED or CANCELLED job: its DONE shards stay done (their output is
        never redone); every other shard, QUARANTINED ones included, is queued again with
        its failures forgotten (a fresh max_attempts). The job is RUNNING once more.

        Every old lease stays void: its token is not among the reopened shards' leases, so a
        zombie of the first run is refused (StaleToken), and new attempts get numbers after
        every attempt made so far, so their files never mix with an old attempt's.

        Crash-safe in this order: the shard records first, the job's record last. A master
        that dies in between leaves the job FAILED or CANCELLED with some shards reopened,
        which a second `resume` completes.

        Idempotent under `key`: the job's record keeps the key of the request that resumed
        it, so a retry of that request (its reply lost, or the master replaced before it
        could answer) is told what happened instead of being refused as a running job's.

        `owner`: the team asking, which finds its own jobs alone; another's is not found, in
        the words of one never submitted (None: any job).
        """
        job = self._context.jobs.get(job_id)
        if job is None or not visible(job, owner):
            raise JobNotFound(
                f"no job {job_id!r} (never submitted here, or forgotten: a job that ended "
                "leaves the master job_retention_s after; its output is still there)"
            )
        async with job.lock:
            if self._context.jobs.get(job_id) is not job:
                raise JobNotFound(f"job {job_id!r} was forgotten (job_retention_s)")
            resumable = job.state in ("FAILED", "CANCELLED")
            if key and job.record.resume_key == key and not resumable:
                return self._resumed(job, repeated=True)
            if not resumable:
                raise NotResumable(
                    f"job {job_id} is {job.state}: only a FAILED or CANCELLED job can be resumed"
                )
            if job.record.shards_total == 0:
                raise NotResumable(
                    f"job {job_id} failed before its input was planned ({job.record.reason}): "
                    "nothing to resume; submit it again"
                )
            store = self._context.store
            entries = await load_with_successors(store, job)
            if len(entries) != job.record.shards_total:
                raise NotResumable(
                    f"job {job_id} has {len(entries)} shard records of "
                    f"{job.record.shards_total}: cannot resume it"
                )
            await self._reclaim_output(job)
            reopened: list[tuple[ShardRecord, int]] = []
            for (old, last), new in zip(entries, reopen([r for r, _ in entries]), strict=True):
                revision = last if new is old else await store.update_shard(new, last=last)
                reopened.append((new, revision))
            retried = sum(1 for old, _ in entries if old.state == "QUARANTINED")
            record = replace(
                job.record,
                state="RUNNING",
                reason="",
                finished_at=0.0,
                manifest="",
                shards_done=0,
                shards_quarantined=0,
                rows_done=0,
                error_rows=0,
                metrics={},
                resume_key=key,
            )
            await self.move(job, record)
            job.finish_failures = 0
            self._context.adopt_shards(job, reopened)
            log.info(
                "job %s resumed: %d shards done, %d quarantined ones retried, %d to run",
                job.id,
                job.counts["DONE"],
                retried,
                job.counts["TODO"],
            )
            self._context.event(job, "state")
        # Nothing may be left to run (a job cancelled as its last shard committed).
        await self.settle(job)
        return self._resumed(job, retried=retried)

    @staticmethod
    def _resumed(job: Job, *, retried: int = 0, repeated: bool = False) -> ResumeReply:
        return ResumeReply(
            state=job.record.state,
            shards_done=job.record.shards_done if job.ended else job.counts["DONE"],
            shards_retried=retried,
            shards_todo=0 if job.ended else job.counts["TODO"],
            repeated=repeated,
        )

    async def _reclaim_output(self, job: Job) -> None:
        """The job's output root is its own again for a resume, or NotResumable: a job that
        ended with nothing committed let go of it, and another may have taken it since."""
        output = self._context.open_output(job.spec.output.uri)
        owner = await asyncio.to_thread(output.reclaim, job.id)
        if owner is not None and owner.job != job.id:
            raise NotResumable(
                f"{job.spec.output.uri} belongs to job {owner.job} now (job {job.id} let go "
                "of it, having committed nothing, or its output was replaced): submit the "
                "job again with another output.uri"
            )

    # -- retention -------------------------------------------------------------------------

    async def forget_ended(
        self, *, now: float, retention_s: float, limit: int = FORGET_PER_PASS
    ) -> list[str]:
        """Forget jobs that ended more than `retention_s` ago (`now`: wall-clock seconds, as
        their records say when they finished): their records leave the store and this
        table; their output and manifest stay where they are. Returns their ids: `limit` at
        most, so that a pass stays short (the reaper expires leases between passes) even
        when a master starts with thousands of jobs past their retention."""

        def expired(j: Job) -> bool:
            ended_at = j.record.finished_at
            return bool(j.ended and ended_at and now - ended_at > retention_s)

        async def forget(job: Job) -> str | None:
            async with job.lock:  # a resume may be under way: look again once it is over
                if not expired(job) or self._context.jobs.get(job.id) is not job:
                    return None
                await self._context.store.forget_job(job.id)
                del self._context.jobs[job.id]
                return job.id

        candidates = [j for j in self._context.jobs.values() if expired(j)][:limit]
        gone: list[str] = []
        for start in range(0, len(candidates), FORGET_AT_ONCE):
            chunk = candidates[start : start + FORGET_AT_ONCE]
            # Purges are idempotent: if one fails, the next pass purges that job again.
            gone += [i for i in await asyncio.gather(*(forget(j) for j in chunk)) if i]
        if gone:
            self._context.publish_job_gauges()
        return gone
