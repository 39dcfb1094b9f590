"""The tail of a job: nothing is queued, some workers are idle, and the last shards still run.

Two answers, both to a lease request that finds nothing queued:
- the liquid split (`pick_split`): the holder of a running shard that computes well below the
  job's usual rate (a straggler: a slow node, a noisy neighbour), judged by the rows it tells
  in its renewals, is asked (on its next renewal's reply) to stop at its next batch and commit
  the rows it has done; the rest becomes a shard at the head of the queue, for the idle
  worker. Nothing is computed twice.
- speculation (`pick_speculative`): the shard that has run longest, well past the usual shard
  time, is leased a second time; the first commit wins. For holders that tell no progress
  (gone quiet, or a job with `split_tail` off), at the price of computing a shard twice.

`pick_split` and `pick_speculative` are pure choices over the job's shards; `ask_split`
records the ask (the holder hears it on its renewal's reply), and the table acts on the rest.
Last, `pace_wait`: how long a worker waiting on another tier of its job waits to ask again.
"""

from __future__ import annotations

import logging
import statistics

from .. import metrics
from .jobs import Job, Shard, Tier

log = logging.getLogger(__name__)

_SPLIT_LOOK_S = 1.0
"""Between two looks for a straggler to split when none was found."""
KEEP_REST_S = 5.0
"""How long a straggler's rest is kept for the idle worker it was split for: that worker asks
again within a couple of seconds of the `wait` it was answered."""
STRAGGLER = 0.6
"""A holder computing at less than this share of the job's usual rate is a straggler: the
rest of its shard goes faster elsewhere."""


def usual_rate(tier: Tier, holders: list[tuple[Shard, float]]) -> float | None:
    """The tier's usual rows a second for one attempt: the median of the attempts that won,
    or before any did, of the holders' (`_holder_rates`). None if nothing tells."""
    if tier.rates:
        return statistics.median(tier.rates)
    return statistics.median(rate for _, rate in holders) if holders else None


def _holder_rates(job: Job, tier: Tier, *, now: float) -> list[tuple[Shard, float]]:
    """Each running shard of the tier with one lease whose holder has told rows done, with
    its rate."""
    rates: list[tuple[Shard, float]] = []
    for index in tier.doing:
        shard = job.shards[index]
        leases = shard.record.leases
        if len(leases) != 1:
            continue
        token = leases[0].token
        rows = shard.progress.get(token, 0)
        told = shard.progress_at.get(token, now)
        ran = told - shard.granted.get(token, told)
        if rows > 0 and ran > 0:
            rates.append((shard, rows / ran))
    return rates


def pick_split(job: Job, tier: Tier, worker: str, *, now: float, min_gain_s: float) -> Shard | None:
    """The running shard whose rest would end the most sooner on a worker at the job's usual
    rate than on its holder (a straggler), if by more than `min_gain_s` (a split costs a
    renewal's round and a commit). A split of a holder at the usual rate gains nothing: the
    rest would only move from one worker to another. Never the asking worker's own shard,
    nor one asked to split already."""
    if not job.spec.fault.split_tail:
        return None
    holders = _holder_rates(job, tier, now=now)
    usual = usual_rate(tier, holders)
    if not usual:
        return None
    best: Shard | None = None
    best_gain = min_gain_s
    for shard, rate in holders:
        lease = shard.record.leases[0]
        if lease.worker == worker or lease.token in shard.split_asked or rate >= STRAGGLER * usual:
            continue
        left = max(0, shard.record.spec.rows - shard.progress[lease.token])
        gain = left / rate - left / usual
        if gain > best_gain:
            best, best_gain = shard, gain
    return best


def pick_speculative(
    job: Job, tier: Tier, worker: str, *, now: float, speculate_after_s: float
) -> Shard | None:
    """The running shard that has run longest, if it runs well past the usual shard time.

    Only once some shards have finished (so that "usual" means something), only a shard
    with a single attempt running and no split asked of it, and never one the asking worker
    holds itself.
    """
    if not job.spec.fault.speculative or not tier.durations:
        return None
    min_age = max(speculate_after_s, 1.5 * statistics.median(tier.durations))
    best: Shard | None = None
    best_age = 0.0
    for index in tier.doing:
        shard = job.shards[index]
        leases = shard.record.leases
        if len(leases) != 1 or leases[0].worker == worker or leases[0].token in shard.split_asked:
            continue
        deadline = shard.deadlines.get(leases[0].token)
        if deadline is not None and deadline - now < job.spec.fault.lease_s / 3:
            # Its holder has missed two renewals: dead, most likely, and its lease runs out
            # soon. A shard that kills its worker would kill the speculating one too.
            continue
        age = now - shard.granted.get(leases[0].token, now)
        if age >= min_age and age > best_age:
            best, best_age = shard, age
    return best


def ask_split(job: Job, tier: Tier, worker: str, *, now: float, min_gain_s: float) -> bool:
    """At the tail: ask a holder to split its shard for `worker`, idle (its renewal's reply
    carries the ask). True while a split asked for this worker is under way."""
    asked = job.split_asks.get(worker)
    if asked is not None:
        pending = job.shards[asked]
        if pending.record.state == "DOING" and pending.split_asked:
            return True
        del job.split_asks[worker]
    if now < job.no_split_before:
        return False
    shard = pick_split(job, tier, worker, now=now, min_gain_s=min_gain_s)
    if shard is None:
        job.no_split_before = now + _SPLIT_LOOK_S
        return False
    token = shard.record.leases[0].token
    shard.split_asked.add(token)
    job.split_asks[worker] = shard.index
    metrics.SPLIT_REQUESTS.labels(job.id).inc()
    log.info(
        "job %s: asking the holder of shard %d (%d of %d rows done) to split it",
        job.id,
        shard.index,
        shard.progress.get(token, 0),
        shard.record.spec.rows,
    )
    return True


PACE_WAIT_MIN_S = 0.1


def pace_wait(other: Tier, *, most: float) -> float:
    """How long a worker waiting on another tier (for its hand-offs, or for room among its
    hand-offs) waits to ask again: a quarter of that tier's usual shard time, so that short
    shards do not stop and go at the pace of the polls; never below a tenth of a second, nor
    above `most` (the usual wait)."""
    if not other.durations:
        return most
    return min(most, max(PACE_WAIT_MIN_S, statistics.median(other.durations) / 4))
