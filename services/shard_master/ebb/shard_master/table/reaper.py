"""Ending the leases no holder will end: those past their deadline, and those of a worker the
controller saw end.

An expired lease, like a failed attempt, counts against the shard's max_attempts. A worker
lost to the cluster (evicted, preempted, killed from outside) is the cluster's fault: its
attempts are forgiven and its shards go back to the queue at once, with no wait for their
leases to run out; a generous cap on such losses per shard still stops a shard that takes
down every worker it touches (`ShardMoves.drop_lease`).

A worker that crashed or ran out of memory holding one shard failed that shard's attempt.
Holding several (it computes one while it reads the next, and under load the rows of both
are in its pipeline at once), any of them may be the cause, and the order they were leased
in does not say which: each becomes a suspect, leased alone from then on, so that the next
crash it causes is its own. Blaming the one held longest instead quarantined a healthy shard
that was only committing when the next one's rows killed the worker.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ebb.common.messaging.messages import WorkerEndedReply

from .. import metrics
from .context import TableContext
from .expiry import Expiry, ExpiryHeap
from .jobs import Job
from .lifecycle import JobLifecycle
from .moves import ShardMoves

log = logging.getLogger(__name__)


class LeaseReaper:
    def __init__(
        self,
        context: TableContext,
        *,
        expiries: ExpiryHeap,
        moves: ShardMoves,
        lifecycle: JobLifecycle,
    ) -> None:
        self._context = context
        self._expiries = expiries
        self._moves = moves
        self._lifecycle = lifecycle

    async def expire_due(self) -> int:
        """Expire every lease whose deadline has passed. Returns how many expired."""
        return await self._expiries.expire_due(self._expire)

    async def _expire(self, entry: Expiry) -> bool:
        job = self._context.jobs.get(entry.job)
        if job is None or job.ended or entry.shard >= len(job.shards):
            return False
        shard = job.shards[entry.shard]
        token = entry.token
        if shard.deadlines.get(token) != entry.deadline:
            return False  # renewed, or already gone
        async with shard.lock:
            # A renew (or the end of the job) may have come while we waited for the lock.
            if job.ended or not job.holds(shard) or shard.deadlines.get(token) != entry.deadline:
                return False
            lease = next((ls for ls in shard.record.leases if ls.token == token), None)
            worker = lease.worker if lease else "?"
            attempt = lease.attempt if lease else 0
            state = await self._moves.drop_lease(
                job,
                shard,
                token,
                reason=f"lease of attempt {attempt} expired (worker {worker})",
                failed=True,
            )
        metrics.LEASE_EXPIRIES.labels(job.id).inc()
        log.info("job %s: shard %d lease expired (%s), now %s", job.id, shard.index, worker, state)
        if state in ("QUARANTINED", "DONE"):
            await self._lifecycle.settle(job)
        return True

    async def worker_ended(
        self, job_id: str, worker: str, *, kind: str, blame: bool, reason: str
    ) -> WorkerEndedReply:
        """The controller saw `worker` end badly: each lease it held ends now, instead of
        when its deadline passes. `blame`: its death may be a shard's doing (it crashed or
        ran out of memory while computing it): the attempt of the shard it held alone counts
        as failed, or, when it held several, each becomes a suspect (module docstring).
        Without blame (the cluster took the worker) every attempt lost with it is forgiven.
        Idempotent: a worker that holds nothing changes nothing, and a worker is counted as
        lost once."""
        job = self._context.find(job_id)
        released: list[int] = []
        forgiven = 0
        settle = False
        why = f"worker {worker} {'failed' if blame else 'was lost'} ({kind}: {reason})"
        # Oldest first: each goes back to the queue in the order it was leased.
        held = sorted(
            (
                (shard.granted.get(lease.token, 0.0), shard.index, lease.token)
                for shard in (job.shards[i] for i in job.doing)
                for lease in shard.record.leases
                if lease.worker == worker
            ),
        )
        guilty = blame and len(held) == 1
        suspected = blame and len(held) > 1
        outcome = "failed" if guilty else "suspect" if suspected else "lost"
        for _, index, token in held:
            if job.ended:  # while we waited for a lock: its leases are void already
                break
            shard = job.shards[index]
            async with shard.lock:
                if job.ended or not job.holds(shard) or token not in shard.deadlines:
                    continue
                state = await self._moves.drop_lease(
                    job,
                    shard,
                    token,
                    reason=why,
                    failed=guilty,
                    lost=not blame,
                    suspected=suspected,
                )
            released.append(index)
            forgiven += not blame
            settle = settle or state in ("QUARANTINED", "DONE")
            metrics.RETRIES.labels(job.id, outcome).inc()
        if forgiven:
            metrics.ATTEMPTS_FORGIVEN.labels(job.id).inc(forgiven)
        if released:
            log.info(
                "job %s: worker %s ended (%s): shards %s back in the queue%s",
                job.id,
                worker,
                kind,
                released,
                ", their attempts forgiven"
                if forgiven
                else ", each now a suspect"
                if suspected
                else "",
            )
        await self._count_lost(job, worker, kind=kind, forgiven=forgiven)
        if settle:
            await self._lifecycle.settle(job)
        return WorkerEndedReply(released=released, forgiven=forgiven)

    async def _count_lost(self, job: Job, worker: str, *, kind: str, forgiven: int) -> None:
        """Add a lost worker (once) and its forgiven attempts to the job's record."""
        first = worker not in job.ended_workers
        if not (first or forgiven):
            return
        async with job.lock:
            if job.ended and not forgiven:
                return
            lost = dict(job.record.workers_lost)
            if first:
                lost[kind] = lost.get(kind, 0) + 1
            record = replace(
                job.record,
                workers_lost=lost,
                attempts_forgiven=job.record.attempts_forgiven + forgiven,
            )
            job.revision = await self._context.store.update_job(record, last=job.revision)
            job.record = record
            job.ended_workers.add(worker)
