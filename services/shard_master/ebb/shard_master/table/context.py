"""What every part of the lease table works with: the jobs this master holds, the store their
records live in, where their events and outputs go, and the two clocks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ebb.common.data.output import OutputStore
from ebb.common.messaging.messages import JobEvent

from .. import metrics
from ..errors import JobNotFound
from .jobs import Job, visible
from .records import RecordStore, ShardRecord
from .status import EventKind, job_event
from .transitions import JOB_STATES

EventSink = Callable[[JobEvent], None]
OutputOpener = Callable[[str], OutputStore]


@dataclass(frozen=True, kw_only=True)
class TableContext:
    jobs: dict[str, Job]
    """Every job this master holds, by id."""
    store: RecordStore
    emit: EventSink
    open_output: OutputOpener
    """How the master reaches a job's output root from its URI (a test gives its own)."""
    clock: Callable[[], float]
    """Monotonic: every deadline is on it."""
    wall_clock: Callable[[], float]
    """Every time written to a record is on it: it must mean the same to the next master, on
    another host maybe."""
    lease_grace_s: float
    """A lease this master finds in a record lives this long past the deadline it had."""

    def find(self, job_id: str, *, owner: str | None = None) -> Job:
        """The job `job_id`, if `owner` may see it (`jobs.visible`): another owner's job is
        not found, in the very words of one that does not exist."""
        job = self.jobs.get(job_id)
        if job is None or not visible(job, owner):
            raise JobNotFound(f"no job {job_id!r}")
        return job

    def event(self, job: Job, kind: EventKind) -> None:
        self.emit(job_event(job, kind))

    def adopt_shards(self, job: Job, entries: list[tuple[ShardRecord, int]]) -> None:
        """Give the job the shards these records describe, their leases judged by both clocks
        as they read now."""
        job.adopt_shards(
            entries,
            now=self.clock(),
            wall_now=self.wall_clock(),
            lease_s=job.spec.fault.lease_s,
            grace_s=self.lease_grace_s,
        )

    def publish_job_gauges(self) -> None:
        counts = Counter(j.state for j in self.jobs.values())
        for state in JOB_STATES:
            metrics.JOBS.labels(state).set(counts[state])
