"""The shard master's answers to requests, served by a RequestServer in front of the table.

The lease protocol (lease, renew, commit, release) is asked on `<prefix>.master.<op>.<worker
id>`: the subject names the caller, and a lease token is honoured only from the worker it was
granted to. A lease-protocol op asked on the subject without a worker is answered with where
to ask instead. The rest (status, cancel, fail, resume, worker_ended, placement) is asked on
`<prefix>.master.<op>`, where every job is answered (the admin's client role, the services).

A team asks status, cancel and resume on `<prefix>.master.<op>.<owner>`: its own jobs alone
are answered, listed and acted on; another owner's job is not found, in the very words of one
that does not exist. NATS lets a team publish on its own subjects alone; the owner is read
from the subject, never from the request.

Every answer is counted by op and outcome. A request that finds this master deposed (another
master writes its state) is refused, and `on_deposed` ends this round of leadership.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors

from ebb.common import schema
from ebb.common.errors import ErrorCode, SchemaError
from ebb.common.messaging import bus
from ebb.common.messaging.bus import RequestServer
from ebb.common.messaging.messages import (
    CancelRequest,
    CommitRequest,
    FailRequest,
    LeaseRequest,
    PlacementReply,
    PlacementRequest,
    ReleaseRequest,
    RenewRequest,
    ResumeRequest,
    StatusRequest,
    WorkerEndedRequest,
)
from ebb.common.messaging.subjects import OWNER_RE, WORKER_ID_RE, WORKER_OPS, Subjects
from ebb.common.schema import Message

from . import metrics
from .errors import BadRequest, Deposed, MasterError
from .table.lease_table import LeaseTable

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=Message)


class MasterRequests:
    """Each request decoded, served by `table`, and its reply (or error) encoded."""

    def __init__(
        self,
        table: LeaseTable,
        *,
        subjects: Subjects,
        on_deposed: Callable[[Deposed], None],
    ) -> None:
        self.table = table
        self.subjects = subjects
        self.on_deposed = on_deposed
        """Called when a request finds another master writing our state."""

    async def serve_on(self, server: RequestServer) -> None:
        """Subscribe `server` to every subject the master answers."""
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
        await server.add(
            self.subjects.owner_op("status", "*"), self._handler(StatusRequest, self._owned_status)
        )
        await server.add(
            self.subjects.owner_op("cancel", "*"), self._handler(CancelRequest, self._owned_cancel)
        )
        await server.add(
            self.subjects.owner_op("resume", "*"), self._handler(ResumeRequest, self._owned_resume)
        )
        await server.add(self.subjects.master("status"), self._handler(StatusRequest, self._status))
        await server.add(self.subjects.master("cancel"), self._handler(CancelRequest, self._cancel))
        await server.add(self.subjects.master("fail"), self._handler(FailRequest, self._fail))
        await server.add(self.subjects.master("resume"), self._handler(ResumeRequest, self._resume))
        await server.add(
            self.subjects.master("worker_ended"),
            self._handler(WorkerEndedRequest, self._worker_ended),
        )
        await server.add(
            self.subjects.master("placement"), self._handler(PlacementRequest, self._placement)
        )

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
                # This round ends (the service's `deposition` agent raises) and the master
                # campaigns again; only an operator's stop makes it exit.
                log.error("deposed: %s", e)
                self.on_deposed(e)
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

    def _moved(self, op: str) -> bus.Handler:
        where = self.subjects.worker_op(op, "<worker id>")

        async def handle(data: bytes, subject: str) -> bytes:
            del data, subject
            metrics.OPS.labels(op, ErrorCode.BAD_REQUEST).inc()
            return bus.error_reply(ErrorCode.BAD_REQUEST, f"{op} is asked on {where}")

        return handle

    # -- the lease protocol: the caller is the subject's last token -------------------------

    async def _lease(self, r: LeaseRequest, subject: str) -> Message:
        caller = _caller(subject)
        if r.worker != caller:
            raise BadRequest(f"worker {caller!r} asked for a lease for worker {r.worker!r}")
        return await self.table.lease(r.job, caller, r.request_id, ready=r.ready, tier=r.tier)

    async def _renew(self, r: RenewRequest, subject: str) -> Message:
        return await self.table.renew(
            r.token, caller=_caller(subject), ready=r.ready, rows_done=r.rows_done
        )

    async def _commit(self, r: CommitRequest, subject: str) -> Message:
        return await self.table.commit(r.token, caller=_caller(subject))

    async def _release(self, r: ReleaseRequest, subject: str) -> Message:
        return await self.table.release(
            r.token, r.reason, retryable=r.retryable, mistake=r.mistake, caller=_caller(subject)
        )

    # -- jobs ------------------------------------------------------------------------------

    async def _status(self, r: StatusRequest, subject: str) -> Message:
        return self.table.status(r)

    async def _cancel(self, r: CancelRequest, subject: str) -> Message:
        return await self.table.lifecycle.cancel(r.job, r.reason)

    async def _fail(self, r: FailRequest, subject: str) -> Message:
        return await self.table.lifecycle.cancel(r.job, r.reason, state="FAILED")

    async def _resume(self, r: ResumeRequest, subject: str) -> Message:
        return await self.table.lifecycle.resume(r.job, key=r.key)

    # -- an owner's own jobs: the owner is the subject's last token -------------------------

    async def _owned_status(self, r: StatusRequest, subject: str) -> Message:
        return self.table.status(r, owner=_owner(subject))

    async def _owned_cancel(self, r: CancelRequest, subject: str) -> Message:
        return await self.table.lifecycle.cancel(r.job, r.reason, owner=_owner(subject))

    async def _owned_resume(self, r: ResumeRequest, subject: str) -> Message:
        return await self.table.lifecycle.resume(r.job, key=r.key, owner=_owner(subject))

    async def _worker_ended(self, r: WorkerEndedRequest, subject: str) -> Message:
        return await self.table.reaper.worker_ended(
            r.job, r.worker, kind=r.kind, blame=r.blame, reason=r.reason
        )

    async def _placement(self, r: PlacementRequest, subject: str) -> Message:
        # Memory only, and not for an ended job: a restarted master hears it again from the
        # controller, which tells it whenever the status it reads differs.
        job = self.table.context.find(r.job)
        if not job.ended:
            job.wait_for_placement(r.tier, r.reason)
        return PlacementReply()


def _owner(subject: str) -> str:
    """The owner an owner's subject names (its last token)."""
    owner = subject.rsplit(".", 1)[-1]
    if not OWNER_RE.fullmatch(owner):
        raise BadRequest(f"bad owner {owner!r} in subject {subject}")
    return owner


def _caller(subject: str) -> str:
    """The worker a lease-protocol subject names (its last token)."""
    worker = subject.rsplit(".", 1)[-1]
    if not WORKER_ID_RE.match(worker):
        raise BadRequest(f"bad worker id {worker!r} in subject {subject}")
    return worker
