"""A worker's leases: their states, and what a renewal's answer does to them."""

from __future__ import annotations

import asyncio

import pytest

from ebb.common.errors import BusError, ErrorCode, RemoteError
from ebb.common.lifecycle import IllegalTransition
from ebb.common.messaging.messages import LeaseReply, RenewReply, ShardSpec
from ebb.worker.leases import (
    TRANSITIONS,
    ActiveLease,
    LeaseKeeper,
    LeaseState,
    StopCause,
)
from ebb.worker.service import shards_to_hold

HELD, COMMITTED, LOST, RELEASED = LeaseState


class Master:
    """Answers every renewal with `answer`: a period, or an error raised."""

    def __init__(
        self, answer: float | Exception, *, split: bool = False, renew_in_s: float | None = None
    ) -> None:
        self.answer = answer
        self.split = split
        self.renew_in_s = renew_in_s
        self.asked: list[tuple[str, bool]] = []
        self.rows_told: list[int] = []

    async def renew(
        self,
        token: str,
        *,
        worker: str,
        timeout_s: float | None = None,
        ready: bool = False,
        rows_done: int = 0,
    ) -> RenewReply:
        self.asked.append((token, ready))
        self.rows_told.append(rows_done)
        if isinstance(self.answer, Exception):
            raise self.answer
        return RenewReply(lease_s=self.answer, split=self.split, renew_in_s=self.renew_in_s)


def granted(token: str = "t1", lease_s: float = 9.0, renew_in_s: float | None = None) -> LeaseReply:
    shard = ShardSpec(index=3, path="data.parquet", format="parquet", rows=10)
    return LeaseReply(
        status="granted",
        shard=shard,
        attempt=1,
        token=token,
        lease_s=lease_s,
        renew_in_s=renew_in_s,
    )


def lease_in(state: LeaseState) -> ActiveLease:
    active = LeaseKeeper(Master(1.0), worker="w1").hold(granted(), sent_at=0.0)
    if state is COMMITTED:
        active.mark_committed()
    elif state is LOST:
        active.lose("gone")
    elif state is RELEASED:
        active.release()
    assert active.state is state
    return active


MOVES = {COMMITTED: ActiveLease.mark_committed, RELEASED: ActiveLease.release}


@pytest.mark.parametrize("old", list(LeaseState))
@pytest.mark.parametrize("new", list(LeaseState))
def test_a_lease_moves_only_as_the_transitions_allow(old: LeaseState, new: LeaseState) -> None:
    if new is HELD:
        return  # nothing moves a lease back to HELD: a new lease is a new object
    active = lease_in(old)

    def move() -> None:
        if new is LOST:
            active.lose("gone")
        else:
            MOVES[new](active)

    if new in TRANSITIONS[old]:
        move()
        assert active.state is new
    else:
        with pytest.raises(IllegalTransition):
            move()
        assert active.state is old


def test_only_held_and_committed_leases_are_renewed() -> None:
    assert [s for s in LeaseState if lease_in(s).renewable] == [HELD, COMMITTED]


async def test_losing_a_lease_cancels_its_attempt_and_says_why() -> None:
    attempt = asyncio.create_task(asyncio.Event().wait())
    keeper = LeaseKeeper(Master(RemoteError(ErrorCode.STALE_TOKEN, "superseded")), worker="w1")
    active = keeper.hold(granted(), sent_at=0.0, task=attempt)
    await keeper.renew_one(active)
    assert active.state is LOST and active.lost_reason == "superseded"
    await asyncio.wait([attempt])
    assert attempt.cancelled()


async def test_a_renewal_moves_the_deadline_and_says_whether_the_pipeline_is_ready() -> None:
    master = Master(12.0)
    ready = [False]
    keeper = LeaseKeeper(master, worker="w1", ready=lambda: ready[0])
    active = keeper.hold(granted(), sent_at=0.0)
    await keeper.renew_one(active)
    ready[0] = True
    await keeper.renew_one(active)
    now = asyncio.get_running_loop().time()
    assert master.asked == [("t1", False), ("t1", True)]
    assert active.state is HELD
    assert now < active.deadline <= now + 12.0
    assert now + 12.0 / 3 * 0.8 - 1 < active.renew_at <= now + 12.0 / 3


@pytest.mark.parametrize("code", [ErrorCode.UNAVAILABLE, ErrorCode.NOT_LEADER, "unknown"])
async def test_a_master_that_cannot_answer_now_is_asked_again_soon(code: str) -> None:
    keeper = LeaseKeeper(Master(RemoteError(code, "busy")), worker="w1")
    active = keeper.hold(granted(), sent_at=0.0)
    await keeper.renew_one(active)
    assert active.state is HELD
    assert active.renew_at <= asyncio.get_running_loop().time() + 1.0


async def test_a_master_out_of_reach_past_the_deadline_loses_only_an_uncommitted_lease() -> None:
    keeper = LeaseKeeper(Master(BusError("no reply")), worker="w1")
    now = asyncio.get_running_loop().time()
    held = keeper.hold(granted("a", lease_s=1.0), sent_at=now - 2)
    committed = keeper.hold(granted("b", lease_s=1.0), sent_at=now - 2)
    committed.mark_committed()
    within = keeper.hold(granted("c", lease_s=10.0), sent_at=now)
    for active in (held, committed, within):
        await keeper.renew_one(active)
    assert held.state is LOST and "not renewed before its deadline" in held.lost_reason
    # The commit record decides the shard: keep the lease alive while its report is retried.
    assert committed.state is COMMITTED
    assert within.state is HELD


async def test_a_refusal_of_a_lease_released_meanwhile_changes_nothing() -> None:
    keeper = LeaseKeeper(Master(RemoteError(ErrorCode.STALE_TOKEN, "released")), worker="w1")
    active = keeper.hold(granted(), sent_at=0.0)
    active.release()
    await keeper.renew_one(active)
    assert active.state is RELEASED


async def test_renew_soon_brings_every_renewal_forward() -> None:
    keeper = LeaseKeeper(Master(9.0), worker="w1")
    now = asyncio.get_running_loop().time()
    leases = [keeper.hold(granted(t), sent_at=now) for t in ("a", "b")]
    keeper.renew_soon()
    assert all(a.renew_at <= asyncio.get_running_loop().time() for a in leases)
    keeper.drop(leases[0])
    assert list(keeper.leases) == ["b"]


async def test_a_renewal_tells_the_rows_done_and_a_split_answer_stops_the_attempt() -> None:
    master = Master(12.0)
    keeper = LeaseKeeper(master, worker="w1")
    active = keeper.hold(granted(), sent_at=0.0)
    active.progress.wrote(4_000)
    await keeper.renew_one(active)
    assert master.rows_told == [4_000] and not active.stop.is_set()
    master.split = True
    await keeper.renew_one(active)
    assert active.stop.is_set() and active.stop_cause is StopCause.STRAGGLER
    assert active.state is HELD, "still ours: it commits its part under this lease"


async def test_a_master_asking_for_renewals_soon_is_heard_and_never_made_later() -> None:
    """At the tail of a job the master asks holders to renew within a second (a split for an
    idle worker rides on a renewal's reply); a lease shorter than that is renewed at a third
    of it still."""
    master = Master(30.0, renew_in_s=1.0)
    keeper = LeaseKeeper(master, worker="w1")
    active = keeper.hold(granted(lease_s=30.0, renew_in_s=1.0), sent_at=0.0)
    assert active.renew_at == 1.0  # from the grant
    await keeper.renew_one(active)
    now = asyncio.get_running_loop().time()
    assert now + 0.8 - 1 < active.renew_at <= now + 1.0
    master.renew_in_s = None  # no worker waits any more: a third of the lease again
    await keeper.renew_one(active)
    now = asyncio.get_running_loop().time()
    assert now + 10.0 * 0.8 - 1 < active.renew_at <= now + 10.0
    short = keeper.hold(granted("t2", lease_s=1.5, renew_in_s=1.0), sent_at=0.0)
    assert short.renew_at == 0.5


async def test_a_committed_lease_is_not_asked_to_stop() -> None:
    keeper = LeaseKeeper(Master(12.0, split=True), worker="w1")
    active = keeper.hold(granted(), sent_at=0.0)
    active.mark_committed()
    await keeper.renew_one(active)
    assert not active.stop.is_set()


def test_the_first_reason_to_stop_is_the_one_kept() -> None:
    active = lease_in(HELD)
    active.split(StopCause.DRAIN)
    active.split(StopCause.STRAGGLER)
    assert active.stop.is_set() and active.stop_cause is StopCause.DRAIN


@pytest.mark.parametrize(
    ("least", "pipeline_rows", "shard_rows", "held"),
    [
        (2, 1_280, 25_000, 2),  # shards larger than the pipeline: one computing, one read
        (2, 1_280, 1_000, 3),
        (2, 1_280, 384, 4),  # a short LLM job's shards: the pipeline's rows and one more
        (2, 2_816, 256, 4),  # never more than a worker's share of the fleet's shards
        (1, 2_816, 256, 1),  # no prefetch asked for: none
        (3, 1_280, 25_000, 3),
    ],
)
def test_a_worker_holds_shards_enough_to_fill_its_pipeline_within_its_share(
    least: int, pipeline_rows: int, shard_rows: int, held: int
) -> None:
    assert shards_to_hold(least=least, pipeline_rows=pipeline_rows, shard_rows=shard_rows) == held
