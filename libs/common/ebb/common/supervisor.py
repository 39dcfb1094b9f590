"""One owner for a service's long-lived tasks.

Every agent a service runs (intake, reaper, renewer, reconcile loop...) is spawned here by
name. If any of them exits, for whatever reason, the service stops: the survivors are
cancelled and the first failure is raised, so the orchestrator restarts the whole service
rather than leave it running with a dead limb.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Coroutine
from types import TracebackType
from typing import Any

from .aio import until
from .errors import EbbError

log = logging.getLogger(__name__)


class AgentExited(EbbError):
    """A task that should have run until stop returned on its own."""


class Supervisor:
    def __init__(self, name: str, *, cancel_timeout_s: float = 10.0) -> None:
        self.name = name
        self.cancel_timeout_s = cancel_timeout_s
        self.stop_requested = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        if name in self._tasks:
            coro.close()
            raise ValueError(f"{self.name}: a task named {name!r} is already running")
        task = asyncio.create_task(coro, name=f"{self.name}.{name}")
        self._tasks[name] = task
        return task

    def request_stop(self) -> None:
        self.stop_requested.set()

    async def wait(self) -> None:
        """Until stop is requested or a task ends. Raises if a task failed or exited early."""
        if not self._tasks:  # nothing to watch: only a stop ends the wait
            await self.stop_requested.wait()
            return
        first = asyncio.wait(list(self._tasks.values()), return_when=asyncio.FIRST_COMPLETED)
        ended = await until(first, self.stop_requested)
        done = ended[0] if ended is not None else set()
        for name, task in self._tasks.items():
            if task in done:
                if task.cancelled():
                    raise AgentExited(f"{self.name}: {name} was cancelled")
                exc = task.exception()
                if exc is not None:
                    raise AgentExited(f"{self.name}: {name} failed: {exc!r}") from exc
                if not self.stop_requested.is_set():
                    raise AgentExited(f"{self.name}: {name} returned before stop was requested")

    async def cancel_all(self) -> None:
        """Cancel every task and wait for them, up to `cancel_timeout_s`."""
        pending = {t for t in self._tasks.values() if not t.done()}
        deadline = asyncio.get_running_loop().time() + self.cancel_timeout_s
        while pending:
            # Again and again: on Python 3.11 asyncio.wait_for (nats-py's request uses it)
            # loses a cancellation that lands as its inner future completes, and the task
            # carries on as if never cancelled.
            for task in pending:
                task.cancel()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=min(left, 0.5))
        for task in pending:
            log.error("%s: %s ignored cancellation", self.name, task.get_name())
        for task in self._tasks.values():
            if task.done() and not task.cancelled() and task.exception() is not None:
                # Retrieved here so that asyncio does not log it again as never retrieved.
                task.exception()
        self._tasks.clear()

    async def __aenter__(self) -> Supervisor:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.cancel_all()


def install_stop_signals(callback: Any) -> None:
    """SIGTERM and SIGINT call `callback` (once each signal) instead of killing the process."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback)


def remove_stop_signals() -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
