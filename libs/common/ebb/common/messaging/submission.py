"""Submitting a job: publish it to the jobs stream and wait until a master has accepted it.

Shared by every client of Ebb's (the SDK, the Batch API gateway): the job id is the message
id, so submitting the same job twice runs it once."""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from .. import schema
from ..errors import BusError, EbbError, ErrorCode, RemoteError, SchemaError
from ..job import JobSpec
from .api import MasterClient
from .bus import Backoff
from .messages import JobEvent
from .natsconfig import NatsConfig
from .subjects import Subjects


class SubmitError(EbbError):
    """The job was not accepted: refused by the master (the message says why) or no master."""


class SubmitPending(SubmitError):
    """The job is queued (JetStream holds it) but no master accepted it in the time given.
    It is not lost: it runs once a master takes it. Submitting it again would not help."""

    def __init__(self, job_id: str, message: str) -> None:
        super().__init__(message)
        self.job_id = job_id


REPLACE_OUTPUT_HEADER = "Ebb-Replace-Output"
"""A submission's header naming the job whose output in the spec's root the job removes
and computes anew (`--replace`): that job must own the root and have ended FAILED or
CANCELLED, or the job is refused."""


async def submit_job(
    nc: NATS,
    config: NatsConfig,
    spec: JobSpec,
    *,
    accept_timeout_s: float = 120.0,
    replace_output_of: str = "",
    owner: str = "",
) -> str:
    """Publish the job and wait until the master has accepted (planned and persisted) it.

    Raises SubmitError with the master's reason if it refuses the job, and SubmitPending
    if no master accepted it within `accept_timeout_s`: it is queued, and runs once one
    does (a master that restarts takes it up at once). `replace_output_of`: the job whose
    output in the spec's root this one replaces (REPLACE_OUTPUT_HEADER). `owner`: the team
    whose job it is, submitted on its subject (`Subjects.owner_submit`); "": no owner's.
    """
    subjects = Subjects(config.prefix)
    spec = spec.with_id()
    headers = {"Nats-Msg-Id": message_id(spec.id, owner)}
    if replace_output_of:
        headers[REPLACE_OUTPUT_HEADER] = replace_output_of
    events = await nc.subscribe(subjects.events(spec.id, owner))
    try:
        try:
            ack = await nc.jetstream().publish(
                subjects.owner_submit(owner) if owner else subjects.submit,
                schema.pack(spec),
                headers=headers,
                stream=subjects.jobs_stream,
            )
        except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
            # JetStream (or the server, without it) says no stream takes the subject.
            raise SubmitError(
                f"no Ebb stack answers at {config.url}: it has no stream "
                f"{subjects.jobs_stream} (is a shard master running there, with "
                f"prefix {config.prefix!r}?)"
            ) from None
        probe = MasterClient(nc, config, backoff=Backoff(attempts=1), owner=owner)
        if ack.duplicate:
            # Submitted before: no new event is coming, but the status answers at once.
            with contextlib.suppress(RemoteError, BusError):
                if (await probe.job(spec.id)).state != "SUBMITTED":
                    return spec.id
        return await _await_acceptance(probe, spec.id, events, accept_timeout_s)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await events.unsubscribe()


def message_id(job_id: str, owner: str = "") -> str:
    """A submission's `Nats-Msg-Id`: the job id, after its owner's name for an owned job (a
    dot between: no job id has one), so that the stream's duplicate window repeats no other
    team's submission of the same id, which the master refuses with the reason instead."""
    return f"{owner}.{job_id}" if owner else job_id


def job_id_of(message_id: str, owner: str = "") -> str:
    """The job id a submission's `Nats-Msg-Id` names (`message_id`); "" if it names none for
    this owner."""
    if not owner:
        return message_id
    head, dot, job_id = message_id.partition(".")
    return job_id if dot and head == owner else ""


async def _await_acceptance(
    probe: MasterClient, job_id: str, events: Subscription, timeout_s: float
) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            msg = await events.next_msg(timeout=1.0)
            event = schema.decode(JobEvent, msg.data)
            if event.kind == "rejected":
                raise SubmitError(f"job {job_id} rejected: {event.reason}")
            if event.kind in ("accepted", "progress", "state"):
                return job_id
        except (nats.errors.TimeoutError, SchemaError):
            pass
        # Events are hints: the status is the truth (and covers a resubmitted job). A job
        # still SUBMITTED is being planned: not accepted yet. No answer at all: no master
        # right now (one restarting, say); the job waits in the stream meanwhile.
        try:
            if (await probe.job(job_id)).state != "SUBMITTED":
                return job_id
        except BusError:
            pass
        except RemoteError as e:
            if e.code == ErrorCode.REJECTED:
                raise SubmitError(f"job {job_id} rejected: {e.message}") from None
            if e.code != ErrorCode.NOT_FOUND:
                raise
    raise SubmitPending(
        job_id,
        f"job {job_id} is queued, but no shard master accepted it within {timeout_s:g}s; "
        f"it runs once one does (`ebb status {job_id}` tells when)",
    )
