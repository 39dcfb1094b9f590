"""The bytes of the gateway's files, in its root (a folder or an object store, through fsspec).

Every file is written whole or not at all (a local file under a temporary name, renamed when
complete; an object store's upload completed when closed), and streamed in and out in pieces:
the gateway never holds a file in memory. Blocking calls run in threads."""

from __future__ import annotations

import asyncio
import os
import posixpath
import secrets
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ebb.common.data.storage import retrying

PIECE = 1024 * 1024
"""Bytes read or written at a time."""


@dataclass(frozen=True)
class Oversize:
    """A line too long to be read: its length, without its newline."""

    bytes: int


def split_lines(pieces: Iterable[bytes], *, max_bytes: int) -> Iterator[bytes | Oversize]:
    """Lines out of pieces of bytes, holding no more than `max_bytes` of one line (a hostile
    file of one 200 MB line costs a piece, not 200 MB and the parse of it)."""
    held = bytearray()
    dropped = 0
    """Bytes of the current line read past and let go (it is too long)."""
    for piece in pieces:
        start = 0
        while (end := piece.find(b"\n", start)) >= 0:
            part = piece[start : end + 1]
            start = end + 1
            if dropped or len(held) + len(part) - 1 > max_bytes:
                yield Oversize(dropped + len(held) + len(part) - 1)
            elif held:
                yield bytes(held) + part
            else:
                yield part
            held.clear()
            dropped = 0
        rest = piece[start:]
        if dropped or len(held) + len(rest) > max_bytes:
            dropped += len(held) + len(rest)
            held.clear()
        else:
            held += rest
    if dropped:
        yield Oversize(dropped)
    elif held:
        yield bytes(held)


class FileStore:
    def __init__(self, root: str) -> None:
        self.uri = root.rstrip("/")
        fs, path = fsspec.core.url_to_fs(self.uri)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = path.rstrip("/")
        self.local = isinstance(fs, LocalFileSystem)

    def full(self, relpath: str) -> str:
        return posixpath.join(self.root, relpath)

    def url(self, relpath: str) -> str:
        """What a job spec names: the root's URI and the path under it."""
        return f"{self.uri}/{relpath}"

    def writer(self, relpath: str) -> Writer:
        return Writer(self, relpath)

    def read_lines(self, relpath: str) -> Iterator[bytes]:
        """The file's lines, each with its newline (the last may lack one): a file the
        gateway wrote itself. Blocking."""
        with self.fs.open(self.full(relpath), "rb", block_size=PIECE) as f:
            yield from f

    def read_bounded_lines(self, relpath: str, *, max_bytes: int) -> Iterator[bytes | Oversize]:
        """A user's file, line by line as `read_lines`, but a line longer than `max_bytes`
        (its newline not counted) is never held: its `Oversize` comes instead, once it has
        been read past. Blocking."""
        with self.fs.open(self.full(relpath), "rb", block_size=PIECE) as f:
            yield from split_lines(iter(lambda: f.read(PIECE), b""), max_bytes=max_bytes)

    async def pieces(self, relpath: str) -> AsyncIterator[bytes]:
        """The file's bytes, a piece at a time."""
        f: IO[bytes] = await asyncio.to_thread(self.fs.open, self.full(relpath), "rb")
        try:
            while piece := await asyncio.to_thread(f.read, PIECE):
                yield piece
        finally:
            await asyncio.to_thread(f.close)

    def remove_temporaries(self, *, older_than_s: float) -> list[str]:
        """Remove what writers left that never completed (`<name>.tmp-<random>`, untouched
        for `older_than_s`), and say which. Only a local root has them: an object store's
        upload appears whole when closed, or not at all. Blocking."""
        if not self.local:
            return []
        removed = []
        cutoff = time.time() - older_than_s
        for folder, _, names in os.walk(self.root):
            for name in names:
                if ".tmp-" not in name:
                    continue
                path = os.path.join(folder, name)
                try:
                    if os.stat(path).st_mtime < cutoff:
                        os.unlink(path)
                        removed.append(os.path.relpath(path, self.root))
                except FileNotFoundError:
                    continue  # its writer finished meanwhile
        return removed

    def exists(self, relpath: str) -> bool:
        path = self.full(relpath)
        self.fs.invalidate_cache(path)
        return bool(retrying(f"stat {self.url(relpath)}", lambda: self.fs.exists(path)))

    def delete(self, relpath: str, *, recursive: bool = False) -> None:
        """Remove a file (or a folder, `recursive`); one that is not there is no error."""
        path = self.full(relpath)
        try:
            retrying(f"delete {self.url(relpath)}", lambda: self.fs.rm(path, recursive=recursive))
        except FileNotFoundError:
            pass


class Writer:
    """A file being written: `write` pieces, then `commit` (it appears whole) or `abort`."""

    def __init__(self, store: FileStore, relpath: str) -> None:
        self.store = store
        self.relpath = relpath
        self.path = store.full(relpath)
        self.bytes = 0
        self._target = f"{self.path}.tmp-{secrets.token_hex(4)}" if store.local else self.path
        if store.local:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._file: Any = store.fs.open(self._target, "wb")

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self.bytes += len(data)

    def tell(self) -> int:
        return self.bytes

    def flush(self) -> None:
        """Nothing to do: `commit` makes the file durable."""

    @property
    def closed(self) -> bool:
        return False

    def commit(self) -> None:
        if self.store.local:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._target, self.path)
        else:
            self._file.close()  # an object store's upload completes here, whole

    def abort(self) -> None:
        discard = getattr(self._file, "discard", None)
        if not self.store.local and callable(discard):
            discard()  # an object store's multipart upload, abandoned
        try:
            self._file.close()
        finally:
            if self.store.local:
                try:
                    os.unlink(self._target)
                except FileNotFoundError:
                    pass

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
