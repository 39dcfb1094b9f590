"""A job and its shards in the master's memory: the records, and the indexes kept from them.

The indexes (the TODO queue, the DOING set, the count of shards per state, the row totals)
are derived from the shard records alone. They change in exactly two places: `adopt_shards`
builds them from scratch, and `ShardMoves.apply` moves one shard with `leave` and `enter`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections import Counter, deque
from dataclasses import replace

from ebb.common.job import JobSpec, accumulators
from ebb.common.messaging.messages import TERMINAL_JOB_STATES, JobState, ShardState

from .. import metrics
from ..errors import BadRequest
from .records import JobRecord, ShardRecord

log = logging.getLogger(__name__)

ERRORS_COUNTED = 1_000
"""Distinct row error messages a job counts at most (see `Job._count_errors`)."""

_KEEP_DURATIONS = 256


class Shard:
    __slots__ = (
        "deadlines",
        "granted",
        "halve_from",
        "kept_for",
        "lock",
        "persisted",
        "progress",
        "progress_at",
        "record",
        "revision",
        "split_asked",
    )

    def __init__(self, record: ShardRecord, revision: int) -> None:
        self.record = record
        self.revision = revision
        self.lock = asyncio.Lock()
        self.deadlines: dict[str, float] = {}
        """Active lease tokens and when each expires (monotonic)."""
        self.granted: dict[str, float] = {}
        """Active lease tokens and when each was granted (monotonic)."""
        self.persisted: dict[str, float] = {}
        """Active lease tokens and until when the record in KV says each lasts (monotonic):
        a renewal writes KV only when this is less than a period away."""
        self.progress: dict[str, int] = {}
        """Active lease tokens and the rows each holder last told it had done (in memory:
        told again on every renewal)."""
        self.progress_at: dict[str, float] = {}
        """When each of those counts last grew (monotonic): a holder's rate is its rows over
        the time to then, not to its latest renewal (which may have told nothing new)."""
        self.kept_for: tuple[str, float] | None = None
        """A straggler's rest: kept for the idle worker it was split for, until then
        (monotonic), so that the straggler, free the moment its part commits, does not
        take it back."""
        self.split_asked: set[str] = set()
        """Active lease tokens whose holders are asked to split (on their renewals' replies)."""
        self.halve_from = 0
        """Asked to split for an idle worker while its holder computes at the usual rate: a
        rest of at least this many rows is cut in two (`transitions.split_part`), for the
        idle worker and the holder. 0: one rest, as a straggler's or a drain's. In memory: a
        master that restarts meanwhile makes one rest."""

    @property
    def index(self) -> int:
        return self.record.spec.index


def named_index(record: ShardRecord) -> int:
    """The highest shard index `record` names: its own, its remainders', its hand-off's."""
    return max(
        record.spec.index,
        record.remainder.index if record.remainder is not None else -1,
        record.remainder_half.index if record.remainder_half is not None else -1,
        record.handoff if record.handoff is not None else -1,
    )


class Tier:
    """The indexes of one tier's shards (`JobSpec.tiers`; a job without tiers has one):
    each tier is leased, timed and sped up at its tail on its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.todo: deque[int] = deque()
        """Indexes of TODO shards in the order they are served. Taking from it is how a shard
        is picked, so an index may stay here a while after its shard left TODO: skip those."""
        self.doing: set[int] = set()
        self.counts: Counter[str] = Counter()
        self.rows_done = 0
        self.bytes_done = 0
        self.splits = 0
        """Its shards DONE by a part (their rest a shard of its own): a worker told to go, or
        the rest moved to an idle worker."""
        self.ready_workers: set[str] = set()
        """Workers of this tier that said their pipeline has started (in memory)."""
        self.durations: deque[float] = deque(maxlen=_KEEP_DURATIONS)
        self.rates: deque[float] = deque(maxlen=_KEEP_DURATIONS)
        """Rows a second of the attempts that won their shards (or parts), newest last."""
        self.idle_at = float("-inf")
        """When a worker last asked for a shard of this tier and found nothing queued (on the
        master's clock): its holders renew soon for a while after (`tail.renew_in`)."""

    @property
    def backlog(self) -> int:
        return self.counts["TODO"] + self.counts["DOING"]

    @property
    def shard_s(self) -> float:
        """The median time of its shards committed lately; 0 before the first."""
        return statistics.median(self.durations) if self.durations else 0.0


def visible(job: Job, owner: str | None) -> bool:
    """Whether the job is one `owner` may see: every job for None (the subjects without an
    owner: the admin, the services), else its own jobs alone."""
    return owner is None or job.record.owner == owner


class Job:
    def __init__(self, record: JobRecord, revision: int, spec: JobSpec) -> None:
        self.record = record
        self.revision = revision
        self.spec = spec
        self.lock = asyncio.Lock()
        self.shards: list[Shard] = []
        self.tiers = [Tier(name) for name in spec.tier_names()]
        self.doing: set[int] = set()
        """Every tier's running shards."""
        self.counts: Counter[str] = Counter()
        """Every tier's shards per state."""
        self.rows_done = 0
        """Rows of the last tier's shards done: the job's output."""
        self.error_rows = 0
        self.quarantined_rows = 0
        self.metric_specs = spec.pipeline.all_metrics()
        self.metrics: dict[str, accumulators.Partial] = {}
        """The partials of the job's metrics merged over its DONE shards, as `rows_done` is
        summed: each shard's once, as its winning attempt committed them."""
        self.errors: Counter[str] = Counter()
        """The row errors of its DONE shards (of the last tier), by message, as their
        commit records counted the most common of each."""
        self.creating = 0
        """Shards whose records are being written (the remainder of a split, the hand-off of
        a shard done to the next tier): the job is not settled while any is."""
        self.next_seq = 0
        self.head_seq = 0
        """Below every queued shard's seq: a remainder of a split shard goes first."""
        self.next_index = 0
        """The index the next shard made while the job runs (a split's remainder, a hand-off)
        takes: past every index a record of the job names (`adopt_shards`), moved on as soon
        as a DONE naming new ones is written. An index is given once, whatever a write's
        answer was."""
        self.splitting = asyncio.Lock()
        """Held across a split or a hand-off (the DONE naming the new shard, its record): two
        must not both take `next_index`. Taken with a shard's lock held, never the other way
        round."""
        self.finish_failures = 0
        self.ready_workers: set[str] = set()
        """Workers that said their pipeline has started (in memory: told again on every
        lease and renewal, so a new master hears within a third of a lease)."""
        self.no_split_before = 0.0
        """No straggler was found then: the next look waits a little (monotonic), so that a
        fleet of idle workers polling does not scan the running shards at every poll."""
        self.split_asks: dict[str, int] = {}
        """Idle workers, each with the shard whose holder was asked to split for it: one
        split at a time per idle worker, not one per lease request while it waits."""
        self.mlflow_error = ""
        """Why its MLflow run is not logged yet, as the tracking store said last time (in
        memory: a new master tries again at once)."""
        self.ended_workers: set[str] = set()
        """Workers the controller said have ended (a repeat of its word counts once)."""
        self.waiting: dict[str, str] = {}
        """Per tier ("" for a job without tiers): why no node could take its workers, as
        the controller said (in memory: it says it again to a master that lost it)."""

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> JobState:
        return self.record.state

    @property
    def ended(self) -> bool:
        return self.record.state in TERMINAL_JOB_STATES

    def adopt_shards(
        self,
        entries: list[tuple[ShardRecord, int]],
        *,
        now: float,
        wall_now: float,
        lease_s: float,
        grace_s: float,
    ) -> None:
        """Build the in-memory table from persisted shard records (after planning or a restart).

        `now` is the monotonic clock, `wall_now` the wall clock the records' times are on."""
        self.shards = [
            Shard(rec, rev) for rec, rev in sorted(entries, key=lambda e: e[0].spec.index)
        ]
        self.next_index = max((named_index(s.record) for s in self.shards), default=-1) + 1
        self.tiers = [Tier(name) for name in self.spec.tier_names()]
        self.doing.clear()
        self.counts.clear()
        self.rows_done = self.error_rows = self.quarantined_rows = 0
        self.metrics = {}
        self.errors = Counter()
        for shard in self.shards:
            rec = shard.record
            self.next_seq = max(self.next_seq, rec.seq + 1)
            self.head_seq = min(self.head_seq, rec.seq)
            if rec.state != "TODO":  # queued below, in the order of their seq
                self.enter(shard)
            for lease in rec.leases:
                left = lease_s
                if lease.expires_at:
                    recorded = max(0.0, lease.expires_at - wall_now)
                    left = min(lease_s, recorded + grace_s)
                    shard.persisted[lease.token] = now + recorded
                shard.deadlines[lease.token] = now + left
                ran = max(0.0, wall_now - lease.granted_at) if lease.granted_at else 0.0
                shard.granted[lease.token] = now - ran
        for shard in sorted(
            (s for s in self.shards if s.record.state == "TODO"), key=lambda s: s.record.seq
        ):
            self.enter(shard)
        self.publish_gauges()

    def add_shard(self, shard: Shard) -> None:
        """A shard made while the job runs, whose record was just created: indexes are
        dense, so it is the next one."""
        if shard.index != len(self.shards):
            raise ValueError(
                f"job {self.id}: shard {shard.index} made where shard {len(self.shards)} was due"
            )
        self.shards.append(shard)

    @property
    def shards_total(self) -> int:
        """Shards of the job, remainders of split shards included."""
        return len(self.shards) if self.shards else self.record.shards_total

    @property
    def settled(self) -> bool:
        """Every shard is DONE or QUARANTINED, and none is on its way."""
        done = self.counts["DONE"] + self.counts["QUARANTINED"]
        return done == self.shards_total and not self.creating

    def tier_named(self, name: str) -> Tier:
        """The tier a worker names; BadRequest for a tier the job has not."""
        names = [tier.name for tier in self.tiers]
        if name not in names:
            raise BadRequest(f"job {self.id} has no tier {name!r}; its tiers: {names}")
        return self.tiers[names.index(name)]

    def tier_of(self, shard: Shard) -> Tier:
        return self.tiers[min(shard.record.tier, len(self.tiers) - 1)]

    def is_last_tier(self, shard: Shard) -> bool:
        return shard.record.tier >= len(self.tiers) - 1

    def held_back(self, tier: Tier) -> bool:
        """Backpressure: no more shards of `tier` are leased while the next tier has as many
        hand-offs waiting (TODO) as `handoff_bound` says. The hand-offs on disk are then at
        most those, plus the shards both tiers hold."""
        at = self.tiers.index(tier)
        if at + 1 >= len(self.tiers):
            return False
        return self.tiers[at + 1].counts["TODO"] >= self.handoff_bound(tier)

    def handoff_bound(self, tier: Tier) -> int:
        """The hand-offs waiting for the tier after `tier` at which `tier` is held back:
        twice the workers the next tier may run or, once both tiers have shards done, if
        more, what those workers get through in the time one of `tier`'s shards takes (the
        median of each tier's), and one more each. A tier held back and let go hands on the
        shards it leases then only that much later: a shorter queue runs dry before they
        come, and the next tier's workers wait (a tier let go all at once comes back all at
        once, in waves)."""
        after = self.tiers[self.tiers.index(tier) + 1]
        most = self.spec.tier_resources(after.name).max_workers
        bound = max(2, 2 * most)
        if tier.durations and after.durations:
            ratio = statistics.median(tier.durations) / statistics.median(after.durations)
            bound = max(bound, most + math.ceil(most * ratio))
        return bound

    def enter(self, shard: Shard, *, first: bool = False) -> None:
        """Add the shard to the indexes of the state its record is in. `first`: a TODO shard
        goes to the head of the queue (a split's remainder), not the tail."""
        rec = shard.record
        tier = self.tier_of(shard)
        self.counts[rec.state] += 1
        tier.counts[rec.state] += 1
        if rec.state == "TODO" and first:
            tier.todo.appendleft(shard.index)
        elif rec.state == "TODO":
            tier.todo.append(shard.index)  # the tail: others get their turn first
        elif rec.state == "DOING":
            self.doing.add(shard.index)
            tier.doing.add(shard.index)
        elif rec.state == "DONE":
            tier.rows_done += rec.rows
            tier.bytes_done += sum(f.bytes for f in rec.files)
            tier.splits += bool(rec.split_at)
            if self.is_last_tier(shard):  # an earlier tier's rows are the next one's input
                self.rows_done += rec.rows
                self.error_rows += rec.error_rows
                # The last tier's partials count the rows of the output, those of the tiers
                # before too (their values come in the hand-off). An earlier tier's count
                # rows the output may never hold.
                if rec.metrics:
                    self._merge_metrics(shard)
                if rec.row_errors:
                    self._count_errors(shard)
            if rec.seconds > 0:
                if not rec.split_at:  # a part is no shard's whole time
                    tier.durations.append(rec.seconds)
                if rec.rows > 0:
                    tier.rates.append(rec.rows / rec.seconds)
        elif rec.state == "QUARANTINED":
            self.quarantined_rows += rec.spec.rows

    def _count_errors(self, shard: Shard) -> None:
        """Count a DONE shard's most common row errors into the job's, and let go of its
        own, as `_merge_metrics` does. Past ERRORS_COUNTED messages only the most common half
        stay: the job's summary quotes the most common few."""
        self.errors.update(shard.record.row_errors)
        if len(self.errors) > ERRORS_COUNTED:
            self.errors = Counter(dict(self.errors.most_common(ERRORS_COUNTED // 2)))
        shard.record = replace(shard.record, row_errors={})

    def _merge_metrics(self, shard: Shard) -> None:
        """Merge a DONE shard's partials into the job's, and let go of its own: a DONE
        record is never written again (DONE is final), and KV keeps them for a restart or a
        resume, which merge them again. A job of thousands of shards need not hold
        thousands of histograms."""
        try:
            self.metrics = accumulators.merge_named(
                self.metric_specs, self.metrics, shard.record.metrics
            )
        except ValueError as e:
            # Written by another version, or damaged: left out, said in the log, rather
            # than failing the job or its status.
            log.warning("job %s: shard %d's metrics left out: %s", self.id, shard.index, e)
        shard.record = replace(shard.record, metrics={})

    def wait_for_placement(self, tier: str, reason: str) -> None:
        """The controller's word on whether tier `tier`'s workers can be placed: `reason`
        why not, or "" (they can)."""
        self.tier_named(tier)
        if reason:
            self.waiting[tier] = reason
        else:
            self.waiting.pop(tier, None)

    def leave(self, shard: Shard, state: ShardState) -> None:
        """Take the shard out of the indexes of `state`, the state it is leaving. (TODO's
        queue needs nothing: the shard was taken from it when it was picked.)"""
        tier = self.tier_of(shard)
        self.counts[state] -= 1
        tier.counts[state] -= 1
        if state == "DOING":
            self.doing.discard(shard.index)
            tier.doing.discard(shard.index)

    def holds(self, shard: Shard) -> bool:
        """`shard` is this job's current shard of its index: not of an earlier run (the job
        was resumed since) and the job has not ended (which releases its shards)."""
        index = shard.index
        return 0 <= index < len(self.shards) and self.shards[index] is shard

    def held_by(self, worker: str, tier: Tier | None = None) -> list[Shard]:
        """The running shards `worker` holds a lease of (of `tier`, if given: a worker runs
        one tier)."""
        return [
            shard
            for shard in (self.shards[i] for i in (tier or self).doing)
            if any(lease.worker == worker for lease in shard.record.leases)
        ]

    def release_shards(self) -> None:
        """Forget the shards of an ended job: its record keeps the final counts."""
        self.shards = []
        for tier in self.tiers:
            tier.todo.clear()
            tier.doing.clear()
        self.doing.clear()

    def publish_gauges(self, *states: ShardState) -> None:
        for state in states or ("TODO", "DOING", "DONE", "QUARANTINED"):
            metrics.SHARDS.labels(self.id, state).set(self.counts[state])
            if len(self.tiers) > 1:
                for tier in self.tiers:
                    metrics.TIER_SHARDS.labels(self.id, tier.name, state).set(tier.counts[state])
