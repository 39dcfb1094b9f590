"""The lease table's records in JetStream KV: `Store`, the RecordStore of the master in service.

NATS's errors stop here, at the edge: the table sees only Ebb's own. A read that fails, or a
write that surely did not land (no server heard it, or one answered with an error), raises
`StoreUnavailable`: nothing changed; ask again. A write whose answer never came (a timeout, a
dropped connection) may have landed all the same, so it raises `StateUnsure`: the master no
longer knows what KV holds, and loads it again rather than carry on from memory.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from ebb.common import failpoints, schema
from ebb.common.messaging.snapshot import kv_snapshot

from .errors import Deposed, StateUnsure, StoreUnavailable
from .table.records import JobRecord, ShardRecord, describe, read_job, shard_key

T = TypeVar("T")


class Store:
    def __init__(
        self, js: JetStreamContext, *, jobs: KeyValue, shards: KeyValue, buckets: tuple[str, str]
    ) -> None:
        self._js = js
        self._jobs = jobs
        self._shards = shards
        self._jobs_bucket, self._shards_bucket = buckets

    async def create_job(self, record: JobRecord) -> int | None:
        """Create the job's record; None if it exists already."""
        try:
            return await _written(
                f"job {record.id}", self._jobs.create(record.id, schema.pack(record))
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def update_job(self, record: JobRecord, *, last: int) -> int:
        try:
            return await _written(
                f"job {record.id} {record.state}",
                self._jobs.update(record.id, schema.pack(record), last=last),
            )
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise Deposed(f"job {record.id} was written by someone else") from e

    async def get_job(self, job: str) -> tuple[JobRecord, int] | None:
        try:
            entry = await _read(f"job {job}", self._jobs.get(job))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        assert entry.value is not None and entry.revision is not None
        return read_job(entry.value), entry.revision

    async def create_shard(self, record: ShardRecord) -> int | None:
        """Create a shard's record; None if it exists already (a resumed planning)."""
        key = shard_key(record.job, record.spec.index)
        try:
            return await _written(describe(record), self._shards.create(key, schema.pack(record)))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def update_shard(self, record: ShardRecord, *, last: int) -> int:
        key = shard_key(record.job, record.spec.index)
        try:
            return await _written(
                describe(record), self._shards.update(key, schema.pack(record), last=last)
            )
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise Deposed(f"shard {key} was written by someone else") from e

    async def load_jobs(self) -> list[tuple[JobRecord, int]]:
        entries = await _read("the jobs", kv_snapshot(self._js, self._jobs_bucket, ">"))
        return [(read_job(e.value), e.revision) for e in entries]

    async def load_shards(self, job: str) -> list[tuple[ShardRecord, int]]:
        entries = await _read(
            f"the shards of job {job}", kv_snapshot(self._js, self._shards_bucket, f"{job}.*")
        )
        return [(schema.decode(ShardRecord, e.value), e.revision) for e in entries]

    async def forget_job(self, job: str) -> None:
        """Remove a job's record and its shards' records for good (no delete markers left:
        a purge of their subjects in the buckets' streams)."""
        # Not a transition (the job ended long ago, its record says all there is): a purge
        # that failed is made again on the next pass, whatever it did.
        await _read(
            f"job {job} (to forget it)",
            self._js.purge_stream(
                f"KV_{self._shards_bucket}", subject=f"$KV.{self._shards_bucket}.{job}.*"
            ),
        )
        await _read(
            f"job {job} (to forget it)",
            self._js.purge_stream(
                f"KV_{self._jobs_bucket}", subject=f"$KV.{self._jobs_bucket}.{job}"
            ),
        )


async def _written(what: str, write: Awaitable[T]) -> T:
    """`write`'s answer. StoreUnavailable where it surely did not land (no server heard it,
    or the server answered with an error); StateUnsure where no answer came, for it may
    have landed all the same. (A compare-and-set's conflict, `KeyWrongLastSequenceError`,
    passes: the caller knows what it means.)"""
    try:
        answer = await write
        if failpoints.take(failpoints.MASTER_KV_ANSWER_LOST, detail=what):
            raise nats.errors.TimeoutError  # the server applied the write; its answer is lost
    except nats.js.errors.KeyWrongLastSequenceError:
        raise
    except (nats.errors.NoRespondersError, nats.js.errors.APIError) as e:
        raise StoreUnavailable(f"could not write {what} ({e!r})") from e
    except (nats.errors.Error, TimeoutError) as e:
        raise StateUnsure(f"the write of {what} may or may not have landed ({e!r})") from e
    return answer


async def _read(what: str, read: Awaitable[T]) -> T:
    """`read`'s answer; StoreUnavailable if it could not be had (nothing changed). A key
    that is not there (`KeyNotFoundError`) passes: the caller knows what it means."""
    try:
        return await read
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        raise
    except (nats.errors.Error, TimeoutError) as e:
        raise StoreUnavailable(f"could not read {what} ({e!r})") from e
