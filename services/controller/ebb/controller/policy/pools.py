"""Which pool a group's workers go to: the one its spec asks for (`resources.pool`), or, for
`auto`, the one the WPAI placement policy gives it by its kind.

58.com's WPAI platform places batch jobs by kind: a short job, cheap to run again, goes to
the mixed pool first (nodes lent by online services, reclaimed when online work comes back);
a long one to the offline pool first, where nothing reclaims it; and a job whose workers were
reclaimed, over and over, prefers the offline pool from then on, however short it looks.

A pool mode says where a group's pods may go and where they go first:

- `offline`: the offline pool only;
- `any`: the offline pool first, then mixed nodes the tide has lent;
- `mixed`: lent mixed nodes first, then the offline pool.

Pure functions of plain values: the Kubernetes backend feeds them each pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ebb.common.job.placement import PoolMode, asked_pool

from .capacity import Bin

OFFLINE = "offline"
MIXED = "mixed"


@dataclass(frozen=True, kw_only=True)
class PoolPolicy:
    """How `pool: auto` is decided."""

    short_job_s: float = 1800.0
    """A job (or a tier of one) expected to finish within this many seconds goes to lent
    mixed nodes first (`mixed`); a longer one, or one whose expected time is not known yet
    (no shard committed), to the offline pool first (`any`)..."""
    reclaims_to_offline: int = 3
    """...and a job whose workers the mixed pool took back this many times (drained by the
    tide, preempted by the scheduler) goes to the offline pool first from then on, whatever
    its length (0: every `auto` job does)."""


def expected_s(*, remaining: int, max_workers: int, shard_s: float) -> float | None:
    """Seconds a group needs to finish: its shards left, in waves of the workers it wants
    (its max, fewer if it has fewer shards left), each wave its usual shard time. None:
    not known (no shard of it committed yet)."""
    if remaining <= 0:
        return 0.0
    if shard_s <= 0:
        return None
    workers = max(1, min(max_workers, remaining))
    return math.ceil(remaining / workers) * shard_s


def decide(asked: str, *, expected: float | None, reclaims: int, policy: PoolPolicy) -> PoolMode:
    """The pool mode of a group whose spec says `pool: asked`, expected to need `expected`
    seconds more (None: not known), whose job's workers were reclaimed `reclaims` times."""
    mode = asked_pool(asked)
    if mode is not None:
        return mode
    if reclaims >= policy.reclaims_to_offline:
        return "any"
    if expected is None or expected > policy.short_job_s:
        return "any"
    return "mixed"


def allows(mode: PoolMode, pool: str) -> bool:
    """Pods placed in `mode` may run on a node of `pool`."""
    return pool == OFFLINE or (pool == MIXED and mode != "offline")


def preferred(mode: PoolMode) -> str:
    """The pool pods placed in `mode` go to first."""
    return MIXED if mode == "mixed" else OFFLINE


def preference(mode: PoolMode) -> Callable[[Bin], int]:
    """A capacity.Demand's order of bins for pods placed in `mode`: its preferred pool's
    first."""
    first = preferred(mode)
    return lambda b: 0 if b.pool == first else 1
