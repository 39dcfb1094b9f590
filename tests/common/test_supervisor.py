"""The supervisor every service runs its agents under."""

from __future__ import annotations

import asyncio

import pytest

from ebb.common.supervisor import AgentExited, Supervisor


async def forever() -> None:
    await asyncio.Event().wait()


async def test_a_stop_cancels_every_agent() -> None:
    sup = Supervisor("svc")
    async with sup:
        tasks = [sup.spawn("a", forever()), sup.spawn("b", forever())]
        sup.request_stop()
        await sup.wait()
    assert all(t.cancelled() for t in tasks)


async def test_a_stop_during_the_wait_ends_it() -> None:
    sup = Supervisor("svc")
    async with sup:
        task = sup.spawn("a", forever())
        asyncio.get_running_loop().call_later(0.02, sup.request_stop)
        await sup.wait()
        assert not task.done()
    assert task.cancelled()


async def test_without_agents_only_a_stop_ends_the_wait() -> None:
    sup = Supervisor("svc")
    waiting = asyncio.create_task(sup.wait())
    await asyncio.sleep(0.02)
    assert not waiting.done()
    sup.request_stop()
    await waiting


async def test_an_agent_that_fails_stops_the_service_with_its_error() -> None:
    async def broken() -> None:
        raise RuntimeError("disk on fire")

    sup = Supervisor("svc")
    with pytest.raises(AgentExited, match=r"broken failed.*disk on fire"):
        async with sup:
            survivor = sup.spawn("survivor", forever())
            sup.spawn("broken", broken())
            await sup.wait()
    assert survivor.cancelled()


async def test_an_agent_returning_early_is_an_error() -> None:
    async def quitter() -> None:
        return None

    with pytest.raises(AgentExited, match="quitter returned before stop"):
        async with Supervisor("svc") as sup:
            sup.spawn("quitter", quitter())
            await sup.wait()


async def test_a_cancellation_lost_on_the_way_is_delivered_again() -> None:
    started, swallowed = asyncio.Event(), asyncio.Event()

    async def deaf_once() -> None:
        started.set()
        # What Python 3.11's asyncio.wait_for does when a cancellation lands just as its
        # inner future completes: the task goes on as though it was never cancelled.
        try:
            await forever()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            swallowed.set()
        await forever()

    sup = Supervisor("svc", cancel_timeout_s=30)
    async with sup:
        task = sup.spawn("deaf", deaf_once())
        await started.wait()
        sup.request_stop()
        await sup.wait()
    assert swallowed.is_set() and task.cancelled()


async def test_names_are_unique() -> None:
    async with Supervisor("svc") as sup:
        sup.spawn("a", forever())
        with pytest.raises(ValueError, match="already running"):
            sup.spawn("a", forever())
