"""The transition maps of shards and jobs, and where a resumed job's shards go: pure, driven by
tables of cases."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from ebb.common.messaging.messages import ShardSpec, ShardState
from ebb.shard_master.errors import IllegalTransition
from ebb.shard_master.table.records import LeaseRecord, ShardRecord
from ebb.shard_master.table.transitions import (
    JOB_STATES,
    JOB_TRANSITIONS,
    SHARD_STATES,
    TRANSITIONS,
    check_job_transition,
    check_transition,
    reopen,
)

SHARD_MOVES = {
    ("TODO", "DOING"),  # a lease
    ("DOING", "DOING"),  # a renewal, a second (speculative) lease, one of two ending
    ("DOING", "TODO"),  # released, or expired, with attempts left
    ("DOING", "DONE"),
    ("DOING", "QUARANTINED"),
}
JOB_MOVES = {
    ("SUBMITTED", "RUNNING"),  # planned and written
    ("SUBMITTED", "FAILED"),  # planning given up, or the controller found it cannot run
    ("SUBMITTED", "CANCELLED"),  # cancelled before it was planned
    ("RUNNING", "SUCCEEDED"),
    ("RUNNING", "FAILED"),
    ("RUNNING", "CANCELLED"),
    ("FAILED", "RUNNING"),  # resumed
    ("CANCELLED", "RUNNING"),  # resumed
}
MAPS: dict[str, tuple[Mapping[Any, frozenset[Any]], set[tuple[str, str]], Callable[..., None]]] = {
    "shard": (TRANSITIONS, SHARD_MOVES, check_transition),
    "job": (JOB_TRANSITIONS, JOB_MOVES, check_job_transition),
}


@pytest.mark.parametrize(
    ("kind", "old", "new"),
    [
        *(("shard", old, new) for old, new in itertools.product(SHARD_STATES, SHARD_STATES)),
        *(("job", old, new) for old, new in itertools.product(JOB_STATES, JOB_STATES)),
    ],
)
def test_each_transition_map_allows_exactly_the_moves_of_the_design(
    kind: str, old: str, new: str
) -> None:
    transitions, moves, check = MAPS[kind]
    assert (new in transitions[old]) == ((old, new) in moves)
    if (old, new) in moves:
        check(old, new)
    else:
        with pytest.raises(IllegalTransition, match=f"a {kind} cannot go from {old} to {new}"):
            check(old, new)


def test_a_job_that_succeeded_goes_nowhere_and_an_ended_one_ends_only_once() -> None:
    assert JOB_TRANSITIONS["SUCCEEDED"] == frozenset()
    for ended in ("SUCCEEDED", "FAILED", "CANCELLED"):
        for again in ("SUCCEEDED", "FAILED", "CANCELLED", "SUBMITTED"):
            with pytest.raises(IllegalTransition):
                check_job_transition(ended, again)


def shard(
    index: int,
    state: ShardState,
    *,
    seq: int,
    failures: int = 0,
    leases: int = 0,
) -> ShardRecord:
    return ShardRecord(
        job="j",
        spec=ShardSpec(index=index, path="in.parquet", format="parquet", rows=10),
        state=state,
        seq=seq,
        attempts=failures + leases,
        failures=failures,
        leases=[LeaseRecord(token=f"t{index}", attempt=1, worker="w") for _ in range(leases)],
    )


def test_a_resumed_job_keeps_its_done_shards_and_queues_the_rest_with_fresh_attempts() -> None:
    records = [
        shard(0, "DONE", seq=0),
        shard(1, "QUARANTINED", seq=1, failures=3),
        shard(2, "DOING", seq=5, failures=1, leases=1),  # its lease died with the job
        shard(3, "TODO", seq=7, failures=2),  # queued, with failures of the first run
        shard(4, "TODO", seq=8),
    ]
    reopened = reopen(records)
    assert reopened[0] is records[0] and reopened[4] is records[4]  # nothing to write
    assert [(r.state, r.failures, r.leases, r.seq) for r in reopened] == [
        ("DONE", 0, [], 0),
        ("TODO", 0, [], 9),  # behind every shard queued so far, in index order
        ("TODO", 0, [], 10),
        ("TODO", 0, [], 7),  # keeps its place: it never left the queue
        ("TODO", 0, [], 8),
    ]
    assert [r.attempts for r in reopened] == [r.attempts for r in records]  # numbers go on


def test_reopening_a_reopened_job_changes_nothing() -> None:
    once = reopen([shard(0, "DONE", seq=0), shard(1, "QUARANTINED", seq=1, failures=3)])
    again = reopen(once)
    assert all(a is b for a, b in zip(again, once, strict=True))
