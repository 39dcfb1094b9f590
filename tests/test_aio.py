"""Waiting until stopped: `until` and `sleep_or_stop`."""

from __future__ import annotations

import asyncio

import pytest

from ebb.common.aio import sleep_or_stop, until


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
