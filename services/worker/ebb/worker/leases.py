"""The leases a worker holds, and the agent that keeps them alive.

A lease moves only by its own methods, each checking where it comes from:

    HELD ──mark_committed()──> COMMITTED
    HELD, COMMITTED ──lose(reason)──> LOST        the master refused a renewal, or the
                                                  deadline passed with none: the attempt
                                                  is abandoned (its task cancelled)
    HELD, COMMITTED ──release()──> RELEASED       handed back to the master

LOST and RELEASED are final. The `renewer` agent renews every HELD or COMMITTED lease at about
a third of its period: from one task, so that a lease has one renewal in flight at most.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from ebb.common import lifecycle
from ebb.common.errors import BusError, RemoteError
from ebb.common.messaging.messages import LeaseReply, RenewReply, ShardSpec

from . import metrics
from .progress import AttemptProgress

log = logging.getLogger(__name__)


class StopCause(Enum):
    """Why an attempt is asked to stop and commit the rows it has done."""

    DRAIN = "worker draining"
    STRAGGLER = "the master asked for the rest to run on an idle worker"


class LeaseState(Enum):
    HELD = "held"
    """Ours: its shard's attempt runs."""
    COMMITTED = "committed"
    """Our commit record exists (or another attempt's does): the shard's output is decided,
    and a release is never poisoned now."""
    LOST = "lost"
    """No longer ours: its attempt is abandoned."""
    RELEASED = "released"
    """Handed back to the master (the release may be under way)."""


TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.HELD: frozenset({LeaseState.COMMITTED, LeaseState.LOST, LeaseState.RELEASED}),
    LeaseState.COMMITTED: frozenset({LeaseState.LOST, LeaseState.RELEASED}),
    LeaseState.LOST: frozenset(),
    LeaseState.RELEASED: frozenset(),
}


@dataclass(eq=False, kw_only=True)
class ActiveLease:
    token: str
    shard: ShardSpec
    attempt: int
    lease_s: float
    deadline: float
    """On our loop's clock: counted from when we SENT the request that granted or renewed it."""
    renew_at: float
    task: asyncio.Task[Any] | None = None
    """The task running the shard's attempt: cancelled when the lease is lost."""
    state: LeaseState = LeaseState.HELD
    lost_reason: str = ""
    progress: AttemptProgress = field(default_factory=AttemptProgress)
    """How far its attempt has got: told in renewals."""
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the attempt must stop and commit what it has done as a part of the shard (its
    worker must go, or the master wants the rest run elsewhere)."""
    stop_cause: StopCause | None = None

    @property
    def rows_done(self) -> int:
        return self.progress.rows_done()

    def split(self, cause: StopCause) -> None:
        """Ask the attempt to stop at its next batch and commit the rows done as a part."""
        if not self.stop.is_set():
            self.stop_cause = cause
            self.stop.set()

    @property
    def renewable(self) -> bool:
        """Still ours, and its attempt still running or reporting."""
        return self.state in (LeaseState.HELD, LeaseState.COMMITTED)

    @property
    def committed(self) -> bool:
        return self.state is LeaseState.COMMITTED

    def mark_committed(self) -> None:
        self._move(LeaseState.COMMITTED)

    def lose(self, reason: str) -> None:
        """No longer ours: abandon its attempt."""
        self._move(LeaseState.LOST)
        self.lost_reason = reason or "lease lost"
        if self.task is not None:
            self.task.cancel()

    def release(self) -> None:
        self._move(LeaseState.RELEASED)

    def _move(self, new: LeaseState) -> None:
        """IllegalTransition (a bug in the worker) unless the lease may make the move."""
        lifecycle.check(TRANSITIONS, self.state, new, what=f"the lease of shard {self.shard.index}")
        self.state = new


def renew_after(lease_s: float, renew_in_s: float | None) -> float:
    """Seconds from a request to the lease's next renewal: a third of the lease, so that two
    renewals may be lost before it runs out, or sooner if the master asks (an idle worker
    waits at the job's tail for a split that rides on a renewal's reply)."""
    if renew_in_s is None or renew_in_s <= 0:
        return lease_s / 3
    return min(lease_s / 3, renew_in_s)


class Renews(Protocol):
    """Whoever renews a lease: the master, through `ebb.common.messaging.api.MasterClient`."""

    async def renew(
        self,
        token: str,
        *,
        worker: str,
        timeout_s: float | None = None,
        ready: bool = False,
        rows_done: int = 0,
    ) -> RenewReply: ...


class LeaseKeeper:
    """The leases this worker holds, by token, each renewed until its attempt ends with it."""

    def __init__(
        self, master: Renews, *, worker: str, ready: Callable[[], bool] = lambda: False
    ) -> None:
        self.master = master
        self.worker = worker
        self.ready = ready
        """Whether the stage processes have started: renew requests say so."""
        self.leases: dict[str, ActiveLease] = {}

    def hold(
        self, reply: LeaseReply, *, sent_at: float, task: asyncio.Task[Any] | None = None
    ) -> ActiveLease:
        """Keep the lease `reply` granted, to the request sent at `sent_at`."""
        assert reply.shard is not None
        active = ActiveLease(
            token=reply.token,
            shard=reply.shard,
            attempt=reply.attempt,
            lease_s=reply.lease_s,
            deadline=sent_at + reply.lease_s,
            renew_at=sent_at + renew_after(reply.lease_s, reply.renew_in_s),
            task=task,
        )
        self.leases[active.token] = active
        return active

    def __len__(self) -> int:
        return len(self.leases)

    def split_all(self, cause: StopCause) -> None:
        """Ask every attempt under way to commit the rows it has done and hand back the rest."""
        for active in list(self.leases.values()):
            active.split(cause)

    def drop(self, active: ActiveLease) -> None:
        """Its attempt is over: stop renewing it."""
        self.leases.pop(active.token, None)

    def renew_soon(self) -> None:
        """Renew every lease within the renewer's next look (half a second), not at its time."""
        now = asyncio.get_running_loop().time()
        for active in self.leases.values():
            active.renew_at = min(active.renew_at, now)

    async def renewer(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for active in list(self.leases.values()):
                if active.renewable and loop.time() >= active.renew_at:
                    await self.renew_one(active)
            upcoming = [a.renew_at for a in self.leases.values() if a.renewable]
            pause = min(upcoming, default=loop.time() + 0.5) - loop.time()
            await asyncio.sleep(min(0.5, max(0.02, pause)))

    async def renew_one(self, active: ActiveLease) -> None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            reply = await self.master.renew(
                active.token,
                worker=self.worker,
                timeout_s=max(0.5, min(5.0, active.lease_s / 4)),
                ready=self.ready(),
                rows_done=active.rows_done,
            )
        except RemoteError as e:
            if not active.renewable:
                return  # released while we asked: the release speaks for it
            if e.lease_lost:
                active.lose(e.message)
            else:
                active.renew_at = loop.time() + 1.0
            return
        except BusError as e:
            if not active.renewable:
                return
            # Past our commit record the shard's output is decided: keep telling the master
            # (the commit is being retried) however long it is away, rather than go quiet.
            if loop.time() >= active.deadline and not active.committed:
                active.lose(f"not renewed before its deadline ({e})")
            else:
                active.renew_at = loop.time() + min(1.0, active.lease_s / 10)
            return
        metrics.RENEWALS.inc()
        if reply.split and active.state is LeaseState.HELD:
            active.split(StopCause.STRAGGLER)
        active.deadline = sent + reply.lease_s
        # Early, with jitter, so that a fleet of workers does not renew in lockstep.
        after = renew_after(reply.lease_s, reply.renew_in_s)
        active.renew_at = sent + after * random.uniform(0.8, 1.0)  # noqa: S311
        log.debug(
            "lease of shard %d renewed (%d rows told), the next in %.1fs",
            active.shard.index,
            active.rows_done,
            active.renew_at - loop.time(),
        )
