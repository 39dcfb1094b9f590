"""An informer: a local cache of one kind of Kubernetes object, kept current by list + watch.

The agent lists once, then watches from the list's resourceVersion. A watch that ends (the
server's timeout, a cut connection) resumes from the last resourceVersion seen; a resume the
server can no longer serve (410 Gone: its history moved on) starts over with a fresh list.
API errors (500, 429 with Retry-After, connection refused) back off, capped, with jitter.
Objects are kept as the plain JSON maps the API sends: no model classes on the hot path.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from ebb.common.messaging.bus import Backoff

from .. import metrics

log = logging.getLogger(__name__)

Obj = dict[str, Any]
ListCall = Callable[..., Awaitable[Any]]


class Expired(Exception):
    """410 Gone: the resourceVersion to resume from is no longer in the server's history."""


def key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta['name']}" if namespace else str(meta["name"])


class Informer:
    def __init__(
        self,
        name: str,
        list_call: ListCall,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        on_change: Callable[[], None] = lambda: None,
        on_delete: Callable[[Obj], None] = lambda obj: None,
        watch_timeout_s: int = 300,
        backoff: Backoff | None = None,
    ) -> None:
        self.name = name
        self._call = list_call
        self._selectors: dict[str, str] = {}
        if label_selector:
            self._selectors["label_selector"] = label_selector
        if field_selector:
            self._selectors["field_selector"] = field_selector
        self._on_change = on_change
        self._on_delete = on_delete
        """Told of each object deleted, as it was last seen: one a watch says was deleted,
        and one a fresh list (after a 410) no longer has, deleted while no watch ran."""
        self._watch_timeout_s = watch_timeout_s
        self._backoff = backoff or Backoff(first_s=0.2, max_s=30.0)
        self.items: dict[str, Obj] = {}
        self.resource_version = ""
        self.synced = asyncio.Event()
        """Set once the first list is in."""
        self.relists = 0

    def values(self) -> list[Obj]:
        return list(self.items.values())

    async def run(self) -> None:
        """Keep the cache current, forever (an agent)."""
        failures = 0
        fresh = True
        while True:
            try:
                if fresh:
                    await self._list()
                    fresh = False
                await self._watch()
                failures = 0
            except Expired:
                log.info("%s: watch history expired; listing again", self.name)
                fresh = True
            except ApiException as e:
                if e.status == 410:
                    fresh = True
                    continue
                delay = _retry_after(e) or self._backoff.delay(failures)
                failures += 1
                metrics.KUBE_ERRORS.labels(self.name, str(e.status)).inc()
                log.warning("%s: API error %s; retrying in %.1fs", self.name, e.status, delay)
                await asyncio.sleep(delay)
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                # A cut stream or a refused connection: resume where we were.
                delay = self._backoff.delay(failures)
                failures += 1
                metrics.KUBE_ERRORS.labels(self.name, type(e).__name__).inc()
                log.info("%s: watch interrupted (%s); resuming in %.1fs", self.name, e, delay)
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        response = await checked(await self._call(**self._selectors, _preload_content=False))
        try:
            body = json.loads(await response.read())
        finally:
            response.release()
        items = {key(obj): obj for obj in body.get("items") or []}
        if self.synced.is_set():  # a relist: what vanished since was deleted unseen
            for name in self.items.keys() - items.keys():
                self._on_delete(self.items[name])
        self.items = items
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion", ""))
        self.relists += 1
        self.synced.set()
        self._on_change()

    async def _watch(self) -> None:
        response = await checked(
            await self._call(
                **self._selectors,
                watch=True,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_s,
                _preload_content=False,
            )
        )
        try:
            async for line in response.content:
                if line.strip():
                    self._apply(json.loads(line))
        finally:
            response.release()

    def _apply(self, event: Obj) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Expired(obj.get("message", ""))
            raise ApiException(status=obj.get("code", 500), reason=obj.get("message", ""))
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self.resource_version = str(version)
        if kind == "BOOKMARK":
            return
        if kind == "DELETED":
            self.items.pop(key(obj), None)
            self._on_delete(obj)
        else:
            self.items[key(obj)] = obj
        self._on_change()


async def checked(response: Any) -> Any:
    """A raw response (`_preload_content=False` skips the client's own status check) that
    is a success, or the ApiException its status says."""
    if 200 <= response.status < 300:
        return response
    try:
        body = await response.read()
    finally:
        response.release()
    error = ApiException(status=response.status, reason=response.reason)
    error.headers = response.headers
    error.body = body
    raise error


def _retry_after(e: ApiException) -> float | None:
    headers: Any = e.headers or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
