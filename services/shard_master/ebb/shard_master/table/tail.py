"""The tail of a job: nothing is queued, some workers are idle, and the last shards still run.

Two answers, both to a lease request that finds nothing queued:
- the liquid split (`pick_split`): the holder of a running shard is asked (on its next
  renewal's reply) to stop at its next batch and commit the rows it has done. A holder that
  computes well below the job's usual rate (a straggler: a slow node, a noisy neighbour),
  judged by the rows it tells in its renewals, hands its whole rest to the idle worker; one
  at the usual rate (the job has fewer shards than workers: a Parquet file of one row group)
  has its rest cut in two, a half for the idle worker and a half for itself, and so on while
  workers are idle and halves are worth it (Dataflow's dynamic work rebalancing). Each rest is
  a shard at the head of the queue. Nothing is computed twice.
- speculation (`pick_speculative`): the shard that has run longest, well past the usual shard
  time, is leased a second time; the first commit wins. For holders that tell no progress
  (gone quiet, or a job with `split_tail` off), at the price of computing a shard twice.

`pick_split` and `pick_speculative` are pure choices over the job's shards; `ask_split`
records the ask (the holder hears it on its renewal's reply), and the table acts on the rest.
Last, `pace_wait`: how long a worker waiting on another tier of its job waits to ask again.
"""

from __future__ import annotations

import logging
import math
import statistics

from .. import metrics
from ..planning.sizing import fleet_shard_rows, least_rows
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
DECODE_ROWS_PER_S = 2_000_000.0
"""Rows a Parquet reader decodes a second, a low guess (a few narrow columns decode at tens
of millions): what a half that starts mid-group costs to reach its first row."""
HALVE_COST_S = 3.0
"""What cutting a rest in two costs its holder: it stops at a batch, commits its part, leases
the second half and starts reading it."""
HALVE_FROM_ROWS = 2_000
"""A rest of fewer rows than this is not cut in two when its part commits: it moves whole."""
RENEW_SOON_S = 1.0
"""How soon a holder renews while a split of its shard may be wanted: a worker waits idle,
or nothing is queued and the holder has told no rows yet (no rate to judge it by)."""


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


def pick_split(
    job: Job,
    tier: Tier,
    worker: str,
    *,
    now: float,
    min_gain_s: float,
    min_halve_gain_s: float = 5.0,
    halves: bool = True,
) -> tuple[Shard, bool] | None:
    """The running shard whose split would end the job's tail the most sooner, and whether
    its rest is to be cut in two (True) or moved whole (False): a straggler's if by more than
    `min_gain_s` (the rest moves after a renewal's round), a halving if by more than
    `min_halve_gain_s` once the holder's own cost is counted (HALVE_COST_S: its stop,
    commit and new lease; the idle worker waits for the split either way). Never the asking
    worker's own shard, nor one asked to split already.

    - A straggler (below STRAGGLER of the usual rate): its whole rest moves to the idle
      worker, at the usual rate: `left / rate - left / usual` sooner.
    - A holder at the usual rate (one shard for two workers: a Parquet file of one row
      group): its rest is cut in two, for the idle worker and the holder, each computing a
      half: `left / (2 * rate)` sooner, less what the second half's reader decodes again
      (the rows of its row group before it: Parquet cannot start mid-group). Only Parquet
      input, whose rows are exact; a hand-off's shards are not halved (their hand-off is
      removed once the last piece is done). Not at all without `halves`."""
    if not job.spec.fault.split_tail:
        return None
    holders = _holder_rates(job, tier, now=now)
    usual = usual_rate(tier, holders)
    if not usual:
        return None
    best: tuple[Shard, bool] | None = None
    best_excess = 0.0
    for shard, rate in holders:
        lease = shard.record.leases[0]
        if lease.worker == worker or lease.token in shard.split_asked:
            continue
        spec = shard.record.spec
        # Rows done by now, not at its last renewal: a holder renews every third of a lease
        # while no worker waits, and had done far more than it told when one comes.
        told_at = shard.progress_at.get(lease.token, now)
        done = min(spec.rows, shard.progress[lease.token] + rate * max(0.0, now - told_at))
        left = max(0, spec.rows - done)
        if rate < STRAGGLER * usual:
            excess, halve = left / rate - left / usual - min_gain_s, False
        elif halvable(job, shard, halves=halves):
            decoded = spec.row_offset + done + left / 2
            cost = HALVE_COST_S + decoded / DECODE_ROWS_PER_S
            excess, halve = left / (2 * rate) - cost - min_halve_gain_s, True
        else:
            continue
        if excess > best_excess:
            best, best_excess = (shard, halve), excess
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


def ask_split(
    job: Job,
    tier: Tier,
    worker: str,
    *,
    now: float,
    min_gain_s: float,
    min_halve_gain_s: float = 5.0,
    halves: bool = True,
) -> bool:
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
    picked = pick_split(
        job,
        tier,
        worker,
        now=now,
        min_gain_s=min_gain_s,
        min_halve_gain_s=min_halve_gain_s,
        halves=halves,
    )
    if picked is None:
        job.no_split_before = now + _SPLIT_LOOK_S
        return False
    shard, halve = picked
    token = shard.record.leases[0].token
    shard.split_asked.add(token)
    shard.halve_from = HALVE_FROM_ROWS if halve else 0
    job.split_asks[worker] = shard.index
    metrics.SPLIT_REQUESTS.labels(job.id).inc()
    log.info(
        "job %s: asking the holder of shard %d (%d of %d rows done) to split it%s",
        job.id,
        shard.index,
        shard.progress.get(token, 0),
        shard.record.spec.rows,
        ", its rest in two" if halve else "",
    )
    return True


def halvable(job: Job, shard: Shard, *, halves: bool = True) -> bool:
    """Whether the rest of `shard` may be cut in two for an idle worker (`pick_split`): Parquet
    input (exact rows), not a hand-off between tiers, the liquid tail on."""
    spec = shard.record.spec
    return (
        halves
        and job.spec.fault.split_tail
        and spec.format == "parquet"
        and shard.record.handed_from is None
    )


def untold(job: Job, tier: Tier, *, halves: bool = True) -> bool:
    """Whether a running shard of the tier that may be cut in halves has a holder that has
    told no rows yet: a split for an idle worker may be chosen as soon as it does."""
    for index in tier.doing:
        shard = job.shards[index]
        leases = shard.record.leases
        told = len(leases) == 1 and shard.progress.get(leases[0].token)
        if len(leases) == 1 and not told and halvable(job, shard, halves=halves):
            return True
    return False


def workers_usable(
    job: Job, tier: Tier, *, now: float, halves: bool = True, min_halve_gain_s: float = 5.0
) -> int:
    """How many workers the tier's shards left could keep busy, for the controller to scale
    on (the shards TODO or DOING, if no more): a shard whose rest may be cut in halves for
    idle workers counts as the pieces it may yet make. By the rows it has left against the
    rows the planner would have given a shard (a Parquet file of one row group is one shard
    of many such), and once its holder has told a rate, by its time left against what a cut
    costs (HALVE_COST_S and `min_halve_gain_s` a piece, as `pick_split` weighs a halving).
    Counted up to the tier's `max_workers`, so a job of many shards costs little."""
    most = job.spec.tier_resources(tier.name).max_workers
    usable = tier.counts["TODO"] + tier.counts["DOING"]
    if usable >= most:
        return usable
    target = job.spec.input.rows_per_shard or fleet_shard_rows(
        job.record.rows_total, most, least=least_rows(job.spec)
    )
    rates = {shard.index: rate for shard, rate in _holder_rates(job, tier, now=now)}
    piece_s = HALVE_COST_S + min_halve_gain_s
    for index in {*tier.doing, *tier.todo}:  # the queue may name a shard gone from TODO
        shard = job.shards[index]
        if shard.record.state not in ("TODO", "DOING") or not halvable(job, shard, halves=halves):
            continue
        done = max((shard.progress.get(ls.token, 0) for ls in shard.record.leases), default=0)
        left = max(0, shard.record.spec.rows - done)
        pieces = max(1, min(math.ceil(left / max(1, target)), left // HALVE_FROM_ROWS))
        rate = rates.get(index)
        if rate:
            pieces = min(pieces, max(1, int(left / rate / piece_s)))
        usable += pieces - 1
        if usable >= most:
            break
    return min(usable, most)


def renew_in(
    job: Job, tier: Tier, shard: Shard, token: str, *, now: float, idle_seen_s: float
) -> float | None:
    """How soon the holder of `token` on `shard` is to renew (RENEW_SOON_S), or None (at a
    third of its lease, as usual). Soon while the tier's queue is empty and a worker asked for
    a shard of it within `idle_seen_s` and found none, or before the holder's first rows: the
    split an idle worker waits for is chosen by the rates renewals tell and rides on a
    renewal's reply, so a holder renewing every ten seconds would keep it waiting twenty."""
    if not job.spec.fault.split_tail or tier.counts["TODO"]:
        return None
    if now - tier.idle_at < idle_seen_s or not shard.progress.get(token):
        return RENEW_SOON_S
    return None


PACE_WAIT_MIN_S = 0.1


def pace_wait(other: Tier, *, most: float) -> float:
    """How long a worker waiting on another tier (for its hand-offs, or for room among its
    hand-offs) waits to ask again: a quarter of that tier's usual shard time, so that short
    shards do not stop and go at the pace of the polls; never below a tenth of a second, nor
    above `most` (the usual wait)."""
    if not other.durations:
        return most
    return min(most, max(PACE_WAIT_MIN_S, statistics.median(other.durations) / 4))


def room_beyond_two(job: Job, tier: Tier) -> bool:
    """Whether a worker holding two shards of the tier may lease a third: only while the
    queue keeps two for each worker the tier may yet have beyond those holding some (up to
    its `max_workers`), so that a worker whose models loaded first does not take a small
    job's shards from those still loading theirs."""
    holders = {lease.worker for i in tier.doing for lease in job.shards[i].record.leases}
    most = job.spec.tier_resources(tier.name).max_workers
    return tier.counts["TODO"] > 2 * max(0, most - len(holders))
