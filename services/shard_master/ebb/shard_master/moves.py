"""Every change of a shard's record, and where a shard goes when an attempt ends.

State lives in two places with one rule between them: a transition is written to KV
(compare-and-set) first, and only then applied in memory and answered. The memory side is
what makes it fast; the KV side is what lets a restarted master carry on. Every change of a
shard's record goes through `ShardMoves.apply`, which checks the move against the transition
map (`transitions.py`), writes it, and then updates every index the job keeps of its shards.

Every method here is called with the shard's lock held: two transitions of one shard never
interleave, while different shards proceed concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

import nats.errors

from ebb.common.layout import CommitRecord
from ebb.common.messages import ShardState

from . import metrics
from .context import TableContext
from .errors import Deposed, ForeignCommit, StateUnsure
from .expiry import Expiry, ExpiryHeap
from .jobs import Job, Shard
from .store import RecordStore, ShardRecord
from .tail import KEEP_REST_S
from .transitions import (
    check_transition,
    missing_remainders,
    remainder_record,
    split_part,
)

log = logging.getLogger(__name__)

_KEEP_ERRORS = 5
PERSISTED_PERIODS = 1.5
"""A lease is written to KV as lasting this many periods, and a renewal is written again only
once less than one period of that is left. Workers renew every third of a period, so every
other renewal is written, not each; and a master that takes over from KV still finds at least
1.5 - 2/3 of a period (plus its grace) on a live worker's lease, more than the third it needs
to hear the next renewal. It gives a dead worker's lease at most one period, as ever."""


async def load_with_remainders(store: RecordStore, job: str) -> list[tuple[ShardRecord, int]]:
    """The job's shard records in the order of their indexes, with the remainders of splits
    whose own record a master that died in between never created (created now)."""
    entries = await store.load_shards(job)
    for record in missing_remainders([r for r, _ in entries]):
        revision = await store.create_shard(record)
        if revision is None:
            raise Deposed(f"shard {record.spec.index} of job {job} was created by someone else")
        log.info("job %s: created shard %d, the rest of a split shard", job, record.spec.index)
        entries.append((record, revision))
    return sorted(entries, key=lambda e: e[0].spec.index)


class ShardMoves:
    def __init__(self, context: TableContext, *, expiries: ExpiryHeap) -> None:
        self._context = context
        self._expiries = expiries

    async def apply(
        self, job: Job, shard: Shard, new: ShardRecord, *, lease: tuple[str, float] | None = None
    ) -> None:
        """Move a shard to its new record: the one place a shard changes. The move is checked
        against the transition map, written to KV (compare-and-set), and only then applied to
        the shard and the job's indexes.

        `lease`: (token, lease_s) of a lease this record grants or renews, whose deadline
        starts now. Tokens the new record no longer holds lose their deadlines."""
        old = shard.record
        check_transition(old.state, new.state)
        requeued = new.state == "TODO" and old.state != "TODO"
        if requeued:  # behind every shard queued so far, after a restart too
            new = replace(new, seq=job.next_seq)
        shard.revision = await self._context.store.update_shard(new, last=shard.revision)
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
            shard.progress.pop(token, None)
            shard.progress_at.pop(token, None)
            shard.split_asked.discard(token)
        if lease is not None:
            token, lease_s = lease
            now = self._context.clock()
            shard.deadlines[token] = now + lease_s
            shard.granted.setdefault(token, now)
            shard.persisted[token] = now + lease_s * PERSISTED_PERIODS
            self._expiries.push(Expiry(now + lease_s, job.id, shard.index, token))

    async def read_commit(self, job: Job, shard: Shard) -> CommitRecord | None:
        """The shard's commit record in the job's output, if there is one; ForeignCommit if it
        belongs to another job."""
        output = self._context.open_output(job.spec.output.uri)
        commit = await asyncio.to_thread(output.read_commit, shard.index)
        if commit is not None and commit.job != job.id:
            raise ForeignCommit(
                f"the commit record of shard {shard.index} in {job.spec.output.uri} belongs "
                f"to job {commit.job}"
            )
        return commit

    async def record_done(
        self, job: Job, shard: Shard, commit: CommitRecord, *, seconds: float = 0.0
    ) -> None:
        """The shard's output is the commit record's. `seconds`: how long the winning attempt
        ran, if known. A commit record of a part (`split_at`) splits the shard: it is DONE by
        the part, and the rest is a shard of its own at the head of the queue."""
        splitting = job.splitting if commit.split_at else contextlib.nullcontext()
        async with splitting:
            new = replace(
                shard.record,
                state="DONE",
                leases=[],
                done_attempt=commit.attempt,
                seconds=seconds,
                rows=commit.rows,
                error_rows=commit.error_rows,
                files=commit.files,
                metrics=commit.metrics,
            )
            if commit.split_at:
                new = split_part(new, commit.split_at, index=len(job.shards))
            await self.apply(job, shard, new)
            if new.remainder is not None:
                await self._queue_remainder(job, new)
        metrics.SHARDS_DONE.labels(job.id).inc()
        metrics.ROWS_DONE.labels(job.id).inc(commit.rows)
        metrics.ERROR_ROWS.labels(job.id).inc(commit.error_rows)
        self._context.event(job, "progress")

    async def _queue_remainder(self, job: Job, part: ShardRecord) -> None:
        """Create the record of the shard a split leaves, first in the queue (caller holds
        the job's `splitting` lock: its index is the next one)."""
        record = remainder_record(job.id, part, seq=job.head_seq - 1)
        try:
            revision = await self._context.store.create_shard(record)
        except (nats.errors.Error, TimeoutError) as e:
            # The part is DONE in KV and the remainder nowhere but in its record: carrying on
            # from memory would finish the job without those rows. Load the table again,
            # which creates the remainder (`missing_remainders`).
            raise StateUnsure(
                f"job {job.id}: shard {part.spec.index} was split but its remainder "
                f"{record.spec.index} could not be written ({e})"
            ) from e
        if revision is None:
            raise Deposed(f"shard {record.spec.index} of job {job.id} was created by someone else")
        job.head_seq -= 1
        remainder = Shard(record, revision)
        asker = next((w for w, i in job.split_asks.items() if i == part.spec.index), None)
        if asker is not None:  # a straggler's rest: for the worker it was split for
            del job.split_asks[asker]
            remainder.kept_for = (asker, self._context.clock() + KEEP_REST_S)
        job.shards.append(remainder)
        job.enter(remainder, first=True)
        job.publish_gauges("TODO")
        metrics.SPLITS.labels(job.id).inc()
        log.info(
            "job %s: shard %d split after %d rows; the rest (%d rows) is shard %d",
            job.id,
            part.spec.index,
            part.split_at,
            record.spec.rows,
            record.spec.index,
        )

    async def drop_lease(
        self,
        job: Job,
        shard: Shard,
        token: str,
        *,
        reason: str,
        failed: bool,
        lost: bool = False,
        suspected: bool = False,
    ) -> ShardState:
        """End one lease of a shard and persist the outcome; returns the shard's new state.

        `failed`: the attempt counts against max_attempts. `lost`: it was lost with a worker
        the cluster took: forgiven, but counted against the job's worker_loss_cap.
        `suspected`: lost with a worker that crashed holding other shards too: not counted
        as failed, but as a loss, and the shard is leased alone from now on."""
        record = shard.record
        remaining = [lease for lease in record.leases if lease.token != token]
        foreign = False
        if not remaining:
            # The attempt may have committed its output and died before telling us: then the
            # shard is done, and retrying or quarantining it would lose or redo that output.
            try:
                commit = await self.read_commit(job, shard)
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
                await self.record_done(job, shard, commit)
                return "DONE"
        failures = record.failures + (1 if failed else 0)
        losses = record.losses + (1 if lost or suspected else 0)
        cap = job.spec.fault.worker_loss_cap()
        too_many_losses = (lost or suspected) and losses >= cap
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
            suspect=record.suspect or suspected,
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
