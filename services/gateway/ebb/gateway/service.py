"""The gateway: `Gateway.run` connects to NATS, serves the Batch API over HTTP and runs the
reconcile loop (ebb.gateway.batches) beside it, until told to stop.

Stateless: the records are in NATS KV, the bytes in the store. Any number of replicas may
serve the same keys; each runs the loop, and their steps never collide (compare-and-set)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import nats.errors
from aiohttp import web
from nats.js.api import KeyValueConfig

from ebb.common import metrics as metrics_server
from ebb.common.messaging import bus
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.provision import ensure_bucket
from ebb.common.messaging.subjects import Subjects

from .api import BatchApi
from .batches import BatchRunner
from .config import GatewayConfig
from .records import Records
from .store import FileStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    nats: NatsConfig
    config: GatewayConfig
    host: str = "127.0.0.1"
    port: int = 8080
    poll_s: float = 5.0
    """Between the reconcile loop's full passes (a batch created or cancelled, or whose job
    said something, is stepped at once)."""
    sweep_s: float = 60.0
    """Between sweeps of expired files."""
    js_replicas: int = 1


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.stop = asyncio.Event()
        self.port: int | None = None
        """The port it serves on, once it does."""
        self.serving = asyncio.Event()

    def request_stop(self) -> None:
        self.stop.set()

    async def run(self) -> None:
        s = self.settings
        nc = await bus.connect(s.nats, name="ebb-gateway", stop=self.stop)
        try:
            js = nc.jetstream()
            subjects = Subjects(s.nats.prefix)
            buckets = (subjects.gateway_files_bucket, subjects.gateway_batches_bucket)
            files, batches = [
                await ensure_bucket(js, KeyValueConfig(bucket=b, history=1, replicas=s.js_replicas))
                for b in buckets
            ]
            records = Records(js, files=files, batches=batches, buckets=buckets)
            runner = BatchRunner(
                config=s.config,
                records=records,
                store=FileStore(s.config.root),
                master=MasterClient(
                    nc, s.nats, backoff=Backoff(first_s=0.2, max_s=2.0, attempts=3)
                ),
                nc=nc,
                nats=s.nats,
                poll_s=s.poll_s,
                sweep_s=s.sweep_s,
            )
            app = BatchApi(config=s.config, records=records, runner=runner).app()
            web_runner = web.AppRunner(app, access_log=None)
            await web_runner.setup()
            site = web.TCPSite(web_runner, s.host, s.port)
            await site.start()
            self.port = _bound_port(site, s.port)
            log.info("Batch API on http://%s:%d/v1", s.host, self.port)
            self.serving.set()
            metrics_server.set_readiness(
                lambda: (nc.is_connected, "serving" if nc.is_connected else "NATS not connected")
            )
            try:
                await runner.run(self.stop)
            finally:
                await web_runner.cleanup()
        finally:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await nc.drain()


def _bound_port(site: web.TCPSite, asked: int) -> int:
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    return int(sockets[0].getsockname()[1]) if sockets else asked
