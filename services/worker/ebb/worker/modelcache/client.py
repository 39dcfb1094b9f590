"""A worker's models through its node's model cache (ebb.worker.modelcache.server), or from the
store.

A model file comes into the worker's own cache folder (modelcache's layout: the blob named by
its SHA-256) from the node cache over HTTP, its bytes hashed as they arrive and checked against
the SHA-256 and length the cache announced, and against what the store itself says of the
object (its size, and its MD5 where the ETag is one), before the blob is renamed into place:
the cache has no authentication beyond the NetworkPolicy, and what it announces is only its
word. Anything else (no cache pod on the node, a refusal, an error, a short or corrupt body)
and the worker fetches the model from the store itself, as it would without a node cache: a
slower start, never a partial or wrong model.

Blocking, like modelcache: each stage process calls it while it loads its model. The stage
processes of one worker take turns by URI (a file lock), so that the first copies the model and
the others find its blob.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import secrets
import tempfile
from urllib.parse import urlencode, urlsplit

import fsspec

from ebb.common import envvars

from .store import CachedModel, ModelFetchError, fetch_model, locked, stat_model, store_md5

log = logging.getLogger(__name__)

SHA256_HEADER = "X-Ebb-Sha256"
"""The response header that names the SHA-256 of a model's bytes (hex)."""
CACHE_HEADER = "X-Ebb-Cache"
"""hit: the node cache held the model; miss: it fetched it from the store for this request."""

CONNECT_TIMEOUT_S = 5.0
"""A node without a ready cache pod drops a connection to the Service (internalTrafficPolicy
Local) rather than refuse it: a worker goes to the store after this long."""
RESPONSE_TIMEOUT_S = 900.0
"""Silence allowed on an open connection. The wait for the response's head includes the node
cache's own download of a model it lacked, which for a large model takes minutes."""

_CHUNK = 8 * 1024 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")


class NodeCacheError(Exception):
    """The node cache did not serve the model (the worker then reads it from the store)."""


def local_model(uri: str, cache_dir: str, *, cache_url: str | None) -> CachedModel:
    """The model at `uri` in `cache_dir`: through the node cache at `cache_url` when there is
    one and it serves it, from the store otherwise."""
    if cache_url:
        try:
            return fetch_through(cache_url, uri, cache_dir)
        except NodeCacheError as e:
            log.warning("the node cache did not serve %s (%s): fetching it from its store", uri, e)
    return fetch_model(uri, cache_dir)


def fetch_through(
    cache_url: str,
    uri: str,
    cache_dir: str,
    *,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    response_timeout_s: float = RESPONSE_TIMEOUT_S,
) -> CachedModel:
    """The model at `uri`, copied from the node cache at `cache_url` into `cache_dir`."""
    target = urlsplit(cache_url)
    if target.scheme != "http" or not target.hostname:
        raise NodeCacheError(f"{cache_url!r} is not an http://host:port URL")
    blobs = os.path.join(cache_dir, "blobs", "sha256")
    for sub in (blobs, os.path.join(cache_dir, "locks")):
        os.makedirs(sub, exist_ok=True)
    key = hashlib.sha256(uri.encode()).hexdigest()[:32]
    try:
        info = stat_model(uri)  # the store's own word, to check the cache's against
    except OSError as e:
        raise NodeCacheError(f"cannot stat {uri} at its store: {e}") from e
    with locked(os.path.join(cache_dir, "locks", f"node-{key}.lock")):
        conn = http.client.HTTPConnection(
            target.hostname, target.port or 80, timeout=connect_timeout_s
        )
        try:
            conn.connect()
            if conn.sock is not None:
                conn.sock.settimeout(response_timeout_s)
            conn.request("GET", f"{target.path.rstrip('/')}/models?{urlencode({'uri': uri})}")
            response = conn.getresponse()
            if response.status != 200:
                text = response.read(1000).decode(errors="replace").strip()
                raise NodeCacheError(f"{response.status} {response.reason}: {text}")
            sha, size = _announced(response)
            if size != int(info["size"]):
                raise NodeCacheError(
                    f"the cache announces {size} bytes, the store holds {info['size']}"
                )
            blob = os.path.join(blobs, sha)
            if _size(blob) == size:  # another stage process of this worker copied it
                return CachedModel(blob, sha, fetched=False)
            _receive(response, blobs, sha=sha, size=size, md5=store_md5(info))
        except (OSError, http.client.HTTPException) as e:
            raise NodeCacheError(f"{cache_url}: {type(e).__name__}: {e}") from e
        finally:
            conn.close()
    log.info("model %s copied from the node cache (%d bytes, sha256 %s)", uri, size, sha[:12])
    return CachedModel(blob, sha, fetched=True)


def _announced(response: http.client.HTTPResponse) -> tuple[str, int]:
    sha = response.getheader(SHA256_HEADER, "")
    if not _SHA256.fullmatch(sha):
        raise NodeCacheError(f"the response names no SHA-256 ({SHA256_HEADER}: {sha!r})")
    length = response.getheader("Content-Length", "")
    if not length.isdigit():
        raise NodeCacheError(f"the response has no length (Content-Length: {length!r})")
    return sha, int(length)


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _receive(
    response: http.client.HTTPResponse, blobs: str, *, sha: str, size: int, md5: str | None
) -> None:
    """The body into a temp file, renamed to its blob only once its length and hash are
    those announced, and its MD5 the store's (`md5`, where the store gives one)."""
    tmp = os.path.join(blobs, f".fetch-{secrets.token_hex(6)}")
    digest, received = hashlib.sha256(), 0
    plain = hashlib.md5(usedforsecurity=False)
    try:
        with open(tmp, "wb") as f:
            while chunk := response.read(_CHUNK):
                f.write(chunk)
                digest.update(chunk)
                plain.update(chunk)
                received += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        if received != size:
            raise NodeCacheError(f"received {received} bytes of {size}")
        if digest.hexdigest() != sha:
            raise NodeCacheError(f"the bytes received hash to {digest.hexdigest()}, not {sha}")
        if md5 is not None and plain.hexdigest() != md5:
            got = plain.hexdigest()
            raise NodeCacheError(f"the bytes received have MD5 {got}, not the store's")
        os.replace(tmp, os.path.join(blobs, sha))
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def worker_cache() -> tuple[str, str | None]:
    """This process's model cache folder and its node cache's URL (None: none), as the worker
    passes them down in the environment."""
    cache_dir = os.environ.get(envvars.MODEL_CACHE_DIR) or os.path.join(
        tempfile.gettempdir(), "ebb-model-cache"
    )
    return cache_dir, os.environ.get(envvars.MODEL_CACHE_URL)


def local_folder(uri: str, cache_dir: str, *, cache_url: str | None) -> str:
    """A local folder holding the model folder at `uri` (a Hugging Face model: config, weights,
    tokenizer files): each file as `local_model` brings it (through the node cache, checked,
    or from the store), linked under its own path in a folder named by the files' digests, as
    the Hugging Face hub's cache links its snapshots to its blobs."""
    fs, root = fsspec.core.url_to_fs(uri)
    root = root.rstrip("/")
    files = sorted(p for p in fs.find(root) if not p.rstrip("/").endswith("/"))
    if not files:
        raise ModelFetchError(f"{uri} holds no file")
    protocol = uri.split("://", 1)[0]
    blobs = {}
    for path in files:
        relative = path[len(root) :].lstrip("/")
        blobs[relative] = local_model(f"{protocol}://{path}", cache_dir, cache_url=cache_url)
    digest = hashlib.sha256(
        "".join(f"{name}\0{model.sha256}\n" for name, model in blobs.items()).encode()
    ).hexdigest()
    folder = os.path.join(cache_dir, "folders", digest[:32])
    if os.path.isdir(folder):
        return folder
    staging = f"{folder}.{secrets.token_hex(6)}"
    for name, model in blobs.items():
        link = os.path.join(staging, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(model.path, link)
    try:
        os.rename(staging, folder)  # whole, or another process's whole one is there
    except OSError:
        if not os.path.isdir(folder):
            raise
    return folder


def local_model_folder(model: str) -> str:
    """A local folder of the model: itself (a path, or `file://`), or (a folder in an object
    store) its copy in the worker's model cache, each file through the node's cache when
    there is one. Raises ModelFetchError or OSError when it cannot be fetched."""
    if "://" not in model or model.startswith("file://"):
        return model.removeprefix("file://")
    cache_dir, cache_url = worker_cache()
    return local_folder(model, cache_dir, cache_url=cache_url)
