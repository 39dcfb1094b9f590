"""The moves a shard and a job may make: DESIGN.md section 4 in code.

Shards: TODO → DOING (a lease) → DONE (a commit), back to the tail of TODO (a release or an
expiry with attempts left), or QUARANTINED (attempts exhausted, or a commit record no attempt
of this job can replace). DOING → DOING is a change within the state: a renewal, a second
(speculative) lease, one of two leases ending. DONE and QUARANTINED are final while the job runs.

A shard may also be split: an attempt that had to stop commits the rows it finished as a part
(the shard goes DOING → DONE by that part, its record naming the remainder), and the rest is a
new shard, TODO at the head of the queue. The part's record is the one durable transition; the
remainder's own record follows it, and a master that died in between creates it on load
(`missing_remainders`).

A job in tiers (`JobSpec.tiers`) hands its rows on: a shard DONE in a tier before the last
names, in the same record, the shard of the next tier that reads its committed output (its
`handoff`), whose own record follows, created on load if a master died in between
(`missing_successors`), as a remainder's is.

Resuming an ended job (FAILED or CANCELLED) is the one way back: it moves its shards by
`REOPEN`, outside the lease protocol, while no lease of the job is current. What was
committed stays DONE; everything else is queued again.

Jobs: SUBMITTED → RUNNING once its shards are planned and written; a job may end before that
(FAILED: its planning was given up, or the controller found it cannot run; CANCELLED: a
user's wish). RUNNING ends SUCCEEDED, FAILED or CANCELLED. A FAILED or CANCELLED job runs
again when resumed; SUCCEEDED is final.
"""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

from ebb.common import lifecycle
from ebb.common.data.layout import attempt_dir
from ebb.common.messaging.messages import HandoffPart, JobState, ShardSpec, ShardState, rest_of

from ..errors import IllegalTransition, TableCorrupt
from .records import ShardRecord

SHARD_STATES: tuple[ShardState, ...] = get_args(ShardState)
JOB_STATES: tuple[JobState, ...] = get_args(JobState)

TRANSITIONS: dict[ShardState, frozenset[ShardState]] = {
    "TODO": frozenset({"DOING"}),
    "DOING": frozenset({"DOING", "TODO", "DONE", "QUARANTINED"}),
    "DONE": frozenset(),
    "QUARANTINED": frozenset(),
}


REOPEN: dict[ShardState, ShardState] = {
    "TODO": "TODO",
    "DOING": "TODO",  # its lease died with the job: the holder was told the job ended
    "DONE": "DONE",
    "QUARANTINED": "TODO",  # retried, with a fresh set of attempts
}
"""Where each shard of a resumed job goes."""


JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    "SUBMITTED": frozenset({"RUNNING", "FAILED", "CANCELLED"}),
    "RUNNING": frozenset({"SUCCEEDED", "FAILED", "CANCELLED"}),
    "SUCCEEDED": frozenset(),
    "FAILED": frozenset({"RUNNING"}),  # resumed
    "CANCELLED": frozenset({"RUNNING"}),  # resumed
}


def check_transition(old: ShardState, new: ShardState) -> None:
    """Raise IllegalTransition unless a shard may go from `old` to `new`."""
    lifecycle.check(TRANSITIONS, old, new, what="a shard", error=IllegalTransition)


def check_job_transition(old: JobState, new: JobState) -> None:
    """Raise IllegalTransition unless a job may go from `old` to `new`."""
    lifecycle.check(JOB_TRANSITIONS, old, new, what="a job", error=IllegalTransition)


def reopen(records: list[ShardRecord]) -> list[ShardRecord]:
    """The records of a resumed job's shards, by `REOPEN`: each one that does not change is
    returned as it is. A shard queued again goes behind every shard queued so far, in the
    order given.

    Every shard not done starts with a fresh set of attempts: failures of the first run
    (what made it fail, often) must not count against the second."""
    next_seq = max((r.seq for r in records), default=-1) + 1
    reopened: list[ShardRecord] = []
    for record in records:
        state = REOPEN[record.state]
        new = record
        if state != record.state or record.leases or (state == "TODO" and record.failures):
            requeued = state == "TODO" and record.state != "TODO"
            new = replace(
                record,
                state=state,
                leases=[],
                failures=0 if state == "TODO" else record.failures,
                seq=next_seq if requeued else record.seq,
            )
            next_seq += requeued
        reopened.append(new)
    return reopened


def remainder_record(job: str, part: ShardRecord, *, seq: int, half: bool = False) -> ShardRecord:
    """The TODO record of the shard a split leaves after `part` (DONE, with a remainder):
    its `remainder`, or (`half`) the second half of its rest, `remainder_half`."""
    spec = part.remainder_half if half else part.remainder
    assert spec is not None
    return ShardRecord(
        job=job,
        spec=spec,
        seq=seq,
        split_from=part.spec.index,
        tier=part.tier,
        handed_from=part.handed_from,
        suspect=part.suspect,  # what made it suspect may lie in the rows not done
    )


def handoff_record(job: str, done: ShardRecord, *, root: str, seq: int) -> ShardRecord:
    """The TODO record of the next tier's shard that reads `done`'s output (DONE in a tier
    before the last, its `handoff` set): the files its winning attempt committed under
    `root`, the root of `done`'s tier, in order."""
    assert done.handoff is not None
    parts = [HandoffPart(path=f"{root}/{f.path}", rows=f.rows) for f in done.files]
    spec = ShardSpec(
        index=done.handoff,
        path=f"{root}/{attempt_dir(done.spec.index, done.done_attempt)}",
        format="arrow",
        rows=sum(part.rows for part in parts),
        parts=parts,
    )
    return ShardRecord(job=job, spec=spec, seq=seq, tier=done.tier + 1, handed_from=done.spec.index)


def successor_of(origin: ShardRecord, successor: ShardRecord) -> bool:
    """`successor` was made for `origin`, whose record names its index: the rest of its split
    (`split_from`), or the hand-off of its output (`handed_from`, and no split of it)."""
    index = origin.spec.index
    rests = [r.index for r in (origin.remainder, origin.remainder_half) if r is not None]
    if successor.spec.index in rests:
        return successor.split_from == index
    if origin.handoff is not None and successor.spec.index == origin.handoff:
        return successor.handed_from == index and successor.split_from is None
    return False


def check_successors(records: list[ShardRecord]) -> None:
    """Raise TableCorrupt if a record some DONE record names as its successor was made for
    another (two DONEs naming one index): the job cannot be finished right."""
    by_index = {r.spec.index: r for r in records}
    for origin in records:
        named = [r.index for r in (origin.remainder, origin.remainder_half) if r is not None]
        named += [origin.handoff] if origin.handoff is not None else []
        for index in named:
            found = by_index.get(index)
            if found is not None and not successor_of(origin, found):
                raise TableCorrupt(
                    f"job {origin.job}: shard {origin.spec.index} names shard {index} as its "
                    f"successor, but that shard was made for shard "
                    f"{found.split_from if found.split_from is not None else found.handed_from}"
                    " (written by a master of an older version after a lost answer): its "
                    "rows cannot be placed; submit the job again into a new output root"
                )


def missing_successors(records: list[ShardRecord], roots: list[str]) -> list[ShardRecord]:
    """The records a DONE shard names (a split's remainder, a hand-off to the next tier)
    whose own record was never created (the master died between the two, or lost the
    answer to the DONE's write), in the order of their indexes. `roots`: each tier's root
    (`layout.tier_root`). TableCorrupt if an index named is held by a record made for
    another shard."""
    check_successors(records)
    present = {r.spec.index for r in records}
    remainders = missing_remainders(records)
    tail = max((r.seq for r in records), default=0) + 1
    handoffs = [
        handoff_record(r.job, r, root=roots[r.tier], seq=tail + k)
        for k, r in enumerate(
            sorted(
                (r for r in records if r.handoff is not None and r.handoff not in present),
                key=lambda r: r.handoff or 0,
            )
        )
    ]
    return sorted([*remainders, *handoffs], key=lambda r: r.spec.index)


def missing_remainders(records: list[ShardRecord]) -> list[ShardRecord]:
    """The records a split wrote in its part but whose own record was never created (the
    master died between the two): each a TODO shard at the head of the queue, in the order
    of their indexes, as they were split."""
    present = {r.spec.index for r in records}
    missing = sorted(
        (
            (rest.index, r, half)
            for r in records
            for half, rest in ((False, r.remainder), (True, r.remainder_half))
            if rest is not None and rest.index not in present
        ),
        key=lambda found: found[0],
    )
    head = min((r.seq for r in records), default=0)
    return [
        remainder_record(r.job, r, seq=head - len(missing) + k, half=half)
        for k, (_, r, half) in enumerate(missing)
    ]


def split_part(
    record: ShardRecord, split_at: int, *, index: int, halve_from: int = 0
) -> ShardRecord:
    """`record` DONE by a part of `split_at` rows (its files, rows and attempt are the
    commit's, set by the caller), naming the remainder `index`. A Parquet or Arrow part covering
    every row (a stop that came as the last row finished) is the whole shard.

    `halve_from`: a rest of at least that many rows (Parquet or Arrow, whose rows are exact)
    is cut in two, for the idle worker it was split for and the holder, idle now: the first
    half `index`, the second `index + 1` (`remainder_half`). 0: never."""
    spec = record.spec
    if spec.format in ("parquet", "arrow") and split_at >= spec.rows:
        return replace(record, split_at=0, remainder=None)
    rest = rest_of(spec, split_at, index=index)
    if not halve_from or rest.rows < halve_from or spec.format not in ("parquet", "arrow"):
        return replace(record, split_at=split_at, remainder=rest)
    first = replace(rest, rows=rest.rows // 2)
    second = rest_of(rest, first.rows, index=index + 1)
    return replace(record, split_at=split_at, remainder=first, remainder_half=second)
