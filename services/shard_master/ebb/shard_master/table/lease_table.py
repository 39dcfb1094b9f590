"""The lease table: every job's shards, their queue, their leases, and the lease protocol
workers speak to it (lease, renew, commit, release).

The table holds the jobs, and the parts that work on them, each its own concern: `intake`
(how a job enters), `lifecycle` (how a job's state changes: the one place it does), `moves`
(how a shard's record changes: the one place it does), `expiries` (when leases run out) and
`reaper` (ending the leases no holder will end).

Concurrency: the service runs on one event loop. A transition on a shard holds that shard's
lock across its KV write, so two transitions of one shard never interleave, while different
shards proceed concurrently. Picking a shard from the queue is synchronous (no await between
looking and taking), so two workers can never be handed the same TODO shard.

Deadlines live on the master's monotonic clock (`clock`). Each lease record also keeps, in
wall-clock time (`wall_clock`), when it was granted and when it expires as of its latest
renewal: a restarted master gives a lease what it had left plus a grace (never a fresh full
period, or a master that restarts more often than a lease lasts would keep a dead holder's
shard forever), and knows how long each attempt has run, which speculation needs.

Over 400 lines: the lease protocol's four operations share one class's locks and indexes;
the worker's folders come first in the layout's plan, then this splits by operation.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from ebb.common import failpoints
from ebb.common.data.output import OutputStore
from ebb.common.job import parse_job
from ebb.common.messaging.messages import (
    CommitReply,
    LeaseReply,
    ReleaseReply,
    RenewReply,
    ShardState,
    StatusReply,
    StatusRequest,
)

from .. import metrics
from ..errors import (
    ForeignCommit,
    JobEnded,
    NoCommitRecord,
    NotHolder,
    StaleToken,
    TableCorrupt,
)
from .context import EventSink, OutputOpener, TableContext
from .expiry import Expiry, ExpiryHeap
from .intake import JobIntake
from .jobs import Job, Shard, Tier
from .lifecycle import JobLifecycle
from .moves import PERSISTED_PERIODS, ShardMoves, load_with_successors
from .reaper import LeaseReaper
from .records import FencedStore, LeaseRecord, RecordStore
from .status import status_reply
from .tail import ask_split, pace_wait, pick_speculative, renew_in, room_beyond_two, untold
from .tracking import MlflowRuns

log = logging.getLogger(__name__)

_LEASE_REPLY_CACHE = 4096
MISTAKE_PREFIX = "every row fails alike, of a mistake in the spec or its code (fix it, run again): "
"""How the reason of a job failed for a mistake every row repeats begins."""
_TAIL_WAIT_S = 5.0


def make_token(epoch: int, job: str, shard: int, attempt: int) -> str:
    return f"{epoch}:{job}:{shard}:{attempt}:{secrets.token_hex(6)}"


def parse_token(token: str) -> tuple[str, int]:
    """(job, shard) named by a token, or StaleToken if it is not one of ours."""
    parts = token.split(":")
    if len(parts) != 5:
        raise StaleToken("malformed lease token")
    try:
        return parts[1], int(parts[2])
    except ValueError:
        raise StaleToken("malformed lease token") from None


class LeaseTable:
    def __init__(
        self,
        *,
        store: RecordStore,
        epoch: int,
        on_event: EventSink,
        open_output: OutputOpener = OutputStore,
        wait_retry_s: float = 1.0,
        speculate_after_s: float = 5.0,
        split_halves: bool = True,
        lease_grace_s: float = 5.0,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._epoch = epoch
        self._wait_retry_s = wait_retry_s
        self._speculate_after_s = speculate_after_s
        self._split_halves = split_halves
        self._lease_replies: OrderedDict[tuple[str, str], LeaseReply] = OrderedDict()
        self.context = context = TableContext(
            jobs={},
            store=FencedStore(store),
            emit=on_event,
            open_output=open_output,
            clock=clock or asyncio.get_running_loop().time,
            wall_clock=wall_clock,
            lease_grace_s=lease_grace_s,
        )
        self.jobs = context.jobs
        self.expiries = ExpiryHeap(clock=context.clock)
        self.lifecycle = JobLifecycle(context)
        self.intake = JobIntake(context, lifecycle=self.lifecycle)
        self.moves = ShardMoves(context, expiries=self.expiries)
        self.reaper = LeaseReaper(
            context, expiries=self.expiries, moves=self.moves, lifecycle=self.lifecycle
        )
        self.mlflow = MlflowRuns(context)

    async def load(self) -> None:
        """Rebuild the table from KV: every job, and every shard of the jobs still running."""
        store = self.context.store
        for record, revision in await store.load_jobs():
            job = Job(record, revision, parse_job(record.spec))
            self.jobs[job.id] = job
            if record.state == "RUNNING":
                try:
                    entries = await load_with_successors(store, job)
                except TableCorrupt as e:
                    # One job's records must not keep the master (and every other job) down.
                    log.error("%s", e)
                    await self.lifecycle.end(job, "FAILED", str(e))
                    continue
                self.context.adopt_shards(job, entries)
                for shard in job.shards:
                    for token, deadline in shard.deadlines.items():
                        self.expiries.push(Expiry(deadline, job.id, shard.index, token))
        self.context.publish_job_gauges()
        log.info("loaded %d jobs (%d running)", len(self.jobs), len(self.running_jobs()))

    def running_jobs(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state == "RUNNING"]

    def status(self, request: StatusRequest, *, owner: str | None = None) -> StatusReply:
        """The status `request` asks, as `owner` (a team) may see it: its own jobs and
        refusals alone; None: everyone's."""
        return status_reply(
            self.jobs,
            self.intake.rejected.seen_by(owner),
            request,
            now=self.context.clock(),
            owner=owner,
            halves=self._split_halves,
            min_halve_gain_s=self._speculate_after_s,
        )

    # -- the lease protocol ----------------------------------------------------------------

    def _locate(self, token: str) -> tuple[Job, Shard]:
        job_id, index = parse_token(token)
        job = self.jobs.get(job_id)
        if job is None:
            raise StaleToken("lease token of an unknown job")
        if job.ended:
            raise JobEnded(f"job {job_id} is {job.state}")
        if not 0 <= index < len(job.shards):
            raise StaleToken("lease token of an unknown shard")
        return job, job.shards[index]

    @staticmethod
    def _check_current(job: Job, shard: Shard) -> None:
        """Under the shard's lock, after whatever was awaited to get it: the job still runs
        and this is still its shard (ending a job waits for every shard lock, and resuming
        it gives it new shards, so nothing they change can change under a held lock)."""
        if job.ended:
            raise JobEnded(f"job {job.id} is {job.state}")
        if not job.holds(shard):
            raise StaleToken("lease of an earlier run of the job")

    async def lease(
        self,
        job_id: str,
        worker: str,
        request_id: str = "",
        *,
        ready: bool = False,
        tier: str = "",
    ) -> LeaseReply:
        """`ready`: the worker's pipeline has started. `tier`: the tier of the job it runs."""
        if ready and (job := self.jobs.get(job_id)) is not None:
            job.ready_workers.add(worker)
            if tier in job.spec.tier_names():
                job.tiers[job.spec.tier_index(tier)].ready_workers.add(worker)
        cache_key = (worker, request_id)
        if request_id and cache_key in self._lease_replies:
            return self._lease_replies[cache_key]
        reply = await self._lease(job_id, worker, tier)
        if request_id and reply.status == "granted":
            self._lease_replies[cache_key] = reply
            while len(self._lease_replies) > _LEASE_REPLY_CACHE:
                self._lease_replies.popitem(last=False)
        return reply

    async def _lease(self, job_id: str, worker: str, tier_name: str) -> LeaseReply:
        job = self.context.find(job_id)
        if job.ended:
            return LeaseReply(status="end")
        tier = job.tier_named(tier_name)
        if job.state != "RUNNING":
            return LeaseReply(status="wait", retry_after_s=self._wait_retry_s)
        held = job.held_by(worker, tier)
        if any(shard.record.suspect for shard in held):
            # Alone until it commits or fails, so that a crash is its own.
            return LeaseReply(status="wait", retry_after_s=self._tail_wait(job))
        if job.held_back(tier):
            after = job.tiers[job.tiers.index(tier) + 1]
            wait = pace_wait(after, most=self._wait_retry_s)
            return LeaseReply(status="wait", retry_after_s=wait)
        if len(held) >= 2 and not room_beyond_two(job, tier):
            # A worker whose shards are small for its pipeline asks for more than the two
            # it holds (ebb.worker.service.shards_to_hold): not while the tier's other
            # workers, those it may yet have, would find less than two each.
            return LeaseReply(status="wait", retry_after_s=self._wait_retry_s)
        shard = self._pick(job, tier, worker, alone=not held)
        speculative = False
        if shard is None:
            # Only a worker holding nothing of the tier is idle: one asking for a shard to
            # read while its own computes (`shards_in_flight`) would start on a split or a
            # second attempt only once its own is done.
            now = self.context.clock()
            # A look for a split ran lately (for this worker's last ask, or another's) and
            # the next is not due: this ask looks at nothing, so the worker asks again soon,
            # not after the tail's long wait (its retry, jittered, may come a little early).
            looked_lately = job.no_split_before > now
            if tier.doing and not held:
                tier.idle_at = now
                if self._ask_split(job, tier, worker):
                    return LeaseReply(status="wait", retry_after_s=self._wait_retry_s)
            if not held:
                shard = pick_speculative(
                    job, tier, worker, now=now, speculate_after_s=self._speculate_after_s
                )
            if shard is None:
                if tier.counts["TODO"] or job.creating:
                    # Queued (a rest kept for another worker, a suspect for a worker with
                    # nothing), or on its way: briefly.
                    return LeaseReply(status="wait", retry_after_s=self._wait_retry_s)
                at = job.tiers.index(tier)
                if any(t.backlog for t in job.tiers[:at]):
                    # A tier before has shards whose rows come here as they are done: soon,
                    # not at the tail (a worker waiting out the tail's long wait would leave
                    # a hand-off queued that long).
                    wait = pace_wait(job.tiers[at - 1], most=self._wait_retry_s)
                    return LeaseReply(status="wait", retry_after_s=wait)
                if tier.backlog:  # running here: the tail
                    if not held and (looked_lately or untold(job, tier, halves=self._split_halves)):
                        # A shard that may be cut for this worker: soon, once its holder
                        # tells its first rows (it renews every second meanwhile), or once
                        # the next look is due.
                        return LeaseReply(status="wait", retry_after_s=self._wait_retry_s)
                    return LeaseReply(status="wait", retry_after_s=self._tail_wait(job))
                return LeaseReply(status="end")
            speculative = True
        lease_s = job.spec.fault.lease_s
        async with shard.lock:
            record = shard.record
            expected: ShardState = "DOING" if speculative else "TODO"
            stale = job.ended or not job.holds(shard)
            if stale or record.state != expected or (speculative and len(record.leases) != 1):
                if not stale and not speculative and record.state == "TODO":
                    tier.todo.appendleft(shard.index)
                return LeaseReply(status="wait", retry_after_s=self._wait_retry_s)
            attempt = record.attempts + 1
            token = make_token(self._epoch, job.id, shard.index, attempt)
            wall_now = self.context.wall_clock()
            lease = LeaseRecord(
                token=token,
                attempt=attempt,
                worker=worker,
                speculative=speculative,
                granted_at=wall_now,
                expires_at=wall_now + lease_s * PERSISTED_PERIODS,
            )
            new = replace(record, state="DOING", attempts=attempt, leases=[*record.leases, lease])
            try:
                await self.moves.apply(job, shard, new, lease=(token, lease_s))
            except BaseException:
                if not speculative:
                    tier.todo.appendleft(shard.index)
                raise
        if speculative:
            log.info("job %s: speculative attempt %d of shard %d", job.id, attempt, shard.index)
        return LeaseReply(
            status="granted",
            shard=record.spec,
            attempt=attempt,
            token=token,
            lease_s=lease_s,
            speculative=speculative,
            renew_in_s=self._renew_in(job, shard, token),
        )

    def _renew_in(self, job: Job, shard: Shard, token: str) -> float | None:
        """How soon the holder of `token` is to renew (`tail.renew_in`): within two tail
        waits of an idle worker's ask, that worker is still waiting."""
        tier, now = job.tier_of(shard), self.context.clock()
        return renew_in(job, tier, shard, token, now=now, idle_seen_s=2 * self._tail_wait(job))

    def _tail_wait(self, job: Job) -> float:
        """How long a worker with nothing to do at the tail (nothing queued, to split or to
        speculate on) waits to ask again: only a shard that comes back or a straggler found
        later can change that. A thousand idle workers asking every second would be most of
        the master's work of a job."""
        return max(self._wait_retry_s, min(_TAIL_WAIT_S, job.spec.fault.lease_s / 10))

    def _pick(self, job: Job, tier: Tier, worker: str, *, alone: bool) -> Shard | None:
        """The first TODO shard in the queue for `worker`: a straggler's rest kept for
        another worker is passed over (it stays first) until its keep runs out, and so is a
        suspect shard unless the worker holds nothing (`alone`). A worker that holds one asks
        for its next to read while the first computes: at the tail, while workers of the
        tier have waited idle lately, it gets nothing (they take what comes back)."""
        now = self.context.clock()
        if not alone and now - tier.idle_at < 2 * self._tail_wait(job):
            return None
        passed: list[int] = []
        try:
            while tier.todo:
                index = tier.todo.popleft()
                shard = job.shards[index]
                if shard.record.state != "TODO":
                    continue
                kept = shard.kept_for
                kept_away = kept is not None and kept[0] != worker and now < kept[1]
                if kept_away or (shard.record.suspect and not alone):
                    passed.append(index)
                    continue
                shard.kept_for = None
                return shard
            return None
        finally:
            tier.todo.extendleft(reversed(passed))

    def _ask_split(self, job: Job, tier: Tier, worker: str) -> bool:
        lease_s = job.spec.fault.lease_s
        min_gain_s = max(self._speculate_after_s, lease_s * 2 / 3)
        return ask_split(
            job,
            tier,
            worker,
            now=self.context.clock(),
            min_gain_s=min_gain_s,
            min_halve_gain_s=self._speculate_after_s,
            halves=self._split_halves,
        )

    def _check_holder(self, shard: Shard, token: str, caller: str | None) -> None:
        """Refuse a current lease token used by anyone but the worker it was granted to
        (caller holds the shard's lock). `caller` None: the caller's identity is not known
        (an in-process use of the table), and not checked."""
        if caller is None:
            return
        lease = next((ls for ls in shard.record.leases if ls.token == token), None)
        if lease is not None and lease.worker != caller:
            raise NotHolder(
                f"the lease on shard {shard.index} (attempt {lease.attempt}) was not granted "
                f"to worker {caller!r}"
            )

    async def renew(
        self, token: str, *, caller: str | None = None, ready: bool = False, rows_done: int = 0
    ) -> RenewReply:
        """`ready`: the caller's pipeline has started. `rows_done`: the rows of the shard its
        attempt has written. The reply asks the holder to split if it was chosen to."""
        job, shard = self._locate(token)
        if ready and caller is not None:
            job.ready_workers.add(caller)
        lease_s = job.spec.fault.lease_s
        async with shard.lock:
            self._check_current(job, shard)
            if token not in shard.deadlines:
                raise StaleToken("lease is no longer current")
            self._check_holder(shard, token, caller)
            if rows_done > shard.progress.get(token, 0):
                shard.progress[token] = rows_done
                shard.progress_at[token] = self.context.clock()
            split = token in shard.split_asked
            now = self.context.clock()
            if shard.persisted.get(token, now) - now >= lease_s:
                # KV's record still covers a full period beyond now: what a master taking
                # over would read is right as it is, so this renewal need not be written.
                self.expiries.set_deadline(
                    shard.deadlines, Expiry(now + lease_s, job.id, shard.index, token)
                )
                metrics.LEASE_RENEWALS.labels(job.id).inc()
                return RenewReply(
                    lease_s=lease_s, split=split, renew_in_s=self._renew_in(job, shard, token)
                )
            expires_at = self.context.wall_clock() + lease_s * PERSISTED_PERIODS
            record = shard.record
            leases = [
                replace(lease, expires_at=expires_at) if lease.token == token else lease
                for lease in record.leases
            ]
            await self.moves.apply(
                job, shard, replace(record, leases=leases), lease=(token, lease_s)
            )
        metrics.LEASE_RENEWALS.labels(job.id).inc()
        return RenewReply(
            lease_s=lease_s, split=split, renew_in_s=self._renew_in(job, shard, token)
        )

    async def commit(self, token: str, *, caller: str | None = None) -> CommitReply:
        job_id, index = parse_token(token)
        job = self.jobs.get(job_id)
        if (
            job is not None
            and 0 <= index < len(job.shards)
            and job.shards[index].record.state == "DONE"
        ):
            return CommitReply(status="already_done")
        job, shard = self._locate(token)
        async with shard.lock:
            self._check_current(job, shard)
            record = shard.record
            if record.state == "DONE":
                return CommitReply(status="already_done")
            if token not in shard.deadlines:
                raise StaleToken("lease is no longer current")
            self._check_holder(shard, token, caller)
            foreign: ForeignCommit | None = None
            try:
                commit = await self.moves.read_commit(job, shard)
            except ForeignCommit as e:
                foreign = e
                await self.moves.drop_lease(job, shard, token, reason=str(e), failed=True)
            else:
                if commit is None:
                    raise NoCommitRecord(
                        f"no commit record for shard {shard.index} in {job.spec.output.uri}"
                    )
                now = self.context.clock()
                seconds = now - shard.granted.get(token, now)
                await self.moves.record_done(job, shard, commit, seconds=seconds)
                failpoints.hit(failpoints.MASTER_AFTER_RECORDING_DONE, detail=str(shard.index))
        await self.lifecycle.settle(job)
        if foreign is not None:
            raise foreign
        return CommitReply(status="done")

    async def release(
        self,
        token: str,
        reason: str,
        *,
        retryable: bool,
        mistake: bool = False,
        caller: str | None = None,
    ) -> ReleaseReply:
        """A worker hands a shard back: at no cost to it (`retryable`), as a failed attempt,
        or (`mistake`) for a mistake that every row of the job would repeat, which fails the
        job at once (the shard itself back unharmed: a resume with the spec fixed runs it)."""
        job, shard = self._locate(token)
        async with shard.lock:
            self._check_current(job, shard)
            if token not in shard.deadlines:
                if shard.record.state == "DONE":
                    return ReleaseReply(state="DONE")
                raise StaleToken("lease is no longer current")
            self._check_holder(shard, token, caller)
            state = await self.moves.drop_lease(
                job, shard, token, reason=reason, failed=not retryable
            )
        metrics.RETRIES.labels(job.id, "released" if retryable else "poisoned").inc()
        if mistake:
            log.warning("job %s: failed at once: %s", job.id, reason)
            await self.lifecycle.cancel(job.id, f"{MISTAKE_PREFIX}{reason}", state="FAILED")
        elif state in ("QUARANTINED", "DONE"):
            await self.lifecycle.settle(job)
        return ReleaseReply(state=state)
