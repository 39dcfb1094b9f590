"""Anthropic's Message Batches: the same batches as the OpenAI routes' (a job each, every
request answered once), in Anthropic's shapes.

`POST /v1/messages/batches` takes the requests inline (`custom_id` and `params`, a Messages
request); they are kept as the batch's input file (purpose `message_batch`) and validated,
run and written as any batch, with `/v1/messages` as its endpoint (ebb.gateway.bodies'
`message_row`; ebb.gateway.results writes each line as a result: `succeeded` with a Message,
`errored`, `canceled`, `expired`). Retrieve, list (`before_id`/`after_id`/`limit`), cancel,
delete and the results (`results_url`, JSONL) answer as Anthropic's API does, its error
envelope (`{"type": "error", "error": {"type", "message"}}`) included. A key is sent as
`x-api-key`; `anthropic-version` is required, as Anthropic requires it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any, Protocol

from aiohttp import web

from .apierror import ApiError
from .batches import BatchRunner
from .bodies import MESSAGES
from .config import ApiKey, GatewayConfig
from .params import not_json
from .quota import Quotas
from .records import ENDED, BatchRecord, Conflict, FileRecord, Records, new_id
from .results import ANTHROPIC_ERROR_TYPES
from .store import FileStore

MAX_REQUESTS = 100_000
"""Requests one Message Batch may hold, as Anthropic's API allows."""
CUSTOM_ID_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
PURPOSE = "message_batch"
"""The purpose of a Message Batch's input file: listed among the owner's files, not taken by
an OpenAI batch."""
WINDOW = 24 * 3600
"""A Message Batch expires 24 hours after it is created."""


def anthropic_error(error: ApiError) -> web.Response:
    """An ApiError in Anthropic's envelope."""
    kind = ANTHROPIC_ERROR_TYPES.get(error.status, "api_error")
    if error.status == 503:
        kind = "overloaded_error"
    body = {"type": "error", "error": {"type": kind, "message": error.message}}
    headers = {} if error.retry else {"x-should-retry": "false"}
    return web.json_response(body, status=error.status, headers=headers)


def _time(stamp: int | None) -> str | None:
    """RFC 3339, as Anthropic writes its times."""
    if stamp is None:
        return None
    return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z")


def message_batch(record: BatchRecord, base_url: str) -> dict[str, Any]:
    """The `message_batch` object of a batch record."""
    ended = record.status in ENDED
    if ended:
        # The requests never run are the results' `canceled` or `expired`, as the batch
        # ended; those of a failed job's batch are `errored`.
        unrun = {"cancelled": "canceled", "expired": "expired"}.get(record.ending, "errored")
        counts = {
            "processing": 0,
            "succeeded": record.completed,
            "errored": record.failed - record.unrun,
            "canceled": 0,
            "expired": 0,
        }
        counts[unrun] += record.unrun
    else:
        # While it runs: what the job has answered, the rest processing.
        counts = {
            "processing": max(0, record.total - record.completed - record.failed),
            "succeeded": record.completed,
            "errored": record.failed,
            "canceled": 0,
            "expired": 0,
        }
    canceling = record.ending == "cancelled" and not ended
    ended_at = record.completed_at or record.failed_at or record.expired_at or record.cancelled_at
    return {
        "id": record.id,
        "type": "message_batch",
        "processing_status": "ended" if ended else "canceling" if canceling else "in_progress",
        "request_counts": counts,
        "ended_at": _time(ended_at) if ended else None,
        "created_at": _time(record.created_at),
        "expires_at": _time(record.expires_at),
        "archived_at": None,
        "cancel_initiated_at": _time(record.cancelling_at),
        "results_url": f"{base_url}/v1/messages/batches/{record.id}/results" if ended else None,
    }


class Gateway(Protocol):
    """What the routes use of the OpenAI routes' (ebb.gateway.api's `BatchApi`)."""

    config: GatewayConfig
    records: Records
    runner: BatchRunner
    store: FileStore
    quotas: Quotas

    def key_of(self, request: web.Request) -> ApiKey: ...
    def quota(self, taking: Awaitable[Any]) -> Awaitable[Any]: ...
    async def stored(self, owner: str) -> int: ...
    async def still_active(self, owner: str, batch_id: str) -> bool | None: ...


class MessageBatches:
    """The routes of Anthropic's Message Batches, over the gateway's records and runner."""

    def __init__(self, api: Gateway) -> None:
        self.api = api

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/messages/batches", self.create),
            web.get("/messages/batches", self.list),
            web.get("/messages/batches/{id}", self.get),
            web.post("/messages/batches/{id}/cancel", self.cancel),
            web.delete("/messages/batches/{id}", self.delete),
            web.get("/messages/batches/{id}/results", self.results),
        ]

    @staticmethod
    def _base(request: web.Request) -> str:
        return f"{request.scheme}://{request.host}"

    async def create(self, request: web.Request) -> web.Response:
        key = self.api.key_of(request)
        try:
            body = json.loads(await request.read(), parse_constant=not_json)
        except (ValueError, RecursionError):
            raise ApiError(400, "The request body is not valid JSON.") from None
        requests = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(requests, list) or not requests:
            raise ApiError(400, "requests: a non-empty list of {custom_id, params} is required.")
        if len(requests) > MAX_REQUESTS:
            raise ApiError(400, f"requests: at most {MAX_REQUESTS:,} in one batch.")
        served = [m for m in self.api.config.models.values() if MESSAGES in m.endpoints]
        if not served:
            raise ApiError(400, "This gateway serves no model for /v1/messages.")
        seen: set[str] = set()
        lines = bytearray()
        for i, item in enumerate(requests):
            custom_id = item.get("custom_id") if isinstance(item, dict) else None
            if not isinstance(custom_id, str) or not CUSTOM_ID_RE.match(custom_id):
                raise ApiError(
                    400,
                    f"requests.{i}.custom_id: 1 to 64 letters, digits, '_' and '-', "
                    f"got {custom_id!r}.",
                )
            if custom_id in seen:
                raise ApiError(400, f"requests.{i}.custom_id: {custom_id!r} is used twice.")
            seen.add(custom_id)
            params = item.get("params")
            if not isinstance(params, dict):
                raise ApiError(400, f"requests.{i}.params: a Messages request is required.")
            line = {"custom_id": custom_id, "method": "POST", "url": MESSAGES, "body": params}
            lines += json.dumps(line, ensure_ascii=False).encode() + b"\n"
        source = await self._input_file(key.owner, key.max_stored_bytes, bytes(lines))
        batch_id = new_id("msgbatch")
        if key.max_active_batches is not None:
            await self.api.quota(
                self.api.quotas.take_batch_place(
                    key.owner,
                    batch_id,
                    limit=key.max_active_batches,
                    still_active=lambda held: self.api.still_active(key.owner, held),
                )
            )
        now = int(time.time())
        record = BatchRecord(
            id=batch_id,
            owner=key.owner,
            endpoint=MESSAGES,
            input_file_id=source.id,
            completion_window=self._window(),
            status="validating",
            created_at=now,
            expires_at=now + WINDOW,
        )
        try:
            await self.api.records.add_live(record.owner, record.id)
            await self.api.records.create_batch(record)
        except BaseException:
            if key.max_active_batches is not None:
                with contextlib.suppress(Exception):
                    await self.api.quotas.give_back_batch_place(key.owner, batch_id)
            raise
        self.api.runner.poke(record.owner, record.id)
        return web.json_response(message_batch(record, self._base(request)))

    def _window(self) -> str:
        """The catalogue's window a Message Batch runs in: `24h` where it is configured,
        else the longest (its priority and pool are the batch's job's)."""
        windows = self.api.config.windows
        if "24h" in windows:
            return "24h"
        return max(windows, key=lambda w: windows[w].seconds)

    async def _input_file(self, owner: str, max_stored: int | None, data: bytes) -> FileRecord:
        """The requests kept as the batch's input file, as an upload is kept (its bytes
        reserved against the key's quota while they are written)."""
        api = self.api
        if len(data) > api.config.max_file_bytes:
            raise ApiError(413, "The batch's requests are larger than this gateway takes.")
        file_id = new_id("file")
        if max_stored is not None:
            await api.quota(
                api.quotas.reserve_bytes(
                    owner,
                    file_id,
                    limit=max_stored,
                    want=len(data),
                    stored=lambda: api.stored(owner),
                )
            )
        path = f"files/{owner}/{file_id}"
        try:

            def write() -> None:
                with api.store.writer(path) as writer:
                    writer.write(data)

            await asyncio.to_thread(write)
            record = FileRecord(
                id=file_id,
                owner=owner,
                purpose=PURPOSE,
                filename="requests.jsonl",
                bytes=len(data),
                created_at=int(time.time()),
                path=path,
            )
            try:
                await api.records.create_file(record)
            except BaseException:
                await asyncio.to_thread(api.store.delete, path)  # no bytes without a record
                raise
        finally:
            if max_stored is not None:
                with contextlib.suppress(Exception):
                    await api.quotas.release_bytes(owner, file_id)
        return record

    async def _batch(self, request: web.Request) -> tuple[BatchRecord, int]:
        batch_id = request.match_info["id"]
        found = await self.api.records.get_batch(self.api.key_of(request).owner, batch_id)
        if found is None or found[0].endpoint != MESSAGES:
            raise ApiError(404, f"Message batch {batch_id} not found.")
        return found

    async def get(self, request: web.Request) -> web.Response:
        record, _ = await self._batch(request)
        return web.json_response(message_batch(record, self._base(request)))

    async def list(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 1000:
            raise ApiError(400, "limit: a whole number from 1 to 1000.")
        before, after = request.query.get("before_id"), request.query.get("after_id")
        records = sorted(
            (b for b, _ in await self.api.records.batches(self.api.key_of(request).owner)),
            key=lambda b: b.id,
            reverse=True,
        )
        records = [b for b in records if b.endpoint == MESSAGES]
        # Newest first; `after_id`: the page after that one (older), `before_id`: before it
        # (newer), as Anthropic pages its lists.
        if after is not None:
            records = [b for b in records if b.id < after]
        if before is not None:
            records = [b for b in records if b.id > before]
            shown = records[-limit:]  # the page just before it: the oldest of the newer
        else:
            shown = records[:limit]
        data = [message_batch(b, self._base(request)) for b in shown]
        return web.json_response(
            {
                "data": data,
                "has_more": len(records) > len(shown),
                "first_id": shown[0].id if shown else None,
                "last_id": shown[-1].id if shown else None,
            }
        )

    async def cancel(self, request: web.Request) -> web.Response:
        for _ in range(10):
            record, revision = await self._batch(request)
            if record.status in ENDED or record.ending:
                return web.json_response(message_batch(record, self._base(request)))
            changed = record.moved("cancelling", ending="cancelled")
            try:
                await self.api.records.update_batch(changed, last=revision)
            except Conflict:
                continue
            self.api.runner.poke(changed.owner, changed.id)
            return web.json_response(message_batch(changed, self._base(request)))
        raise ApiError(409, "The batch keeps changing; try again.", retry=True)

    async def delete(self, request: web.Request) -> web.Response:
        record, _ = await self._batch(request)
        if record.status not in ENDED:
            raise ApiError(
                400,
                f"Message batch {record.id} is still processing: cancel it first, and "
                "delete it once it has ended.",
            )
        await self.api.records.delete_batch(record)
        for file_id in (record.output_file_id, record.error_file_id, record.input_file_id):
            if file_id is None:
                continue
            found = await self.api.records.get_file(record.owner, file_id)
            if found is not None:
                await self.api.records.delete_file(found)
                await asyncio.to_thread(self.api.store.delete, found.path)
        return web.json_response({"id": record.id, "type": "message_batch_deleted"})

    async def results(self, request: web.Request) -> web.StreamResponse:
        record, _ = await self._batch(request)
        if record.status not in ENDED:
            raise ApiError(
                404, f"Message batch {record.id} has not ended: its results are not ready."
            )
        files = []
        for file_id in (record.output_file_id, record.error_file_id):
            found = (
                None if file_id is None else await self.api.records.get_file(record.owner, file_id)
            )
            if found is not None:
                files.append(found)
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/binary",
                "Content-Length": str(sum(f.bytes for f in files)),
            }
        )
        await response.prepare(request)
        for found in files:
            async for piece in self.api.store.pieces(found.path):
                await response.write(piece)
        await response.write_eof()
        return response
