"""Files written durably on a local disk: complete before they are visible (temp file, fsync,
rename or link), and a full disk waited out rather than failed."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


FULL_DISK_WAIT_S = 120.0
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})


def waiting_for_room(
    what: str,
    write: Callable[[], None],
    *,
    wait_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Run a local write; while it finds the disk full (or over quota), wait for room and run
    it again, up to `wait_s`. A disk that fills for a while (another job's output, logs,
    a node's image cache) is nobody's shard's fault: its attempt waits instead of failing,
    and a disk full for good still fails it, with the system's words. Blocking: callers run
    it in a thread."""
    deadline = time.monotonic() + wait_s
    delay = 0.1
    while True:
        try:
            write()
            return
        except OSError as e:
            if e.errno not in _NO_ROOM or time.monotonic() + delay > deadline:
                raise
            log.warning("%s: %s; waiting for room (%.1fs)", what, e.strerror or e, delay)
            sleep(delay)
            delay = min(2.0, delay * 2)


def write_new(path: str, data: bytes, *, wait_s: float) -> None:
    """`data` in a new local file at `path`, on disk (fsynced) when this returns, and nothing
    at `path` if it fails; a full disk is waited out for up to `wait_s`."""

    def write() -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            unlink_quietly(path)
            raise

    waiting_for_room(f"write {path}", write, wait_s=wait_s)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
