"""The node model cache (ebb.worker.modelcache.server) over real HTTP on loopback, with a
store fsspec reads; and a worker's side of it (ebb.worker.modelcache.client): through the
cache, and from the store when the cache is down, refuses, or lies."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import signal
import sys
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlencode

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from ebb.common import envvars
from ebb.worker.modelcache.client import SHA256_HEADER, NodeCacheError, fetch_through, local_model
from ebb.worker.modelcache.command import byte_size
from ebb.worker.modelcache.index import BlobIndex, evictions
from ebb.worker.modelcache.protocol import refusal
from ebb.worker.modelcache.server import CacheServerConfig, ModelCacheServer

from ..helpers import free_port, wait_until

MiB = 1 << 20


class CountingStore(MemoryFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """An object store in memory (a store of its own, apart from memory://) that counts the
    objects opened for reading: each a download. A test may hold downloads at a gate."""

    protocol = "countmem"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    reads: ClassVar[Counter[str]] = Counter()
    gate: ClassVar[threading.Event | None] = None

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return super()._strip_protocol(str(path).removeprefix("countmem://"))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """With an ETag, as S3 gives: the MD5 of a single-part object, a version of it."""
        out = dict(super().info(path, **kwargs))
        if out["type"] == "file":
            data = self.store[self._strip_protocol(path)].getvalue()
            out["ETag"] = f'"{hashlib.md5(data).hexdigest()}"'
        return out

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            CountingStore.reads[self._strip_protocol(path)] += 1
            if CountingStore.gate is not None:
                assert CountingStore.gate.wait(timeout=60), "the gate never opened"
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("countmem", CountingStore, clobber=True)


def reads(uri: str) -> int:
    return CountingStore.reads[CountingStore._strip_protocol(uri)]


@pytest.fixture
def root() -> str:
    """A bucket of this test's own."""
    return f"countmem://models-{uuid.uuid4().hex[:8]}"


def put(uri: str, data: bytes) -> str:
    fsspec.filesystem("countmem").pipe_file(uri, data)
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
async def server(tmp_path: Path, root: str) -> AsyncIterator[ModelCacheServer]:
    s = ModelCacheServer(
        CacheServerConfig(
            cache_dir=str(tmp_path / "node"),
            max_bytes=1 << 30,
            model_roots=[root],
            host="127.0.0.1",
            port=0,
        )
    )
    await s.start()
    try:
        yield s
    finally:
        await s.close()


def target(uri: str) -> str:
    return "/models?" + urlencode({"uri": uri})


async def request(
    port: int, path: str, *, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 exchange: the server closes the connection after its response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: cache\r\n\r\n".encode())
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status.split()[1]), headers, body


# -- the server ------------------------------------------------------------------------------


async def test_a_model_is_served_with_its_hash_and_the_second_time_from_the_cache(
    server: ModelCacheServer, root: str
) -> None:
    blob = os.urandom(3 * MiB + 17)
    uri = f"{root}/m.onnx"
    sha = put(uri, blob)
    status, headers, body = await request(server.port, target(uri))
    assert (status, body) == (200, blob)
    assert headers["x-ebb-sha256"] == sha and headers["content-length"] == str(len(blob))
    assert headers["x-ebb-cache"] == "miss"
    status, headers, body = await request(server.port, target(uri))
    assert (status, body, headers["x-ebb-cache"]) == (200, blob, "hit")
    status, headers, body = await request(server.port, target(uri), method="HEAD")
    assert (status, body, headers["content-length"]) == (200, b"", str(len(blob)))
    assert reads(uri) == 1
    # A changed object is another version: fetched anew.
    sha2 = put(uri, blob[::-1])
    status, headers, body = await request(server.port, target(uri))
    assert (body, headers["x-ebb-sha256"], headers["x-ebb-cache"]) == (blob[::-1], sha2, "miss")
    assert reads(uri) == 2


async def test_concurrent_requests_for_one_model_download_it_once(
    server: ModelCacheServer, root: str
) -> None:
    blob = os.urandom(2 * MiB)
    uri = f"{root}/big.onnx"
    sha = put(uri, blob)
    CountingStore.gate = threading.Event()
    try:
        asked = [asyncio.create_task(request(server.port, target(uri))) for _ in range(8)]
        await wait_until(lambda: server.waiting(uri) == 8, timeout=30, what="8 waiting")
        CountingStore.gate.set()
        answers = await asyncio.gather(*asked)
    finally:
        CountingStore.gate = None
    assert reads(uri) == 1
    for status, headers, body in answers:
        assert (status, headers["x-ebb-sha256"], body) == (200, sha, blob)


async def test_a_server_closed_during_a_fetch_cuts_its_waiters_after_the_grace(
    tmp_path: Path, root: str
) -> None:
    s = ModelCacheServer(
        CacheServerConfig(
            cache_dir=str(tmp_path / "node"),
            max_bytes=MiB,
            model_roots=[root],
            host="127.0.0.1",
            port=0,
        )
    )
    await s.start()
    uri = f"{root}/m.onnx"
    put(uri, b"weights")
    CountingStore.gate = threading.Event()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(f"GET {target(uri)} HTTP/1.1\r\n\r\n".encode())
        await wait_until(lambda: s.waiting(uri) == 1, timeout=30, what="a waiter")
        await s.close(grace_s=0)
        assert await reader.read() == b""  # cut: no response, which a worker never keeps
        writer.close()
        await writer.wait_closed()
    finally:
        CountingStore.gate.set()
        CountingStore.gate = None


async def test_least_recently_used_models_go_past_the_bound(tmp_path: Path, root: str) -> None:
    size = 1 * MiB
    s = ModelCacheServer(
        CacheServerConfig(
            cache_dir=str(tmp_path / "node"),
            max_bytes=int(2.5 * size),
            model_roots=[root],
            host="127.0.0.1",
            port=0,
        )
    )
    await s.start()
    try:
        uris = {name: f"{root}/{name}.onnx" for name in "abc"}
        shas = {name: put(uri, os.urandom(size)) for name, uri in uris.items()}
        for name in "aba":  # a, b, then a again: b is the least recently used
            assert (await request(s.port, target(uris[name])))[0] == 200
        assert (await request(s.port, target(uris["c"])))[0] == 200
        blobs = tmp_path / "node" / "blobs" / "sha256"
        assert {p.name for p in blobs.iterdir()} == {shas["a"], shas["c"]}
        _, headers, _ = await request(s.port, target(uris["a"]))
        assert headers["x-ebb-cache"] == "hit"
        _, headers, body = await request(s.port, target(uris["b"]))
        assert headers["x-ebb-cache"] == "miss" and hashlib.sha256(body).hexdigest() == shas["b"]
        assert (reads(uris["a"]), reads(uris["b"])) == (1, 2)
    finally:
        await s.close()


async def test_a_model_being_sent_is_never_evicted_and_a_download_waits_for_room(
    tmp_path: Path, root: str
) -> None:
    s = ModelCacheServer(
        CacheServerConfig(
            cache_dir=str(tmp_path / "node"),
            max_bytes=40 * MiB,
            model_roots=[root],
            host="127.0.0.1",
            port=0,
            room_timeout_s=0.5,
        )
    )
    await s.start()
    try:
        # Larger than the socket buffers of loopback: the server waits on the reader.
        big, small = os.urandom(32 * MiB), os.urandom(16 * MiB)
        sha_big, sha_small = put(f"{root}/big", big), put(f"{root}/small", small)
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(f"GET {target(f'{root}/big')} HTTP/1.1\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        # 48 MiB would pass the bound, and the big one is being sent: no room for the small
        # one within the wait. Refused (its worker reads it from the store), nothing evicted.
        status, _, body = await request(s.port, target(f"{root}/small"))
        assert status == 503 and b"no room" in body
        assert reads(f"{root}/small") == 0
        blobs = tmp_path / "node" / "blobs" / "sha256"
        assert {p.name for p in blobs.iterdir()} == {sha_big}
        rest = await reader.read()
        writer.close()
        await writer.wait_closed()
        assert hashlib.sha256(rest).hexdigest() == sha_big
        await wait_until(lambda: s.connections == 0, timeout=30, what="the response done")
        # The big one sent, it may go: the small one takes its room.
        status, _, body = await request(s.port, target(f"{root}/small"))
        assert (status, hashlib.sha256(body).hexdigest()) == (200, sha_small)
        assert {p.name for p in blobs.iterdir()} == {sha_small}
    finally:
        await s.close()


async def test_a_stalled_worker_is_cut_off_and_its_model_released(
    tmp_path: Path, root: str
) -> None:
    s = ModelCacheServer(
        CacheServerConfig(
            cache_dir=str(tmp_path / "node"),
            max_bytes=40 * MiB,
            model_roots=[root],
            host="127.0.0.1",
            port=0,
            send_timeout_s=0.2,
        )
    )
    await s.start()
    try:
        sha = put(f"{root}/big", os.urandom(32 * MiB))
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(f"GET {target(f'{root}/big')} HTTP/1.1\r\n\r\n".encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert s.pins(sha) == 1
        # The worker takes no more: the server gives up on it, and lets go of the model.
        await wait_until(lambda: s.connections == 0, timeout=30, what="the response cut")
        assert s.pins(sha) == 0
        writer.close()
        await writer.wait_closed()
    finally:
        await s.close()


async def test_only_models_are_served_and_none_larger_than_the_cache(
    tmp_path: Path, root: str
) -> None:
    """A job's input under the data roots is no model: refused. A model larger than the whole
    cache is refused before a byte is downloaded (its worker reads it from the store), and
    evicts nothing."""
    s = ModelCacheServer(
        CacheServerConfig(
            cache_dir=str(tmp_path / "node"),
            max_bytes=4 * MiB,
            model_roots=[f"{root}/models"],
            host="127.0.0.1",
            port=0,
        )
    )
    await s.start()
    try:
        data = f"{root}/data/part-0.parquet"
        put(data, os.urandom(MiB))
        status, _, body = await request(s.port, target(data))
        assert status == 403 and b"outside the model roots" in body
        kept = put(f"{root}/models/small.onnx", os.urandom(MiB))
        assert (await request(s.port, target(f"{root}/models/small.onnx")))[0] == 200
        huge = f"{root}/models/huge.onnx"
        put(huge, os.urandom(5 * MiB))
        status, _, body = await request(s.port, target(huge))
        assert status == 413 and b"larger than this node's cache" in body
        assert (reads(data), reads(huge)) == (0, 0)
        blobs = tmp_path / "node" / "blobs" / "sha256"
        assert {p.name for p in blobs.iterdir()} == {kept}
    finally:
        await s.close()


async def test_concurrent_requests_of_different_models_stay_within_the_bound(
    tmp_path: Path, root: str
) -> None:
    """Eight workers ask for eight different models at once, three fitting the cache: two
    downloads at a time, each once its room is had; the folder never holds more than the
    bound; every response whole."""
    size, bound = 4 * MiB, 12 * MiB
    s = ModelCacheServer(
        CacheServerConfig(
            cache_dir=str(tmp_path / "node"),
            max_bytes=bound,
            model_roots=[root],
            host="127.0.0.1",
            port=0,
            max_fetches=2,
        )
    )
    await s.start()
    blobs = tmp_path / "node" / "blobs" / "sha256"
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            held = sum(p.stat().st_size for p in blobs.iterdir() if p.is_file())
            most = max(most, held)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    uris = [f"{root}/model-{n}.onnx" for n in range(8)]
    shas = [put(uri, os.urandom(size)) for uri in uris]
    CountingStore.gate = threading.Event()
    try:
        asked = [asyncio.create_task(request(s.port, target(uri))) for uri in uris]
        await wait_until(
            lambda: all(s.waiting(uri) == 1 for uri in uris) and sum(map(reads, uris)) == 2,
            timeout=30,
            what="eight requests waiting, two downloads started",
        )
        assert s.reserved_bytes == 2 * size
        CountingStore.gate.set()
        answers = await asyncio.gather(*asked)
    finally:
        CountingStore.gate.set()
        CountingStore.gate = None
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await s.close()
    for (status, headers, body), sha in zip(answers, shas, strict=True):
        assert (status, headers["x-ebb-sha256"], hashlib.sha256(body).hexdigest()) == (
            200,
            sha,
            sha,
        )
    assert sum(map(reads, uris)) == 8
    assert most <= bound


@pytest.mark.parametrize(
    ("path", "status", "words"),
    [
        ("/models", 400, "give one store URI"),
        ("/models?uri=a&uri=b", 400, "give one store URI"),
        ("/nowhere", 404, "GET /models?uri="),
        ("/models?uri=/etc/passwd", 403, "not a store URI"),
        ("/models?uri=file:///etc/passwd", 403, "outside the model roots"),
        ("/models?uri={root}/../other/m.onnx", 403, "canonical"),
        ("/models?uri=countmem://elsewhere/m.onnx", 403, "outside the model roots"),
        ("/models?uri={root}/missing.onnx", 404, "does not exist"),
        ("/models?uri=nosuchstore://bucket/m.onnx", 502, "cannot fetch"),
    ],
)
async def test_a_bad_request_gets_a_clear_error_and_the_server_stays_up(
    tmp_path: Path, root: str, path: str, status: int, words: str
) -> None:
    s = ModelCacheServer(
        CacheServerConfig(
            cache_dir=str(tmp_path / "node"),
            max_bytes=MiB,
            model_roots=[root, "nosuchstore://bucket"],
            host="127.0.0.1",
            port=0,
        )
    )
    await s.start()
    try:
        got, headers, body = await request(s.port, path.replace("{root}", root))
        assert got == status and words in body.decode(), body
        assert headers["content-length"] == str(len(body))
        assert (await request(s.port, "/healthz"))[:3:2] == (200, b"alive\n")
        sha = put(f"{root}/ok.onnx", b"fine")
        assert (await request(s.port, target(f"{root}/ok.onnx")))[1]["x-ebb-sha256"] == sha
    finally:
        await s.close()


async def test_malformed_requests_and_methods_are_refused(server: ModelCacheServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"NONSENSE\r\n\r\n")
    raw = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert raw.startswith(b"HTTP/1.1 400") and b"malformed" in raw
    status, _, body = await request(server.port, target("countmem://x/y"), method="DELETE")
    assert status == 405 and b"GET or HEAD" in body


async def test_a_restarted_server_finds_its_models_and_drops_cut_downloads(
    tmp_path: Path, root: str
) -> None:
    config = CacheServerConfig(
        cache_dir=str(tmp_path / "node"),
        max_bytes=MiB,
        model_roots=[root],
        host="127.0.0.1",
        port=0,
    )
    uri = f"{root}/m.onnx"
    put(uri, b"model bytes")
    first = ModelCacheServer(config)
    await first.start()
    await request(first.port, target(uri))
    await first.close()
    cut = tmp_path / "node" / "blobs" / "sha256" / ".fetch-0123456789ab"
    cut.write_bytes(b"half a model")
    second = ModelCacheServer(config)
    await second.start()
    try:
        assert not cut.exists()
        _, headers, body = await request(second.port, target(uri))
        assert (headers["x-ebb-cache"], body) == ("hit", b"model bytes")
        assert reads(uri) == 1
    finally:
        await second.close()


async def test_the_cache_runs_as_a_process_and_stops_on_sigterm(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "m.onnx").write_bytes(b"weights")
    env = {
        **os.environ,
        envvars.MODEL_CACHE_DIR: str(tmp_path / "node"),
        envvars.MODEL_CACHE_MAX_BYTES: "1Mi",
        envvars.MODEL_ROOTS: f"file://{store}",
        envvars.METRICS_PORT: "0",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "ebb.worker.modelcache", "--port", "0"),
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        said = b""
        async with asyncio.timeout(60):
            while (found := re.search(rb"node model cache on port (\d+)", said)) is None:
                line = await process.stderr.readline()
                assert line, f"it ended before it listened: {said.decode()}"
                said += line
        port = int(found[1])
        status, _, body = await request(port, target(f"file://{store}/m.onnx"))
        assert (status, body) == (200, b"weights")
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            rest = await process.stderr.read()
            assert await process.wait() == 0, rest.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


# -- decisions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("blobs", "pinned", "max_bytes", "evicted"),
    [
        ([("a", 10), ("b", 10)], set(), 20, []),
        ([("a", 10), ("b", 10), ("c", 10)], set(), 20, ["a"]),
        ([("a", 10), ("b", 10), ("c", 10)], {"a"}, 20, ["b"]),
        ([("a", 10), ("b", 10), ("c", 10)], set(), 5, ["a", "b", "c"]),
        ([("a", 30), ("b", 10)], {"a"}, 20, ["b"]),  # a pinned blob alone past the bound
        ([("a", 30)], set(), 20, ["a"]),
        ([], set(), 0, []),
    ],
)
def test_evictions_take_the_least_recently_used_unpinned_blobs(
    blobs: list[tuple[str, int]], pinned: set[str], max_bytes: int, evicted: list[str]
) -> None:
    assert evictions(blobs, pinned=pinned, max_bytes=max_bytes) == evicted


def test_the_index_orders_by_use_and_keeps_pins() -> None:
    index = BlobIndex(max_bytes=20, blobs=[("a", 10), ("b", 10)])
    index.pin("a", 10)  # a is now the most recently used, and held
    index.pin("c", 10, count=2)
    assert index.evict() == ["b"]
    index.unpin("a")
    index.pin("d", 5)
    assert index.evict() == ["a"]
    assert (index.total_bytes, index.pins("c"), "a" in index) == (15, 2, False)
    with pytest.raises(ValueError, match="not pinned"):
        index.unpin("a")
    index.pin("e", 10, count=0)  # a fetch whose every waiter left: in the index, unheld
    assert index.evict() == ["e"]  # c and d are held


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("s3://data/models/m.onnx", None),
        ("s3://data/models", None),
        ("s3://data", "canonical"),
        ("s3://data/models/./m.onnx", "canonical"),
        ("s3://data//m.onnx", "canonical"),
        ("s3://data/m.onnx?versionId=1", "query"),
        ("s3://database/m.onnx", "outside"),
        ("gs://data/m.onnx", "outside"),
        ("data/m.onnx", "not a store URI"),
    ],
)
def test_the_cache_fetches_only_canonical_uris_under_its_roots(uri: str, words: str | None) -> None:
    why = refusal(uri, ["s3://data/"])
    assert (why is None) if words is None else (why is not None and words in why)


def test_sizes_read_as_kubernetes_writes_them() -> None:
    assert [byte_size(t) for t in ("1024", "2Ki", "3Mi", "50Gi")] == [1024, 2048, 3 * MiB, 50 << 30]
    for bad in ("", "5G", "Gi", "1.5Gi"):
        with pytest.raises(Exception, match="not a size"):
            byte_size(bad)


# -- a worker's side -------------------------------------------------------------------------


async def test_a_worker_copies_a_model_through_the_node_cache(
    server: ModelCacheServer, root: str, tmp_path: Path
) -> None:
    blob = os.urandom(MiB)
    uri = f"{root}/m.onnx"
    sha = put(uri, blob)
    url = f"http://127.0.0.1:{server.port}"
    mine = str(tmp_path / "worker")
    got = await asyncio.to_thread(fetch_through, url, uri, mine)
    assert (got.sha256, got.fetched, Path(got.path).read_bytes()) == (sha, True, blob)
    assert Path(got.path).parent == tmp_path / "worker" / "blobs" / "sha256"
    # Another stage process of the worker finds the blob; another worker gets a hit.
    again = await asyncio.to_thread(local_model, uri, mine, cache_url=url)
    assert (again.path, again.fetched) == (got.path, False)
    other = await asyncio.to_thread(local_model, uri, str(tmp_path / "w2"), cache_url=url)
    assert Path(other.path).read_bytes() == blob
    assert reads(uri) == 1
    assert [p.name for p in (tmp_path / "worker" / "blobs" / "sha256").iterdir()] == [sha]


async def test_the_stage_processes_of_a_worker_copy_a_model_once(
    server: ModelCacheServer, root: str, tmp_path: Path
) -> None:
    blob = os.urandom(4 * MiB)
    uri = f"{root}/m.onnx"
    sha = put(uri, blob)
    url = f"http://127.0.0.1:{server.port}"
    got = await asyncio.gather(
        *(asyncio.to_thread(fetch_through, url, uri, str(tmp_path / "w")) for _ in range(3))
    )
    assert sorted(g.fetched for g in got) == [False, False, True]
    assert {g.path for g in got} == {str(tmp_path / "w" / "blobs" / "sha256" / sha)}
    assert Path(got[0].path).read_bytes() == blob
    assert reads(uri) == 1


async def test_a_worker_without_a_cache_on_its_node_reads_from_the_store(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blob = os.urandom(1000)
    uri = f"{root}/m.onnx"
    sha = put(uri, blob)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    with caplog.at_level(logging.WARNING, "ebb.worker.modelcache.client"):
        got = await asyncio.to_thread(local_model, uri, str(tmp_path / "w"), cache_url=url)
    assert (got.sha256, Path(got.path).read_bytes()) == (sha, blob)
    assert reads(uri) == 1
    assert "did not serve" in caplog.text and "ConnectionRefusedError" in caplog.text


async def test_a_worker_falls_back_when_the_cache_refuses(
    server: ModelCacheServer, tmp_path: Path
) -> None:
    elsewhere = f"countmem://other-{uuid.uuid4().hex[:8]}/m.onnx"  # outside its roots
    put(elsewhere, b"weights")
    url = f"http://127.0.0.1:{server.port}"
    with pytest.raises(NodeCacheError, match=r"403 Forbidden: .* outside the model roots"):
        await asyncio.to_thread(fetch_through, url, elsewhere, str(tmp_path / "w"))
    got = await asyncio.to_thread(local_model, elsewhere, str(tmp_path / "w"), cache_url=url)
    assert Path(got.path).read_bytes() == b"weights"


Answer = Callable[[asyncio.StreamWriter, bytes, str], Awaitable[None]]


async def _corrupt(writer: asyncio.StreamWriter, blob: bytes, sha: str) -> None:
    bad = bytes([blob[0] ^ 1]) + blob[1:]
    head = f"HTTP/1.1 200 OK\r\n{SHA256_HEADER}: {sha}\r\nContent-Length: {len(bad)}\r\n\r\n"
    writer.write(head.encode() + bad)


async def _short(writer: asyncio.StreamWriter, blob: bytes, sha: str) -> None:
    head = f"HTTP/1.1 200 OK\r\n{SHA256_HEADER}: {sha}\r\nContent-Length: {len(blob)}\r\n\r\n"
    writer.write(head.encode() + blob[: len(blob) // 2])


async def _unnamed(writer: asyncio.StreamWriter, blob: bytes, sha: str) -> None:
    writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(blob)}\r\n\r\n".encode() + blob)


async def _another(writer: asyncio.StreamWriter, blob: bytes, sha: str) -> None:
    """Other bytes of the same length, announced with their own SHA-256: consistent in
    itself, and not what the store holds (its MD5 says so)."""
    other = os.urandom(len(blob))
    named = hashlib.sha256(other).hexdigest()
    head = f"HTTP/1.1 200 OK\r\n{SHA256_HEADER}: {named}\r\nContent-Length: {len(other)}\r\n\r\n"
    writer.write(head.encode() + other)


async def _longer(writer: asyncio.StreamWriter, blob: bytes, sha: str) -> None:
    other = blob + b"more"
    named = hashlib.sha256(other).hexdigest()
    head = f"HTTP/1.1 200 OK\r\n{SHA256_HEADER}: {named}\r\nContent-Length: {len(other)}\r\n\r\n"
    writer.write(head.encode() + other)


async def _failing(writer: asyncio.StreamWriter, blob: bytes, sha: str) -> None:
    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\nbusy\n")


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (_corrupt, "hash to"),
        (_short, "bytes of"),
        (_unnamed, "names no SHA-256"),
        (_failing, "503"),
        (_another, "not the store.s"),
        (_longer, "the store holds"),
    ],
)
async def test_a_worker_never_keeps_what_a_lying_cache_sends(
    answer: Answer, words: str, root: str, tmp_path: Path
) -> None:
    blob = os.urandom(64 * 1024)
    uri = f"{root}/m.onnx"
    sha = put(uri, blob)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await answer(writer, blob, sha)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    liar = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{liar.sockets[0].getsockname()[1]}"
    mine = tmp_path / "w"
    try:
        with pytest.raises(NodeCacheError, match=words):
            await asyncio.to_thread(fetch_through, url, uri, str(mine))
        assert list((mine / "blobs" / "sha256").iterdir()) == []  # nothing partial left
        got = await asyncio.to_thread(local_model, uri, str(mine), cache_url=url)
    finally:
        liar.close()
        await liar.wait_closed()
    assert (got.sha256, Path(got.path).read_bytes()) == (sha, blob)
    assert reads(uri) == 1  # from the store, once: nothing of the liar's was kept
