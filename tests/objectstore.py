"""A real S3-protocol server on loopback for tests and benchmarks: moto's standalone server,
and an HTTP proxy in front of it that injects what stores do in production: per-request
latency, throttling (503 SlowDown), dropped connections and stalled uploads.

The proxy runs its own event loop in a thread, so that the processes of a job (master,
workers) and the test's own loop reach it alike, over TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from ebb.common.data.layout import COMMITS_DIR, MANIFEST

from .helpers import free_port

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

FaultKind = Literal["slowdown", "drop", "stall", "error"]

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>ebbtest</RequestId></Error>"
)
_ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied (injected)</Message><RequestId>ebbtest</RequestId></Error>"
)
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
}


@dataclass
class Fault:
    kind: FaultKind
    """slowdown: answer 503 SlowDown; drop: close the connection without an answer; stall:
    hold the request until the proxy is released or the client goes away; error: 403."""
    method: str | None = None
    """Only requests of this HTTP method (None: any)."""
    path: str = ""
    """Only requests whose path (and query) matches this regular expression."""
    times: int = 1
    """How many matching requests it hits before it is spent."""
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.hits >= self.times:
            return False
        if self.method is not None and method != self.method:
            return False
        return re.search(self.path, path) is not None


@dataclass
class FaultyProxy:
    """An S3 endpoint that forwards to `upstream`, with faults. Start with `start()`."""

    upstream: str
    latency_s: float = 0.0
    faults: list[Fault] = field(default_factory=list)
    seen: list[tuple[str, str, int]] = field(default_factory=list)
    """Every request: (method, path, status answered; 0 for none)."""
    arrivals: list[float] = field(default_factory=list)
    """When each request arrived (time.perf_counter())."""

    def __post_init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._lock = threading.Lock()
        self._release: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None
        self.stalled: list[tuple[str, str]] = []

    def start(self) -> FaultyProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def release_stalled(self) -> None:
        def release() -> None:
            if self._release is not None:
                self._release.set()

        self._loop.call_soon_threadsafe(release)

    def count(self, method: str, pattern: str) -> int:
        with self._lock:
            return sum(1 for m, p, _ in self.seen if m == method and re.search(pattern, p))

    async def _start(self) -> None:
        self._release = asyncio.Event()
        self._session = ClientSession(
            connector=TCPConnector(limit=0),
            auto_decompress=False,
            timeout=ClientTimeout(total=None),
        )
        app = web.Application(client_max_size=1 << 34)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, backlog=1024).start()

    async def _stop(self) -> None:
        assert self._release is not None
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    fault.hits += 1
                    return fault
        return None

    def _note(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.seen.append((method, path, status))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        # Decoded (`shard=3`, not `shard%3D3`) for matching; forwarded as it came.
        method, path = request.method, request.path
        with self._lock:
            self.arrivals.append(time.perf_counter())
        body = await request.read()
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        fault = self._fault_for(method, path)
        if fault is not None:
            if fault.kind == "slowdown":
                self._note(method, path, 503)
                return web.Response(status=503, body=_SLOWDOWN, content_type="application/xml")
            if fault.kind == "error":
                self._note(method, path, 403)
                return web.Response(status=403, body=_ACCESS_DENIED, content_type="application/xml")
            if fault.kind == "drop":
                self._note(method, path, 0)
                assert request.transport is not None
                request.transport.abort()
                raise web.HTTPServiceUnavailable  # never sent: the connection is gone
            assert self._release is not None
            with self._lock:
                self.stalled.append((method, path))
            self._note(method, path, 0)
            await self._release.wait()
            raise web.HTTPServiceUnavailable(body=_SLOWDOWN, content_type="application/xml")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        assert self._session is not None
        async with self._session.request(
            method,
            self.upstream + request.raw_path,
            headers=headers,
            data=io.BytesIO(body),
            allow_redirects=False,
        ) as upstream:
            payload = await upstream.read()
            answer = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
            self._note(method, path, upstream.status)
            response = web.Response(status=upstream.status, body=payload, headers=answer)
            if method == "HEAD":
                # A HEAD answer states the object's length without a body.
                length = upstream.headers.get("Content-Length")
                if length is not None:
                    response.headers["Content-Length"] = length
            return response


class MotoS3:
    """moto's S3 server on a free loopback port: in a thread of this process, or (`process`)
    as a process of its own, so that its work does not share this process's GIL."""

    def __init__(self, *, process: bool = False, host: str = "127.0.0.1") -> None:
        """`host`: the address it listens on (another than loopback for pods on the suite's
        nodes, which reach this host at their bridge's address)."""
        self.host = host
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        self._server: Any = None
        if not process:
            from moto.server import ThreadedMotoServer

            self._server = ThreadedMotoServer(ip_address=host, port=self.port, verbose=False)

    def start(self) -> MotoS3:
        if self._server is not None:
            self._server.start()
            return self
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.host, self.port), timeout=0.2),
            ):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("moto's server did not start listening within 30 s")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)


def s3_environment(endpoint: str) -> dict[str, str]:
    """What a process needs to reach the test store: credentials and the endpoint, from the
    same variables a real deployment sets."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        # No instance metadata lookups on a machine that has none.
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    clear_s3_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        clear_s3_cache()


def clear_s3_cache() -> None:
    """s3fs keeps one filesystem per set of arguments: a new endpoint needs a new one."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def create_bucket(endpoint: str, name: str) -> None:
    import boto3  # type: ignore[import-untyped]

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    client.create_bucket(Bucket=name)


def s3(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(
        key=ACCESS_KEY,
        secret=SECRET_KEY,
        client_kwargs={"endpoint_url": endpoint, "region_name": REGION},
        skip_instance_cache=True,
    )


def upload(fs: Any, local: Path, remote: str) -> None:
    """Every file of the folder `local` to `remote` (bucket/prefix)."""
    for path in sorted(local.iterdir()):
        fs.pipe_file(f"{remote}/{path.name}", path.read_bytes())


def _read(data: bytes, path: str) -> pa.Table:
    if path.endswith(".jsonl"):
        return pa.Table.from_pylist([json.loads(line) for line in data.splitlines()])
    return pq.read_table(io.BytesIO(data))


def _output(fs: Any, root: str) -> tuple[pa.Table, dict[str, Any]]:
    manifest = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    tables = [_read(fs.cat_file(f"{root}/{f['path']}"), f["path"]) for f in manifest["files"]]
    return pa.concat_tables(tables, promote_options="default"), manifest


def output_commits(fs: Any, root: str) -> list[dict[str, Any]]:
    return [json.loads(fs.cat_file(p)) for p in fs.find(f"{root}/{COMMITS_DIR}")]


def assert_exactly_once(fs: Any, root: str, rows: int) -> pa.Table:
    """The job's output at `root` (bucket/prefix) holds ids 0..rows-1 each once, its manifest
    lists exactly the committed files, each whole; the output as one table."""
    fs.invalidate_cache()
    table, manifest = _output(fs, root)
    ids = [int(i) for i in table.column("id").to_pylist() if i is not None]
    assert len(ids) == table.num_rows
    assert sorted(ids) == list(range(rows)), "every id exactly once"
    committed = {f["path"] for record in output_commits(fs, root) for f in record["files"]}
    assert {f["path"] for f in manifest["files"]} == committed
    for f in manifest["files"]:  # every listed object is whole
        assert fs.info(f"{root}/{f['path']}")["size"] > 0
    return table
