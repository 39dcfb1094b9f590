"""A typed client for the shard master's request/reply API, shared by the worker and the SDK."""

from __future__ import annotations

import secrets
from typing import TypeVar

from nats.aio.client import Client as NATS

from ..errors import ErrorCode, RemoteError
from ..schema import Message
from .bus import Backoff, request
from .messages import (
    CancelReply,
    CancelRequest,
    CommitReply,
    CommitRequest,
    FailRequest,
    JobStatus,
    LeaseReply,
    LeaseRequest,
    PlacementReply,
    PlacementRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
    ResumeReply,
    ResumeRequest,
    StatusReply,
    StatusRequest,
    WorkerEndedReply,
    WorkerEndedRequest,
)
from .natsconfig import NatsConfig
from .subjects import OWNER_OPS, Subjects, check_owner

M = TypeVar("M", bound=Message)


class MasterClient:
    """Requests to the master. Each retries timeouts and "no responders" (a master restarting
    or failing over) on `backoff`; an error reply raises RemoteError at once.

    With an `owner` (a team), status, cancel and resume are asked on that owner's subjects
    (`Subjects.owner_op`), where the master answers of its jobs alone: what a team's
    credential may ask, and what the gateway asks for a batch's owner."""

    def __init__(
        self,
        nc: NATS,
        config: NatsConfig,
        *,
        backoff: Backoff | None = None,
        owner: str = "",
    ) -> None:
        self.nc = nc
        self.config = config
        self.subjects = Subjects(config.prefix)
        self.timeout_s = config.request_timeout_s
        self.backoff = backoff or Backoff(first_s=0.2, max_s=5.0, attempts=0)
        self.owner = check_owner(owner) if owner else ""

    def for_owner(self, owner: str) -> MasterClient:
        """This client asking on `owner`'s subjects ("": on those without an owner)."""
        return MasterClient(self.nc, self.config, backoff=self.backoff, owner=owner)

    async def lease(
        self, job: str, worker: str, *, ready: bool = False, tier: str = ""
    ) -> LeaseReply:
        """`ready`: this worker's pipeline has started. `tier`: the job's tier it runs."""
        # One id for every retry of this request: a reply lost in transit is answered again
        # with the same lease instead of a second one.
        req = LeaseRequest(
            job=job, worker=worker, request_id=secrets.token_hex(8), ready=ready, tier=tier
        )
        return await self._call("lease", req, LeaseReply, worker=worker)

    # The lease protocol goes to subjects that name the worker asking: the master refuses a
    # token used by any worker but the one it was leased to.

    async def renew(
        self,
        token: str,
        *,
        worker: str,
        timeout_s: float | None = None,
        ready: bool = False,
        rows_done: int = 0,
    ) -> RenewReply:
        return await request(
            self.nc,
            self.subjects.worker_op("renew", worker),
            RenewRequest(token=token, ready=ready, rows_done=rows_done),
            RenewReply,
            timeout_s=timeout_s or self.timeout_s,
        )

    async def commit(self, token: str, *, worker: str, rows: int, error_rows: int) -> CommitReply:
        req = CommitRequest(token=token, rows=rows, error_rows=error_rows)
        return await self._call("commit", req, CommitReply, worker=worker)

    async def release(
        self, token: str, reason: str, *, worker: str, retryable: bool, mistake: bool = False
    ) -> ReleaseReply:
        req = ReleaseRequest(token=token, reason=reason, retryable=retryable, mistake=mistake)
        return await self._call("release", req, ReleaseReply, worker=worker)

    async def status(
        self,
        job: str = "",
        *,
        include_spec: bool = False,
        include_leases: bool = False,
        active_only: bool = False,
    ) -> StatusReply:
        """One job's status, or every job's, the master's pages gathered into one reply."""
        pages: list[StatusReply] = []
        after = ""
        while True:
            req = StatusRequest(
                job=job,
                include_spec=include_spec,
                include_leases=include_leases,
                active_only=active_only,
                after=after,
            )
            pages.append(await self._call("status", req, StatusReply))
            after = pages[-1].next
            if not after:
                break
        if len(pages) == 1:
            return pages[0]
        return StatusReply(
            jobs=[j for page in pages for j in page.jobs], rejected=pages[0].rejected
        )

    async def job(self, job: str, *, include_spec: bool = False) -> JobStatus:
        """One job's status. RemoteError `rejected` if its submission was refused."""
        reply = await self.status(job, include_spec=include_spec)
        if not reply.jobs:
            reason = reply.rejected.get(job, f"job {job} was rejected")
            raise RemoteError(ErrorCode.REJECTED, reason)
        return reply.jobs[0]

    async def cancel(self, job: str, reason: str = "cancelled by user") -> CancelReply:
        return await self._call("cancel", CancelRequest(job=job, reason=reason), CancelReply)

    async def fail(self, job: str, reason: str) -> CancelReply:
        return await self._call("fail", FailRequest(job=job, reason=reason), CancelReply)

    async def worker_ended(
        self, job: str, worker: str, *, kind: str, blame: bool, reason: str = ""
    ) -> WorkerEndedReply:
        """The controller's word that `worker` of `job` ended badly (see WorkerEndedRequest)."""
        request = WorkerEndedRequest(job=job, worker=worker, kind=kind, blame=blame, reason=reason)
        return await self._call("worker_ended", request, WorkerEndedReply)

    async def placement(self, job: str, tier: str, reason: str) -> PlacementReply:
        """The controller's word that the workers of `job` (its tier `tier`) cannot be
        placed on any node, and why; `reason` "": they can (see PlacementRequest)."""
        request = PlacementRequest(job=job, tier=tier, reason=reason)
        return await self._call("placement", request, PlacementReply)

    async def resume(self, job: str, *, key: str | None = None) -> ResumeReply:
        """Resume `job`. Every retry of this call (a timeout, a master restarting) carries
        one idempotency key, `key` or a fresh one: a retry whose first reply was lost is
        answered `repeated`, not refused because the job now runs."""
        request = ResumeRequest(job=job, key=key if key is not None else secrets.token_hex(16))
        return await self._call("resume", request, ResumeReply)

    async def _call(self, op: str, message: Message, reply_type: type[M], *, worker: str = "") -> M:
        if worker:
            subject = self.subjects.worker_op(op, worker)
        elif self.owner and op in OWNER_OPS:
            subject = self.subjects.owner_op(op, self.owner)
        else:
            subject = self.subjects.master(op)
        return await request(
            self.nc,
            subject,
            message,
            reply_type,
            timeout_s=self.timeout_s,
            backoff=self.backoff,
        )
