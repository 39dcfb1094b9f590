"""When leases run out: a heap of lease deadlines, and the pass that expires those due.

Deadlines are on the master's monotonic clock. The heap holds an entry per deadline ever set
and never looks for one to remove: a lease renewed, released or committed leaves its old
entry behind, and expiring it finds the shard's deadline for that token changed or gone and
does nothing. An expiry the store refuses (a NATS server down, a stream electing its leader)
goes back on the heap, and no expiry is tried again before a backoff has passed: not every
few milliseconds.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from ..errors import Deposed, StoreUnavailable

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.2
"""The wait after an expiry pass that failed..."""
RETRY_MAX_S = 5.0
"""...doubling with each pass in a row that fails, up to this."""


class Expiry(NamedTuple):
    deadline: float
    """Monotonic."""
    job: str
    shard: int
    token: str


def retry_delay(failures: int) -> float:
    """The wait before expiries are tried again after `failures` failed passes in a row."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** min(failures - 1, 5))


class ExpiryHeap:
    def __init__(self, *, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._heap: list[Expiry] = []
        self._failures = 0
        self._retry_at = 0.0

    def push(self, entry: Expiry) -> None:
        heapq.heappush(self._heap, entry)

    def set_deadline(self, deadlines: dict[str, float], entry: Expiry) -> None:
        """Move a lease's deadline (`deadlines`: its shard's, by token) and schedule its
        expiry, the two together: a deadline moved with no entry for it is a lease that
        never expires (its old entry, when due, finds the deadline moved and drops)."""
        deadlines[entry.token] = entry.deadline
        self.push(entry)

    def next_expiry(self) -> float | None:
        """When the next expiry is due (monotonic), if any lease may expire."""
        return max(self._heap[0].deadline, self._retry_at) if self._heap else None

    def due(self, now: float) -> list[Expiry]:
        """Take every entry due by `now`, earliest first."""
        due: list[Expiry] = []
        while self._heap and self._heap[0].deadline <= now:
            due.append(heapq.heappop(self._heap))
        return due

    async def expire_due(self, expire: Callable[[Expiry], Awaitable[bool]]) -> int:
        """`expire` every entry due; returns how many it expired (it says so with True).

        Each is handled on its own: one that cannot be expired now (the store is
        unreachable) goes back on the heap and the others still expire.
        """
        now = self._clock()
        if now < self._retry_at:
            return 0
        due = self.due(now)
        expired = 0
        failed = False
        try:
            while due:
                entry = due[0]
                try:
                    if await expire(entry):
                        expired += 1
                except Deposed:
                    raise
                except StoreUnavailable as e:
                    failed = True
                    log.warning("could not expire a lease of job %s (%s); retrying", entry.job, e)
                    self.push(entry)
                except Exception:
                    failed = True
                    log.exception("could not expire a lease of job %s; retrying", entry.job)
                    self.push(entry)
                due.pop(0)
            if failed:
                self._failures += 1
                self._retry_at = self._clock() + retry_delay(self._failures)
            else:
                self._failures = 0
        finally:
            for entry in due:  # not reached: a Deposed master stops, but leaves them due
                self.push(entry)
        return expired
