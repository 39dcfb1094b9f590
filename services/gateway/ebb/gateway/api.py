"""The HTTP edge: the Batch API's routes, its keys, its error shapes (aiohttp).

Mounted under `/v1` (a client's `base_url` ends with it) and at the root. Every error is
the API's envelope, `{"error": {"message", "type", "param", "code"}}`, with the status the
official client maps to its exceptions; a refusal that asking again cannot change says
`x-should-retry: false`, so that the client does not ask three times. A key sees only its
owner's files and batches: another's id is answered as one that does not exist.

Past 400 lines as one concept, the routes: the parameters it reads are ebb.gateway.params',
its error shape ebb.gateway.apierror's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_exceptions import HTTPRequestEntityTooLarge

from . import metrics
from .apierror import ApiError, not_found
from .batches import BatchRunner
from .bodies import MESSAGES
from .config import ApiKey, GatewayConfig
from .messages import MessageBatches, anthropic_error
from .params import expires_after, listing, metadata, not_json, page, read_field
from .quota import Busy, QuotaExceeded, Quotas
from .records import ENDED, BatchRecord, Conflict, FileRecord, Records, RecordsUnavailable, new_id
from .requests import ENDPOINTS

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
KEY: web.RequestKey[ApiKey] = web.RequestKey("key", ApiKey)


class BatchApi:
    def __init__(self, *, config: GatewayConfig, records: Records, runner: BatchRunner) -> None:
        self.config = config
        self.records = records
        self.runner = runner
        self.store = runner.store
        self.quotas = Quotas(records)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=1024**2)
        routes = [
            web.post("/files", self.upload),
            web.get("/files", self.list_files),
            web.get("/files/{id}", self.get_file),
            web.delete("/files/{id}", self.delete_file),
            web.get("/files/{id}/content", self.file_content),
            web.post("/batches", self.create_batch),
            web.get("/batches", self.list_batches),
            web.get("/batches/{id}", self.get_batch),
            web.post("/batches/{id}/cancel", self.cancel_batch),
            *MessageBatches(self).routes(),
        ]
        for prefix in ("/v1", ""):
            app.router.add_routes([web.route(r.method, prefix + r.path, r.handler) for r in routes])
        app.router.add_get("/healthz", self.health)
        return app

    # -- middlewares ------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource
        name = route.canonical.removeprefix("/v1") if route is not None else "unmatched"
        started = time.monotonic()
        try:
            response = await handler(request)
        except ApiError as e:
            response = anthropic_error(e) if _anthropic(request) else e.response()
        except HTTPRequestEntityTooLarge as e:
            response = ApiError(413, f"The request body is too large: {e.text}").response()
        except web.HTTPException as e:
            response = ApiError(e.status, e.reason, code=None, retry=e.status >= 500).response()
        except RecordsUnavailable as e:
            log.warning("%s %s: %s", request.method, request.path, e)
            response = ApiError(
                503,
                "The gateway cannot reach its records; try again.",
                kind="server_error",
                retry=True,
            ).response()
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            response = ApiError(
                500, "The gateway failed to answer; try again.", kind="server_error", retry=True
            ).response()
        metrics.HTTP_REQUESTS.labels(name, str(response.status)).inc()
        metrics.HTTP_SECONDS.labels(name).observe(time.monotonic() - started)
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/healthz":
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        found = self.config.owner_of(key.strip()) if scheme.lower() == "bearer" else None
        anthropic_key = request.headers.get("x-api-key")  # Anthropic's clients send it so
        if found is None and anthropic_key is not None and not header:
            found = self.config.owner_of(anthropic_key.strip())
        if found is None:
            raise ApiError(
                401,
                "Incorrect API key provided."
                if header or anthropic_key
                else "No API key provided: send Authorization: Bearer <key> (or x-api-key).",
                code="invalid_api_key",
            )
        if _anthropic(request) and not request.headers.get("anthropic-version"):
            raise ApiError(400, "anthropic-version: header is required.")
        request[KEY] = found
        return await handler(request)

    @staticmethod
    def key_of(request: web.Request) -> ApiKey:
        """The key the request was let in with."""
        return request[KEY]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    # -- files ------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        key = request[KEY]
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "Upload a file as multipart/form-data (fields purpose, file).")
        file_id = new_id("file")
        limit = self.config.max_file_bytes
        if key.max_stored_bytes is not None:
            # The room this upload may fill, reserved before a byte is stored: uploads at
            # once share what is left (the body's length bounds the file's).
            want = min(limit, request.content_length or limit)
            limit = await self.quota(
                self.quotas.reserve_bytes(
                    key.owner,
                    file_id,
                    limit=key.max_stored_bytes,
                    want=want,
                    stored=lambda: self.stored(key.owner),
                )
            )
        try:
            return await self._upload(request, key, file_id, limit)
        finally:
            if key.max_stored_bytes is not None:
                with contextlib.suppress(Exception):
                    await self.quotas.release_bytes(key.owner, file_id)

    async def stored(self, owner: str) -> int:
        return sum(f.bytes for f in await self.records.files(owner))

    async def _upload(
        self, request: web.Request, key: ApiKey, file_id: str, limit: int
    ) -> web.Response:
        path = f"files/{key.owner}/{file_id}"
        purpose: str | None = None
        filename = "upload"
        size: int | None = None
        expiry: dict[str, str] = {}
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise ApiError(400, "A form field holds a nested multipart body.")  # noqa: TRY301
                if part.name == "purpose":
                    purpose = await read_field(part)
                elif part.name in ("expires_after[anchor]", "expires_after[seconds]"):
                    expiry[part.name[len("expires_after[") : -1]] = await read_field(part)
                elif part.name == "file" and size is None:
                    filename = part.filename or "upload"
                    size = await self._store_part(part, path, limit, request)
                else:
                    await part.release()
        except BaseException as e:
            if size is not None:
                await asyncio.to_thread(self.store.delete, path)  # no bytes without a record
            if isinstance(e, ApiError | ValueError | HttpProcessingError):
                # Read the rest, so that the client hears the answer and not a reset.
                with contextlib.suppress(Exception):
                    while await request.content.readany():
                        pass
            if isinstance(e, ValueError | HttpProcessingError):  # aiohttp's: a bad body
                raise ApiError(400, f"The multipart body does not parse: {e}") from None
            raise
        if size is None:
            raise ApiError(
                400,
                "Missing required parameter: 'file'.",
                param="file",
                code="missing_required_parameter",
            )
        if purpose != "batch":
            await asyncio.to_thread(self.store.delete, path)
            raise ApiError(
                400,
                f"Invalid value for 'purpose': {purpose!r}. This gateway keeps files for "
                "batches: 'batch'.",
                param="purpose",
                code="invalid_value",
            )
        try:
            keep = expires_after(expiry, default=int(self.config.file_expiry_s))
        except ApiError:
            await asyncio.to_thread(self.store.delete, path)
            raise
        now = int(time.time())
        record = FileRecord(
            id=file_id,
            owner=key.owner,
            bytes=size,
            created_at=now,
            filename=filename,
            purpose="batch",
            path=path,
            expires_at=now + keep,
        )
        try:
            await self.records.create_file(record)
        except BaseException:
            await asyncio.to_thread(self.store.delete, path)  # no bytes without a record
            raise
        metrics.UPLOADED_BYTES.inc(size)
        return web.json_response(record.api())

    async def _store_part(
        self, part: BodyPartReader, path: str, limit: int, request: web.Request
    ) -> int:
        """Stream the file part into the store; 413 (after reading the rest of the
        request, so that the client hears the answer) if it grows past `limit`."""
        writer = await asyncio.to_thread(self.store.writer, path)
        try:
            while piece := await part.read_chunk(256 * 1024):
                if writer.bytes + len(piece) > limit:
                    raise ApiError(  # noqa: TRY301 - the writer is aborted below, as on any error
                        413,
                        f"File is too large: the most this key may upload now is {limit} bytes.",
                        param="file",
                        code="file_too_large",
                    )
                await asyncio.to_thread(writer.write, piece)
            await asyncio.to_thread(writer.commit)
        except BaseException:
            await asyncio.to_thread(writer.abort)
            while await request.content.readany():
                pass
            raise
        return writer.bytes

    async def list_files(self, request: web.Request) -> web.Response:
        key = request[KEY]
        purpose = request.query.get("purpose")
        files = [
            f
            for f in await self.records.files(key.owner)
            if purpose is None or f.purpose == purpose
        ]
        shown, more = page(request, files, default=10_000, most=10_000)
        return listing([f.api() for f in shown], more)

    async def _file(self, request: web.Request) -> FileRecord:
        file_id = request.match_info["id"]
        record = await self.records.get_file(request[KEY].owner, file_id)
        if record is None:
            raise not_found("File", file_id)
        return record

    async def get_file(self, request: web.Request) -> web.Response:
        return web.json_response((await self._file(request)).api())

    async def delete_file(self, request: web.Request) -> web.Response:
        record = await self._file(request)
        await self.records.delete_file(record)  # first: no record ever names missing bytes
        await asyncio.to_thread(self.store.delete, record.path)
        return web.json_response({"id": record.id, "object": "file", "deleted": True})

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        record = await self._file(request)
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Length": str(record.bytes),
            }
        )
        await response.prepare(request)
        async for piece in self.store.pieces(record.path):
            await response.write(piece)
        await response.write_eof()
        return response

    # -- batches ----------------------------------------------------------------------------

    async def create_batch(self, request: web.Request) -> web.Response:
        key = request[KEY]
        try:
            body = json.loads(await request.read(), parse_constant=not_json)
        except (ValueError, RecursionError):  # not UTF-8, not JSON, NaN, nested too deep
            raise ApiError(400, "The request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str):
                raise ApiError(
                    400,
                    f"Missing required parameter: {name!r}.",
                    param=name,
                    code="missing_required_parameter",
                )
        endpoint, window = body["endpoint"], body["completion_window"]
        # The endpoints some model of the catalogue answers: an embeddings batch on a
        # gateway of chat models only is refused here, not failed line by line.
        served = [
            e for e in ENDPOINTS if any(e in m.endpoints for m in self.config.models.values())
        ]
        if endpoint not in served:
            listed = ", ".join(repr(e) for e in served)
            raise ApiError(
                400,
                f"Invalid value: {endpoint!r}. Supported values are: {listed}.",
                param="endpoint",
                code="invalid_value",
            )
        if window not in self.config.windows:
            listed = ", ".join(repr(w) for w in self.config.windows)
            raise ApiError(
                400,
                f"Invalid value: {window!r}. Supported values are: {listed}.",
                param="completion_window",
                code="invalid_value",
            )
        tags = metadata(body.get("metadata"))
        output_expiry = body.get("output_expires_after")
        if output_expiry is not None and not isinstance(output_expiry, dict):
            raise ApiError(
                400,
                "Invalid type for 'output_expires_after': expected an object.",
                param="output_expires_after",
                code="invalid_type",
            )
        keep = expires_after(output_expiry, default=None) if output_expiry else None
        source = await self.records.get_file(key.owner, body["input_file_id"])
        if source is None:
            raise not_found("File", body["input_file_id"], "input_file_id")
        if source.purpose != "batch":
            raise ApiError(
                400,
                f"File {source.id} has purpose {source.purpose!r}; a batch reads a file "
                "uploaded with purpose 'batch'.",
                param="input_file_id",
                code="invalid_value",
            )
        batch_id = new_id("batch")
        if key.max_active_batches is not None:
            await self.quota(
                self.quotas.take_batch_place(
                    key.owner,
                    batch_id,
                    limit=key.max_active_batches,
                    still_active=lambda held: self.still_active(key.owner, held),
                )
            )
        now = int(time.time())
        record = BatchRecord(
            id=batch_id,
            owner=key.owner,
            endpoint=endpoint,
            input_file_id=source.id,
            completion_window=window,
            status="validating",
            created_at=now,
            expires_at=now + int(self.config.windows[window].seconds),
            metadata=tags,
            output_expires_s=keep,
        )
        try:
            await self.records.add_live(record.owner, record.id)  # before: never unindexed
            await self.records.create_batch(record)
        except BaseException:
            if key.max_active_batches is not None:
                with contextlib.suppress(Exception):
                    await self.quotas.give_back_batch_place(key.owner, batch_id)
            raise
        self.runner.poke(record.owner, record.id)
        return web.json_response(record.api())

    async def still_active(self, owner: str, batch_id: str) -> bool | None:
        found = await self.records.get_batch(owner, batch_id)
        return None if found is None else found[0].status not in ENDED

    async def quota(self, taking: Awaitable[Any]) -> Any:
        """A quota's answer as the API gives it: 429 past it, 503 when its ledger is busy."""
        try:
            return await taking
        except QuotaExceeded as e:
            raise ApiError(429, e.message, code="quota_exceeded") from None
        except Busy:
            raise ApiError(
                503, "Too many changes at once; try again.", kind="server_error", retry=True
            ) from None

    async def _batch(self, request: web.Request) -> tuple[BatchRecord, int]:
        batch_id = request.match_info["id"]
        found = await self.records.get_batch(request[KEY].owner, batch_id)
        if found is None or found[0].endpoint == MESSAGES:  # a Message Batch is Anthropic's
            raise not_found("Batch", batch_id)
        return found

    async def get_batch(self, request: web.Request) -> web.Response:
        return web.json_response((await self._batch(request))[0].api())

    async def list_batches(self, request: web.Request) -> web.Response:
        batches = [
            b for b, _ in await self.records.batches(request[KEY].owner) if b.endpoint != MESSAGES
        ]
        shown, more = page(request, batches, default=20, most=100, order="desc")
        return listing([b.api() for b in shown], more)

    async def cancel_batch(self, request: web.Request) -> web.Response:
        for _ in range(10):
            batch, revision = await self._batch(request)
            if batch.status in ("cancelling", "cancelled") or batch.ending == "cancelled":
                return web.json_response(batch.api())  # being cancelled already
            if batch.status not in ("validating", "in_progress"):
                raise ApiError(409, f"Cannot cancel a batch with status {batch.status!r}.")
            changed = batch.moved("cancelling", ending="cancelled")
            try:
                await self.records.update_batch(changed, last=revision)
            except Conflict:
                continue  # the runner moved it meanwhile: look again
            self.runner.poke(changed.owner, changed.id)
            return web.json_response(changed.api())
        raise ApiError(409, "The batch keeps changing; try again.", retry=True)


def _anthropic(request: web.Request) -> bool:
    """A request of Anthropic's Message Batches: answered in Anthropic's error shape."""
    return request.path.removeprefix("/v1").startswith("/messages/batches")
