"""The node model cache's bound: which blobs go, least recently used first, never one in use.

The cache server (ebb.worker.modelcache.server) keeps one `BlobIndex` of the blobs in its folder:
their sizes, in the order they were last asked for, how many responses hold each now (a pin), and
the room reserved for downloads under way. `evictions` is the decision, a pure function of
those values; the server deletes what the index gives up, in the same turn of its event loop,
so that no pin can arrive in between. A download starts only once its room is reserved: the
blobs, pinned or not, plus the downloads never hold more than the bound.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Container, Iterable

log = logging.getLogger(__name__)


def evictions(
    blobs: Iterable[tuple[str, int]], *, pinned: Container[str], max_bytes: int
) -> list[str]:
    """The blobs to delete so that those left hold at most `max_bytes`: from the least
    recently used on (`blobs` is in that order), never a pinned one. A pinned blob counts
    toward the total, as its bytes stay on disk while it is served: the bound may then be
    passed until it is released, when the next decision takes it back."""
    listed = list(blobs)
    total = sum(size for _, size in listed)
    chosen: list[str] = []
    for sha, size in listed:
        if total <= max_bytes:
            break
        if sha in pinned:
            continue
        chosen.append(sha)
        total -= size
    return chosen


class BlobIndex:
    """The blobs of the cache, least recently used first, with their pins."""

    def __init__(self, *, max_bytes: int, blobs: Iterable[tuple[str, int]] = ()) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, not {max_bytes}")
        self.max_bytes = max_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict(blobs)
        self._pins: Counter[str] = Counter()
        self.reserved = 0
        """Bytes of the downloads under way, each reserved before it starts."""

    @property
    def total_bytes(self) -> int:
        return sum(self._sizes.values())

    def __contains__(self, sha: object) -> bool:
        return sha in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def pin(self, sha: str, size: int, *, count: int = 1) -> None:
        """The blob is asked for: it becomes the most recently used, held `count` more
        times (a response each) until as many `unpin`s."""
        self._sizes[sha] = size
        self._sizes.move_to_end(sha)
        if count:  # a key held at 0 would read as pinned
            self._pins[sha] += count

    def unpin(self, sha: str) -> None:
        if self._pins[sha] <= 0:
            raise ValueError(f"blob {sha[:12]} is not pinned")
        self._pins[sha] -= 1
        if not self._pins[sha]:
            del self._pins[sha]

    def pins(self, sha: str) -> int:
        return self._pins[sha]

    def evict(self, *, room: int = 0) -> list[str]:
        """Forget the blobs past the bound, less the room reserved and `room` more (see
        `evictions`), and name them, for the caller to delete before it yields to anything
        that could pin them."""
        bound = max(0, self.max_bytes - self.reserved - room)
        chosen = evictions(self._sizes.items(), pinned=self._pins, max_bytes=bound)
        for sha in chosen:
            del self._sizes[sha]
        return chosen

    def fits(self, size: int) -> bool:
        """A download of `size` bytes fits beside the blobs and the downloads under way."""
        return self.total_bytes + self.reserved + size <= self.max_bytes

    def pinned_bytes(self) -> int:
        return sum(self._sizes.get(sha, 0) for sha in self._pins)


def scan(blobs_dir: str) -> list[tuple[str, int]]:
    """The blobs a cache folder holds (a server restarted beside its emptyDir finds them), the
    oldest first by the time each was written. Temp files of downloads cut short by the
    previous run (modelcache names them `.fetch-*`) are deleted: the folder is this server's
    alone, and nobody is writing them now."""
    found: list[tuple[float, str, int]] = []
    try:
        entries = list(os.scandir(blobs_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        if entry.name.startswith(".fetch-"):
            log.info("removing %s, a download cut short", entry.name)
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
            continue
        if entry.name.startswith(".") or not entry.is_file():
            continue
        stat = entry.stat()
        found.append((stat.st_mtime, entry.name, stat.st_size))
    return [(sha, size) for _, sha, size in sorted(found)]
