"""The moves a shard and a job may make: DESIGN.md section 4 in code.

Shards: TODO → DOING (a lease) → DONE (a commit), back to the tail of TODO (a release or an
expiry with attempts left), or QUARANTINED (attempts exhausted, or a commit record no attempt
of this job can replace). DOING → DOING is a change within the state: a renewal, a second
(speculative) lease, one of two leases ending. DONE and QUARANTINED are final while the job runs.

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

from ebb.common.messages import JobState, ShardState

from .errors import IllegalTransition
from .store import ShardRecord

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
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"a shard cannot go from {old} to {new}")


def check_job_transition(old: JobState, new: JobState) -> None:
    """Raise IllegalTransition unless a job may go from `old` to `new`."""
    if new not in JOB_TRANSITIONS[old]:
        raise IllegalTransition(f"a job cannot go from {old} to {new}")


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
