"""Every change of a shard's record, and where a shard goes when an attempt ends.

State lives in two places with one rule between them: a transition is written to KV
(compare-and-set) first, and only then applied in memory and answered. The memory side is
what makes it fast; the KV side is what lets a restarted master carry on. Every change of a
shard's record goes through `ShardMoves.apply`, which checks the move against the transition
map (`ebb.shard_master.table.transitions`), writes it, and then updates every index the job keeps of
its shards.

Every method here is called with the shard's lock held: two transitions of one shard never
interleave, while different shards proceed concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

from ebb.common import failpoints
from ebb.common.data.layout import CommitRecord, attempt_dir, tier_root
from ebb.common.messaging.messages import ShardState

from .. import metrics
from ..errors import Deposed, ForeignCommit, IllegalTransition, StateUnsure
from .context import TableContext
from .expiry import Expiry, ExpiryHeap
from .jobs import Job, Shard
from .records import RecordStore, ShardRecord
from .tail import KEEP_REST_S
from .transitions import (
    check_transition,
    handoff_record,
    missing_successors,
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


def tier_roots(job: Job) -> list[str]:
    """Where each tier of the job commits: a tier before the last under the output root's
    `_tiers`, the last (or only) tier in the output root itself."""
    names = job.spec.tier_names()
    uri = job.spec.output.uri
    return [tier_root(uri, name) for name in names[:-1]] + [uri]


async def load_with_successors(store: RecordStore, job: Job) -> list[tuple[ShardRecord, int]]:
    """The job's shard records in the order of their indexes, with the shards that DONE
    records name (a split's remainder, a hand-off to the next tier) whose own record a master
    that died in between never created (created now)."""
    entries = await store.load_shards(job.id)
    for record in missing_successors([r for r, _ in entries], tier_roots(job)):
        revision = await store.create_shard(record)
        if revision is None:
            raise Deposed(f"shard {record.spec.index} of job {job.id} was created by someone else")
        what = "the rest of a split shard" if record.split_from is not None else "a hand-off"
        log.info("job %s: created shard %d, %s", job.id, record.spec.index, what)
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
            self._expiries.set_deadline(
                shard.deadlines, Expiry(now + lease_s, job.id, shard.index, token)
            )
            shard.granted.setdefault(token, now)
            shard.persisted[token] = now + lease_s * PERSISTED_PERIODS

    async def read_commit(self, job: Job, shard: Shard) -> CommitRecord | None:
        """The shard's commit record in the job's output, if there is one; ForeignCommit if it
        belongs to another job."""
        root = tier_roots(job)[job.tiers.index(job.tier_of(shard))]
        output = self._context.open_output(root)
        commit = await asyncio.to_thread(output.read_commit, shard.index)
        if commit is not None and commit.job != job.id:
            raise ForeignCommit(
                f"the commit record of shard {shard.index} in {root} belongs to job {commit.job}"
            )
        return commit

    async def record_done(
        self, job: Job, shard: Shard, commit: CommitRecord, *, seconds: float = 0.0
    ) -> None:
        """The shard's output is the commit record's. `seconds`: how long the winning attempt
        ran, if known. A commit record of a part (`split_at`) splits the shard: it is DONE by
        the part, and the rest is a shard of its own at the head of the queue. In a tier
        before the last, what it committed becomes a shard of the next tier (a hand-off);
        in a later tier, the hand-off it read is removed once every row of it is done."""
        hands_on = not job.is_last_tier(shard)
        creates = bool(commit.split_at) or hands_on
        # Counted before the DONE is applied: the job is not settled until they exist.
        job.creating += creates
        try:
            async with job.splitting if creates else contextlib.nullcontext():
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
                    row_errors=commit.row_errors,
                )
                # Indexes from the job's counter, moved past them before the DONE naming
                # them is written: whatever its answer, no other record is made with them.
                first = index = job.next_index
                if commit.split_at:
                    # Split for an idle worker: the rest, if worth two, goes to two.
                    halve = shard.halve_from if new.handed_from is None else 0
                    new = split_part(new, commit.split_at, index=index, halve_from=halve)
                    index += (new.remainder is not None) + (new.remainder_half is not None)
                if hands_on:
                    new = replace(new, handoff=index)
                    index += 1
                job.next_index = index
                try:
                    await self.apply(job, shard, new)
                except IllegalTransition:
                    job.next_index = first  # refused before anything was written
                    raise
                names = " split" if new.remainder is not None else ""
                names += " handoff" if new.handoff is not None else ""
                if names:
                    failpoints.hit(failpoints.MASTER_BEFORE_SUCCESSOR, f"{shard.index}{names}")
                if new.remainder is not None:
                    await self._queue_remainder(job, new)
                if new.remainder_half is not None:
                    await self._queue_remainder(job, new, half=True, holder=commit.worker)
                if new.handoff is not None:
                    await self._queue_handoff(job, new)
        finally:
            job.creating -= creates
        if new.handed_from is not None and new.remainder is None:
            await self._remove_handoff(job, new)
        if len(job.tiers) > 1:
            metrics.TIER_ROWS.labels(job.id, job.tier_of(shard).name).inc(commit.rows)
        if not hands_on:
            metrics.SHARDS_DONE.labels(job.id).inc()
            metrics.ROWS_DONE.labels(job.id).inc(commit.rows)
            metrics.ERROR_ROWS.labels(job.id).inc(commit.error_rows)
        self._context.event(job, "progress")

    async def _queue_handoff(self, job: Job, done: ShardRecord) -> None:
        """Create the record of the next tier's shard that reads what `done` committed, at
        the tail of that tier's queue (caller holds the job's `splitting` lock)."""
        root = tier_roots(job)[done.tier]
        record = handoff_record(job.id, done, root=root, seq=job.next_seq)
        revision = await self._create_successor(
            job, record, f"shard {done.spec.index} is done but its hand-off"
        )
        job.next_seq += 1
        handoff = Shard(record, revision)
        job.add_shard(handoff)
        job.enter(handoff)
        job.publish_gauges("TODO")

    async def _create_successor(self, job: Job, record: ShardRecord, what: str) -> int:
        """Write the record of a shard a DONE record names (a remainder, a hand-off); its
        revision. The DONE is in KV and this shard nowhere but in it: carrying on from memory
        after a failed write would finish the job without its rows, so the table is loaded
        again, which creates it (`missing_successors`)."""
        try:
            revision = await self._context.store.create_shard(record)
        except StateUnsure as e:
            raise StateUnsure(
                f"job {job.id}: {what} {record.spec.index} could not be written ({e})"
            ) from e
        if revision is None:
            raise Deposed(f"shard {record.spec.index} of job {job.id} was created by someone else")
        return revision

    async def _remove_handoff(self, job: Job, done: ShardRecord) -> None:
        """Every row of the hand-off `done` read is in the next tier's output: remove it.
        Best effort: what is left behind goes with the job's `_tiers` when it succeeds."""
        source = job.shards[done.handed_from or 0].record
        store = self._context.open_output(tier_roots(job)[source.tier])
        try:
            await asyncio.to_thread(
                store.remove, attempt_dir(source.spec.index, source.done_attempt)
            )
        except OSError as e:
            log.warning(
                "job %s: could not remove the hand-off of shard %d: %s",
                job.id,
                source.spec.index,
                e,
            )

    async def _queue_remainder(
        self, job: Job, part: ShardRecord, *, half: bool = False, holder: str = ""
    ) -> None:
        """Create the record of the shard a split leaves (`half`: the second half of a rest
        cut in two, kept a while for `holder`, the worker that committed the part), first in
        the queue (caller holds the job's `splitting` lock: its index is the next one)."""
        record = remainder_record(job.id, part, seq=job.head_seq - 1, half=half)
        revision = await self._create_successor(
            job, record, f"shard {part.spec.index} was split but its remainder"
        )
        job.head_seq -= 1
        remainder = Shard(record, revision)
        asker = next((w for w, i in job.split_asks.items() if i == part.spec.index), None)
        if asker is not None and not half:  # a rest split off for the worker that asked
            del job.split_asks[asker]
            remainder.kept_for = (asker, self._context.clock() + KEEP_REST_S)
        elif half and holder:  # not for a third worker's spare slot: the holder goes on
            remainder.kept_for = (holder, self._context.clock() + KEEP_REST_S)
        job.add_shard(remainder)
        job.enter(remainder, first=True)
        job.publish_gauges("TODO")
        metrics.SPLITS.labels(job.id).inc()
        log.info(
            "job %s: shard %d split after %d rows; the rest%s (%d rows) is shard %d",
            job.id,
            part.spec.index,
            part.split_at,
            "'s second half" if half else "",
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
