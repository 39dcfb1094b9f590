"""The shard master service: NATS in front of the lease table.

`ShardMaster.run` connects, then campaigns: once it leads, it loads the table from KV, serves
requests, and runs its agents until a stop, or until a lost lead, a deposition or NATS going
away ends the round and it campaigns again.

Agents (each a task of one supervisor; if one dies, the master stops them all, then campaigns
again if leadership or NATS was the cause, or exits to be restarted):
- leadership: keeps the leader key (`leader.Leadership.keepalive`); losing it ends the round.
- deposition: ends the round as leadership does when a request finds another master writing.
- intake:     takes job messages off the EBB_JOBS stream (`submissions.Submissions`), which
              the table plans and persists (`intake.JobIntake`), then acks them.
- reaper:     expires leases past their deadline and finishes jobs whose shards are settled.
- publisher:  sends job events (progress, state changes) for the CLI and the controller.
Requests are served beside them by a RequestServer (`requests.MasterRequests`): the lease
protocol on `<prefix>.master.<op>.<worker id>`, the rest on `<prefix>.master.<op>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS

from ebb.common import metrics as metrics_server
from ebb.common import schema
from ebb.common.aio import sleep_or_stop, until
from ebb.common.messaging import bus, provision
from ebb.common.messaging.bus import RequestServer
from ebb.common.messaging.messages import JobEvent
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import Subjects
from ebb.common.supervisor import AgentExited, Supervisor

from . import metrics
from .election import Leadership
from .errors import Deposed, StoreUnavailable
from .kv import Store
from .requests import MasterRequests
from .submissions import Submissions
from .table.lease_table import LeaseTable
from .table.lifecycle import FORGET_PER_PASS

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MasterConfig:
    nats: NatsConfig = field(default_factory=NatsConfig)
    id: str = field(default_factory=socket.gethostname)
    """This master's identity in the leader election. A restart under the same id leads at once."""
    data_roots: list[str] = field(default_factory=list)
    """Input, output, model and code paths of a job must lie under one of these."""
    leader_ttl_s: float = 10.0
    """A dead leader is replaced after at most this long."""
    job_retention_s: float = 7 * 86400.0
    """A job that ended leaves the master's memory and KV this long after (its output and
    manifest stay): nothing grows without bound with the number of jobs run."""
    js_replicas: int = 1
    """Copies of the jobs stream and the KV buckets, when the master creates them: 1 for one
    nats-server, 3 on a three-node cluster (any one server may then go down)."""
    wait_retry_s: float = 1.0
    """Told to workers that find no shard free, yet the job unfinished."""
    speculate_after_s: float = 5.0
    """A shard runs at least this long (and 1.5x the median shard time) before it is duplicated."""
    split_halves: bool = True
    """At the tail, a holder at the usual rate has its rest cut in two for an idle worker
    (`table.tail.pick_split`). False: only stragglers are split, their rest moved whole."""
    lease_grace_s: float = 5.0
    """A lease that this master finds after a restart lives this long past the deadline it
    had (time for its holder to reach us), however often the master restarts."""
    reaper_interval_s: float = 0.5
    concurrency: int = 64
    """Requests served at once."""
    shutdown_grace_s: float = 5.0
    metrics_port: int | None = None


class ShardMaster:
    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.subjects = Subjects(config.nats.prefix)
        self.supervisor = Supervisor("master")
        self.table: LeaseTable | None = None
        self._events: asyncio.Queue[JobEvent] = asyncio.Queue(maxsize=10_000)
        self.ready = asyncio.Event()
        """Set once this master leads and serves requests."""
        self.deposed: Deposed | None = None
        """Why this round of leadership must end (a request found another master writing)."""
        self._step_down = asyncio.Event()

    def request_stop(self) -> None:
        self.supervisor.request_stop()

    async def run(self) -> None:
        """Lead (or stand by) until asked to stop. A master that loses the lead, or NATS
        under an agent (NATS away longer than the leader TTL, another master writing), steps
        down and campaigns again with state reloaded from KV, rather than exit and wait for
        someone to restart it."""
        try:
            nc = await bus.connect(
                self.config.nats,
                name=f"ebb-master-{self.config.id}",
                stop=self.supervisor.stop_requested,
            )
        except bus.ConnectAborted as e:
            log.info("%s", e)
            return
        metrics_server.set_readiness(
            lambda: (
                nc.is_connected,
                ("leading" if self.ready.is_set() else "standing by")
                if nc.is_connected
                else "NATS not connected",
            )
        )
        try:
            failures = 0
            while True:
                try:
                    await self._run(nc)
                    return
                except (Deposed, AgentExited) as e:
                    cause = e if isinstance(e, Deposed) else e.__cause__
                    if self.supervisor.stop_requested.is_set() or not isinstance(
                        cause, Deposed | StoreUnavailable | nats.errors.Error | TimeoutError
                    ):
                        raise
                    log.warning("stepping down (%s): campaigning again", e)
                    failures = 0
                except (StoreUnavailable, nats.errors.Error, TimeoutError) as e:
                    # Setting up (the stream, the buckets, the leader key, the state) while
                    # NATS fails over: a server gone, a stream electing its leader. Not a
                    # reason to exit: try again, backing off.
                    if self.supervisor.stop_requested.is_set():
                        raise
                    metrics.SETUP_FAILURES.inc()
                    delay = bus.Backoff(first_s=0.5).delay(failures)
                    failures += 1
                    why = str(e) or repr(e)  # some of nats-py's errors have no message
                    log.warning("could not set up on NATS (%s); again in %.1fs", why, delay)
                    await sleep_or_stop(delay, self.supervisor.stop_requested)
                self.ready.clear()
                self.table = None
                self.deposed = None
                await self._until_connected(nc)
        finally:
            try:
                await nc.drain()
            except (nats.errors.Error, TimeoutError) as e:
                log.debug("drain failed: %s", e)
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await nc.close()

    async def _until_connected(self, nc: NATS) -> None:
        """Until NATS is back (it reconnects on its own), or a stop is requested."""
        while not nc.is_connected:
            if await sleep_or_stop(0.5, self.supervisor.stop_requested):
                return

    async def _run(self, nc: NATS) -> None:
        js = nc.jetstream()
        await provision.ensure_jetstream(
            js,
            self.subjects,
            leader_ttl_s=self.config.leader_ttl_s,
            replicas=self.config.js_replicas,
        )
        leadership = Leadership(
            await js.key_value(self.subjects.leader_bucket),
            holder=self.config.id,
            ttl_s=self.config.leader_ttl_s,
        )
        epoch = await until(leadership.acquire(), self.supervisor.stop_requested)
        if epoch is None:
            return

        store = Store(
            js,
            jobs=await js.key_value(self.subjects.jobs_bucket),
            shards=await js.key_value(self.subjects.shards_bucket),
            buckets=(self.subjects.jobs_bucket, self.subjects.shards_bucket),
        )
        self.table = table = LeaseTable(
            store=store,
            epoch=epoch,
            on_event=self._emit,
            wait_retry_s=self.config.wait_retry_s,
            speculate_after_s=self.config.speculate_after_s,
            split_halves=self.config.split_halves,
            lease_grace_s=self.config.lease_grace_s,
        )
        await table.load()
        server = RequestServer(nc, queue="ebb-master", concurrency=self.config.concurrency)
        requests = MasterRequests(table, subjects=self.subjects, on_deposed=self._depose)
        await requests.serve_on(server)
        submissions = Submissions(
            table,
            subjects=self.subjects,
            data_roots=self.config.data_roots,
            stop=self.supervisor.stop_requested,
        )
        # Our subscriptions reach the server with the next flush: only then do we serve.
        await nc.flush()
        self._step_down = asyncio.Event()
        self.ready.set()
        log.info("shard master %s serving (epoch %d)", self.config.id, epoch)
        try:
            async with self.supervisor as sup:
                sup.spawn("deposition", self.deposition())
                sup.spawn("leadership", leadership.keepalive())
                sup.spawn("intake", submissions.intake(js))
                sup.spawn("reaper", self.reaper(table))
                sup.spawn("tracker", table.mlflow.tracker())
                sup.spawn("publisher", self.publisher(nc))
                await sup.wait()
            if self.deposed is not None:
                raise self.deposed
        finally:
            # Staged: stop answering (in-flight requests finish), then hand leadership over.
            await server.close(grace_s=self.config.shutdown_grace_s)
            await leadership.resign()

    # -- agents ----------------------------------------------------------------------------

    async def deposition(self) -> None:
        """Ends this round of leadership when a request handler finds itself deposed: the
        supervisor stops the other agents and `run` campaigns again."""
        await self._step_down.wait()
        raise self.deposed or Deposed("another master writes our state")

    def _depose(self, why: Deposed) -> None:
        """A request found another master writing our state: end this round."""
        self.deposed = self.deposed or why
        self._step_down.set()

    async def reaper(self, table: LeaseTable) -> None:
        """Expire overdue leases; finish jobs whose shards are all settled."""
        loop = asyncio.get_running_loop()
        forget_at = loop.time()
        while True:
            try:
                await table.reaper.expire_due()
                for job in table.running_jobs():
                    if job.settled:
                        await table.lifecycle.settle(job)
                if loop.time() >= forget_at:
                    forget_at = loop.time() + min(60.0, self.config.job_retention_s / 10)
                    # Finished-at times are wall-clock ones (written by whichever master).
                    gone = await table.lifecycle.forget_ended(
                        now=time.time(), retention_s=self.config.job_retention_s
                    )
                    if len(gone) == FORGET_PER_PASS:
                        forget_at = loop.time()  # more left: the next pass goes on with them
                    if gone:
                        log.info(
                            "forgot %d jobs ended over %gs ago",
                            len(gone),
                            self.config.job_retention_s,
                        )
            except Deposed:
                raise
            except Exception:
                log.exception("reaper pass failed; retrying")
            wait = self.config.reaper_interval_s
            next_expiry = table.expiries.next_expiry()
            if next_expiry is not None:
                wait = min(wait, max(0.01, next_expiry - loop.time()))
            await asyncio.sleep(wait)

    def _emit(self, event: JobEvent) -> None:
        try:
            self._events.put_nowait(event)
        except asyncio.QueueFull:
            log.debug("event queue full; dropping %s event of %s", event.kind, event.job)

    async def publisher(self, nc: NATS) -> None:
        while True:
            event = await self._events.get()
            try:
                # An owned job's events where only its owner (and those who see every job)
                # may listen.
                subject = self.subjects.events(event.job, event.owner)
                await nc.publish(subject, schema.encode(event))
            except nats.errors.Error as e:
                log.debug("could not publish event: %s", e)
