"""Submitted jobs taken off the EBB_JOBS stream, one message at a time.

Each message is decoded (MessagePack, or JSON when its Content-Type says so), its paths
checked against the data roots, and handed to the table (`ebb.shard_master.table.intake` plans and
persists it). It is acked once persisted, terminated when refused (a refusal is remembered for
`status` under the id the message claims, if any can be read), and let come back a bounded number of
times when the store could not take it, after which the job is abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from ebb.common import mlflow_export, schema
from ebb.common.aio import sleep_or_stop
from ebb.common.errors import SchemaError, SpecError
from ebb.common.job import JOB_ID_RE, JobSpec, check_roots, parse_job
from ebb.common.messaging.subjects import Subjects
from ebb.common.messaging.submission import REPLACE_OUTPUT_HEADER, job_id_of

from . import metrics
from .errors import Deposed, PlanningError
from .table.lease_table import LeaseTable

log = logging.getLogger(__name__)

_MAX_SUBMIT_DELIVERIES = 5
_INTAKE_CONSUMER = "ebb-master"


class Submissions:
    """The stream side of intake: fetch, decode, hand to `table`, ack."""

    def __init__(
        self,
        table: LeaseTable,
        *,
        subjects: Subjects,
        data_roots: list[str],
        stop: asyncio.Event,
    ) -> None:
        self.table = table
        self.subjects = subjects
        self.data_roots = data_roots
        """Input, output, model and code paths of a job must lie under one of these."""
        self.stop = stop
        """Cuts short the wait between two fetches that failed."""

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
                # Jobs without an owner, and every owner's.
                filter_subjects=[self.subjects.submit, self.subjects.owners_submit],
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
                if await sleep_or_stop(1.0, self.stop):
                    return
                continue
            for msg in messages:
                await self._take_job(msg)

    async def _take_job(self, msg: Msg) -> None:
        table = self.table
        try:
            owner = self.subjects.submission_owner(msg.subject)
        except ValueError as e:
            # Not a subject the stream takes (nor could a team publish on it): no owner to
            # tell, nobody to answer.
            metrics.INVALID_MESSAGES.labels("submit").inc()
            log.warning("a submission on %s dropped: %s", msg.subject, e)
            await msg.term()
            return
        claimed_id = _claimed_job_id(msg, owner)
        try:
            spec = _decode_job(msg, owner)
            replace_output_of = _replace_output_of(msg)
            check_roots(spec, self.data_roots)
            _check_tracking(spec)
        except Exception as e:  # noqa: BLE001 - one bad message must not stop the intake
            # SchemaError above all, but a NUL byte in a path (ValueError) and the like too:
            # whatever is wrong with one message must not stop the intake of the others.
            metrics.INVALID_MESSAGES.labels("submit").inc()
            reason = str(e) if isinstance(e, SchemaError) else f"{type(e).__name__}: {e}"
            log.warning("job %s rejected: %s", claimed_id or "<no id>", reason)
            if claimed_id:
                table.intake.reject(claimed_id, reason, owner=owner)
            await msg.term()
            return
        try:
            accepted = await table.intake.submit(
                spec, replace_output_of=replace_output_of, owner=owner
            )
        except PlanningError as e:
            log.warning("job %s rejected: %s", spec.id, e)
            table.intake.reject(spec.id, str(e), owner=owner)
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
                    spec.id, f"could not be planned after {delivered} tries: {e}", owner=owner
                )
                await msg.term()
            else:
                log.warning("job %s: intake failed (%s); will retry", spec.id, e)
                await msg.nak(delay=2.0 * delivered)
            return
        if not accepted:
            log.info("job %s was submitted before; ignoring the repeat", spec.id)
        await msg.ack()


def _decode_job(msg: Msg, owner: str) -> JobSpec:
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
        claimed = job_id_of(headers.get("Nats-Msg-Id", ""), owner)
        spec = parse_job({**spec.to_dict(), "id": claimed}) if claimed else spec.with_id()
    return spec


def _check_tracking(spec: JobSpec) -> None:
    """A job that asks for an MLflow run is refused by a master that could not log one,
    rather than found out at its end."""
    if spec.tracking.mlflow_uri is not None and not mlflow_export.available():
        raise SchemaError(
            "tracking.mlflow_uri",
            "this master cannot log to MLflow: install the mlflow extra (ebb[mlflow])",
        )


def _replace_output_of(msg: Msg) -> str:
    """The job whose output the submission replaces (`--replace`), "" for none."""
    named = (msg.headers or {}).get(REPLACE_OUTPUT_HEADER, "")
    if named and not JOB_ID_RE.fullmatch(named):
        raise SpecError("", f"{REPLACE_OUTPUT_HEADER} {named!r} is not a job id")
    return named


def _claimed_job_id(msg: Msg, owner: str) -> str:
    """The job id a message of `owner`'s claims, if one can be read at all: for rejection
    notices."""
    candidates: list[Any] = [job_id_of((msg.headers or {}).get("Nats-Msg-Id", ""), owner)]
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
