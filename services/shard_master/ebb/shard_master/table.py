"""The lease table: every job's shards, their queue, their leases, and each transition.

State lives in two places with one rule between them: a transition is written to KV
(compare-and-set) first, and only then applied in memory and answered. The memory side is
what makes it fast; the KV side is what lets a restarted master carry on. Every change of a
shard's record goes through `LeaseTable.apply`, which checks the move against the transition
map (`transitions.py`), writes it, and then updates every index the job keeps of its shards.

Concurrency: the service runs on one event loop. A transition on a shard holds that shard's
lock across its KV write, so two transitions of one shard never interleave, while different
shards proceed concurrently. Picking a shard from the queue is synchronous (no await between
looking and taking), so two workers can never be handed the same TODO shard.

Deadlines live on the master's monotonic clock. Each lease record also keeps, in wall-clock
time, when it was granted and when it expires as of its latest renewal: a restarted master
gives a lease what it had left plus a grace (never a fresh full period, or a master that
restarts more often than a lease lasts would keep a dead holder's shard forever), and knows
how long each attempt has run, which speculation needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import secrets
import statistics
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import replace

import nats.errors

from ebb.common import failpoints
from ebb.common.layout import CommitRecord, OutputOwner
from ebb.common.messages import (
    CancelReply,
    CommitReply,
    JobEvent,
    JobState,
    LeaseReply,
    ReleaseReply,
    RenewReply,
    ResumeReply,
    ShardState,
    StatusReply,
    WorkerEndedReply,
)
from ebb.common.output import OutputStore
from ebb.common.spec import JobSpec, parse_job

from . import metrics
from .errors import (
    BadRequest,
    Deposed,
    ForeignCommit,
    JobEnded,
    JobNotFound,
    NoCommitRecord,
    NotHolder,
    NotResumable,
    OutputTaken,
    StaleToken,
)
from .finish import failure_reason, write_manifest
from .jobs import Job, Shard
from .ownership import OwnerView, spec_mismatch, taken_reason, view_from_record
from .planner import plan_input
from .status import EventKind, describe, job_event
from .store import JobRecord, LeaseRecord, RecordStore, ShardRecord
from .transitions import REOPEN, check_transition

log = logging.getLogger(__name__)

_KEEP_ERRORS = 5
_LEASE_REPLY_CACHE = 4096
_CREATE_CHUNK = 256
_FINISH_TRIES = 5
PERSISTED_PERIODS = 1.5
"""A lease is written to KV as lasting this many periods, and a renewal is written again only
once less than one period of that is left. Workers renew every third of a period, so every
other renewal is written, not each; and a master that takes over from KV still finds at least
1.5 - 2/3 of a period (plus its grace) on a live worker's lease, more than the third it needs
to hear the next renewal. It gives a dead worker's lease at most one period, as ever."""


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


EventSink = Callable[[JobEvent], None]
OutputOpener = Callable[[str], OutputStore]


STATUS_PAGE = 500
"""Jobs in one status reply at most (about 350 bytes each without their specs)."""
FORGET_PER_PASS = 500
"""Jobs past their retention forgotten in one reaper pass at most..."""
FORGET_AT_ONCE = 32
"""...their purges this many jobs at a time (each job: two requests to NATS)."""
REJECTIONS_KEPT = 256
"""Refused submissions remembered (the newest), for `status` to say why."""
REASON_CHARS = 512
"""A refusal's reason kept at most: all REJECTIONS_KEPT of them, with their ids, stay far
below NATS's largest message (1 MiB) in the status reply that carries them."""


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
        lease_grace_s: float = 5.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._store = store
        self._epoch = epoch
        self._emit = on_event
        self._open_output = open_output
        self._wait_retry_s = wait_retry_s
        self._speculate_after_s = speculate_after_s
        self._lease_grace_s = lease_grace_s
        self._clock = clock or asyncio.get_running_loop().time
        self.jobs: dict[str, Job] = {}
        self.rejected: OrderedDict[str, str] = OrderedDict()
        self._expiries: list[tuple[float, str, int, str]] = []
        self._expiry_failures = 0
        self._expiry_retry_at = 0.0
        """After a failed expiry (the store away: a NATS server down, a stream electing its
        leader), none is tried again before this, backing off; not every few milliseconds."""
        self._lease_replies: OrderedDict[tuple[str, str], LeaseReply] = OrderedDict()

    # -- loading and intake ----------------------------------------------------------------

    async def load(self) -> None:
        """Rebuild the table from KV: every job, and every shard of the jobs still running."""
        now = self._clock()
        for record, revision in await self._store.load_jobs():
            spec = parse_job(record.spec)
            job = Job(record, revision, spec)
            self.jobs[job.id] = job
            if record.state == "RUNNING":
                job.adopt_shards(
                    await self._store.load_shards(job.id),
                    now=now,
                    wall_now=time.time(),
                    lease_s=spec.fault.lease_s,
                    grace_s=self._lease_grace_s,
                )
                for shard in job.shards:
                    for token, deadline in shard.deadlines.items():
                        heapq.heappush(self._expiries, (deadline, job.id, shard.index, token))
        self._publish_job_gauges()
        log.info(
            "loaded %d jobs (%d running)",
            len(self.jobs),
            sum(1 for j in self.jobs.values() if j.state == "RUNNING"),
        )

    def reject(self, job_id: str, reason: str) -> None:
        """Remember a refused submission for a while, so `status` can say why: the newest
        REJECTIONS_KEPT, each reason cut to REASON_CHARS (a reason may quote the spec, and
        every unpaged `status` reply carries them all)."""
        if len(reason) > REASON_CHARS:  # the middle goes: a quoted value, most likely
            half = REASON_CHARS // 2
            reason = reason[: half - 1] + "…" + reason[-half:]
        self.rejected.pop(job_id, None)  # refused again: the newest again
        self.rejected[job_id] = reason
        while len(self.rejected) > REJECTIONS_KEPT:
            self.rejected.popitem(last=False)
        self._emit(JobEvent(job=job_id, kind="rejected", reason=reason))

    async def abandon(self, job_id: str, reason: str) -> None:
        """A submission that could not be completed: a job left SUBMITTED is marked FAILED."""
        job = self.jobs.get(job_id)
        if job is None:
            self.reject(job_id, reason)
            return
        async with job.lock:
            if job.state == "SUBMITTED":
                await self._end(job, "FAILED", reason)

    async def submit(self, spec: JobSpec) -> bool:
        """Plan and persist a validated job. False if it was known already (a resubmission)."""
        job = self.jobs.get(spec.id)
        if job is not None and job.state != "SUBMITTED":
            return False
        # Plan before writing anything: input that cannot be planned is refused with no trace.
        # Planning reads only metadata, but of possibly many files: off the event loop.
        submitted = spec  # as submitted: what the output records, before planning types it
        required = [*(spec.input.columns or []), *spec.output.carryover]
        plan = await asyncio.to_thread(
            plan_input, spec.input, required_columns=list(dict.fromkeys(required))
        )
        shard_specs = plan.shards
        if plan.column_types != spec.input.column_types:
            # The spec workers get says how to type each column: every shard alike.
            spec = replace(spec, input=replace(spec.input, column_types=plan.column_types))
        # The output root becomes this job's, atomically: no other job can write into it.
        await self._claim_output(submitted)
        if job is None:
            record = JobRecord(id=spec.id, spec=spec.to_dict(), submitted_at=time.time())
            revision = await self._store.create_job(record)
            if revision is None:
                found = await self._store.get_job(spec.id)
                if found is None:
                    raise BadRequest(f"job {spec.id} vanished during submission")
                record, revision = found
                if record.state != "SUBMITTED":
                    return False
            job = Job(record, revision, spec)
            self.jobs[job.id] = job
        records = [ShardRecord(job=spec.id, spec=s, seq=s.index) for s in shard_specs]
        for start in range(0, len(records), _CREATE_CHUNK):
            chunk = records[start : start + _CREATE_CHUNK]
            # Records that exist already come from an interrupted planning of this same job.
            await asyncio.gather(*(self._store.create_shard(r) for r in chunk))
        entries = await self._store.load_shards(spec.id)
        running = replace(
            job.record,
            state="RUNNING",
            shards_total=len(records),
            rows_total=sum(s.rows for s in shard_specs),
        )
        job.revision = await self._store.update_job(running, last=job.revision)
        job.record = running
        job.adopt_shards(
            entries,
            now=self._clock(),
            wall_now=time.time(),
            lease_s=spec.fault.lease_s,
            grace_s=self._lease_grace_s,
        )
        self._publish_job_gauges()
        log.info("job %s accepted: %d shards, ~%d rows", job.id, len(records), running.rows_total)
        self._emit(self._event(job, "accepted"))
        return True

    async def _claim_output(self, spec: JobSpec) -> None:
        """Make the spec's output root this job's, or raise OutputTaken saying whose it is
        and what the user can do. A job that carries on in its own root (a resume on a new
        stack: the same id) must compute the rows it committed there."""
        uri = spec.output.uri
        fields = spec.output_fields()
        output = self._open_output(uri)
        try:
            owner, taken_from = await asyncio.to_thread(output.claim, spec.id, fields=fields)
            if owner.job != spec.id:
                raise OutputTaken(taken_reason(uri, await self._owner_view(owner, output)))
            if taken_from:
                log.info(
                    "job %s takes %s over from job %s, which ended with nothing committed",
                    spec.id,
                    uri,
                    taken_from,
                )
                return
            mismatch = spec_mismatch(uri, owner, spec, fields)
            if mismatch:
                raise OutputTaken(mismatch)
            if owner.state:  # it ended there before: it runs again
                await asyncio.to_thread(output.reclaim, spec.id)
        except (NotADirectoryError, IsADirectoryError, PermissionError) as e:
            raise OutputTaken(f"cannot write to {uri}: {e}") from e

    async def _owner_view(self, owner: OutputOwner, output: OutputStore) -> OwnerView:
        """The job that owns a root, as this master knows it, or else as the root tells."""
        job = self.jobs.get(owner.job)
        if job is not None:
            ended = job.ended
            return OwnerView(
                job=job.id,
                state=job.state,
                shards_done=job.record.shards_done if ended else job.counts["DONE"],
                shards_total=job.record.shards_total,
                rows_done=job.record.rows_done if ended else job.rows_done,
                here=True,
            )
        committed = 0 if owner.state else await asyncio.to_thread(output.committed_shards)
        complete = not owner.state and await asyncio.to_thread(output.read_manifest) is not None
        return view_from_record(owner, committed=committed, complete=complete)

    # -- the lease protocol ----------------------------------------------------------------

    def _job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id!r}")
        return job

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
        and this is still its shard (`_end` and `resume` wait for every shard lock, so
        nothing they change can change under a held lock)."""
        if job.ended:
            raise JobEnded(f"job {job.id} is {job.state}")
        if not job.holds(shard):
            raise StaleToken("lease of an earlier run of the job")

    async def apply(
        self, job: Job, shard: Shard, new: ShardRecord, *, lease: tuple[str, float] | None = None
    ) -> None:
        """Move a shard to its new record (caller holds the shard's lock): the one place a
        shard changes. The move is checked against the transition map, written to KV
        (compare-and-set), and only then applied to the shard and the job's indexes.

        `lease`: (token, lease_s) of a lease this record grants or renews, whose deadline
        starts now. Tokens the new record no longer holds lose their deadlines."""
        old = shard.record
        check_transition(old.state, new.state)
        requeued = new.state == "TODO" and old.state != "TODO"
        if requeued:  # behind every shard queued so far, after a restart too
            new = replace(new, seq=job.next_seq)
        shard.revision = await self._store.update_shard(new, last=shard.revision)
        shard.record = new
        if requeued:
            job.next_seq += 1
        if old.state != new.state:
            job.leave(shard, old.state)
            job.enter(shard)
            job.publish_gauges(old.state, new.state)
        held = {ls.token for ls in new.leases}
        for token in [t for t in shard.deadlines if t not in held]:
            del shard.deadlines[token]
            shard.granted.pop(token, None)
            shard.persisted.pop(token, None)
        if lease is not None:
            token, lease_s = lease
            now = self._clock()
            shard.deadlines[token] = now + lease_s
            shard.granted.setdefault(token, now)
            shard.persisted[token] = now + lease_s * PERSISTED_PERIODS
            heapq.heappush(self._expiries, (now + lease_s, job.id, shard.index, token))

    async def lease(
        self, job_id: str, worker: str, request_id: str = "", *, ready: bool = False
    ) -> LeaseReply:
        """`ready`: the worker's pipeline has started."""
        if ready and (job := self.jobs.get(job_id)) is not None:
            job.ready_workers.add(worker)
        cache_key = (worker, request_id)
        if request_id and cache_key in self._lease_replies:
            return self._lease_replies[cache_key]
        reply = await self._lease(job_id, worker)
        if request_id and reply.status == "granted":
            self._lease_replies[cache_key] = reply
            while len(self._lease_replies) > _LEASE_REPLY_CACHE:
                self._lease_replies.popitem(last=False)
        return reply

    async def _lease(self, job_id: str, worker: str) -> LeaseReply:
        job = self._job(job_id)
        if job.ended:
            return LeaseReply(status="end")
        if job.state != "RUNNING":
            return LeaseReply(status="wait", retry_after_s=self._wait_retry_s)
        shard = self._pick(job)
        speculative = False
        if shard is None:
            shard = self._pick_speculative(job, worker)
            if shard is None:
                if job.doing:
                    return LeaseReply(status="wait", retry_after_s=self._wait_retry_s)
                return LeaseReply(status="end")
            speculative = True
        lease_s = job.spec.fault.lease_s
        async with shard.lock:
            record = shard.record
            expected: ShardState = "DOING" if speculative else "TODO"
            stale = job.ended or not job.holds(shard)
            if stale or record.state != expected or (speculative and len(record.leases) != 1):
                if not stale and not speculative and record.state == "TODO":
                    job.todo.appendleft(shard.index)
                return LeaseReply(status="wait", retry_after_s=self._wait_retry_s)
            attempt = record.attempts + 1
            token = make_token(self._epoch, job.id, shard.index, attempt)
            wall_now = time.time()
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
                await self.apply(job, shard, new, lease=(token, lease_s))
            except BaseException:
                if not speculative:
                    job.todo.appendleft(shard.index)
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
        )

    def _pick(self, job: Job) -> Shard | None:
        while job.todo:
            shard = job.shards[job.todo.popleft()]
            if shard.record.state == "TODO":
                return shard
        return None

    def _pick_speculative(self, job: Job, worker: str) -> Shard | None:
        """The running shard that has run longest, if it runs well past the usual shard time.

        Only once some shards have finished (so that "usual" means something), only a shard
        with a single attempt running, and never one the asking worker holds itself.
        """
        if not job.spec.fault.speculative or not job.durations:
            return None
        min_age = max(self._speculate_after_s, 1.5 * statistics.median(job.durations))
        now = self._clock()
        best: Shard | None = None
        best_age = 0.0
        for index in job.doing:
            shard = job.shards[index]
            leases = shard.record.leases
            if len(leases) != 1 or leases[0].worker == worker:
                continue
            age = now - shard.granted.get(leases[0].token, now)
            if age >= min_age and age > best_age:
                best, best_age = shard, age
        return best

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
        self, token: str, *, caller: str | None = None, ready: bool = False
    ) -> RenewReply:
        """`ready`: the caller's pipeline has started."""
        job, shard = self._locate(token)
        if ready and caller is not None:
            job.ready_workers.add(caller)
        lease_s = job.spec.fault.lease_s
        async with shard.lock:
            self._check_current(job, shard)
            if token not in shard.deadlines:
                raise StaleToken("lease is no longer current")
            self._check_holder(shard, token, caller)
            now = self._clock()
            if shard.persisted.get(token, now) - now >= lease_s:
                # KV's record still covers a full period beyond now: what a master taking
                # over would read is right as it is, so this renewal need not be written.
                shard.deadlines[token] = now + lease_s
                metrics.LEASE_RENEWALS.labels(job.id).inc()
                return RenewReply(lease_s=lease_s)
            expires_at = time.time() + lease_s * PERSISTED_PERIODS
            record = shard.record
            leases = [
                replace(lease, expires_at=expires_at) if lease.token == token else lease
                for lease in record.leases
            ]
            await self.apply(job, shard, replace(record, leases=leases), lease=(token, lease_s))
        metrics.LEASE_RENEWALS.labels(job.id).inc()
        return RenewReply(lease_s=lease_s)

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
                commit = await self._read_commit(job, shard)
            except ForeignCommit as e:
                foreign = e
                await self._drop_lease(job, shard, token, reason=str(e), failed=True)
            else:
                if commit is None:
                    raise NoCommitRecord(
                        f"no commit record for shard {shard.index} in {job.spec.output.uri}"
                    )
                now = self._clock()
                seconds = now - shard.granted.get(token, now)
                await self._record_done(job, shard, commit, seconds=seconds)
                failpoints.hit(failpoints.MASTER_AFTER_RECORDING_DONE, detail=str(shard.index))
        await self.settle(job)
        if foreign is not None:
            raise foreign
        return CommitReply(status="done")

    async def _read_commit(self, job: Job, shard: Shard) -> CommitRecord | None:
        output = self._open_output(job.spec.output.uri)
        commit = await asyncio.to_thread(output.read_commit, shard.index)
        if commit is not None and commit.job != job.id:
            raise ForeignCommit(
                f"the commit record of shard {shard.index} in {job.spec.output.uri} belongs "
                f"to job {commit.job}"
            )
        return commit

    async def _record_done(
        self, job: Job, shard: Shard, commit: CommitRecord, *, seconds: float = 0.0
    ) -> None:
        """The shard's output is the commit record's (caller holds the shard's lock).
        `seconds`: how long the winning attempt ran, if known."""
        new = replace(
            shard.record,
            state="DONE",
            leases=[],
            done_attempt=commit.attempt,
            seconds=seconds,
            rows=commit.rows,
            error_rows=commit.error_rows,
            files=commit.files,
        )
        await self.apply(job, shard, new)
        metrics.SHARDS_DONE.labels(job.id).inc()
        metrics.ROWS_DONE.labels(job.id).inc(commit.rows)
        metrics.ERROR_ROWS.labels(job.id).inc(commit.error_rows)
        self._emit(self._event(job, "progress"))

    async def release(
        self, token: str, reason: str, *, retryable: bool, caller: str | None = None
    ) -> ReleaseReply:
        job, shard = self._locate(token)
        async with shard.lock:
            self._check_current(job, shard)
            if token not in shard.deadlines:
                if shard.record.state == "DONE":
                    return ReleaseReply(state="DONE")
                raise StaleToken("lease is no longer current")
            self._check_holder(shard, token, caller)
            state = await self._drop_lease(job, shard, token, reason=reason, failed=not retryable)
        metrics.RETRIES.labels(job.id, "released" if retryable else "poisoned").inc()
        if state in ("QUARANTINED", "DONE"):
            await self.settle(job)
        return ReleaseReply(state=state)

    async def _drop_lease(
        self, job: Job, shard: Shard, token: str, *, reason: str, failed: bool, lost: bool = False
    ) -> ShardState:
        """End one lease of a shard (caller holds the shard's lock) and persist the outcome.

        `failed`: the attempt counts against max_attempts. `lost`: it was lost with a worker
        the cluster took: forgiven, but counted against the job's worker_loss_cap."""
        record = shard.record
        remaining = [lease for lease in record.leases if lease.token != token]
        foreign = False
        if not remaining:
            # The attempt may have committed its output and died before telling us: then the
            # shard is done, and retrying or quarantining it would lose or redo that output.
            try:
                commit = await self._read_commit(job, shard)
            except ForeignCommit as e:
                # Never ours to adopt, and no retry can replace it.
                commit, foreign, reason = None, True, str(e)
            if commit is not None:
                log.info(
                    "job %s: shard %d was committed by attempt %d",
                    job.id,
                    shard.index,
                    commit.attempt,
                )
                await self._record_done(job, shard, commit)
                return "DONE"
        failures = record.failures + (1 if failed else 0)
        losses = record.losses + (1 if lost else 0)
        cap = job.spec.fault.worker_loss_cap()
        too_many_losses = lost and losses >= cap
        if too_many_losses:
            reason = (
                f"{losses} workers were lost while computing it, the last: {reason} (a shard "
                f"that takes down every worker it touches; fault.max_worker_losses is {cap})"
            )
        errors = [*record.errors, reason][-_KEEP_ERRORS:] if reason else record.errors
        state: ShardState
        if remaining:
            state = "DOING"  # another attempt still runs; it may yet succeed
        elif foreign or failures >= job.spec.fault.max_attempts or too_many_losses:
            state = "QUARANTINED"
        else:
            state = "TODO"  # at the tail of the queue: others get their turn first
        new = replace(
            record,
            state=state,
            leases=remaining,
            failures=failures,
            losses=losses,
            errors=errors,
        )
        await self.apply(job, shard, new)
        if state == "QUARANTINED":
            log.warning(
                "job %s: shard %d quarantined after %d failed attempts and %d lost: %s",
                job.id,
                shard.index,
                failures,
                losses,
                reason,
            )
        return state

    async def worker_ended(
        self, job_id: str, worker: str, *, kind: str, blame: bool, reason: str
    ) -> WorkerEndedReply:
        """The controller saw `worker` end badly: each lease it held ends now, instead of
        when its deadline passes. `blame`: its death may be a shard's doing (it crashed or
        ran out of memory while computing it), and the attempt of the shard it held longest
        counts as failed; every other attempt lost with it (the cluster took the worker) is
        forgiven. Idempotent: a worker that holds nothing changes nothing, and a worker is
        counted as lost once."""
        job = self._job(job_id)
        released: list[int] = []
        forgiven = 0
        settle = False
        why = f"worker {worker} {'failed' if blame else 'was lost'} ({kind}: {reason})"
        # Oldest first: a worker computes its shards in the order it leased them, so when it
        # dies of what a shard can cause, the one it held longest (whose rows were in its
        # pipeline) is blamed; those it had only read ahead are forgiven. Each goes back to
        # the queue in that order, so its next holder meets them in the same order again.
        held = sorted(
            (
                (shard.granted.get(lease.token, 0.0), shard.index, lease.token)
                for shard in (job.shards[i] for i in job.doing)
                for lease in shard.record.leases
                if lease.worker == worker
            ),
        )
        for n, (_, index, token) in enumerate(held):
            if job.ended:  # while we waited for a lock: its leases are void already
                break
            shard = job.shards[index]
            guilty = blame and n == 0
            async with shard.lock:
                if job.ended or not job.holds(shard) or token not in shard.deadlines:
                    continue
                state = await self._drop_lease(
                    job, shard, token, reason=why, failed=guilty, lost=not guilty
                )
            released.append(index)
            forgiven += not guilty
            settle = settle or state in ("QUARANTINED", "DONE")
            metrics.RETRIES.labels(job.id, "failed" if guilty else "lost").inc()
        if forgiven:
            metrics.ATTEMPTS_FORGIVEN.labels(job.id).inc(forgiven)
        if released:
            log.info(
                "job %s: worker %s ended (%s): shards %s back in the queue%s",
                job.id,
                worker,
                kind,
                released,
                ", their attempts forgiven" if forgiven else "",
            )
        await self._count_lost(job, worker, kind=kind, forgiven=forgiven)
        if settle:
            await self.settle(job)
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
            job.revision = await self._store.update_job(record, last=job.revision)
            job.record = record
            job.ended_workers.add(worker)

    def next_expiry(self) -> float | None:
        return max(self._expiries[0][0], self._expiry_retry_at) if self._expiries else None

    async def expire_due(self) -> int:
        """Expire every lease whose deadline has passed. Returns how many expired.

        Each lease is handled on its own: one that cannot be expired now (the store is
        unreachable) goes back on the heap and the others still expire.
        """
        now = self._clock()
        due: list[tuple[float, str, int, str]] = []
        if now < self._expiry_retry_at:
            return 0
        while self._expiries and self._expiries[0][0] <= now:
            due.append(heapq.heappop(self._expiries))
        expired = 0
        failed = False
        try:
            while due:
                entry = due[0]
                try:
                    if await self._expire(*entry):
                        expired += 1
                except Deposed:
                    raise
                except (nats.errors.Error, TimeoutError) as e:
                    failed = True
                    log.warning("could not expire a lease of job %s (%s); retrying", entry[1], e)
                    heapq.heappush(self._expiries, entry)
                except Exception:
                    failed = True
                    log.exception("could not expire a lease of job %s; retrying", entry[1])
                    heapq.heappush(self._expiries, entry)
                due.pop(0)
            if failed:
                self._expiry_failures += 1
                delay = min(5.0, 0.1 * 2 ** min(self._expiry_failures, 6))
                self._expiry_retry_at = self._clock() + delay
            else:
                self._expiry_failures = 0
        finally:
            for entry in due:  # not reached: a Deposed master stops, but leaves them due
                heapq.heappush(self._expiries, entry)
        return expired

    async def _expire(self, deadline: float, job_id: str, index: int, token: str) -> bool:
        job = self.jobs.get(job_id)
        if job is None or job.ended or index >= len(job.shards):
            return False
        shard = job.shards[index]
        if shard.deadlines.get(token) != deadline:
            return False  # renewed, or already gone
        async with shard.lock:
            # A renew (or the end of the job) may have come while we waited for the lock.
            if job.ended or not job.holds(shard) or shard.deadlines.get(token) != deadline:
                return False
            lease = next((ls for ls in shard.record.leases if ls.token == token), None)
            worker = lease.worker if lease else "?"
            attempt = lease.attempt if lease else 0
            state = await self._drop_lease(
                job,
                shard,
                token,
                reason=f"lease of attempt {attempt} expired (worker {worker})",
                failed=True,
            )
        metrics.LEASE_EXPIRIES.labels(job.id).inc()
        log.info("job %s: shard %d lease expired (%s), now %s", job.id, index, worker, state)
        if state in ("QUARANTINED", "DONE"):
            await self.settle(job)
        return True

    # -- job outcomes ----------------------------------------------------------------------

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
                            await self._end(job, "FAILED", f"could not finish the job: {e}")
                except Deposed:
                    raise
                except Exception:
                    log.exception("job %s: could not record its failure either", job.id)

    async def _settle(self, job: Job) -> None:
        async with job.lock:
            if job.state != "RUNNING":
                return
            total = job.record.shards_total
            settled = job.counts["DONE"] + job.counts["QUARANTINED"]
            errors = job.error_rows + job.quarantined_rows
            budget = job.spec.fault.max_error_fraction * max(job.record.rows_total, 1)
            if errors > budget:
                await self._end(job, "FAILED", failure_reason(job, errors))
            elif settled == total:
                if job.counts["DONE"] == 0:
                    await self._end(job, "FAILED", failure_reason(job, errors))
                else:
                    await self._succeed(job)

    async def _succeed(self, job: Job) -> None:
        manifest = await write_manifest(job, self._open_output(job.spec.output.uri))
        await self._end(job, "SUCCEEDED", "", manifest=manifest)

    async def _end(self, job: Job, state: JobState, reason: str, *, manifest: str = "") -> None:
        """Persist a terminal state (caller holds the job's lock).

        Every shard's lock is taken first, in index order (nothing else holds two): a
        transition under way (a commit reading its record from the output, say) finishes
        before the job ends, and every one after finds the job ended (`_check_current`)."""
        async with contextlib.AsyncExitStack() as held:
            for shard in list(job.shards):
                await held.enter_async_context(shard.lock)
            await self._end_locked(job, state, reason, manifest=manifest)

    async def _end_locked(self, job: Job, state: JobState, reason: str, *, manifest: str) -> None:
        record = replace(
            job.record,
            state=state,
            reason=reason,
            finished_at=time.time(),
            shards_done=job.counts["DONE"],
            shards_quarantined=job.counts["QUARANTINED"],
            rows_done=job.rows_done,
            error_rows=job.error_rows,
            manifest=manifest,
        )
        job.revision = await self._store.update_job(record, last=job.revision)
        # Before the end shows (a client that sees it may stop this very master, as `ebb run`
        # stops its stack): the next job to name the root learns from it how this one ended.
        await self._record_end_in_output(job, record)
        job.record = record
        log.info("job %s %s %s", job.id, state, reason)
        self._publish_job_gauges()
        self._emit(self._event(job, "state"))
        job.release_shards()

    async def _record_end_in_output(self, job: Job, record: JobRecord) -> None:
        """Tell the job's output root how the job ended; if nothing is committed there, the
        job lets go of it. Best effort: a root that never hears of the end keeps its owner."""
        uri = job.spec.output.uri
        try:
            output = self._open_output(uri)
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
        self, job_id: str, reason: str, *, state: JobState = "CANCELLED"
    ) -> CancelReply:
        """End a job that has not ended: CANCELLED (a user's wish) or FAILED (the controller
        found it cannot run). Its leases are void from now on."""
        job = self._job(job_id)
        async with job.lock:
            if not job.ended:
                await self._end(job, state, reason)
        return CancelReply(state=job.record.state)

    async def resume(self, job_id: str, *, key: str = "") -> ResumeReply:
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
        """
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFound(
                f"no job {job_id!r} (never submitted here, or forgotten: a job that ended "
                "leaves the master job_retention_s after; its output is still there)"
            )
        async with job.lock:
            if self.jobs.get(job_id) is not job:
                raise JobNotFound(f"job {job_id!r} was forgotten (job_retention_s)")
            if key and job.record.resume_key == key and job.state not in ("FAILED", "CANCELLED"):
                return ResumeReply(
                    state=job.record.state,
                    shards_done=job.record.shards_done if job.ended else job.counts["DONE"],
                    shards_todo=0 if job.ended else job.counts["TODO"],
                    repeated=True,
                )
            if job.state not in ("FAILED", "CANCELLED"):
                raise NotResumable(
                    f"job {job_id} is {job.state}: only a FAILED or CANCELLED job can be resumed"
                )
            if job.record.shards_total == 0:
                raise NotResumable(
                    f"job {job_id} failed before its input was planned ({job.record.reason}): "
                    "nothing to resume; submit it again"
                )
            entries = sorted(await self._store.load_shards(job.id), key=lambda e: e[0].spec.index)
            if len(entries) != job.record.shards_total:
                raise NotResumable(
                    f"job {job_id} has {len(entries)} shard records of "
                    f"{job.record.shards_total}: cannot resume it"
                )
            await self._reclaim_output(job)
            next_seq = max(rec.seq for rec, _ in entries) + 1
            reopened: list[tuple[ShardRecord, int]] = []
            retried = 0
            for rec, last in entries:
                state = REOPEN[rec.state]
                revision = last
                if rec.state == "QUARANTINED":
                    retried += 1
                new = rec
                # Every shard not done starts with a fresh set of attempts: failures of the
                # first run (what made it fail, often) must not count against the second.
                if state != rec.state or rec.leases or (state == "TODO" and rec.failures):
                    requeued = state == "TODO" and rec.state != "TODO"
                    new = replace(
                        rec,
                        state=state,
                        leases=[],
                        failures=0 if state == "TODO" else rec.failures,
                        seq=next_seq if requeued else rec.seq,
                    )
                    next_seq += requeued
                    revision = await self._store.update_shard(new, last=revision)
                reopened.append((new, revision))
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
                resume_key=key,
            )
            job.revision = await self._store.update_job(record, last=job.revision)
            job.record = record
            job.finish_failures = 0
            job.adopt_shards(
                reopened,
                now=self._clock(),
                wall_now=time.time(),
                lease_s=job.spec.fault.lease_s,
                grace_s=self._lease_grace_s,
            )
            self._publish_job_gauges()
            log.info(
                "job %s resumed: %d shards done, %d quarantined ones retried, %d to run",
                job.id,
                job.counts["DONE"],
                retried,
                job.counts["TODO"],
            )
            self._emit(self._event(job, "state"))
        # Nothing may be left to run (a job cancelled as its last shard committed).
        await self.settle(job)
        return ResumeReply(
            state=job.record.state,
            shards_done=job.record.shards_done if job.ended else job.counts["DONE"],
            shards_retried=retried,
            shards_todo=0 if job.ended else job.counts["TODO"],
        )

    async def _reclaim_output(self, job: Job) -> None:
        """The job's output root is its own again for a resume, or NotResumable: a job that
        ended with nothing committed let go of it, and another may have taken it since."""
        output = self._open_output(job.spec.output.uri)
        owner = await asyncio.to_thread(output.reclaim, job.id)
        if owner is not None and owner.job != job.id:
            raise NotResumable(
                f"job {job.id} ended with nothing committed and let go of its output root; "
                f"{job.spec.output.uri} belongs to job {owner.job} now. Submit the job again "
                "with another output.uri"
            )

    # -- reading ---------------------------------------------------------------------------

    def status(
        self,
        job_id: str = "",
        *,
        include_spec: bool = False,
        include_leases: bool = False,
        active_only: bool = False,
        limit: int = 0,
        after: str = "",
    ) -> StatusReply:
        if limit < 0:
            raise BadRequest(f"limit must be 0 (the page size) or more, not {limit}")
        if job_id:
            job = self.jobs.get(job_id)
            if job is None:
                if job_id in self.rejected:
                    return StatusReply(jobs=[], rejected={job_id: self.rejected[job_id]})
                raise JobNotFound(f"no job {job_id!r}")
            jobs = [job]
        else:
            # A page at a time, in id order: every job in one reply would outgrow NATS's
            # largest message once a few thousand jobs are kept.
            ids = sorted(i for i in self.jobs if i > after)
            chosen = [self.jobs[i] for i in ids if not (active_only and self.jobs[i].ended)]
            jobs, more = chosen[: limit or STATUS_PAGE], chosen[limit or STATUS_PAGE :]
        now = self._clock()
        return StatusReply(
            jobs=[
                describe(j, now=now, include_spec=include_spec, include_leases=include_leases)
                for j in jobs
            ],
            rejected={} if job_id or after else dict(self.rejected),
            next=jobs[-1].id if not job_id and more else "",
        )

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
                if not expired(job) or self.jobs.get(job.id) is not job:
                    return None
                await self._store.forget_job(job.id)
                del self.jobs[job.id]
                return job.id

        candidates = [j for j in self.jobs.values() if expired(j)][:limit]
        gone: list[str] = []
        for start in range(0, len(candidates), FORGET_AT_ONCE):
            chunk = candidates[start : start + FORGET_AT_ONCE]
            # Purges are idempotent: if one fails, the next pass purges that job again.
            gone += [i for i in await asyncio.gather(*(forget(j) for j in chunk)) if i]
        if gone:
            self._publish_job_gauges()
        return gone

    def running_jobs(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state == "RUNNING"]

    def _event(self, job: Job, kind: EventKind) -> JobEvent:
        return job_event(job, kind)

    def _publish_job_gauges(self) -> None:
        counts = Counter(j.state for j in self.jobs.values())
        for state in ("SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"):
            metrics.JOBS.labels(state).set(counts[state])
