"""The lease table's durable form: one record per job and per shard, and the store they live in.

Every write is a compare-and-set on the record's last revision. A write that finds another
revision means some other process (a second master that believes it leads) wrote the record:
the store raises `Deposed` rather than overwrite it. A write whose answer never came raises
`StateUnsure` (it may have landed); a read that fails, or a write that surely did not land,
`StoreUnavailable`. The JetStream KV store is at the NATS edge (`ebb.shard_master.kv`); the
table sees only `RecordStore`, and holds it through `FencedStore`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from ebb.common import schema
from ebb.common.data.layout import OutputFile
from ebb.common.job.placement import as_meant_before_pools
from ebb.common.messaging.messages import JobState, ShardSpec, ShardState

from ..errors import Deposed

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class LeaseRecord:
    token: str
    attempt: int
    worker: str
    speculative: bool = False
    granted_at: float = 0.0
    """Wall-clock time of the grant: a restarted master knows how long the attempt has run."""
    expires_at: float = 0.0
    """Wall-clock time the lease expires, as of its latest renewal: a restarted master gives
    it no longer than this plus a grace. (Wall clock, because it must mean the same to the
    next master, on another host maybe; a running master judges by its monotonic clock.)"""


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    job: str
    spec: ShardSpec
    state: ShardState = "TODO"
    seq: int = 0
    """Queue position while TODO: lower is served first; re-queued shards get a new, higher seq."""
    attempts: int = 0
    """Attempts started. The next attempt is numbered attempts + 1."""
    failures: int = 0
    """Attempts that failed (lease expired, poisoned, its worker crashed or ran out of memory
    computing it). At max_attempts the shard is quarantined."""
    losses: int = 0
    """Attempts lost with a worker the cluster took (preempted, evicted, killed from outside),
    forgiven: not failures. At the job's worker_loss_cap the shard is quarantined anyway."""
    tier: int = 0
    """The tier of the job whose workers compute it (`JobSpec.tiers`; 0 without tiers)."""
    handed_from: int | None = None
    """A shard of a later tier: the shard of the tier before whose committed output (the
    hand-off) are its rows. Its remainders, if it is split, read the same hand-off."""
    handoff: int | None = None
    """DONE in a tier before the last: the shard of the next tier that reads its output.
    Written in the same record as the DONE, as `remainder` is, so that a master that died
    before it created that shard's record creates it on load (`missing_successors`)."""
    suspect: bool = False
    """A worker that crashed or ran out of memory held it with other shards, each of which
    may have been the cause: it is leased alone from now on (to a worker holding nothing,
    which reads nothing ahead while it holds it), so that the next crash names the shard."""
    leases: list[LeaseRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """The latest failure reasons, newest last."""
    done_attempt: int = 0
    seconds: float = 0.0
    """How long the winning attempt ran, when the master saw it start and commit: the shard
    times that speculation compares with, kept across restarts."""
    rows: int = 0
    error_rows: int = 0
    files: list[OutputFile] = field(default_factory=list)
    split_at: int = 0
    """DONE by a part: the winning attempt committed the first `split_at` rows (its commit
    record's `split_at`), and `remainder` is the rest."""
    remainder: ShardSpec | None = None
    """The shard made of the rows after `split_at`. Written here, in the same record as the
    part's DONE, so that the split is one durable transition: a master that dies before it
    created the remainder's own record creates it when it loads the job
    (`transitions.missing_successors`)."""
    remainder_half: ShardSpec | None = None
    """The rest cut in two for an idle worker (a split's rest worth two workers): the second
    half, a shard of its own, and `remainder` the first. Written with the DONE, as
    `remainder` is; both halves name this shard as `split_from`."""
    split_from: int | None = None
    """The shard this one is the remainder of."""
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The winning attempt's partials of the job's metrics (its commit record's): the job's
    metrics merge those of its DONE shards, each shard's rows counted once."""
    row_errors: dict[str, int] = field(default_factory=dict)
    """The winning attempt's most common row errors (its commit record's), by message."""


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    id: str
    spec: dict[str, Any]
    state: JobState = "SUBMITTED"
    owner: str = ""
    """The team whose job it is: the subject it was submitted on named it (never the
    message, which anyone can write). "" for a job submitted without an owner (the admin's
    client role), and for every record written before jobs had owners."""
    reason: str = ""
    shards_total: int = 0
    rows_total: int = 0
    submitted_at: float = 0.0
    finished_at: float = 0.0
    # Final counts, written when the job ends, so that a finished job is described without
    # loading its shards.
    shards_done: int = 0
    shards_quarantined: int = 0
    rows_done: int = 0
    error_rows: int = 0
    manifest: str = ""
    resume_key: str = ""
    """The idempotency key of the request that last resumed the job."""
    workers_lost: dict[str, int] = field(default_factory=dict)
    """Workers of the job that ended badly, by kind, as the controller told (every run)."""
    attempts_forgiven: int = 0
    """Attempts lost with a worker the cluster took, not counted as failures (every run)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The values of the job's metrics over its DONE shards, written when the job ends."""
    row_errors: dict[str, int] = field(default_factory=dict)
    """The most common row errors of its DONE shards, by message, written when it ends."""
    mlflow_run: str = ""
    """A job whose spec names an MLflow tracking URI, once it SUCCEEDED: "pending" (written
    with the SUCCEEDED) until its metrics are logged as a run, then that run's id
    (ebb.shard_master.table.tracking)."""
    advice: str = ""
    """What to change for the job to use all its workers (planning.sizing.few_shards_advice);
    "" when its input makes enough shards."""
    pools_placed: bool = False
    """Written by a master whose controller places workers by `resources.pool`. A record
    without it is read with the pools its spec meant then (placement.as_meant_before_pools)."""


def read_job(value: bytes) -> JobRecord:
    """A job's stored record as this version reads it. One written before pools placed
    workers gets the pools its spec meant then (as_meant_before_pools), and is written back
    so with its next update."""
    record = schema.decode(JobRecord, value)
    if record.pools_placed:
        return record
    return replace(record, spec=as_meant_before_pools(record.spec), pools_placed=True)


def shard_key(job: str, index: int) -> str:
    return f"{job}.{index:07d}"


class RecordStore(Protocol):
    """Where the lease table keeps its records: JetStream KV in service, memory in tests.

    `update_*` is a compare-and-set on `last`, raising Deposed when the record has moved on;
    `create_*` returns None when the record exists already. A write whose outcome is unknown
    raises StateUnsure; a read that cannot be made, or a write that surely did not land,
    StoreUnavailable."""

    async def create_job(self, record: JobRecord) -> int | None: ...
    async def update_job(self, record: JobRecord, *, last: int) -> int: ...
    async def get_job(self, job: str) -> tuple[JobRecord, int] | None: ...
    async def create_shard(self, record: ShardRecord) -> int | None: ...
    async def update_shard(self, record: ShardRecord, *, last: int) -> int: ...
    async def load_jobs(self) -> list[tuple[JobRecord, int]]: ...
    async def load_shards(self, job: str) -> list[tuple[ShardRecord, int]]: ...
    async def forget_job(self, job: str) -> None: ...


class FencedStore:
    """The table's store: `inner`, which takes no write more once one found this master
    deposed or unsure of what it wrote.

    Stepping down is not instant: the request that found it out ends this round, and until
    the supervisor has stopped every agent, other requests are still being served from
    memory. One of them would write on what memory says, and memory may be behind KV (a DONE
    that landed unanswered names a new shard's index; a second DONE would name it again).
    So every write from then on is refused (Deposed) until a new round loads the table."""

    def __init__(self, inner: RecordStore) -> None:
        self.inner = inner
        self.fenced: Deposed | None = None

    async def _write(self, write: Callable[[], Awaitable[T]]) -> T:
        if self.fenced is not None:
            raise Deposed(f"this master is stepping down: {self.fenced}")
        try:
            return await write()
        except Deposed as e:
            self.fenced = e
            raise

    async def create_job(self, record: JobRecord) -> int | None:
        return await self._write(lambda: self.inner.create_job(record))

    async def update_job(self, record: JobRecord, *, last: int) -> int:
        return await self._write(lambda: self.inner.update_job(record, last=last))

    async def get_job(self, job: str) -> tuple[JobRecord, int] | None:
        return await self.inner.get_job(job)

    async def create_shard(self, record: ShardRecord) -> int | None:
        return await self._write(lambda: self.inner.create_shard(record))

    async def update_shard(self, record: ShardRecord, *, last: int) -> int:
        return await self._write(lambda: self.inner.update_shard(record, last=last))

    async def load_jobs(self) -> list[tuple[JobRecord, int]]:
        return await self.inner.load_jobs()

    async def load_shards(self, job: str) -> list[tuple[ShardRecord, int]]:
        return await self.inner.load_shards(job)

    async def forget_job(self, job: str) -> None:
        await self._write(lambda: self.inner.forget_job(job))


def describe(record: ShardRecord) -> str:
    """A shard record as a failpoint's condition and an error message read it: its key, its
    state, and the successors it names ("handoff", "split")."""
    names = " handoff" if record.handoff is not None else ""
    names += " split" if record.remainder is not None else ""
    names += " halves" if record.remainder_half is not None else ""
    return f"shard {shard_key(record.job, record.spec.index)} {record.state}{names}"
