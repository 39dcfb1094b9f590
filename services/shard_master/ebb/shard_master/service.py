"""The shard master service: NATS in front of the lease table.

Agents (each a task of one supervisor; if one dies, the master stops them all, then campaigns
again if leadership or NATS was the cause, or exits to be restarted):
- leadership: keeps the leader key; losing it stops the agents, and the master campaigns again.
- deposition: ends the round as leadership does when a request finds another master writing.
- intake:     pulls job messages from the EBB_JOBS stream, validates, plans, persists, acks.
- reaper:     expires leases past their deadline and finishes jobs whose shards are settled.
- publisher:  sends job events (progress, state changes) for the CLI and the controller.
Requests are served beside them by a RequestServer: the lease protocol on
`<prefix>.master.<op>.<worker id>` (the subject names the caller, and a lease token is honoured
only from the worker it was granted to), the rest on `<prefix>.master.<op>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from ebb.common import bus, provision, schema
from ebb.common import metrics as metrics_server
from ebb.common.aio import sleep_or_stop, until
from ebb.common.bus import RequestServer
from ebb.common.errors import ErrorCode, SchemaError, SpecError
from ebb.common.messages import (
    CancelRequest,
    CommitRequest,
    FailRequest,
    JobEvent,
    LeaseRequest,
    ReleaseRequest,
    RenewRequest,
    ResumeRequest,
    StatusRequest,
    WorkerEndedRequest,
)
from ebb.common.natsconfig import NatsConfig
from ebb.common.schema import Message
from ebb.common.spec import JOB_ID_RE, JobSpec, check_roots, parse_job
from ebb.common.subjects import WORKER_ID_RE, WORKER_OPS, Subjects
from ebb.common.supervisor import AgentExited, Supervisor

from . import metrics
from .errors import BadRequest, Deposed, MasterError, PlanningError
from .leader import Leadership
from .lifecycle import FORGET_PER_PASS
from .store import Store
from .table import LeaseTable

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=Message)

_MAX_SUBMIT_DELIVERIES = 5
_INTAKE_CONSUMER = "ebb-master"


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
                        cause, Deposed | nats.errors.Error | TimeoutError
                    ):
                        raise
                    log.warning("stepping down (%s): campaigning again", e)
                    failures = 0
                except (nats.errors.Error, TimeoutError) as e:
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
            lease_grace_s=self.config.lease_grace_s,
        )
        await table.load()
        server = RequestServer(nc, queue="ebb-master", concurrency=self.config.concurrency)
        await server.add(
            self.subjects.worker_ops("lease"), self._handler(LeaseRequest, self._lease)
        )
        await server.add(
            self.subjects.worker_ops("renew"), self._handler(RenewRequest, self._renew)
        )
        await server.add(
            self.subjects.worker_ops("commit"), self._handler(CommitRequest, self._commit)
        )
        await server.add(
            self.subjects.worker_ops("release"), self._handler(ReleaseRequest, self._release)
        )
        for op in WORKER_OPS:
            # The subject without a worker: answered with where to ask instead.
            await server.add(self.subjects.master(op), self._moved(op))
        await server.add(self.subjects.master("status"), self._handler(StatusRequest, self._status))
        await server.add(self.subjects.master("cancel"), self._handler(CancelRequest, self._cancel))
        await server.add(self.subjects.master("fail"), self._handler(FailRequest, self._fail))
        await server.add(self.subjects.master("resume"), self._handler(ResumeRequest, self._resume))
        await server.add(
            self.subjects.master("worker_ended"),
            self._handler(WorkerEndedRequest, self._worker_ended),
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
                sup.spawn("intake", self.intake(js))
                sup.spawn("reaper", self.reaper())
                sup.spawn("publisher", self.publisher(nc))
                await sup.wait()
            if self.deposed is not None:
                raise self.deposed
        finally:
            # Staged: stop answering (in-flight requests finish), then hand leadership over.
            await server.close(grace_s=self.config.shutdown_grace_s)
            await leadership.resign()

    # -- requests --------------------------------------------------------------------------

    def _handler(
        self, request_type: type[Req], serve: Callable[[Req, str], Awaitable[Message]]
    ) -> bus.Handler:
        """`serve(request, subject)`: the subject names the caller of the lease protocol."""
        op = request_type.KIND

        async def handle(data: bytes, subject: str) -> bytes:
            started = time.perf_counter()
            try:
                request = schema.decode(request_type, data)
            except SchemaError as e:
                metrics.INVALID_MESSAGES.labels(op).inc()
                metrics.OPS.labels(op, ErrorCode.BAD_REQUEST).inc()
                return bus.error_reply(ErrorCode.BAD_REQUEST, str(e))
            try:
                reply = await serve(request, subject)
            except Deposed as e:
                # Someone else writes our state: answering anything more would be a lie.
                # This round ends (the `deposition` agent raises) and the master campaigns
                # again; only an operator's stop makes it exit.
                log.error("deposed: %s", e)
                self.deposed = self.deposed or e
                self._step_down.set()
                metrics.OPS.labels(op, e.code).inc()
                return bus.error_reply(e.code, str(e))
            except MasterError as e:
                metrics.OPS.labels(op, e.code).inc()
                return bus.error_reply(e.code, str(e))
            except (nats.errors.Error, TimeoutError) as e:
                metrics.OPS.labels(op, ErrorCode.UNAVAILABLE).inc()
                return bus.error_reply(ErrorCode.UNAVAILABLE, f"state store unavailable: {e}")
            metrics.OPS.labels(op, "ok").inc()
            metrics.OP_SECONDS.labels(op).observe(time.perf_counter() - started)
            return schema.encode(reply)

        return handle

    def _table(self) -> LeaseTable:
        assert self.table is not None
        return self.table

    def _moved(self, op: str) -> bus.Handler:
        where = self.subjects.worker_op(op, "<worker id>")

        async def handle(data: bytes, subject: str) -> bytes:
            del data, subject
            metrics.OPS.labels(op, ErrorCode.BAD_REQUEST).inc()
            return bus.error_reply(ErrorCode.BAD_REQUEST, f"{op} is asked on {where}")

        return handle

    def _caller(self, subject: str) -> str:
        """The worker a lease-protocol subject names (its last token)."""
        worker = subject.rsplit(".", 1)[-1]
        if not WORKER_ID_RE.match(worker):
            raise BadRequest(f"bad worker id {worker!r} in subject {subject}")
        return worker

    async def _lease(self, r: LeaseRequest, subject: str) -> Message:
        caller = self._caller(subject)
        if r.worker != caller:
            raise BadRequest(f"worker {caller!r} asked for a lease for worker {r.worker!r}")
        return await self._table().lease(r.job, caller, r.request_id, ready=r.ready)

    async def _renew(self, r: RenewRequest, subject: str) -> Message:
        return await self._table().renew(
            r.token, caller=self._caller(subject), ready=r.ready, rows_done=r.rows_done
        )

    async def _commit(self, r: CommitRequest, subject: str) -> Message:
        return await self._table().commit(r.token, caller=self._caller(subject))

    async def _release(self, r: ReleaseRequest, subject: str) -> Message:
        return await self._table().release(
            r.token, r.reason, retryable=r.retryable, caller=self._caller(subject)
        )

    async def _status(self, r: StatusRequest, subject: str) -> Message:
        return self._table().status(r)

    async def _cancel(self, r: CancelRequest, subject: str) -> Message:
        return await self._table().lifecycle.cancel(r.job, r.reason)

    async def _fail(self, r: FailRequest, subject: str) -> Message:
        return await self._table().lifecycle.cancel(r.job, r.reason, state="FAILED")

    async def _resume(self, r: ResumeRequest, subject: str) -> Message:
        return await self._table().lifecycle.resume(r.job, key=r.key)

    async def _worker_ended(self, r: WorkerEndedRequest, subject: str) -> Message:
        return await self._table().reaper.worker_ended(
            r.job, r.worker, kind=r.kind, blame=r.blame, reason=r.reason
        )

    # -- agents ----------------------------------------------------------------------------

    async def deposition(self) -> None:
        """Ends this round of leadership when a request handler finds itself deposed: the
        supervisor stops the other agents and `run` campaigns again."""
        await self._step_down.wait()
        raise self.deposed or Deposed("another master writes our state")

    async def intake(self, js: JetStreamContext) -> None:
        """Take submitted jobs off the stream, one at a time, acking each once it is persisted."""
        # Messages a previous master fetched and never acked (it died while planning them)
        # would wait out ack_wait before anyone saw them again. We alone lead now: a new
        # consumer delivers every message still in the (work-queue) stream at once. One that
        # was planned already is recognised as a repeat and acked.
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_consumer(self.subjects.jobs_stream, _INTAKE_CONSUMER)
        sub = await js.pull_subscribe(
            self.subjects.submit,
            durable=_INTAKE_CONSUMER,
            stream=self.subjects.jobs_stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=120.0,
                # A message that keeps failing without being acked or terminated (a crash
                # while planning it, say) is not redelivered forever.
                max_deliver=2 * _MAX_SUBMIT_DELIVERIES,
            ),
        )
        try:
            await self._intake_loop(sub)
        finally:
            # Unsubscribe rather than let drain() handle it: fetched messages are never marked
            # done in a pull subscription's queue, so drain would wait out its whole timeout.
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _intake_loop(self, sub: Any) -> None:
        while True:
            try:
                messages = await sub.fetch(batch=8, timeout=1.0)
            except TimeoutError:  # nats.errors.TimeoutError, or asyncio's from inside fetch
                continue
            except nats.errors.Error as e:
                log.warning("intake: fetch failed (%s); retrying", e)
                await asyncio.sleep(1.0)
                continue
            for msg in messages:
                await self._take_job(msg)

    async def _take_job(self, msg: Msg) -> None:
        table = self._table()
        claimed_id = _claimed_job_id(msg)
        try:
            spec = self._decode_job(msg)
            check_roots(spec, self.config.data_roots)
        except Exception as e:  # noqa: BLE001 - one bad message must not stop the intake
            # SchemaError above all, but a NUL byte in a path (ValueError) and the like too:
            # whatever is wrong with one message must not stop the intake of the others.
            metrics.INVALID_MESSAGES.labels("submit").inc()
            reason = str(e) if isinstance(e, SchemaError) else f"{type(e).__name__}: {e}"
            log.warning("job %s rejected: %s", claimed_id or "<no id>", reason)
            if claimed_id:
                table.intake.reject(claimed_id, reason)
            await msg.term()
            return
        try:
            accepted = await table.intake.submit(spec)
        except PlanningError as e:
            log.warning("job %s rejected: %s", spec.id, e)
            table.intake.reject(spec.id, str(e))
            await msg.term()
            return
        except Deposed:
            raise
        except Exception as e:
            # Storage or NATS trouble: let the message come back, a bounded number of times.
            delivered = msg.metadata.num_delivered
            if delivered >= _MAX_SUBMIT_DELIVERIES:
                log.exception("job %s: giving up after %d tries", spec.id, delivered)
                await table.intake.abandon(
                    spec.id, f"could not be planned after {delivered} tries: {e}"
                )
                await msg.term()
            else:
                log.warning("job %s: intake failed (%s); will retry", spec.id, e)
                await msg.nak(delay=2.0 * delivered)
            return
        if not accepted:
            log.info("job %s was submitted before; ignoring the repeat", spec.id)
        await msg.ack()

    def _decode_job(self, msg: Msg) -> JobSpec:
        headers = msg.headers or {}
        if headers.get("Content-Type", "").startswith("application/json"):
            try:
                body = json.loads(msg.data)
            except (ValueError, UnicodeDecodeError) as e:
                raise SpecError("", f"not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise SpecError("", "a job message is a map")
            body.setdefault(schema.VERSION_KEY, schema.SCHEMA_VERSION)
        else:
            body = schema.unpack(msg.data)
        schema.check_version(body)
        spec = parse_job(body)
        if not spec.id:
            claimed = headers.get("Nats-Msg-Id", "")
            spec = parse_job({**spec.to_dict(), "id": claimed}) if claimed else spec.with_id()
        return spec

    async def reaper(self) -> None:
        """Expire overdue leases; finish jobs whose shards are all settled."""
        table = self._table()
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
                await nc.publish(self.subjects.events(event.job), schema.encode(event))
            except nats.errors.Error as e:
                log.debug("could not publish event: %s", e)


def _claimed_job_id(msg: Msg) -> str:
    """The job id a message claims, if one can be read at all: for rejection notices."""
    candidates: list[Any] = [(msg.headers or {}).get("Nats-Msg-Id")]
    try:
        body = schema.unpack(msg.data)
        candidates.insert(0, body.get("id"))
    except SchemaError:
        try:
            body = json.loads(msg.data)
            if isinstance(body, dict):
                candidates.insert(0, body.get("id"))
        except (ValueError, UnicodeDecodeError):
            pass
    for c in candidates:
        if isinstance(c, str) and JOB_ID_RE.match(c):
            return c
    return ""
