"""Shared-memory segments for the large buffers in frames (tensors, images).

Pushing a 37 KB tensor through two pipes (stage -> router -> stage) costs more than running a
model on it. Large buffers therefore travel out of band: the producer pickles with protocol 5,
puts the array buffers of a frame into one shared-memory segment (a file in /dev/shm, mapped),
and sends only the segment's name and the buffers' places in it. The consumer maps the
segment and unpickles arrays that are views of it: no copy until the model stacks its batch.

Who frees what:
- the consumer unmaps a segment when every row of its frame has been processed, and tells the
  router so (or dies, which tells the router as much);
- the router then hands the segment back to its producer (`reclaim`), which keeps it,
  mapped and with its pages already in memory, for a later frame: creating and faulting in
  fresh shared memory for every frame costs more than the copy into it. Segments whose
  producer is gone are unlinked. Segments of a worker that died are swept by the next worker
  on the machine (their names carry the creator's pid).
Plain files and mmap rather than multiprocessing.shared_memory, whose resource tracker would
unlink segments at the exit of whichever process touched them first (before Python 3.13).
Without /dev/shm (not Linux), every buffer simply stays in the pipes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re

log = logging.getLogger(__name__)

PREFIX = "ebb"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-\d+$")
SHM_DIR = "/dev/shm"  # noqa: S108 - where Linux keeps POSIX shared memory
AVAILABLE = os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class Arena:
    """This process's view of the segments: the ones it creates, the ones it has mapped."""

    def __init__(self, *, min_bytes: int = 64 * 1024, pool_bytes: int = 64 * 2**20) -> None:
        self.min_bytes = min_bytes if AVAILABLE else 1 << 62
        """Frames with fewer out-of-band bytes than this stay in the pipe (a segment costs a
        few system calls: worth it for megabytes, not for a handful of small arrays)."""
        self._counter = itertools.count()
        self._mapped: dict[str, tuple[mmap.mmap, int]] = {}
        self._closing: list[mmap.mmap] = []
        self._owned: dict[str, mmap.mmap] = {}
        """Segments this process created and has not unlinked: in flight or free."""
        self._free: list[str] = []
        self.pool_bytes = pool_bytes

    def store(self, buffers: list[memoryview]) -> tuple[str, list[tuple[int, int]]]:
        """Copy `buffers` into a segment (a free one if one is big enough). Returns its name
        and each buffer's place."""
        total = sum(b.nbytes for b in buffers)
        name = self._take_free(total) or self._create(total)
        memory = self._owned[name]
        places = []
        offset = 0
        for b in buffers:
            flat = b.cast("B")
            memory[offset : offset + flat.nbytes] = flat
            places.append((offset, flat.nbytes))
            offset += flat.nbytes
        return name, places

    def _take_free(self, size: int) -> str | None:
        best = None
        for name in self._free:
            capacity = len(self._owned[name])
            if capacity >= size and (best is None or capacity < len(self._owned[best])):
                best = name
        if best is not None:
            self._free.remove(best)
        return best

    def _create(self, size: int) -> str:
        # Rounded up to a power of two, so that a segment fits the frames that come after.
        capacity = max(1 << max(size - 1, 1).bit_length(), 64 * 1024)
        name = f"{PREFIX}-{os.getpid()}-{next(self._counter)}"
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, capacity)
            # Fault every page in at once: page by page, on first touch, costs more.
            self._owned[name] = mmap.mmap(fd, capacity, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        return name

    def reclaim(self, name: str) -> None:
        """A segment of ours that nobody reads any more: keep it for reuse (within the pool's
        size), or let it go."""
        if name not in self._owned:
            unlink(name)
            return
        pooled = sum(len(self._owned[n]) for n in self._free)
        if pooled + len(self._owned[name]) <= self.pool_bytes:
            self._free.append(name)
        else:
            self._owned.pop(name).close()
            unlink(name)

    def owns(self, name: str) -> bool:
        return name in self._owned

    def views(self, name: str, places: list[tuple[int, int]], items: int) -> list[memoryview]:
        """Views of a segment's buffers; it stays mapped until `done` for `items` items."""
        if name in self._mapped:
            memory, pending = self._mapped[name]
        else:
            fd = os.open(_path(name), os.O_RDWR)
            try:
                memory = mmap.mmap(fd, os.fstat(fd).st_size, flags=_MAP_FLAGS)
            finally:
                os.close(fd)
            pending = 0
        self._mapped[name] = (memory, pending + items)
        whole = memoryview(memory)
        return [whole[offset : offset + length] for offset, length in places]

    def done(self, name: str, items: int) -> bool:
        """`items` rows of segment `name` are processed; unmap it once all of them are.
        True when that happened (nobody here reads the segment any more)."""
        if name not in self._mapped:
            return False
        memory, pending = self._mapped[name]
        if pending - items > 0:
            self._mapped[name] = (memory, pending - items)
            return False
        del self._mapped[name]
        self._closing.append(memory)
        self.sweep()
        return True

    def sweep(self) -> None:
        """Unmap what can be: a mapping with views still alive (an array a user modelet kept,
        say) waits for the garbage collector and the next sweep."""
        still = []
        for memory in self._closing:
            try:
                memory.close()
            except BufferError:
                still.append(memory)
        self._closing = still

    def close(self) -> None:
        """Unmap everything; unlink the free segments (those in flight are the router's)."""
        for memory, _ in self._mapped.values():
            self._closing.append(memory)
        self._mapped.clear()
        for name in self._free:
            self._owned.pop(name).close()
            unlink(name)
        self._free.clear()
        for memory in self._owned.values():
            self._closing.append(memory)
        self._owned.clear()
        self.sweep()


def unlink(name: str) -> None:
    """Remove a segment's name (its memory goes once every mapping is closed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(name))


def remove_all_of(pid: int, *, keep: set[str]) -> int:
    """Unlink the segments process `pid` made (it has exited), but those in `keep`."""
    if not AVAILABLE:
        return 0
    removed = 0
    for name in os.listdir(SHM_DIR):
        m = _NAME.match(name)
        if m is not None and int(m.group(1)) == pid and name not in keep:
            with contextlib.suppress(OSError):
                os.unlink(_path(name))
                removed += 1
    return removed


def sweep_orphans() -> int:
    """Remove segments whose creating process is gone (a worker that was SIGKILLed)."""
    if not AVAILABLE:
        return 0
    removed = 0
    for name in os.listdir(SHM_DIR):
        m = _NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            os.unlink(_path(name))
            removed += 1
    return removed
