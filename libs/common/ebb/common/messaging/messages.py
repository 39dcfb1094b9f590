"""Every message that crosses NATS, as a versioned schema.

Requests go to `<prefix>.master.<op>`; each has one reply type. A reply is either the op's
reply message (`ok: true`) or an `ErrorReply` (`ok: false`, a stable `code` and a sentence).

Over 400 lines: one schema per message, kept together so that a change of the wire format
is read in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from ..schema import Message

# -- shards ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ShardSpec(Message):
    """Where a shard's rows are. Metadata only, never data."""

    index: int
    path: str
    """The file holding the rows."""
    format: Literal["parquet", "csv", "jsonl", "arrow"]
    """arrow: a hand-off between the tiers of a job: the Arrow IPC files the attempt of the
    tier before committed (`parts`), read in order."""
    rows: int
    """Rows in the shard: exact for Parquet, an estimate for text formats."""
    row_groups: list[int] = field(default_factory=list)
    """Parquet: the row groups read, in order."""
    row_offset: int = 0
    """Rows of the range above skipped before the shard's first row: the remainder of a split
    shard starts where the part committed before it ended (`rest_of`). Parquet row groups
    wholly skipped are not read; a text range is read and its first rows dropped. (A shard
    planned before whole-row-group shards may have it too, for a row group cut into ranges.)"""
    byte_start: int = 0
    """Text formats: first byte of the shard, at the start of a line."""
    byte_end: int = 0
    """Text formats: one past the last byte, at the end of a line."""
    parts: list[HandoffPart] = field(default_factory=list)
    """arrow: the files of the hand-off, in order (`path` is the first's folder)."""

    @property
    def is_handoff(self) -> bool:
        """The rows are a hand-off from the tier before, not the job's input."""
        return self.format == "arrow"


@dataclass(frozen=True, kw_only=True)
class HandoffPart(Message):
    """One Arrow IPC file of a hand-off between tiers."""

    path: str
    rows: int


def rest_of(shard: ShardSpec, split_at: int, *, index: int) -> ShardSpec:
    """The remainder of `shard` once its first `split_at` rows are committed: a shard of its
    own (`index`), over the same range, starting `split_at` rows further in. (A text shard's
    rows are an estimate: its remainder has at least one. Parquet and Arrow rows are exact.)"""
    if split_at <= 0:
        raise ValueError(f"a shard is split after one row or more, not {split_at}")
    return replace(
        shard,
        index=index,
        rows=max(shard.rows - split_at, 0 if shard.format in ("parquet", "arrow") else 1),
        row_offset=shard.row_offset + split_at,
    )


ShardState = Literal["TODO", "DOING", "DONE", "QUARANTINED"]
JobState = Literal["SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]
TERMINAL_JOB_STATES: frozenset[str] = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


# -- replies ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ErrorReply(Message):
    KIND: ClassVar[str] = "error"
    ok: bool = False
    code: str
    """One of `ebb.common.errors.ErrorCode` (a plain string here, so that a code added by a
    newer peer still passes validation)."""
    message: str


# -- lease protocol --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LeaseRequest(Message):
    KIND: ClassVar[str] = "lease"
    job: str
    worker: str
    request_id: str = ""
    """Retries of one request carry the same id and get the same answer: a lost reply never
    leaves behind a lease nobody knows about."""
    ready: bool = False
    """The asking worker's pipeline has started (its stage processes are ready): the job's
    pipeline can start somewhere, so a worker that cannot start it is its node's fault."""
    tier: str = ""
    """The tier of the job the worker runs (`JobSpec.tiers`); "" for a job without tiers."""


@dataclass(frozen=True, kw_only=True)
class LeaseReply(Message):
    KIND: ClassVar[str] = "lease_reply"
    ok: bool = True
    status: Literal["granted", "wait", "end"]
    """granted: work on `shard`; wait: ask again after `retry_after_s`; end: the job is over."""
    shard: ShardSpec | None = None
    attempt: int = 0
    token: str = ""
    lease_s: float = 0.0
    """Lease period, counted by the worker from when it SENT the request."""
    retry_after_s: float = 0.0
    speculative: bool = False
    """Another attempt of this shard is running; whichever commits first wins."""
    renew_in_s: float | None = None
    """Renew within this many seconds rather than at a third of `lease_s`: the tail of the
    job is near, and a split of this shard for an idle worker rides on a renewal's reply."""


@dataclass(frozen=True, kw_only=True)
class RenewRequest(Message):
    KIND: ClassVar[str] = "renew"
    token: str
    ready: bool = False
    """As in LeaseRequest: the renewing worker's pipeline has started."""
    rows_done: int = 0
    """Rows of the shard the attempt has written so far: how the master judges which shard
    to split at the tail of a job."""


@dataclass(frozen=True, kw_only=True)
class RenewReply(Message):
    KIND: ClassVar[str] = "renew_reply"
    ok: bool = True
    lease_s: float
    split: bool = False
    """Workers are idle and nothing is queued: stop at the next batch, commit the rows done as
    a part of the shard, and the rest goes to one of them (the liquid tail)."""
    renew_in_s: float | None = None
    """As in LeaseReply: renew sooner than at a third of `lease_s`, while a worker of the job
    waits idle at its tail (the rows this renewal tells decide the split for it)."""


@dataclass(frozen=True, kw_only=True)
class CommitRequest(Message):
    KIND: ClassVar[str] = "commit"
    token: str
    rows: int = 0
    error_rows: int = 0


@dataclass(frozen=True, kw_only=True)
class CommitReply(Message):
    KIND: ClassVar[str] = "commit_reply"
    ok: bool = True
    status: Literal["done", "already_done"]


@dataclass(frozen=True, kw_only=True)
class ReleaseRequest(Message):
    KIND: ClassVar[str] = "release"
    token: str
    reason: str
    retryable: bool = True
    """True: back to the tail of the queue as is. False (poison): counts as a failed attempt."""
    mistake: bool = False
    """Every row of the shard's first chunk failed alike, the way a mistake in the spec or
    its code fails them (a column that is not there, a type the model refuses): every row of
    the job would repeat it, and the job fails at once with `reason`."""


@dataclass(frozen=True, kw_only=True)
class ReleaseReply(Message):
    KIND: ClassVar[str] = "release_reply"
    ok: bool = True
    state: ShardState


# -- jobs ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StatusRequest(Message):
    KIND: ClassVar[str] = "status"
    job: str = ""
    """One job, or every job when empty."""
    include_spec: bool = False
    include_leases: bool = False
    active_only: bool = False
    """Only jobs that are not finished."""
    limit: int = 0
    """Jobs in the reply at most (0: the master's page size)."""
    after: str = ""
    """The page of jobs after this id: the `next` of the previous reply."""


@dataclass(frozen=True, kw_only=True)
class LeaseInfo(Message):
    shard: int
    attempt: int
    worker: str
    expires_in_s: float
    rows: int = 0
    """Rows in the shard (an estimate for text input)."""
    rows_done: int = 0
    """Rows its holder last told it had written."""
    splitting: bool = False
    """Its holder is asked to split the shard for an idle worker."""


@dataclass(frozen=True, kw_only=True)
class JobStatus(Message):
    id: str
    name: str
    state: JobState
    reason: str = ""
    owner: str = ""
    """The team whose job it is (the subject it was submitted on named it); "" for a job
    submitted without an owner."""
    priority: int = 0
    shards_total: int = 0
    shards: dict[str, int] = field(default_factory=dict)
    """Shard count per state (TODO, DOING, DONE, QUARANTINED)."""
    rows_total: int = 0
    """Exact for Parquet input; an estimate from planning for text formats."""
    rows_done: int = 0
    """Rows of the shards committed (a job with tiers: its last tier's)."""
    shards_split: int = 0
    """Shards done by a part, their rest a shard of its own (every tier's): a worker told to
    go committed the rows it had, or the rest moved to an idle worker."""
    rows_in_flight: int = 0
    """Rows the shards running now have computed and written, as their renewals told, not
    committed yet (a job with tiers: its last tier's): progress before a shard commits. A
    shard run twice at once counts once, by its furthest attempt."""
    workers_usable: int = 0
    """How many workers the shards left could keep busy, which the controller scales on: the
    shards TODO or DOING, a Parquet shard counted as the pieces the liquid tail may yet cut
    it into for idle workers (a file of one row group is one shard for many workers), at
    most `max_workers`. 0 from a master that does not tell it: the shards TODO or DOING. A
    job with tiers: see each tier's."""
    error_rows: int = 0
    submitted_at: float = 0.0
    """Wall-clock seconds since the epoch, for display only."""
    finished_at: float = 0.0
    min_workers: int = 0
    max_workers: int = 0
    manifest: str = ""
    """URI of `_manifest.json`, once the job succeeded."""
    spec: dict[str, Any] | None = None
    leases: list[LeaseInfo] = field(default_factory=list)
    workers_ready: int = 0
    """Workers whose pipeline has started, as they told this master (since it leads)."""
    workers_busy: list[str] = field(default_factory=list)
    """Workers holding a live lease of the job (any tier's), in id order: a controller that
    shrinks a group drains the others first, so that work in hand is not cut short while an
    idle worker stays. Empty from a master that does not tell it."""
    workers_lost: dict[str, int] = field(default_factory=dict)
    """Workers of the job that ended badly, by the kind the controller gave (capacity: taken
    by the cluster, preempted, evicted, its node lost or killed from outside; oom; crash;
    setup: its pipeline could not start there), as the controller told the master."""
    row_errors: dict[str, int] = field(default_factory=dict)
    """The most common row errors of its shards done, by message (each cut to 300
    characters), most common first: the counts of the shards' most common few, summed."""
    advice: str = ""
    """What to change for the job to use all its workers: its input makes fewer shards than
    it may run workers (a Parquet file of one row group is one shard), and which setting or
    file to change; "" when it makes enough."""
    workers_drained: int = 0
    """Workers of the job that ended because they were told to go (their place given back,
    their tier done) and went in time, committing what they had done: not lost."""
    attempts_forgiven: int = 0
    """Attempts lost with a worker the cluster took away: not counted against max_attempts."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The values of the job's metrics (`StageSpec.metrics`) over the rows of its shards done
    so far, each counted once."""
    tiers: list[TierStatus] = field(default_factory=list)
    """A job with tiers (`JobSpec.tiers`): each tier's shards, in the tiers' order. `shards`
    above counts every tier's; `rows_done` the last tier's."""
    shard_s: float = 0.0
    """The median time its shards took, of those committed lately (a part of a split shard
    is no shard's whole time); 0: none yet. A job with tiers: see each tier's."""
    mlflow_run: str = ""
    """Its metrics' MLflow run, when the spec names a tracking URI and it SUCCEEDED: the
    run's id, or "pending" while the tracking store has not taken it (`mlflow_error` says
    why; the master keeps trying)."""
    mlflow_error: str = ""
    waiting: str = ""
    """Why the job runs no workers although it wants some: no node of the cluster could
    ever take them (the pool, GPU type or node selector it asks for), or the cluster refused
    to create them (a permission the controller lacks, in the API server's words), as the
    controller told the master; "" when it may run. The job waits: it is not failed, and
    runs once such a node appears, or the permission is granted. A job with tiers: its
    tiers' reasons, each named."""


@dataclass(frozen=True, kw_only=True)
class TierStatus(Message):
    """One tier of a job. A tier after the first gets a shard for each of the tier before's
    that is done (the hand-off of its rows), so its TODO shards are its backlog."""

    name: str
    shards: dict[str, int] = field(default_factory=dict)
    """This tier's shards per state (TODO, DOING, DONE, QUARANTINED)."""
    rows_done: int = 0
    """Rows this tier's shards done have committed."""
    rows_in_flight: int = 0
    """Rows this tier's running shards have computed, not committed yet (JobStatus's)."""
    workers_usable: int = 0
    """How many workers this tier's shards left could keep busy (JobStatus's)."""
    shards_split: int = 0
    """This tier's shards done by a part (JobStatus's)."""
    bytes_done: int = 0
    """Bytes of the files they committed: a tier before the last, its hand-offs."""
    workers_ready: int = 0
    """Workers of this tier whose pipeline has started, as they told this master: a tier
    whose workers cannot start theirs fails the job even while another tier's run."""
    held_back: bool = False
    """No shard of this tier is leased for now: the hand-offs waiting for the next tier are
    at their bound (backpressure)."""
    shard_s: float = 0.0
    """The median time this tier's shards took, of those committed lately; 0: none yet."""
    waiting: str = ""
    """Why this tier runs no workers although it wants some (see JobStatus.waiting)."""


@dataclass(frozen=True, kw_only=True)
class StatusReply(Message):
    KIND: ClassVar[str] = "status_reply"
    ok: bool = True
    jobs: list[JobStatus]
    rejected: dict[str, str] = field(default_factory=dict)
    """Recently rejected submissions by job id, with the reason (kept in memory only)."""
    next: str = ""
    """More jobs follow: ask again with `after` set to this."""


@dataclass(frozen=True, kw_only=True)
class CancelRequest(Message):
    KIND: ClassVar[str] = "cancel"
    job: str
    reason: str = "cancelled by user"


@dataclass(frozen=True, kw_only=True)
class FailRequest(Message):
    """The controller's verdict that a job cannot run (its image cannot be pulled, its code
    crashes every time): the job ends FAILED with the reason."""

    KIND: ClassVar[str] = "fail"
    job: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class WorkerEndedRequest(Message):
    """The controller saw a worker of `job` end badly: the leases it held end now, instead of
    when their deadlines pass. Idempotent: a worker that holds nothing (any more) changes
    nothing but the count of lost workers, which a repeat (same `worker`) does not change."""

    KIND: ClassVar[str] = "worker_ended"
    job: str
    worker: str
    kind: str
    """How it ended, as the controller classified it (ebb.controller.policy.failures.Kind)."""
    blame: bool
    """True: it died of what a shard can cause (out of memory, a crash) while computing its
    shards, and their attempts count as failed. False: the cluster took it (preempted,
    evicted, its node lost, killed from outside), or it could not start its pipeline there:
    its shards go back to the queue with no penalty."""
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class PlacementRequest(Message):
    """The controller's word that no node of the cluster could ever take the workers of
    `job` (of its tier `tier`; "" for a job without tiers), and why; `reason` "": they can
    be placed (again). Kept in the master's memory for the job's status, not in KV: the
    controller tells it again whenever the status it reads says otherwise, so a master
    that restarts hears it within a pass."""

    KIND: ClassVar[str] = "placement"
    job: str
    tier: str = ""
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class PlacementReply(Message):
    KIND: ClassVar[str] = "placement_reply"
    ok: bool = True


@dataclass(frozen=True, kw_only=True)
class WorkerEndedReply(Message):
    KIND: ClassVar[str] = "worker_ended_reply"
    ok: bool = True
    released: list[int] = field(default_factory=list)
    """Shards whose lease of that worker ended now."""
    forgiven: int = 0
    """Of those, attempts not counted against max_attempts."""


@dataclass(frozen=True, kw_only=True)
class CancelReply(Message):
    KIND: ClassVar[str] = "cancel_reply"
    ok: bool = True
    state: JobState


@dataclass(frozen=True, kw_only=True)
class ResumeRequest(Message):
    """Re-open a FAILED or CANCELLED job: its committed shards stay done, every other shard
    (quarantined ones included) gets a fresh set of attempts, and it runs again."""

    KIND: ClassVar[str] = "resume"
    job: str
    key: str = ""
    """An idempotency key, the same in every retry of one request: a retry whose first
    reply was lost finds the job resumed under its key and is answered as the first was,
    not refused because the job runs now. Empty: no such recognition."""


@dataclass(frozen=True, kw_only=True)
class ResumeReply(Message):
    KIND: ClassVar[str] = "resume_reply"
    ok: bool = True
    state: JobState
    shards_done: int = 0
    """Shards kept as they were: committed, never redone."""
    shards_retried: int = 0
    """Shards that were quarantined and get max_attempts new attempts."""
    shards_todo: int = 0
    """Shards to run: the retried ones and those never finished."""
    repeated: bool = False
    """The request's key had resumed the job already (a retry of a request whose reply was
    lost): nothing was done again, and the counts are the job's as they are now."""


@dataclass(frozen=True, kw_only=True)
class JobEvent(Message):
    """Published on `<prefix>.jobs.<job>.events` (an owned job's: `.<owner>` after it, where
    only that owner and the roles that see every job hear it): a hint to look, never the
    source of truth."""

    KIND: ClassVar[str] = "job_event"
    job: str
    kind: Literal["accepted", "rejected", "progress", "state"]
    owner: str = ""
    """The job's owner, whose subject it is published on; "" for a job without one."""
    state: str = ""
    reason: str = ""
    shards_done: int = 0
    shards_total: int = 0
    rows_done: int = 0
    error_rows: int = 0
