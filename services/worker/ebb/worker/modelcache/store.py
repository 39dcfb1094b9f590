"""Model files from a store, fetched once per node into a local content-addressed cache.

    <cache>/blobs/sha256/<hex>      a model file, named by the SHA-256 of its bytes
    <cache>/refs/<key>.json         which blob a store object (URI + ETag/size/mtime) holds
    <cache>/locks/<key>.lock        held while that object is fetched

The processes that share a cache folder (EBB_MODEL_CACHE_DIR: a worker's stage processes, the
workers of one machine; on Kubernetes the node's cache server, ebb.worker.modelcache.server) share
its files. The first to need an object takes its lock and downloads it to a temp file in the cache,
hashing as it writes; the size (and, where the store gives a plain MD5 ETag, the MD5) is
checked against the store's; then the blob gets its name by an atomic rename, and the ref
after it. The others wait on the lock and find the ref. A blob is never partial (rename), never
mistaken (its name is its hash, verified on every reuse by size, and at fetch by content), and
a changed object (new ETag) is a new key: fetched again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec

from ebb.common.data.storage import retrying

log = logging.getLogger(__name__)

_CHUNK = 8 * 1024 * 1024


class ModelFetchError(Exception):
    """The model cannot be fetched, or what was fetched is not what the store holds."""


class ModelMissing(ModelFetchError):
    """The store holds no object at that URI."""


@dataclass(frozen=True)
class CachedModel:
    path: str
    """The local file: a blob of the cache."""
    sha256: str
    fetched: bool
    """True if this call downloaded it; False if it was in the cache already."""


def _key(uri: str, info: dict[str, Any]) -> str:
    version = [str(info.get(k, "")) for k in ("ETag", "etag", "size", "LastModified", "mtime")]
    return hashlib.sha256("\n".join([uri, *version]).encode()).hexdigest()[:32]


@contextmanager
def locked(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if we die holding it
        yield
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _cached(cache_dir: str, ref: str, size: int) -> tuple[str, str] | None:
    """(blob path, sha256) if the ref names a blob of the expected size."""
    try:
        with open(ref) as f:
            sha = str(json.load(f)["sha256"])
    except (OSError, ValueError, KeyError):
        return None
    blob = os.path.join(cache_dir, "blobs", "sha256", sha)
    try:
        if os.path.getsize(blob) == size:
            return blob, sha
    except OSError:
        pass
    return None


def stat_model(uri: str) -> dict[str, Any]:
    """What the store says of the object at `uri` (size, ETag...): ModelMissing if none."""
    fs, path = fsspec.core.url_to_fs(uri)

    def stat() -> dict[str, Any]:
        fs.invalidate_cache(path)
        info: dict[str, Any] = fs.info(path)
        return info

    try:
        return retrying(f"stat {uri}", stat)
    except FileNotFoundError:
        raise ModelMissing(f"model {uri} does not exist") from None


def cached_model(uri: str, cache_dir: str, info: dict[str, Any]) -> CachedModel | None:
    """The blob holding the version of `uri` that `info` describes, if the cache has it."""
    ref = os.path.join(cache_dir, "refs", f"{_key(uri, info)}.json")
    found = _cached(cache_dir, ref, int(info["size"]))
    return CachedModel(found[0], found[1], fetched=False) if found is not None else None


def store_md5(info: dict[str, Any]) -> str | None:
    """The MD5 of the object's bytes where the store gives it: a single-part upload's ETag
    (a multipart one has a dash, and is no digest of the bytes)."""
    etag = str(info.get("ETag", info.get("etag", ""))).strip('"')
    return etag if len(etag) == 32 and "-" not in etag else None


def fetch_model(uri: str, cache_dir: str) -> CachedModel:
    """A local path holding the bytes of the model at `uri`, fetched at most once per cache."""
    fs, path = fsspec.core.url_to_fs(uri)
    info = stat_model(uri)
    size = int(info["size"])
    key = _key(uri, info)
    for sub in ("blobs/sha256", "refs", "locks"):
        os.makedirs(os.path.join(cache_dir, sub), exist_ok=True)
    ref = os.path.join(cache_dir, "refs", f"{key}.json")
    found = _cached(cache_dir, ref, size)
    if found is not None:
        return CachedModel(found[0], found[1], fetched=False)
    with locked(os.path.join(cache_dir, "locks", f"{key}.lock")):
        found = _cached(cache_dir, ref, size)  # another worker fetched it while we waited
        if found is not None:
            return CachedModel(found[0], found[1], fetched=False)
        blob, sha = retrying(
            f"fetch {uri}",
            lambda: _download(fs, path, uri, cache_dir, info),
            passthrough=(ModelFetchError,),
        )
        _write_atomic(ref, json.dumps({"uri": uri, "sha256": sha, "size": size}).encode())
    log.info("model %s fetched into the cache (%d bytes, sha256 %s)", uri, size, sha[:12])
    return CachedModel(blob, sha, fetched=True)


def _download(
    fs: fsspec.AbstractFileSystem, path: str, uri: str, cache_dir: str, info: dict[str, Any]
) -> tuple[str, str]:
    blobs = os.path.join(cache_dir, "blobs", "sha256")
    tmp = os.path.join(blobs, f".fetch-{secrets.token_hex(6)}")
    sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    try:
        with fs.open(path, "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
                sha.update(chunk)
                md5.update(chunk)
                size += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        expected = int(info["size"])
        if size != expected:
            raise ModelFetchError(f"model {uri}: read {size} bytes, the store holds {expected}")
        etag = store_md5(info)
        if etag is not None and etag != md5.hexdigest():
            raise ModelFetchError(f"model {uri}: MD5 {md5.hexdigest()} is not its ETag {etag}")
        blob = os.path.join(blobs, sha.hexdigest())
        os.replace(tmp, blob)
        return blob, sha.hexdigest()
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
