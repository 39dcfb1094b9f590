"""Waiting that a stop ends: every service's agents wait on work, or sleep, until told to stop.

`until(work, stop)` awaits `work` unless `stop` is set first, and then cancels it;
`sleep_or_stop(seconds, stop)` is the sleep between two tries that a stop cuts short;
`wait_any(events, timeout_s=...)` is the wait of a loop that something wakes (a change, a
message) and that looks again after a while if nothing does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def until(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """`work`'s result, or None if `stop` is set first: `work` is then cancelled, and waited
    for, before this returns. Wrap `work` in `asyncio.shield` to let it carry on instead.

    Work that completes although it was cancelled (it had finished as the stop came) gives
    its result all the same: whoever acquired something (a semaphore's slot, a lease) is told
    and can give it back. Cancelling the caller cancels `work` too."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        abandoned = not task.done()
        if abandoned:
            task.cancel()
            await asyncio.wait([task])
    if abandoned and task.cancelled():
        return None
    return task.result()


async def sleep_or_stop(seconds: float, stop: asyncio.Event) -> bool:
    """Sleep `seconds`, or until `stop` is set if that comes first. True if it is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()
    return stop.is_set()


async def wait_any(events: Iterable[asyncio.Event], *, timeout_s: float | None) -> bool:
    """Until one of `events` is set, or `timeout_s` has passed (None: no limit). True if one
    is set. At once if one is set already; the events are left as they are (clearing one
    before the work it wakes for is the caller's part). Cancelling the caller leaves no
    waiter behind."""
    events = list(events)
    if not events:
        raise ValueError("wait_any needs an event to wait for")
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return any(event.is_set() for event in events)
