"""The little of HTTP/1.1 the node model cache speaks (ebb.worker.modelcache.server), on asyncio
streams.

One request per connection, no body: a request line and headers in, a response with its
Content-Length and `Connection: close` out. The image has no HTTP server library, and a cache
that serves one kind of GET needs none.
"""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit


class RequestError(Exception):
    """A request the server answers with an error status, and why. `counted`: its outcome
    is in the request metrics already (under a name of its own)."""

    def __init__(self, status: HTTPStatus, message: str, *, counted: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.counted = counted


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]


async def read_request(reader: asyncio.StreamReader, *, timeout_s: float) -> Request | None:
    """The request's line and headers (its headers unread: none changes the answer); None if
    the peer closed before it asked anything."""
    try:
        async with asyncio.timeout(timeout_s):
            head = await reader.readuntil(b"\r\n\r\n")
    except TimeoutError:
        raise RequestError(HTTPStatus.REQUEST_TIMEOUT, "no request in time") from None
    except asyncio.LimitOverrunError:
        raise RequestError(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large"
        ) from None
    except asyncio.IncompleteReadError:
        return None
    try:
        line = head.split(b"\r\n", 1)[0].decode("ascii")
        method, target, version = line.split(" ")
    except (UnicodeDecodeError, ValueError):
        raise RequestError(HTTPStatus.BAD_REQUEST, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise RequestError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"{version} is not HTTP/1.x")
    parts = urlsplit(target)
    return Request(method, parts.path, parse_qs(parts.query))


def response_head(status: HTTPStatus, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status.value} {status.phrase}"]
    lines += [f"{name}: {value}" for name, value in {**headers, "Connection": "close"}.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def reply(writer: asyncio.StreamWriter, status: HTTPStatus, message: str) -> None:
    """A whole response: the status, and a line of text that says why."""
    body = (message + "\n").encode()
    headers = {"Content-Type": "text/plain; charset=utf-8", "Content-Length": str(len(body))}
    writer.write(response_head(status, headers) + body)
    await writer.drain()


def refusal(uri: str, roots: Sequence[str]) -> str | None:
    """Why the cache will not fetch `uri`; None: it will. Only a store URI in canonical form
    (no `.`, `..` or `//` to read past a root, no query) under one of `roots` (the model
    roots)."""
    parts = urlsplit(uri)
    if not parts.scheme or "://" not in uri:
        return f"{uri!r} is not a store URI (scheme://...)"
    if parts.query or parts.fragment:
        return f"{uri!r} has a query or fragment"
    path = posixpath.normpath("/" + parts.path.lstrip("/"))
    canonical = f"{parts.scheme}://{parts.netloc}{path}"
    if canonical != uri:
        return f"{uri!r} is not in canonical form ({canonical!r})"
    if not any(uri.startswith(root.rstrip("/") + "/") for root in roots):
        allowed = ", ".join(roots) or "(none configured)"
        return f"{uri!r} lies outside the model roots this cache serves: {allowed}"
    return None
