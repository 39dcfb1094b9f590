"""The node's model cache: one server per node (a DaemonSet), models for the node's workers.

`python -m ebb.worker.modelcache` (ebb.worker.modelcache.command). A cache that the pods of a node
share would want a hostPath, which Kubernetes' "restricted" Pod Security level refuses; this server
keeps the cache in its own pod's emptyDir, which lives as long as that pod, and a DaemonSet's pod
stays on its node while workers come and go. Workers reach the one on their node through a Service
whose internalTrafficPolicy is Local (docs/deployment.md); ebb.worker.modelcache.client is their
side.

    GET  /models?uri=<store URI>   the object's bytes, with their SHA-256 (X-Ebb-Sha256) and
                                   length; HEAD: the same head, no body
    GET  /healthz                  the server answers

A miss is fetched by modelcache.fetch_model (its lock, its checks of size and MD5) into the
cache folder; the requests for a URI that arrive while it is fetched wait for that one fetch.
Every request asks the store for the object's version (a stat, not a download), so that a
changed object is fetched anew. One request per connection.

Bounds: only objects under the model roots the operator names are served (not the data roots:
inputs and outputs are no cache's business); an object larger than the whole cache is refused
(413: the worker reads it from its store); at most `max_fetches` downloads run at once, each
only once its room is reserved. The cache is bound by `max_bytes`
(ebb.worker.modelcache.index): the blobs and the downloads under way never hold more; the
least recently used blobs go to make room, never one a response holds; a download that finds
no room within `room_timeout_s` (the cache full of models being sent) is refused (503: the
worker reads it from its store).

The server has no authentication of its own: who may reach it is the NetworkPolicy's word
(k8s/base/model-cache.yaml), and a worker checks what it gets against the store's own size
and checksum (ebb.worker.modelcache.client), not only against what the cache announces.

The server's state (the downloads in flight, the room reserved for them, the blobs pinned by
responses, eviction) is one state machine, kept in one module; its command line is
ebb.worker.modelcache.command, its metrics ebb.worker.modelcache.metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus

from .client import CACHE_HEADER, SHA256_HEADER
from .index import BlobIndex, scan
from .metrics import EVICTIONS, REQUESTS, SERVED_BYTES, STORED_BYTES
from .protocol import Request, RequestError, read_request, refusal, reply, response_head
from .store import (
    CachedModel,
    ModelFetchError,
    ModelMissing,
    cached_model,
    fetch_model,
    stat_model,
)

log = logging.getLogger(__name__)

_FETCH_TRIES = 3


class TooLarge(Exception):
    """The object is larger than the whole cache: kept, it would evict everything else and
    pass the bound, and go again after one response."""


class NoRoom(Exception):
    """No room for the download within the wait: the cache is full of models being sent."""


@dataclass(frozen=True, kw_only=True)
class CacheServerConfig:
    cache_dir: str
    """The cache folder (the pod's emptyDir), laid out as modelcache lays it out."""
    max_bytes: int
    """Models beyond this are removed, least recently used first. The folder may hold more
    for a while: downloads under way, and models still being sent (the emptyDir's sizeLimit
    must leave room for them, or the kubelet evicts the pod)."""
    model_roots: Sequence[str]
    """Only objects under these URIs are fetched (where the operator keeps models): workers
    run user code, and the cache must not become a way to read its own files, other stores,
    or a job's inputs and outputs (a 100 GB Parquet file would fill its disk)."""
    host: str = "0.0.0.0"  # noqa: S104 - every worker of the node connects
    port: int = 8080
    """0: any free port (`ModelCacheServer.port` says which)."""
    request_timeout_s: float = 30.0
    """A request's head must arrive within this."""
    send_timeout_s: float = 300.0
    """A response whose worker takes none of its bytes for this long is cut: a stalled worker
    must not pin a model (and its room on the disk) for ever."""
    chunk_bytes: int = 1 << 20
    max_fetches: int = 2
    """Downloads from the store at once (each of a different model): the rest wait."""
    room_timeout_s: float = 60.0
    """A download waits this long for room (responses to end, unpinning models to evict);
    then its request is refused, and its worker reads the model from the store."""


@dataclass(frozen=True)
class _Held:
    """A model in the cache, pinned for one response (which unpins it)."""

    model: CachedModel
    size: int


class _Flight:
    """One fetch of a URI and the requests waiting for it."""

    def __init__(self, task: asyncio.Task[_Held]) -> None:
        self.task = task
        self.waiters = 0


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


class ModelCacheServer:
    """The HTTP server over one cache folder: it fetches, pins, sends and evicts its blobs."""

    def __init__(self, config: CacheServerConfig) -> None:
        self.config = config
        self._blobs = os.path.join(config.cache_dir, "blobs", "sha256")
        self._index = BlobIndex(max_bytes=config.max_bytes)
        self._flights: dict[str, _Flight] = {}
        self._downloads = asyncio.Semaphore(config.max_fetches)
        self._freed: asyncio.Future[None] | None = None
        """Resolved (and replaced) whenever room may have been freed: a pin let go, a
        download's reservation ended."""
        self._connections: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def connections(self) -> int:
        return len(self._connections)

    def pins(self, sha: str) -> int:
        """Responses holding the blob `sha` now."""
        return self._index.pins(sha)

    @property
    def reserved_bytes(self) -> int:
        """Room held for downloads under way."""
        return self._index.reserved

    def waiting(self, uri: str) -> int:
        """Requests waiting now for the fetch of `uri` under way (0: none under way)."""
        flight = self._flights.get(uri)
        return flight.waiters if flight is not None else 0

    async def start(self) -> None:
        os.makedirs(self._blobs, exist_ok=True)
        self._index = BlobIndex(max_bytes=self.config.max_bytes, blobs=scan(self._blobs))
        self._evict()
        self._server = await asyncio.start_server(
            self._connection, self.config.host, self.config.port
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info(
            "node model cache on port %d: %s, %d models (%d bytes) of at most %d bytes",
            self.port,
            self.config.cache_dir,
            len(self._index),
            self._index.total_bytes,
            self.config.max_bytes,
        )

    async def close(self, *, grace_s: float = 10.0) -> None:
        """Take no new connection; give responses under way `grace_s` to end, then cut them."""
        if self._server is None:
            return
        self._server.close()
        if self._connections:
            await asyncio.wait(set(self._connections), timeout=grace_s)
        pending = [*self._connections, *(f.task for f in self._flights.values())]
        for task in pending:
            task.cancel()
        # A cancelled fetch leaves its thread to finish the download into the cache.
        await asyncio.gather(*pending, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        whole = False
        try:
            await self._answer(reader, writer)
            whole = True
        except ConnectionError as e:  # the worker went away: nothing to tell it
            log.debug("connection lost: %s", e)
        except TimeoutError:
            log.warning("a worker took nothing for %.0fs: response cut", self.config.send_timeout_s)
        except Exception:  # one request's fault must not stop the node's cache
            # The connection closes without a complete answer: the worker reads its model
            # from the store instead.
            log.exception("answering a request failed")
        finally:
            await self._hang_up(writer, flush=whole)
            self._connections.discard(task)

    async def _hang_up(self, writer: asyncio.StreamWriter, *, flush: bool) -> None:
        """Close after the bytes still buffered are sent, within the send timeout; or at once,
        dropping them (a response cut short: nothing more of it is worth waiting for)."""
        if flush:
            writer.close()
            # A peer that is gone, or takes nothing: what is left is dropped below.
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(self.config.send_timeout_s):
                    await writer.wait_closed()
                return
        writer.transport.abort()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_request(reader, timeout_s=self.config.request_timeout_s)
            if request is not None:
                await self._route(request, writer)
        except RequestError as e:
            if not e.counted:
                REQUESTS.labels("refused" if e.status < 500 else "failed").inc()
            await reply(writer, e.status, str(e))

    async def _route(self, request: Request, writer: asyncio.StreamWriter) -> None:
        if request.path == "/healthz":
            await reply(writer, HTTPStatus.OK, "alive")
        elif request.path == "/models":
            await self._models(request, writer)
        else:
            raise RequestError(
                HTTPStatus.NOT_FOUND,
                f"no {request.path} here: GET /models?uri=<store URI>, GET /healthz",
            )

    async def _models(self, request: Request, writer: asyncio.StreamWriter) -> None:
        if request.method not in ("GET", "HEAD"):
            raise RequestError(HTTPStatus.METHOD_NOT_ALLOWED, f"{request.method}: GET or HEAD")
        uris = request.query.get("uri", [])
        if len(uris) != 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, "give one store URI: /models?uri=...")
        (uri,) = uris
        why = refusal(uri, self.config.model_roots)
        if why is not None:
            raise RequestError(HTTPStatus.FORBIDDEN, why)
        try:
            held = await self._acquire(uri)
        except ModelMissing as e:
            raise RequestError(HTTPStatus.NOT_FOUND, str(e)) from e
        except TooLarge as e:
            REQUESTS.labels("too_large").inc()
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(e), counted=True) from e
        except NoRoom as e:
            REQUESTS.labels("no_room").inc()
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, str(e), counted=True) from e
        except (ModelFetchError, OSError, ValueError, ImportError) as e:
            # OSError: the store's errors (StoreError), after modelcache's retries, or the
            # cache folder's. ValueError, ImportError: fsspec without that protocol.
            log.warning("cannot fetch %s: %s", uri, e)
            raise RequestError(HTTPStatus.BAD_GATEWAY, f"cannot fetch {uri}: {e}") from e
        try:
            REQUESTS.labels("miss" if held.model.fetched else "hit").inc()
            await self._send(writer, held, body=request.method == "GET")
        finally:
            self._release(held.model.sha256)

    async def _acquire(self, uri: str) -> _Held:
        """The model at `uri` in the cache, pinned for the caller: one fetch for all the
        requests that ask while it runs."""
        flight = self._flights.get(uri)
        if flight is None:
            flight = _Flight(asyncio.create_task(self._fetch(uri), name=f"fetch {uri}"))
            self._flights[uri] = flight
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            # The fetch pins its blob once for each request still waiting when it ends.
            done = flight.task.done() and not flight.task.cancelled()
            if done and flight.task.exception() is None:
                self._release(flight.task.result().model.sha256)
            elif not done:
                flight.waiters -= 1
            raise

    async def _fetch(self, uri: str) -> _Held:
        try:
            info = await asyncio.to_thread(stat_model, uri)
            size = int(info["size"])
            hit = await asyncio.to_thread(cached_model, uri, self.config.cache_dir, info)
            # Looked at and pinned in one turn of the loop, the only place blobs are deleted.
            if hit is not None and _size(hit.path) == size:
                model = hit
            else:
                model, size = await self._download(uri, size)
            self._index.pin(model.sha256, size, count=self._flights[uri].waiters)
        finally:
            del self._flights[uri]  # a later request asks the store for the version again
        self._evict()
        return _Held(model, size)

    async def _download(self, uri: str, size: int) -> tuple[CachedModel, int]:
        """The model into the cache, once a download slot and its room are had."""
        if size > self.config.max_bytes:
            raise TooLarge(
                f"model {uri} ({size} bytes) is larger than this node's cache "
                f"({self.config.max_bytes} bytes): read it from its store"
            )
        async with self._downloads:
            await self._reserve(size)
            try:
                for _ in range(_FETCH_TRIES):
                    model = await asyncio.to_thread(fetch_model, uri, self.config.cache_dir)
                    # Looked at (and pinned by the caller) in this turn of the loop: a blob
                    # evicted while fetch_model returned it is fetched again.
                    got = _size(model.path)
                    if got is not None:
                        return model, got
                raise ModelFetchError(f"model {uri}: evicted each time it was fetched")
            finally:
                self._index.reserved -= size
                self._room_freed()

    async def _reserve(self, size: int) -> None:
        """Hold `size` bytes of the bound for a download, evicting the least recently used
        models that no response holds; wait (`room_timeout_s`) for responses to end if that
        is not enough, then NoRoom."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.room_timeout_s
        while True:
            self._evict(room=size)
            if self._index.fits(size):
                self._index.reserved += size
                STORED_BYTES.set(self._index.total_bytes)
                return
            left = deadline - loop.time()
            if left <= 0:
                raise NoRoom(
                    f"no room for {size} bytes in this node's cache within "
                    f"{self.config.room_timeout_s:g}s: {self._index.pinned_bytes()} bytes of "
                    f"models are being sent and {self._index.reserved} being fetched, of "
                    f"{self.config.max_bytes}"
                )
            if self._freed is None or self._freed.done():
                self._freed = loop.create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._freed), left)

    def _room_freed(self) -> None:
        if self._freed is not None and not self._freed.done():
            self._freed.set_result(None)

    def _release(self, sha: str) -> None:
        self._index.unpin(sha)
        self._evict()
        self._room_freed()

    def _evict(self, *, room: int = 0) -> None:
        """Delete the blobs past the bound (less the downloads' room, and `room` more), in
        this turn of the loop (see `_fetch`). Their refs stay: modelcache reads a ref whose
        blob is gone as a miss."""
        for sha in self._index.evict(room=room):
            log.info(
                "evicting blob %s: the cache is over %d bytes", sha[:12], self._index.max_bytes
            )
            try:
                os.unlink(os.path.join(self._blobs, sha))
            except FileNotFoundError:
                pass
            EVICTIONS.inc()
        STORED_BYTES.set(self._index.total_bytes)

    async def _send(self, writer: asyncio.StreamWriter, held: _Held, *, body: bool) -> None:
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(held.size),
            SHA256_HEADER: held.model.sha256,
            CACHE_HEADER: "miss" if held.model.fetched else "hit",
        }
        f = await asyncio.to_thread(open, held.model.path, "rb")  # pinned: it is there
        try:
            writer.write(response_head(HTTPStatus.OK, headers))
            left = held.size if body else 0
            while left > 0:
                chunk = await asyncio.to_thread(f.read, min(left, self.config.chunk_bytes))
                if not chunk:  # cannot happen to a blob, named by its content; cut it short
                    raise ConnectionError(f"blob {held.model.sha256[:12]} ended {left} short")
                writer.write(chunk)
                async with asyncio.timeout(self.config.send_timeout_s):
                    await writer.drain()
                left -= len(chunk)
                SERVED_BYTES.inc(len(chunk))
            await writer.drain()
        finally:
            f.close()
