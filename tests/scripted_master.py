"""A stand-in shard master for controller tests: it answers the requests the controller
sends to the master, over a real NATS server, with job statuses a test writes by hand.

For situations a real master cannot be steered into on cue, such as a tier whose backlog or
back-pressure the test sets. The controller under test is the real one, with the real
MasterClient: only the master's answers are the test's.
"""

from __future__ import annotations

import dataclasses

from nats.aio.client import Client as NATS

from ebb.common import schema
from ebb.common.messaging.bus import RequestServer
from ebb.common.messaging.messages import (
    TERMINAL_JOB_STATES,
    CancelReply,
    FailRequest,
    JobStatus,
    PlacementReply,
    PlacementRequest,
    StatusReply,
    StatusRequest,
    WorkerEndedReply,
    WorkerEndedRequest,
)
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import Subjects


class ScriptedMaster:
    """Answers `status`, `worker_ended`, `fail` and `placement` from `jobs`, which a test
    sets."""

    def __init__(self, nc: NATS, config: NatsConfig) -> None:
        self.jobs: dict[str, JobStatus] = {}
        """What the master says of each job (its spec included, sent when asked for)."""
        self.ended: list[WorkerEndedRequest] = []
        """What the controller told of workers that ended badly."""
        self.failed: dict[str, str] = {}
        """Jobs the controller failed, and why."""
        self.placements: list[PlacementRequest] = []
        """What the controller told of groups its cluster cannot place, in order."""
        self._subjects = Subjects(config.prefix)
        self._server = RequestServer(nc, queue="scripted-master")

    def set(self, job: JobStatus) -> None:
        self.jobs[job.id] = job

    async def start(self) -> None:
        await self._server.add(self._subjects.master("status"), self._status)
        await self._server.add(self._subjects.master("worker_ended"), self._worker_ended)
        await self._server.add(self._subjects.master("fail"), self._fail)
        await self._server.add(self._subjects.master("placement"), self._placement)

    async def close(self) -> None:
        await self._server.close(grace_s=1.0)

    async def _status(self, data: bytes, subject: str) -> bytes:
        del subject
        request = schema.decode(StatusRequest, data)
        jobs = [self.jobs[request.job]] if request.job in self.jobs else []
        if not request.job:
            jobs = list(self.jobs.values())
        if request.active_only:
            jobs = [j for j in jobs if j.state not in TERMINAL_JOB_STATES]
        if not request.include_spec:
            jobs = [dataclasses.replace(j, spec=None) for j in jobs]
        return schema.encode(StatusReply(jobs=jobs))

    async def _worker_ended(self, data: bytes, subject: str) -> bytes:
        del subject
        self.ended.append(schema.decode(WorkerEndedRequest, data))
        return schema.encode(WorkerEndedReply())

    async def _fail(self, data: bytes, subject: str) -> bytes:
        del subject
        request = schema.decode(FailRequest, data)
        self.failed[request.job] = request.reason
        job = self.jobs.get(request.job)
        if job is not None:
            self.jobs[request.job] = dataclasses.replace(job, state="FAILED", reason=request.reason)
        return schema.encode(CancelReply(state="FAILED"))

    async def _placement(self, data: bytes, subject: str) -> bytes:
        """Heard, and kept in the job's status as a real master keeps it."""
        del subject
        request = schema.decode(PlacementRequest, data)
        self.placements.append(request)
        job = self.jobs.get(request.job)
        if job is not None and not request.tier:
            self.jobs[request.job] = dataclasses.replace(job, waiting=request.reason)
        elif job is not None:
            tiers = [
                dataclasses.replace(t, waiting=request.reason) if t.name == request.tier else t
                for t in job.tiers
            ]
            self.jobs[request.job] = dataclasses.replace(job, tiers=tiers)
        return schema.encode(PlacementReply())
