"""How the master describes its jobs: the `status` reply, a page at a time, and the events
it publishes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

from ebb.common.data.layout import most_common_errors
from ebb.common.messaging.messages import (
    JobEvent,
    JobStatus,
    LeaseInfo,
    StatusReply,
    StatusRequest,
    TierStatus,
)

from ..errors import BadRequest, JobNotFound
from . import jobmetrics
from .jobs import Job, Tier, visible
from .tail import workers_usable

EventKind = Literal["accepted", "rejected", "progress", "state"]

STATUS_PAGE = 500
"""Jobs in one status reply at most (about 350 bytes each without their specs)."""


def status_reply(
    jobs: Mapping[str, Job],
    rejected: Mapping[str, str],
    request: StatusRequest,
    *,
    now: float,
    owner: str | None = None,
    halves: bool = True,
    min_halve_gain_s: float = 5.0,
) -> StatusReply:
    """One job (`request.job`), or a page of them in id order; `rejected`: refused
    submissions by id (those `owner` may see). `owner`: the team asking, which sees its own
    jobs alone (another's is not found, as one that does not exist); None: every job. `now`
    is the master's monotonic clock; `halves`, `min_halve_gain_s`: how the liquid tail cuts
    rests for idle workers (`tail.workers_usable`)."""
    job_id, limit, after = request.job, request.limit, request.after
    if limit < 0:
        raise BadRequest(f"limit must be 0 (the page size) or more, not {limit}")
    if job_id:
        job = jobs.get(job_id)
        if job is None or not visible(job, owner):
            if job_id in rejected:
                return StatusReply(jobs=[], rejected={job_id: rejected[job_id]})
            raise JobNotFound(f"no job {job_id!r}")
        chosen = [job]
        more: list[Job] = []
    else:
        # A page at a time, in id order: every job in one reply would outgrow NATS's
        # largest message once a few thousand jobs are kept.
        ids = sorted(i for i in jobs if i > after and visible(jobs[i], owner))
        listed = [jobs[i] for i in ids if not (request.active_only and jobs[i].ended)]
        chosen, more = listed[: limit or STATUS_PAGE], listed[limit or STATUS_PAGE :]
    return StatusReply(
        jobs=[
            describe(
                j,
                now=now,
                include_spec=request.include_spec,
                include_leases=request.include_leases,
                usable=lambda job, tier: workers_usable(
                    job, tier, now=now, halves=halves, min_halve_gain_s=min_halve_gain_s
                ),
            )
            for j in chosen
        ],
        rejected={} if job_id or after else dict(rejected),
        next=chosen[-1].id if not job_id and more else "",
    )


def describe(
    job: Job,
    *,
    now: float,
    include_spec: bool,
    include_leases: bool,
    usable: Callable[[Job, Tier], int] | None = None,
) -> JobStatus:
    """A job's status; `now` is the master's monotonic clock, which lease deadlines are on;
    `usable`: the workers a tier's work left could keep busy (`tail.workers_usable`)."""
    find_usable = usable or (lambda job, tier: workers_usable(job, tier, now=now))
    record = job.record
    live = job.state == "RUNNING"
    if live:
        shards = {s: job.counts[s] for s in ("TODO", "DOING", "DONE", "QUARANTINED")}
        rows_done, error_rows = job.rows_done, job.error_rows
    else:
        shards = {"DONE": record.shards_done, "QUARANTINED": record.shards_quarantined}
        rows_done, error_rows = record.rows_done, record.error_rows
    leases: list[LeaseInfo] = []
    if include_leases and live:
        for index in sorted(job.doing):
            shard = job.shards[index]
            for lease in shard.record.leases:
                if lease.token in shard.deadlines:
                    leases.append(
                        LeaseInfo(
                            shard=index,
                            attempt=lease.attempt,
                            worker=lease.worker,
                            expires_in_s=shard.deadlines[lease.token] - now,
                            rows=shard.record.spec.rows,
                            rows_done=shard.progress.get(lease.token, 0),
                            splitting=lease.token in shard.split_asked,
                        )
                    )
    in_flight = _rows_in_flight(job) if live else {}
    return JobStatus(
        id=job.id,
        name=job.spec.name,
        state=record.state,
        reason=record.reason,
        owner=record.owner,
        priority=job.spec.priority,
        shards_total=job.shards_total,
        shards=shards,
        rows_total=record.rows_total,
        rows_done=rows_done,
        rows_in_flight=in_flight.get(job.tiers[-1].name, 0),
        workers_usable=find_usable(job, job.tiers[0]) if live and not job.spec.tiers else 0,
        shards_split=sum(t.splits for t in job.tiers) if live else 0,
        error_rows=error_rows,
        submitted_at=record.submitted_at,
        finished_at=record.finished_at,
        min_workers=job.spec.resources.min_workers,
        max_workers=job.spec.resources.max_workers,
        manifest=record.manifest,
        spec=record.spec if include_spec else None,
        leases=leases,
        workers_ready=len(job.ready_workers),
        workers_busy=_busy(job) if live else [],
        workers_lost={k: n for k, n in record.workers_lost.items() if k != DRAINED},
        workers_drained=record.workers_lost.get(DRAINED, 0),
        advice=record.advice,
        attempts_forgiven=record.attempts_forgiven,
        metrics=jobmetrics.results(job) if live else dict(record.metrics),
        row_errors=most_common_errors(job.errors) if live else dict(record.row_errors),
        # A job of one tier too: its workers are placed, sized and started by their tier.
        tiers=_tiers(job, in_flight, find_usable) if live and job.spec.tiers else [],
        shard_s=job.tiers[0].shard_s if live and not job.spec.tiers else 0.0,
        waiting=_waiting(job) if live else "",
        mlflow_run=record.mlflow_run,
        mlflow_error=job.mlflow_error,
    )


DRAINED = "drained"
"""The kind a worker that ended because it was told to go is counted under in the job's
record (beside the kinds of loss), and shown apart (JobStatus.workers_drained)."""


def _waiting(job: Job) -> str:
    """Why the job's workers (a tier's, each named) cannot be placed; "" if they can."""
    if not job.spec.tiers:
        return job.waiting.get("", "")
    told = [(t.name, job.waiting[t.name]) for t in job.tiers if t.name in job.waiting]
    return "; ".join(f"tier {name}: {reason}" for name, reason in told)


def _busy(job: Job) -> list[str]:
    """The workers holding a live lease of the job."""
    busy = {
        lease.worker
        for index in job.doing
        for lease in job.shards[index].record.leases
        if lease.token in job.shards[index].deadlines
    }
    return sorted(busy)


def _rows_in_flight(job: Job) -> dict[str, int]:
    """By tier, the rows the running shards have done and not committed: each shard's
    furthest live attempt's, as its renewals told."""
    rows: dict[str, int] = {}
    for index in job.doing:
        shard = job.shards[index]
        done = max((n for t, n in shard.progress.items() if t in shard.deadlines), default=0)
        tier = job.tier_of(shard).name
        rows[tier] = rows.get(tier, 0) + min(done, shard.record.spec.rows)
    return rows


def _tiers(
    job: Job, in_flight: dict[str, int], usable: Callable[[Job, Tier], int]
) -> list[TierStatus]:
    return [
        TierStatus(
            name=tier.name,
            shards={s: tier.counts[s] for s in ("TODO", "DOING", "DONE", "QUARANTINED")},
            workers_usable=usable(job, tier),
            rows_done=tier.rows_done,
            rows_in_flight=in_flight.get(tier.name, 0),
            shards_split=tier.splits,
            bytes_done=tier.bytes_done,
            workers_ready=len(tier.ready_workers),
            held_back=job.held_back(tier),
            shard_s=tier.shard_s,
            waiting=job.waiting.get(tier.name, ""),
        )
        for tier in job.tiers
    ]


def job_event(job: Job, kind: EventKind) -> JobEvent:
    return JobEvent(
        job=job.id,
        kind=kind,
        owner=job.record.owner,
        state=job.state,
        reason=job.record.reason,
        shards_done=job.counts["DONE"],
        shards_total=job.shards_total,
        rows_done=job.rows_done,
        error_rows=job.error_rows,
    )
