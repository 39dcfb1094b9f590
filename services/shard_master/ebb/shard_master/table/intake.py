"""How a job enters the table: planned, given its output root, and written with its shards;
or refused, and remembered for a while with the reason.

A submission is written in an order that survives a master dying anywhere in it: nothing
before the input is planned (input that cannot be planned is refused with no trace), then
the output root, the job's record (SUBMITTED), its shards' records, and last the job's move
to RUNNING. A second delivery of the same submission finds the job SUBMITTED and completes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import replace

from ebb.common.data.layout import OutputOwner
from ebb.common.data.output import OutputStore
from ebb.common.job import JobSpec
from ebb.common.messaging.messages import JobEvent

from ..errors import BadRequest, MissingColumns, OutputTaken, PlanningError
from ..planning.planner import plan_input
from ..planning.sizing import few_shards_advice, least_rows
from .context import TableContext
from .jobs import Job
from .lifecycle import JobLifecycle
from .ownership import (
    OwnerView,
    replace_refusal,
    spec_mismatch,
    taken_reason,
    view_from_record,
)
from .records import JobRecord, ShardRecord

log = logging.getLogger(__name__)

_CREATE_CHUNK = 256
REJECTIONS_KEPT = 256
"""Refused submissions remembered (the newest), for `status` to say why."""
REASON_CHARS = 512
"""A refusal's reason kept at most: all REJECTIONS_KEPT of them, with their ids, stay far
below NATS's largest message (1 MiB) in the status reply that carries them."""


class RejectionLog:
    """Refused submissions by owner and job id, oldest first, and why each was refused: the
    newest REJECTIONS_KEPT, each reason cut to REASON_CHARS (a reason may quote the spec, and
    every unpaged `status` reply carries them all). An owner sees its own alone (`seen_by`):
    a reason may quote its spec."""

    def __init__(self) -> None:
        self._reasons: OrderedDict[tuple[str, str], str] = OrderedDict()

    def add(self, job_id: str, reason: str, *, owner: str = "") -> str:
        """Remember a refusal; returns the reason as kept."""
        if len(reason) > REASON_CHARS:  # the middle goes: a quoted value, most likely
            half = REASON_CHARS // 2
            reason = reason[: half - 1] + "…" + reason[-half:]
        key = (owner, job_id)
        self._reasons.pop(key, None)  # refused again: the newest again
        self._reasons[key] = reason
        while len(self._reasons) > REJECTIONS_KEPT:
            self._reasons.popitem(last=False)
        return reason

    def seen_by(self, owner: str | None) -> dict[str, str]:
        """The refusals `owner` may see, by job id, oldest first: its own; None: everyone's
        (one id refused for two owners: the newest)."""
        seen: dict[str, str] = {}
        for (whose, job_id), reason in self._reasons.items():
            if owner is None or whose == owner:
                seen.pop(job_id, None)
                seen[job_id] = reason
        return seen

    def __len__(self) -> int:
        return len(self._reasons)


def _column_field(spec: JobSpec, column: str) -> str:
    """The field of `spec` that names an input column (one that planning requires)."""
    if spec.input.columns is not None and column in spec.input.columns:
        return "input.columns"
    return "output.carryover"


class JobIntake:
    def __init__(self, context: TableContext, *, lifecycle: JobLifecycle) -> None:
        self._context = context
        self._lifecycle = lifecycle
        self.rejected = RejectionLog()

    def reject(self, job_id: str, reason: str, *, owner: str = "") -> None:
        """Remember a refused submission of `owner`'s for a while, so `status` can say why
        (to that owner, and to those who see every job)."""
        reason = self.rejected.add(job_id, reason, owner=owner)
        self._context.emit(JobEvent(job=job_id, kind="rejected", reason=reason, owner=owner))

    async def abandon(self, job_id: str, reason: str, *, owner: str = "") -> None:
        """A submission that could not be completed: a job left SUBMITTED is marked FAILED."""
        job = self._context.jobs.get(job_id)
        if job is None or job.record.owner != owner:
            self.reject(job_id, reason, owner=owner)
            return
        async with job.lock:
            if job.state == "SUBMITTED":
                await self._lifecycle.end(job, "FAILED", reason)

    async def submit(self, spec: JobSpec, *, replace_output_of: str = "", owner: str = "") -> bool:
        """Plan and persist a validated job of `owner`'s ("": of no owner). False if it was
        known already (a resubmission). `replace_output_of`: a job whose output in the spec's
        root is removed (it must have ended FAILED or CANCELLED, and own the root still) for
        this one to compute anew. An id that is another owner's job's is refused: a job is
        never taken over, nor completed, by another's submission."""
        jobs, store = self._context.jobs, self._context.store
        job = jobs.get(spec.id)
        if job is not None and job.record.owner != owner:
            raise PlanningError(f"job id {spec.id!r} is taken: submit the job under another id")
        if job is not None and job.state != "SUBMITTED":
            return False
        # Plan before writing anything: input that cannot be planned is refused with no trace.
        # Planning reads only metadata, but of possibly many files: off the event loop.
        submitted = spec  # as submitted: what the output records, before planning types it
        # The columns the stages reading the input name (a job in tiers: its first tier's;
        # a later tier reads the rows handed on): when every column is read, the files must
        # have them (with input.columns, the spec's own check saw to it).
        read = spec.input_columns_read() if spec.input.columns is None else {}
        # Those that read the input: a job in tiers, its first tier's.
        first_workers = spec.tier_resources(spec.tier_names()[0]).max_workers
        required = [*(spec.input.columns or []), *spec.output.carryover, *read]
        try:
            plan = await asyncio.to_thread(
                plan_input,
                spec.input,
                required_columns=list(dict.fromkeys(required)),
                workers=first_workers,
                least_rows=least_rows(spec),
            )
        except MissingColumns as e:
            named = [
                f"{column!r} ({read[column] if column in read else _column_field(spec, column)})"
                for column in e.missing
            ]
            raise PlanningError(
                f"{e.path} has no column {', '.join(named)}: it has {e.names}"
            ) from None
        shard_specs = plan.shards
        if plan.column_types != spec.input.column_types:
            # The spec workers get says how to type each column: every shard alike.
            spec = replace(spec, input=replace(spec.input, column_types=plan.column_types))
        # The output root becomes this job's, atomically: no other job can write into it.
        await self._claim_output(submitted, replace_output_of=replace_output_of, submitter=owner)
        if job is None:
            submitted_at = self._context.wall_clock()
            advice = few_shards_advice(
                shard_specs,
                first_workers,
                rows_per_shard=spec.input.rows_per_shard,
                split_tail=spec.fault.split_tail,
            )
            record = JobRecord(
                id=spec.id,
                spec=spec.to_dict(),
                owner=owner,
                submitted_at=submitted_at,
                pools_placed=True,
                advice=advice,
            )
            revision = await store.create_job(record)
            if revision is None:
                found = await store.get_job(spec.id)
                if found is None:
                    raise BadRequest(f"job {spec.id} vanished during submission")
                record, revision = found
                if record.owner != owner:
                    raise PlanningError(
                        f"job id {spec.id!r} is taken: submit the job under another id"
                    )
                if record.state != "SUBMITTED":
                    return False
            job = Job(record, revision, spec)
            jobs[job.id] = job
        records = [ShardRecord(job=spec.id, spec=s, seq=s.index) for s in shard_specs]
        for start in range(0, len(records), _CREATE_CHUNK):
            chunk = records[start : start + _CREATE_CHUNK]
            # Records that exist already come from an interrupted planning of this same job.
            await asyncio.gather(*(store.create_shard(r) for r in chunk))
        entries = await store.load_shards(spec.id)
        running = replace(
            job.record,
            state="RUNNING",
            shards_total=len(records),
            rows_total=sum(s.rows for s in shard_specs),
        )
        await self._lifecycle.move(job, running)
        self._context.adopt_shards(job, entries)
        log.info("job %s accepted: %d shards, ~%d rows", job.id, len(records), running.rows_total)
        self._context.event(job, "accepted")
        return True

    async def _claim_output(
        self, spec: JobSpec, *, replace_output_of: str = "", submitter: str = ""
    ) -> None:
        """Make the spec's output root this job's, or raise OutputTaken saying whose it is
        and what the user can do. A job that carries on in its own root (a resume on a new
        stack: the same id) must compute the rows it committed there. A job told to replace
        another's output (`replace_output_of`) removes it, if that job ended FAILED or
        CANCELLED. `submitter`: the team submitting ("": none), told whose a root is only
        if it is one of its own jobs."""
        uri = spec.output.uri
        fields = spec.output_fields()
        output = self._context.open_output(uri)
        try:
            owner, taken_from = await asyncio.to_thread(output.claim, spec.id, fields=fields)
            if owner.job != spec.id and not self._seen_by(owner.job, submitter):
                # Another team's job (or one this master cannot tell is the team's): its id,
                # state and progress are not this team's to read.
                raise OutputTaken(
                    f"{uri} holds the output of another owner's job: choose another output.uri"
                )
            if owner.job != spec.id and replace_output_of:
                view = await self._owner_view(owner, output)
                refusal = replace_refusal(uri, view, replace_output_of)
                if refusal:
                    raise OutputTaken(refusal)
                owner = await asyncio.to_thread(
                    output.replace_output, owner, spec.id, fields=fields
                )
                if owner.job == spec.id:
                    log.info(
                        "job %s replaces the output of job %s (%s) in %s: removed",
                        spec.id,
                        view.job,
                        view.state,
                        uri,
                    )
                    return
            if owner.job != spec.id:
                raise OutputTaken(taken_reason(uri, await self._owner_view(owner, output)))
            if owner.removing:
                # This job replaced another's output and stopped before it was all removed
                # (this is its submission again): nothing of its own is there yet.
                await asyncio.to_thread(output.finish_removing, owner)
                return
            if taken_from:
                log.info(
                    "job %s takes %s over from job %s, which ended with nothing committed",
                    spec.id,
                    uri,
                    taken_from,
                )
                return
            mismatch = spec_mismatch(uri, owner, spec, fields)
            if mismatch:
                raise OutputTaken(mismatch)
            tiered = len(spec.tiers) > 1
            committed = await asyncio.to_thread(output.committed_shards) if tiered else 0
            if committed:
                # A later tier's shards are numbered as the earlier tier's finished: the
                # numbers of another run mean other rows, and adopting them would lose some.
                raise OutputTaken(
                    f"{uri} holds shards job {spec.id} committed in a run this master has no "
                    "record of: a job in tiers carries on only from the master's state. "
                    "Choose another output.uri, or remove that output"
                )
            if owner.state:  # it ended there before: it runs again
                await asyncio.to_thread(output.reclaim, spec.id)
        except (NotADirectoryError, IsADirectoryError, PermissionError) as e:
            raise OutputTaken(f"cannot write to {uri}: {e}") from e

    def _seen_by(self, job_id: str, submitter: str) -> bool:
        """Whether `submitter` may be told of the job `job_id` (that owns a root): a team, of
        its own jobs this master knows; the admin ("", no owner), of any."""
        if not submitter:
            return True
        job = self._context.jobs.get(job_id)
        return job is not None and job.record.owner == submitter

    async def _owner_view(self, owner: OutputOwner, output: OutputStore) -> OwnerView:
        """The job that owns a root, as this master knows it, or else as the root tells."""
        job = self._context.jobs.get(owner.job)
        if job is not None:
            ended = job.ended
            return OwnerView(
                job=job.id,
                state=job.state,
                shards_done=job.record.shards_done if ended else job.counts["DONE"],
                shards_total=job.record.shards_total,
                rows_done=job.record.rows_done if ended else job.rows_done,
                here=True,
            )
        committed = 0 if owner.state else await asyncio.to_thread(output.committed_shards)
        complete = not owner.state and await asyncio.to_thread(output.read_manifest) is not None
        return view_from_record(owner, committed=committed, complete=complete)
