"""The moves a shard may make: DESIGN.md section 4 in code.

TODO → DOING (a lease) → DONE (a commit), back to the tail of TODO (a release or an expiry
with attempts left), or QUARANTINED (attempts exhausted, or a commit record no attempt of
this job can replace). DOING → DOING is a change within the state: a renewal, a second
(speculative) lease, one of two leases ending. DONE and QUARANTINED are final while the job runs.

Resuming an ended job (FAILED or CANCELLED) is the one way back: it moves its shards by
`REOPEN`, outside the lease protocol, while no lease of the job is current. What was
committed stays DONE; everything else is queued again.
"""

from __future__ import annotations

from typing import get_args

from ebb.common.messages import ShardState

from .errors import IllegalTransition

SHARD_STATES: tuple[ShardState, ...] = get_args(ShardState)

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


def check_transition(old: ShardState, new: ShardState) -> None:
    """Raise IllegalTransition unless a shard may go from `old` to `new`."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"a shard cannot go from {old} to {new}")
