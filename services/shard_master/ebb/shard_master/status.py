"""How the master describes a job: the `status` reply and the events it publishes."""

from __future__ import annotations

from typing import Literal

from ebb.common.messages import JobEvent, JobStatus, LeaseInfo

from .jobs import Job

EventKind = Literal["accepted", "rejected", "progress", "state"]


def describe(job: Job, *, now: float, include_spec: bool, include_leases: bool) -> JobStatus:
    """A job's status; `now` is the master's monotonic clock, which lease deadlines are on."""
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
                        )
                    )
    return JobStatus(
        id=job.id,
        name=job.spec.name,
        state=record.state,
        reason=record.reason,
        priority=job.spec.priority,
        shards_total=record.shards_total,
        shards=shards,
        rows_total=record.rows_total,
        rows_done=rows_done,
        error_rows=error_rows,
        submitted_at=record.submitted_at,
        finished_at=record.finished_at,
        min_workers=job.spec.resources.min_workers,
        max_workers=job.spec.resources.max_workers,
        manifest=record.manifest,
        spec=record.spec if include_spec else None,
        leases=leases,
        workers_ready=len(job.ready_workers),
        workers_lost=dict(record.workers_lost),
        attempts_forgiven=record.attempts_forgiven,
    )


def job_event(job: Job, kind: EventKind) -> JobEvent:
    return JobEvent(
        job=job.id,
        kind=kind,
        state=job.state,
        reason=job.record.reason,
        shards_done=job.counts["DONE"],
        shards_total=job.record.shards_total,
        rows_done=job.rows_done,
        error_rows=job.error_rows,
    )
