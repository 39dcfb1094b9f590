"""Waiting until stopped or woken: `until`, `sleep_or_stop` and `wait_any`."""

from __future__ import annotations

import asyncio

import pytest

from ebb.common.aio import sleep_or_stop, until, wait_any


async def forever() -> int:
    await asyncio.Event().wait()
    return 0


async def answer(value: int, *, after_s: float = 0.0) -> int:
    await asyncio.sleep(after_s)
    return value


async def test_until_gives_the_work_result_when_no_stop_comes() -> None:
    assert await until(answer(7), asyncio.Event()) == 7


async def test_until_raises_the_work_error() -> None:
    async def broken() -> None:
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        await until(broken(), asyncio.Event())


async def test_a_stop_cancels_the_work_and_gives_none() -> None:
    stop = asyncio.Event()
    work = asyncio.create_task(forever())
    waiting = asyncio.create_task(until(work, stop))
    await asyncio.sleep(0.01)
    stop.set()
    assert await waiting is None
    assert work.cancelled()


async def test_a_stop_set_before_leaves_no_work_running() -> None:
    stop = asyncio.Event()
    stop.set()
    work = asyncio.create_task(forever())
    assert await until(work, stop) is None
    assert work.cancelled()


async def test_a_shielded_work_carries_on_after_a_stop() -> None:
    stop = asyncio.Event()
    stop.set()
    work = asyncio.create_task(answer(3, after_s=0.05))
    assert await until(asyncio.shield(work), stop) is None
    assert await work == 3


async def test_work_done_as_the_stop_comes_gives_its_result() -> None:
    """A semaphore's slot acquired as the stop came must reach the caller, or it leaks."""
    stop = asyncio.Event()
    slots = asyncio.Semaphore(1)
    await slots.acquire()
    waiting = asyncio.create_task(until(slots.acquire(), stop))
    await asyncio.sleep(0.01)
    # The slot comes free and the stop is set in one turn of the loop: both are done at once.
    slots.release()
    stop.set()
    got = await waiting
    assert got is True
    assert slots.locked()


async def test_cancelling_the_caller_cancels_the_work() -> None:
    work = asyncio.create_task(forever())
    waiting = asyncio.create_task(until(work, asyncio.Event()))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert work.cancelled()


async def test_sleep_or_stop_sleeps_the_whole_time_without_a_stop() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await sleep_or_stop(0.05, asyncio.Event()) is False
    assert loop.time() - started >= 0.05


async def test_sleep_or_stop_wakes_at_the_stop() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    asyncio.get_running_loop().call_later(0.02, stop.set)
    assert await sleep_or_stop(10, stop) is True
    assert loop.time() - started < 5


async def test_sleep_or_stop_returns_at_once_when_stopped_already() -> None:
    stop = asyncio.Event()
    stop.set()
    assert await sleep_or_stop(10, stop) is True
    assert await sleep_or_stop(0, stop) is True


async def test_wait_any_wakes_at_the_first_event_set() -> None:
    first, second = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    loop.call_later(0.02, second.set)
    assert await wait_any([first, second], timeout_s=10) is True
    assert loop.time() - started < 5
    assert second.is_set() and not first.is_set()


async def test_wait_any_gives_false_after_the_timeout() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await wait_any([asyncio.Event(), asyncio.Event()], timeout_s=0.05) is False
    assert loop.time() - started >= 0.05


async def test_wait_any_returns_at_once_when_an_event_is_set_already() -> None:
    woken = asyncio.Event()
    woken.set()
    assert await wait_any([asyncio.Event(), woken], timeout_s=10) is True
    assert await wait_any([woken], timeout_s=0) is True
    assert woken.is_set()  # left for the caller to clear


async def test_wait_any_without_a_timeout_waits_for_an_event() -> None:
    woken = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, woken.set)
    assert await wait_any([woken], timeout_s=None) is True


async def test_wait_any_needs_an_event() -> None:
    with pytest.raises(ValueError, match="an event"):
        await wait_any([], timeout_s=1)


async def test_cancelling_wait_any_leaves_no_waiter_behind() -> None:
    waiting = asyncio.create_task(wait_any([asyncio.Event(), asyncio.Event()], timeout_s=None))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0)  # the waiters' cancellation lands
    me = asyncio.current_task()
    assert [t for t in asyncio.all_tasks() if t is not me and not t.done()] == []
