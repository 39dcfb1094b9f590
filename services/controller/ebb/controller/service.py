"""The controller service: a reconcile loop, woken by job events, cluster changes and a
periodic resync.

Agents: `reconciler` (one pass at a time, level-triggered; a failed pass is logged and the
next one tries again), the backend's own (informers, the tide), and, with a leader elector,
`leadership`: only the replica holding the Lease runs the others. Events only make the next
pass come sooner: missing one costs at most `resync_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import nats.errors

from ebb.common import metrics as metrics_server
from ebb.common.aio import until, wait_any
from ebb.common.errors import BusError, RemoteError
from ebb.common.messaging import bus
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import Subjects
from ebb.common.runner import GRACE_S
from ebb.common.supervisor import Supervisor

from . import metrics
from .backend import ClusterBackend
from .election import LeaderElector
from .reconcile import Reconciler, ReconcilerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    nats: NatsConfig = field(default_factory=NatsConfig)
    resync_s: float = 2.0
    """Longest time between two reconcile passes."""
    min_interval_s: float = 0.2
    """Shortest time between two passes, however many events arrive."""
    reconciler: ReconcilerConfig = field(default_factory=ReconcilerConfig)
    shutdown_grace_s: float = GRACE_S


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        backend: ClusterBackend,
        *,
        elector: LeaderElector | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.elector = elector
        self.supervisor = Supervisor("controller")
        self._wake = asyncio.Event()
        self.reconciler: Reconciler | None = None
        self.leading = asyncio.Event()

    def request_stop(self) -> None:
        self.supervisor.request_stop()

    async def run(self) -> None:
        try:
            nc = await bus.connect(
                self.config.nats, name="ebb-controller", stop=self.supervisor.stop_requested
            )
        except bus.ConnectAborted as e:
            log.info("%s", e)
            return
        metrics_server.set_readiness(
            lambda: (nc.is_connected, "connected" if nc.is_connected else "NATS not connected")
        )
        subjects = Subjects(self.config.nats.prefix)
        # One try per request: a pass that cannot reach the master is skipped, not stalled.
        master = MasterClient(nc, self.config.nats, backoff=Backoff(attempts=1))
        self.reconciler = Reconciler(
            master=master, backend=self.backend, config=self.config.reconciler
        )

        async def on_event(_msg: Any) -> None:
            self._wake.set()

        # Every job's events, a team's as well as those without an owner.
        subscriptions = [await nc.subscribe(s, cb=on_event) for s in subjects.every_event]
        try:
            if self.elector is not None and not await self._lead(self.elector):
                return  # asked to stop while standing by
            self.leading.set()
            async with self.supervisor as sup:
                if self.elector is not None:
                    sup.spawn("leadership", self.elector.keep())
                for name, agent in self.backend.agents().items():
                    sup.spawn(name, agent)
                sup.spawn("reconciler", self.reconcile_forever())
                await sup.wait()
        finally:
            for subscription in subscriptions:
                with contextlib.suppress(nats.errors.Error):
                    await subscription.unsubscribe()
            await self.backend.close(grace_s=self.config.shutdown_grace_s)
            if self.elector is not None and self.leading.is_set():
                await self.elector.release()
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await nc.drain()

    async def _lead(self, elector: LeaderElector) -> bool:
        """Wait to lead; False if a stop came first."""
        led = await until(_acquired(elector), self.supervisor.stop_requested)
        return led is not None

    async def reconcile_forever(self) -> None:
        assert self.reconciler is not None
        wakers = [self._wake, self.backend.changed]
        while True:
            for event in wakers:
                event.clear()  # before the pass: a change during it calls for another
            try:
                await self.reconciler.reconcile_once()
                metrics.RECONCILES.labels("ok").inc()
            except Exception as e:
                if _master_unavailable(e):
                    metrics.RECONCILES.labels("master_unavailable").inc()
                    log.info("reconcile skipped: master unavailable (%s)", e)
                else:
                    metrics.RECONCILES.labels("error").inc()
                    log.exception("reconcile pass failed")
            await asyncio.sleep(self.config.min_interval_s)
            await wait_any(wakers, timeout_s=self.config.resync_s)


async def _acquired(elector: LeaderElector) -> bool:
    await elector.acquire()
    return True


def _master_unavailable(error: Exception) -> bool:
    """The pass could not reach the master, or the master could not answer now: the next
    pass asks again. Any other refusal is a bug of ours or of the master's."""
    return isinstance(error, BusError) or (isinstance(error, RemoteError) and error.retryable)
