"""The Python SDK: submit a job, follow it, cancel or resume it.

async with await EbbClient.connect(NatsConfig(url="nats://ebb-nats:4222")) as ebb:
    job_id = await ebb.submit(load_job_file("job.yaml"))
    final = await ebb.wait(job_id)

Connected with a team's credential (ebb.common.messaging.identity.TeamSigner: its JWT names
the team and is tagged so), the client is that team's: it submits its jobs under the team
and asks of them on the team's subjects, where the master answers of the team's own jobs
alone. With any other credential it is the admin's client role, which sees every job.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import TracebackType

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from ebb.common.aio import wait_any
from ebb.common.job import JobSpec
from ebb.common.messaging import bus
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.messages import (
    TERMINAL_JOB_STATES,
    CancelReply,
    JobStatus,
    ResumeReply,
    StatusReply,
)
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import Subjects
from ebb.common.messaging.submission import SubmitError, SubmitPending, submit_job

__all__ = ["EbbClient", "SubmitError", "SubmitPending"]


class EbbClient:
    def __init__(self, nc: NATS, config: NatsConfig) -> None:
        self.nc = nc
        self.config = config
        self.subjects = Subjects(config.prefix)
        self.owner = bus.connection_owner(config)
        """The team this client is ("": the admin's client role, or no auth at all)."""
        self.master = MasterClient(
            nc, config, backoff=Backoff(first_s=0.2, max_s=2.0, attempts=8), owner=self.owner
        )

    @classmethod
    async def connect(cls, config: NatsConfig) -> EbbClient:
        return cls(await bus.connect(config, name="ebb-client"), config)

    async def close(self) -> None:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self.nc.drain()

    async def __aenter__(self) -> EbbClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def submit(
        self, spec: JobSpec, *, accept_timeout_s: float = 120.0, replace_output_of: str = ""
    ) -> str:
        """Publish the job and wait until the master has accepted (planned and persisted) it.

        The job id is the message id, so submitting the same job twice runs it once.
        Raises SubmitError with the master's reason if it refuses the job, and SubmitPending
        if no master accepted it within `accept_timeout_s`: it is queued, and runs once one
        does (a master that restarts takes it up at once). `replace_output_of`: the job that
        owns the spec's output root, ended FAILED or CANCELLED: its output there is removed
        and this job computes it anew (refused for any other owner, or a job that ended
        otherwise).
        """
        return await submit_job(
            self.nc,
            self.config,
            spec,
            accept_timeout_s=accept_timeout_s,
            replace_output_of=replace_output_of,
            owner=self.owner,
        )

    async def status(self, job: str = "") -> StatusReply:
        return await self.master.status(job)

    async def job(self, job: str, *, include_spec: bool = False) -> JobStatus:
        """One job's status; with its spec as submitted if `include_spec`."""
        return await self.master.job(job, include_spec=include_spec)

    async def cancel(self, job: str, reason: str = "cancelled by user") -> CancelReply:
        return await self.master.cancel(job, reason)

    async def resume(self, job: str) -> ResumeReply:
        """Re-open a FAILED or CANCELLED job: committed shards are kept, quarantined ones
        retried. RemoteError `not_resumable` for a job that runs or succeeded, `not_found`
        for one the master does not know (or has forgotten)."""
        return await self.master.resume(job)

    async def wait(
        self,
        job: str,
        *,
        poll_s: float = 0.5,
        on_update: Callable[[JobStatus], None] | None = None,
    ) -> JobStatus:
        """Until the job ends; `on_update` sees each status on the way. Returns the last one."""
        woken = asyncio.Event()

        async def on_event(_msg: object) -> None:
            woken.set()

        # A team hears its own job's events; the admin, whoever's job it is.
        owners = [self.owner] if self.owner else ["", "*"]
        subscriptions = [
            await self.nc.subscribe(self.subjects.events(job, owner), cb=on_event)
            for owner in owners
        ]
        try:
            while True:
                status = await self.master.job(job)
                if on_update is not None:
                    on_update(status)
                if status.state in TERMINAL_JOB_STATES:
                    return status
                woken.clear()
                await wait_any([woken], timeout_s=poll_s)
        finally:
            for events in subscriptions:
                with contextlib.suppress(nats.errors.Error):
                    await events.unsubscribe()
