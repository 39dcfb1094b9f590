"""The tail of a job: nothing is queued, some workers are idle, and the last shards still run.

Two answers, both to a lease request that finds nothing queued:
- the liquid split (`pick_split`): the holder of the running shard with the most work left,
  judged by the rows it tells in its renewals, is asked (on its next renewal's reply) to stop
  at its next batch and commit the rows it has done; the rest becomes a shard at the head of
  the queue, for the idle worker. Nothing is computed twice.
- speculation (`pick_speculative`): the shard that has run longest, well past the usual shard
  time, is leased a second time; the first commit wins. For holders that tell no progress
  (gone quiet, or a job with `split_tail` off), at the price of computing a shard twice.

Both are pure choices over the job's shards; the table acts on them.
"""

from __future__ import annotations

import statistics

from .jobs import Job, Shard


def pick_split(job: Job, worker: str, *, now: float, min_left_s: float) -> Shard | None:
    """The running shard whose holder would take longest to finish it alone, if that is more
    than `min_left_s` (a split costs a renewal's round and a commit): one lease, a holder
    other than `worker` that has told rows done, and no split asked of it already."""
    if not job.spec.fault.split_tail:
        return None
    best: Shard | None = None
    best_left = min_left_s
    for index in job.doing:
        shard = job.shards[index]
        leases = shard.record.leases
        if len(leases) != 1 or leases[0].worker == worker:
            continue
        token = leases[0].token
        rows = shard.progress.get(token, 0)
        ran = now - shard.granted.get(token, now)
        if token in shard.split_asked or rows <= 0 or ran <= 0:
            continue
        left_s = max(0, shard.record.spec.rows - rows) * ran / rows
        if left_s > best_left:
            best, best_left = shard, left_s
    return best


def pick_speculative(
    job: Job, worker: str, *, now: float, speculate_after_s: float
) -> Shard | None:
    """The running shard that has run longest, if it runs well past the usual shard time.

    Only once some shards have finished (so that "usual" means something), only a shard
    with a single attempt running and no split asked of it, and never one the asking worker
    holds itself.
    """
    if not job.spec.fault.speculative or not job.durations:
        return None
    min_age = max(speculate_after_s, 1.5 * statistics.median(job.durations))
    best: Shard | None = None
    best_age = 0.0
    for index in job.doing:
        shard = job.shards[index]
        leases = shard.record.leases
        if len(leases) != 1 or leases[0].worker == worker or leases[0].token in shard.split_asked:
            continue
        age = now - shard.granted.get(leases[0].token, now)
        if age >= min_age and age > best_age:
            best, best_age = shard, age
    return best
