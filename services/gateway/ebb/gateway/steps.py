"""One batch's steps, from `validating` to its end: each read from its record and its job,
written compare-and-set, safe to take twice (files are written again whole, byte for byte,
and a job submitted twice runs once).

    validating --(the file checked, its rows written)--> in_progress --(its job ended)-->
    finalizing --(output and error files written)--> completed | cancelled | expired | failed

A file that fails validation ends `failed`, naming its lines; `cancel` asks the job to stop
(`cancelling`) and a batch past its window is stopped the same way (`expired`): either
ends with what its job committed, the rest as error lines saying why. A cancelled batch is
shown `cancelling` while its files are written. Which batch is stepped when is the loop's
(ebb.gateway.batches). One concept, a batch's way to its end, past 400 lines: each status's
step and the failure of any of them read best side by side."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import IO, Any, cast

import pyarrow as pa
import pyarrow.parquet as pq

from ebb.common.data.storage import StoreError
from ebb.common.errors import BusError, ErrorCode, RemoteError
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.messages import TERMINAL_JOB_STATES, JobStatus
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.submission import SubmitError, SubmitPending, submit_job

from . import metrics
from .config import GatewayConfig
from .jobspec import batch_job, request_schema, rows_per_shard
from .records import (
    BatchError,
    BatchRecord,
    BatchStatus,
    Conflict,
    FileRecord,
    Records,
    RecordsUnavailable,
)
from .requests import Validation, validate
from .results import Tally, job_rows, write_results
from .store import FileStore

log = logging.getLogger(__name__)

ROW_GROUP_BYTES = 32 * 1024 * 1024
"""Prompt text in one row group of a batch's job input at most (a shard's requests are held
in memory while it is written)."""

MAX_STEP_FAILURES = 3
"""Times a batch's step may fail unexpectedly (not a conflict, not NATS or the store away)
before the batch fails with the reason."""


def batch_dir(batch: BatchRecord) -> str:
    return f"batches/{batch.owner}/{batch.id}"


def result_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output (or error) file: the same on every pass."""
    digest = hashlib.blake2b(f"{batch_id}\0{kind}".encode(), digest_size=12).hexdigest()
    return f"file-{digest}"


class BatchSteps:
    def __init__(
        self,
        *,
        config: GatewayConfig,
        records: Records,
        store: FileStore,
        master: MasterClient,
        nc: Any,
        nats: NatsConfig,
        poke: Callable[[str, str], None],
    ) -> None:
        self.config = config
        self.records = records
        self.store = store
        self.master = master
        self.nc = nc
        self.nats = nats
        self.poke = poke
        """Asks the loop to step a batch again soon (its next step is due now)."""

    async def take(self, record: BatchRecord, revision: int) -> None:
        """The batch's next step, whatever it raises kept to the batch."""
        try:
            await self.step(record, revision)
        except Conflict:
            pass  # deliberate: another replica took this step; the next pass reads its record
        except (RecordsUnavailable, StoreError, BusError) as e:
            log.warning("batch %s (%s): %s; trying again", record.id, record.status, e)
        except Exception as e:
            # Whatever one batch's step raises (a file the store lost, a bug a hostile line
            # found) stays that batch's: counted, and the batch failed with the reason once
            # it repeats, never the loop's end (every replica would die on it in turn).
            log.exception("batch %s (%s): its step failed", record.id, record.status)
            try:
                await self._step_failed(record, revision, e)
            except (Conflict, RecordsUnavailable, StoreError, BusError) as again:
                log.warning("batch %s: cannot record its failed step: %s", record.id, again)

    def _master(self, batch: BatchRecord) -> MasterClient:
        """Whom to ask of the batch's job: the master on its owner's subjects (where the
        gateway's role may ask for any owner), or, for a job from before jobs had owners, on
        those without one."""
        return self.master.for_owner(batch.owner) if batch.job_owned else self.master

    async def _step_failed(self, batch: BatchRecord, revision: int, error: Exception) -> None:
        failures = batch.step_failures + 1
        if failures < MAX_STEP_FAILURES:
            await self.records.update_batch(replace(batch, step_failures=failures), last=revision)
            return
        why = f"{type(error).__name__}: {error}"[:500]
        failed = BatchError(
            code="server_error",
            message=f"The gateway failed {failures} times to take the batch's step from "
            f"{batch.status!r}; the last time: {why}",
        )
        if batch.job is not None:
            with contextlib.suppress(RemoteError, BusError):
                await self._master(batch).cancel(batch.job, "its batch failed in the gateway")
        await self.records.update_batch(
            batch.moved("failed", errors=[*batch.errors, failed], step_failures=failures),
            last=revision,
        )
        await asyncio.to_thread(self.store.delete, batch_dir(batch), recursive=True)

    async def step(self, batch: BatchRecord, revision: int) -> None:
        now = time.time()
        if batch.status == "validating" or (batch.status == "cancelling" and batch.job is None):
            # Cancelled while validating: its file is still read, for its counts and for its
            # error file to list each request as cancelled.
            await self._validate(batch, revision, now)
        elif batch.status in ("in_progress", "cancelling"):
            await self._follow(batch, revision, now)
        elif batch.status == "finalizing":
            await self._finalize(batch, revision)

    # -- validating -------------------------------------------------------------------------

    async def _validate(self, batch: BatchRecord, revision: int, now: float) -> None:
        source = await self.records.get_file(batch.owner, batch.input_file_id)
        try:
            if source is None:
                raise FileNotFoundError(batch.input_file_id)  # noqa: TRY301 - as if read gone
            found = await asyncio.to_thread(self._check_and_write, batch, source)
        except FileNotFoundError:
            await asyncio.to_thread(self.store.delete, batch_dir(batch), recursive=True)
            error = BatchError(
                code="invalid_request",
                message=f"Cannot find file {batch.input_file_id}: it was deleted before the "
                "batch could read it.",
                param="input_file_id",
            )
            await self.records.update_batch(batch.moved("failed", errors=[error]), last=revision)
            return
        for _ in range(3):
            try:
                await self._validated(batch, revision, now, found)
                return
            except Conflict:
                # Cancelled while its file was read (the only change another may make to a
                # validating batch): what was read stands, and the cancel with it.
                again = await self.records.get_batch(batch.owner, batch.id)
                if again is None or again[0].status != "cancelling" or again[0].job is not None:
                    raise
                batch, revision = again

    async def _validated(
        self, batch: BatchRecord, revision: int, now: float, found: Validation
    ) -> None:
        if found.problem_count:
            errors = list(found.problems)
            if found.problem_count > len(errors):
                errors.append(
                    BatchError(
                        code="too_many_errors",
                        message=f"{found.problem_count} lines have problems; the first "
                        f"{len(found.problems)} are listed.",
                    )
                )
            await asyncio.to_thread(self.store.delete, batch_dir(batch), recursive=True)
            await self.records.update_batch(
                batch.moved("failed", errors=errors, total=found.total), last=revision
            )
            return
        counted = replace(
            batch,
            total=found.total,
            rejected=found.rejected,
            failed=found.rejected,
            model=found.model,
        )
        ending = batch.ending or ("expired" if now >= batch.expires_at else "")
        if found.accepted == 0 or ending:
            # Every request refused, or the batch cancelled or expired already: nothing to
            # run; the error file says why, request by request.
            await self.records.update_batch(
                counted.moved("finalizing", ending=ending), last=revision
            )
            self.poke(batch.owner, batch.id)
            return
        await self.records.update_batch(
            counted.moved("in_progress", job=batch.id, job_owned=True), last=revision
        )
        api = metrics.api_of(batch.endpoint)
        metrics.BATCH_REQUESTS.labels(api, "accepted").inc(found.accepted)
        self.poke(batch.owner, batch.id)  # submit its job at once

    def _check_and_write(self, batch: BatchRecord, source: FileRecord) -> Validation:
        """Read the input file once: its rows into the job's Parquet input (a row group per
        shard), its refused requests into the rejected lines. Blocking."""
        folder = batch_dir(batch)
        schema = request_schema(batch.endpoint)
        rows: list[dict[str, Any]] = []
        with (
            self.store.writer(f"{folder}/requests.parquet") as requests_file,
            self.store.writer(f"{folder}/rejected.jsonl") as rejected_file,
        ):
            parquet = pq.ParquetWriter(cast(IO[bytes], requests_file), schema)

            held = 0
            """Bytes of prompt text in `rows`."""

            def accept(row: dict[str, Any], model: str) -> None:
                # A row group per shard: a shard is whole row groups of the job's input. One
                # is cut short where its prompts grow past ROW_GROUP_BYTES (a shard of
                # requests of a megabyte each is held in memory once, not 500 MB of them).
                nonlocal held
                rows.append(row)
                held += _request_bytes(row)
                if len(rows) >= rows_per_shard(self.config.models[model]) or (
                    held >= ROW_GROUP_BYTES
                ):
                    parquet.write_table(pa.Table.from_pylist(rows, schema=schema))
                    rows.clear()
                    held = 0

            def reject(line: dict[str, Any]) -> None:
                rejected_file.write(_jsonl(line))

            found = validate(
                self.store.read_bounded_lines(source.path, max_bytes=self.config.max_line_bytes),
                batch_id=batch.id,
                endpoint=batch.endpoint,
                models=self.config.models,
                max_requests=self.config.max_requests,
                max_line_bytes=self.config.max_line_bytes,
                accept=accept,
                reject=reject,
            )
            if rows:
                parquet.write_table(pa.Table.from_pylist(rows, schema=schema))
            parquet.close()
        return found

    # -- in progress ------------------------------------------------------------------------

    async def _follow(self, batch: BatchRecord, revision: int, now: float) -> None:
        job = batch.job
        if job is None:  # cancelled while validating: nothing ran
            await self.records.update_batch(batch.moved("finalizing"), last=revision)
            self.poke(batch.owner, batch.id)
            return
        try:
            status = await self._master(batch).job(job)
        except RemoteError as e:
            if e.code == ErrorCode.NOT_FOUND:
                if not batch.job_owned:
                    # A batch from before jobs had owners: its job is submitted (again) under
                    # its owner, and asked of there from now on.
                    batch = replace(batch, job_owned=True)
                    revision = await self.records.update_batch(batch, last=revision)
                await self._submit(batch, revision)
                return
            if e.code == ErrorCode.REJECTED:
                await self._job_refused(batch, revision, e.message)
                return
            raise
        if (
            batch.status == "in_progress"
            and not batch.ending
            and now >= batch.expires_at
            and status.state not in TERMINAL_JOB_STATES
        ):
            # Past its window with work left (a job that ended in time is not expired).
            batch = replace(batch, ending="expired")
            revision = await self.records.update_batch(batch, last=revision)
        if batch.ending and status.state not in TERMINAL_JOB_STATES:
            try:
                await self._master(batch).cancel(job, f"batch {batch.ending}")
            except RemoteError as e:
                log.info("batch %s: cancel of job %s: %s", batch.id, job, e)
        counted = self._counted(batch, status)
        if status.state in TERMINAL_JOB_STATES:
            await self.records.update_batch(counted.moved("finalizing"), last=revision)
            self.poke(batch.owner, batch.id)
        elif counted != batch:
            await self.records.update_batch(counted, last=revision)

    def _counted(self, batch: BatchRecord, status: JobStatus) -> BatchRecord:
        return replace(
            batch,
            completed=status.rows_done - status.error_rows,
            failed=batch.rejected + status.error_rows,
        )

    async def _submit(self, batch: BatchRecord, revision: int) -> None:
        assert batch.model is not None and batch.job is not None
        folder = batch_dir(batch)
        spec = batch_job(
            batch_id=batch.job,
            owner=batch.owner,
            endpoint=batch.endpoint,
            model=self.config.models[batch.model],
            window=self.config.windows[batch.completion_window],
            input_uri=self.store.url(f"{folder}/requests.parquet"),
            output_uri=self.store.url(f"{folder}/output"),
        )
        try:
            await submit_job(self.nc, self.nats, spec, accept_timeout_s=10.0, owner=batch.owner)
        except SubmitPending:
            log.info("batch %s: job %s queued, no master has taken it yet", batch.id, batch.job)
        except SubmitError as e:
            await self._job_refused(batch, revision, str(e))

    async def _job_refused(self, batch: BatchRecord, revision: int, why: str) -> None:
        error = BatchError(code="job_rejected", message=f"Ebb refused the batch's job: {why}")
        await self.records.update_batch(batch.moved("failed", errors=[error]), last=revision)

    # -- finalizing ---------------------------------------------------------------------------

    async def _finalize(self, batch: BatchRecord, revision: int) -> None:
        state, reason = "SUCCEEDED", ""
        if batch.job is not None:
            try:
                status = await self._master(batch).job(batch.job)
                state, reason = status.state, status.reason
            except RemoteError as e:
                if e.code != ErrorCode.NOT_FOUND:
                    raise
                state, reason = "FAILED", "the shard master no longer knows the job"
        if batch.job is not None and batch.ending == "expired" and state == "SUCCEEDED":
            # Every request answered before the cancel for its window took: completed.
            batch = replace(batch, ending="")
        ending = batch.ending or ("failed" if state == "FAILED" else "")
        tally, files = await asyncio.to_thread(self._write_results, batch, ending, reason)
        for record in files.values():
            try:
                await self.records.create_file(record)
            except Exception as e:
                if "wrong last sequence" not in str(e).lower():
                    raise
        final: BatchStatus = (
            "cancelled"
            if batch.ending == "cancelled"
            else "expired"
            if batch.ending == "expired"
            else "failed"
            if state == "FAILED"
            else "completed"
        )
        errors = batch.errors
        if state == "FAILED" and not batch.ending:
            errors = [*errors, BatchError(code="job_failed", message=reason or "the job failed")]
        output, error = (files[k].id if k in files else None for k in ("output", "error"))
        await self.records.update_batch(
            batch.moved(
                final,
                completed=tally.completed,
                failed=tally.failed,
                unrun=tally.unrun,
                input_tokens=tally.input_tokens,
                output_tokens=tally.output_tokens,
                output_file_id=output,
                error_file_id=error,
                errors=errors,
            ),
            last=revision,
        )
        # Its copy of the requests and its job's output are in the files now: let them go
        # (a replica that dies first leaves them; the batch's record says it ended).
        await asyncio.to_thread(self.store.delete, batch_dir(batch), recursive=True)
        api = metrics.api_of(batch.endpoint)
        metrics.BATCH_REQUESTS.labels(api, "completed").inc(tally.completed)
        metrics.BATCH_REQUESTS.labels(api, "failed").inc(tally.failed)

    def _write_results(
        self, batch: BatchRecord, ending: str, reason: str
    ) -> tuple[Tally, dict[str, FileRecord]]:
        folder = batch_dir(batch)
        now = int(time.time())
        made: dict[str, FileRecord] = {}
        ids = {kind: result_file_id(batch.id, kind) for kind in ("output", "error")}
        paths = {kind: f"files/{batch.owner}/{ids[kind]}" for kind in ids}
        has_requests = self.store.exists(f"{folder}/requests.parquet")
        has_rejected = self.store.exists(f"{folder}/rejected.jsonl")
        with (
            self.store.writer(paths["output"]) as output,
            self.store.writer(paths["error"]) as errors,
        ):
            tally = write_results(
                batch_id=batch.id,
                endpoint=batch.endpoint,
                model=batch.model or "",
                job_output=self.store.url(f"{folder}/output"),
                requests=job_rows(self.store, f"{folder}/requests.parquet")
                if has_requests
                else iter(()),
                rejected=self.store.read_lines(f"{folder}/rejected.jsonl")
                if has_rejected
                else iter(()),
                ending=ending,
                reason=reason,
                output=output,
                errors=errors,
            )
        for kind, writer in (("output", output), ("error", errors)):
            if writer.bytes == 0:
                self.store.delete(paths[kind])
                continue
            made[kind] = FileRecord(
                id=ids[kind],
                owner=batch.owner,
                bytes=writer.bytes,
                created_at=now,
                filename=f"{batch.id}_{kind}.jsonl",
                purpose="batch_output",
                path=paths[kind],
                expires_at=None if batch.output_expires_s is None else now + batch.output_expires_s,
            )
        return tally, made


def _request_bytes(row: dict[str, Any]) -> int:
    """About what a request's row holds in memory: its prompt, or its inputs."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if prompt is not None:
        return sum(len(m["content"]) + len(m["role"]) for m in prompt)
    texts = row.get("input") or []
    ids = row.get("input_ids") or []
    return sum(map(len, texts)) + 8 * sum(map(len, ids))


def _jsonl(value: dict[str, Any]) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
