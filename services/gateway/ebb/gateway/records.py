"""The files' and batches' records, in two NATS KV buckets, keyed `<owner>.<id>`.

A record holds what the API shows of it and what the gateway needs besides (where its bytes
are, its job). Every change is a compare-and-set on the revision read: two replicas of the
gateway, or one that restarted halfway, never undo each other's step (`Conflict`: read again).
Ids sort by creation time, so a list is the keys sorted, read a page at a time.

The two indexes beside the records (the live batches, the files that expire by hour) live
here too: each is written in the same call as the record it indexes, in the order that
never loses one, which is why this module is past 400 lines rather than split in two."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, NamedTuple

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from ebb.common.errors import EbbError
from ebb.common.messaging.snapshot import kv_snapshot

log = logging.getLogger(__name__)

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
ENDED: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})


@dataclass(frozen=True, kw_only=True)
class LiveBatch:
    owner: str
    id: str
    since: float
    """When it was indexed (the epoch's seconds)."""


class Expiring(NamedTuple):
    """An entry of the expiry index: a file due to go in that hour (since the epoch)."""

    owner: str
    id: str
    hour: int


def _hour(at: float) -> int:
    return int(at // 3600)


class Conflict(EbbError):
    """Someone else changed the record since it was read."""


class RecordsUnavailable(EbbError):
    """NATS did not answer: nothing changed, ask again."""


def new_id(kind: str) -> str:
    """`file-…` or `batch_…`: milliseconds since the epoch (base 36, fixed width, so ids sort
    by creation) and randomness."""
    ms = int(time.time() * 1000)
    stamp = _base36(ms).rjust(9, "0")
    sep = "-" if kind == "file" else "_"
    return f"{kind}{sep}{stamp}{secrets.token_hex(8)}"


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while n:
        n, r = divmod(n, 36)
        out = digits[r] + out
    return out or "0"


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    id: str
    owner: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    path: str
    """Under the gateway's root."""
    expires_at: int | None = None

    def api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@dataclass(frozen=True, kw_only=True)
class BatchError:
    code: str
    message: str
    param: str | None = None
    line: int | None = None


@dataclass(frozen=True, kw_only=True)
class BatchRecord:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    errors: list[BatchError] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    model: str | None = None
    """The catalogue model its requests name (None until validated, or if none did)."""
    rejected: int = 0
    """Requests refused at validation (lines of the error file before the job ran)."""
    unrun: int = 0
    """Of the failed, those the batch ended (cancelled, expired) before they ran."""
    job: str | None = None
    """Its Ebb job, once submitted."""
    job_owned: bool = False
    """Its job is (to be) submitted under the batch's owner, and asked of on that owner's
    subjects, where the owner's own NATS identity reads it too. False: a batch that went
    in_progress before jobs had owners, whose job has none (asked of on the subjects without
    an owner), until it must be submitted again."""
    output_expires_s: int | None = None
    """How long its output and error files are kept (`output_expires_after`); None: kept
    until deleted."""
    ending: Literal["", "cancelled", "expired"] = ""
    """Why its job was stopped short: the batch ends so once the job has ended."""
    step_failures: int = 0
    """Times its steps failed unexpectedly, over its life (never reset: the batch fails
    past a few, so a step that keeps failing cannot hold a replica's place for ever)."""

    @property
    def key(self) -> str:
        return f"{self.owner}.{self.id}"

    def api(self) -> dict[str, Any]:
        errors = (
            {"object": "list", "data": [asdict(e) for e in self.errors]} if self.errors else None
        )
        usage = {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }
        # A cancelled batch's results are written as any batch's (`finalizing`), but the
        # API goes `cancelling` -> `cancelled`: that is what its clients are shown.
        cancelling = self.status == "finalizing" and self.ending == "cancelled"
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": "cancelling" if cancelling else self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": None
            if cancelling or self.ending == "cancelled"
            else self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "usage": usage,
            "metadata": self.metadata,
        }

    def moved(self, status: BatchStatus, **changes: Any) -> BatchRecord:
        """The record in `status`, its `<status>_at` stamped now (and `changes`)."""
        now = int(time.time())
        stamp: dict[str, Any] = {f"{status}_at": now} if f"{status}_at" in _STAMPED else {}
        return replace(self, status=status, **stamp, **changes)


_STAMPED = frozenset(
    f"{s}_at"
    for s in (
        "in_progress",
        "finalizing",
        "completed",
        "failed",
        "expired",
        "cancelling",
        "cancelled",
    )
)


def _dump(record: FileRecord | BatchRecord) -> bytes:
    return json.dumps(asdict(record), sort_keys=True).encode()


def _load_file(raw: bytes) -> FileRecord:
    return FileRecord(**json.loads(raw))


def _load_batch(raw: bytes) -> BatchRecord:
    body = json.loads(raw)
    body["errors"] = [BatchError(**e) for e in body.get("errors", [])]
    return BatchRecord(**body)


class Records:
    """The two buckets, read and written as records."""

    def __init__(self, js: Any, *, files: KeyValue, batches: KeyValue, buckets: tuple[str, str]):
        self._js = js
        self._files = files
        self._batches = batches
        self._files_bucket, self._batches_bucket = buckets

    # -- files ------------------------------------------------------------------------------

    async def create_file(self, record: FileRecord) -> bool:
        """False if the record exists already (a result file written by an earlier pass).
        A file that expires is put in the expiry index first (a record is never missed by
        the sweep; an entry whose record never came is dropped by it)."""
        if record.expires_at is not None:
            await self.index_expiry(record)
        try:
            await _call(self._files.create(f"{record.owner}.{record.id}", _dump(record)))
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        return True

    async def get_file(self, owner: str, file_id: str) -> FileRecord | None:
        raw = await self._get(self._files, owner, file_id)
        return None if raw is None else _load_file(raw[0])

    async def delete_file(self, record: FileRecord) -> None:
        await _call(self._files.delete(f"{record.owner}.{record.id}"))
        if record.expires_at is not None:
            await self.forget_expiry(Expiring(record.owner, record.id, _hour(record.expires_at)))

    # -- the expiry index: `exp.<hour>.<owner>.<id>` (four tokens: no list of records sees
    # it), so that a sweep reads the files due in the hours since the last one, not every
    # file kept.

    async def index_expiry(self, record: FileRecord) -> None:
        assert record.expires_at is not None
        hour = _hour(record.expires_at)
        await _call(self._files.put(f"exp.{hour}.{record.owner}.{record.id}", b""))

    async def forget_expiry(self, entry: Expiring) -> None:
        await self._purge(self._files_bucket, f"exp.{entry.hour}.{entry.owner}.{entry.id}")

    async def expiring(self, hour: int | None = None) -> list[Expiring]:
        """The index's entries of one hour (the hour since the epoch), or all of them."""
        pattern = "exp.*.*.*" if hour is None else f"exp.{hour}.*.*"
        entries = await _call(kv_snapshot(self._js, self._files_bucket, pattern))
        found = []
        for e in entries:
            _, at, owner, file_id = e.key.split(".", 3)
            found.append(Expiring(owner, file_id, int(at)))
        return found

    async def _purge(self, bucket: str, key: str) -> None:
        # Purged from the stream, not deleted: a KV delete leaves a marker that every later
        # read of an index would read again, one per entry ever dropped.
        await _call(self._js.purge_stream(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}"))

    async def files(self, owner: str) -> list[FileRecord]:
        entries = await _call(kv_snapshot(self._js, self._files_bucket, f"{owner}.*"))
        return [_load_file(e.value) for e in entries]

    # -- an owner's quota ledger (one key of one token: no `<owner>.*` list sees it) --------

    async def get_ledger(self, owner: str) -> tuple[dict[str, Any], int]:
        """The owner's ledger (empty if none yet) and its revision (0: not there)."""
        try:
            entry = await _call(self._files.get(f"ledger_{owner}"))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return {}, 0
        assert entry.value is not None and entry.revision is not None
        return json.loads(entry.value), entry.revision

    async def put_ledger(self, owner: str, ledger: dict[str, Any], *, last: int) -> None:
        """Write the ledger if nobody did since `last` was read (`Conflict` otherwise)."""
        raw = json.dumps(ledger, sort_keys=True).encode()
        try:
            if last == 0:
                await _call(self._files.create(f"ledger_{owner}", raw))
            else:
                await _call(self._files.update(f"ledger_{owner}", raw, last=last))
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise Conflict(f"{owner}'s quota ledger was changed by someone else") from e

    # -- batches ----------------------------------------------------------------------------

    async def create_batch(self, record: BatchRecord) -> int:
        return int(await _call(self._batches.create(record.key, _dump(record))))

    async def get_batch(self, owner: str, batch_id: str) -> tuple[BatchRecord, int] | None:
        raw = await self._get(self._batches, owner, batch_id)
        return None if raw is None else (_load_batch(raw[0]), raw[1])

    async def update_batch(self, record: BatchRecord, *, last: int) -> int:
        """Write the record if nobody did since `last`; one that ends leaves the index of
        live batches (if that write is lost, the next pass drops it)."""
        try:
            revision = int(await _call(self._batches.update(record.key, _dump(record), last=last)))
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise Conflict(f"batch {record.id} was changed by someone else") from e
        if record.status in ENDED:
            with contextlib.suppress(RecordsUnavailable):
                await self.drop_live(record.owner, record.id)
        return revision

    async def delete_batch(self, record: BatchRecord) -> None:
        """Forget an ended batch (Anthropic's Message Batches may be deleted)."""
        await self._purge(self._batches_bucket, record.key)

    # -- the index of live batches: `live.<owner>.<id>` (three tokens: no list of records
    # sees it), written before the batch's record and dropped once it ends, so that a pass
    # reads the batches not ended, not every batch ever made.

    async def add_live(self, owner: str, batch_id: str) -> None:
        await _call(self._batches.put(f"live.{owner}.{batch_id}", str(time.time()).encode()))

    async def drop_live(self, owner: str, batch_id: str) -> None:
        await self._purge(self._batches_bucket, f"live.{owner}.{batch_id}")

    async def live(self) -> list[LiveBatch]:
        """The index: every batch not known to have ended, with when it was indexed."""
        entries = await _call(kv_snapshot(self._js, self._batches_bucket, "live.*.*"))
        found = []
        for e in entries:
            _, owner, batch_id = e.key.split(".", 2)
            try:
                since = float(e.value)
            except ValueError:
                since = 0.0
            found.append(LiveBatch(owner=owner, id=batch_id, since=since))
        return found

    async def batches(self, owner: str = "*") -> list[tuple[BatchRecord, int]]:
        """Every batch of `owner` (`*`: of everyone's), with its revision. A record that
        does not read as a batch (written by another version) is logged and left out: one
        record never stops the list of all."""
        entries = await _call(kv_snapshot(self._js, self._batches_bucket, f"{owner}.*"))
        found = []
        for e in entries:
            try:
                found.append((_load_batch(e.value), e.revision))
            except (ValueError, TypeError, KeyError) as error:
                log.error("batch record %s does not read: %s", e.key, error)
        return found

    async def _get(self, kv: KeyValue, owner: str, rid: str) -> tuple[bytes, int] | None:
        if not _is_token(rid):
            return None  # not an id of ours: no key could hold it
        try:
            entry = await _call(kv.get(f"{owner}.{rid}"))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        assert entry.value is not None and entry.revision is not None
        return entry.value, entry.revision


def _is_token(rid: str) -> bool:
    return bool(rid) and len(rid) <= 128 and all(c.isalnum() or c in "-_" for c in rid)


async def _call(operation: Any) -> Any:
    try:
        return await operation
    except (
        nats.js.errors.KeyWrongLastSequenceError,
        nats.js.errors.KeyNotFoundError,
        nats.js.errors.KeyDeletedError,
    ):
        raise
    except (nats.errors.Error, TimeoutError) as e:
        raise RecordsUnavailable(f"NATS KV did not answer ({e!r})") from e
