"""A slow disk for the chaos campaign: a FUSE passthrough whose writes take as long as asked.

python -m bench.slowfs BACKING MOUNTPOINT --control FILE

Every operation that changes the disk (create, write, flush, fsync, rename, link, unlink,
mkdir, truncate, release) sleeps for the seconds written in the control file (0 or missing:
at full speed) before it is passed to BACKING, so a worker writing its output, its commit
record or the master its manifest meets a disk that answers in hundreds of milliseconds, as
an overloaded network volume does. The control file is re-read at most every 0.2 s: the
campaign turns the slowness on and off while the job runs.

Runs in the foreground until unmounted (`fusermount -u MOUNTPOINT`). Needs /dev/fuse,
libfuse 2 (Debian: libfuse2, fuse) and fusepy; `available()` says whether all are here.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

CONTROL_READ_S = 0.2


def available() -> str | None:
    """None if a slow disk can be mounted here; else why not."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount") is None:
        return "no fusermount (Debian package fuse)"
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: fusepy finds no libfuse
        return f"fusepy or libfuse 2 missing: {e}"
    return None


def _operations(backing: str, control: Path) -> Any:
    import fuse

    class SlowPassthrough(fuse.Operations):  # type: ignore[misc]
        def __init__(self) -> None:
            self.root = os.path.realpath(backing)
            self._delay = 0.0
            self._read_at = 0.0
            self._lock = threading.Lock()

        def _full(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def _slow(self) -> None:
            now = time.monotonic()
            with self._lock:
                if now - self._read_at > CONTROL_READ_S:
                    self._read_at = now
                    try:
                        self._delay = max(0.0, float(control.read_text().strip() or 0))
                    except (OSError, ValueError):
                        self._delay = 0.0
                delay = self._delay
            if delay:
                time.sleep(delay)

        # -- reads: at full speed ----------------------------------------------------------

        def access(self, path: str, mode: int) -> None:
            if not os.access(self._full(path), mode):
                raise fuse.FuseOSError(errno.EACCES)

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.lstat(self._full(path))
            keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink")
            return {k: getattr(st, k) for k in (*keys, "st_size", "st_uid")}

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._full(path))]

        def readlink(self, path: str) -> str:
            return os.readlink(self._full(path))

        def statfs(self, path: str) -> dict[str, Any]:
            st = os.statvfs(self._full(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree")
            return {
                k: getattr(st, k) for k in (*keys, "f_files", "f_flag", "f_frsize", "f_namemax")
            }

        def open(self, path: str, flags: int) -> int:
            return os.open(self._full(path), flags)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        # -- changes: slow -------------------------------------------------------------------

        def chmod(self, path: str, mode: int) -> None:
            self._slow()
            os.chmod(self._full(path), mode)

        def chown(self, path: str, uid: int, gid: int) -> None:
            os.chown(self._full(path), uid, gid)

        def utimens(self, path: str, times: tuple[float, float] | None = None) -> None:
            os.utime(self._full(path), times)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            self._slow()
            return os.open(self._full(path), os.O_WRONLY | os.O_CREAT, mode)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            self._slow()
            return os.pwrite(fh, data, offset)

        def truncate(self, path: str, length: int, fh: int | None = None) -> None:
            self._slow()
            os.truncate(self._full(path), length)

        def flush(self, path: str, fh: int) -> None:
            self._slow()
            os.fsync(fh)

        def fsync(self, path: str, datasync: int, fh: int) -> None:
            self._slow()
            os.fsync(fh)

        def release(self, path: str, fh: int) -> None:
            os.close(fh)

        def mkdir(self, path: str, mode: int) -> None:
            self._slow()
            os.mkdir(self._full(path), mode)

        def rmdir(self, path: str) -> None:
            self._slow()
            os.rmdir(self._full(path))

        def unlink(self, path: str) -> None:
            self._slow()
            os.unlink(self._full(path))

        def rename(self, old: str, new: str) -> None:
            self._slow()
            os.rename(self._full(old), self._full(new))

        def link(self, target: str, source: str) -> None:
            # fusepy's order: `target` is the new name, `source` the existing file.
            self._slow()
            os.link(self._full(source), self._full(target))

        def symlink(self, target: str, source: str) -> None:
            os.symlink(source, self._full(target))

    return SlowPassthrough()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.slowfs", description=__doc__)
    p.add_argument("backing")
    p.add_argument("mountpoint")
    p.add_argument("--control", required=True, help="a file holding the delay in seconds")
    args = p.parse_args(argv)
    import fuse

    fuse.FUSE(
        _operations(args.backing, Path(args.control)),
        args.mountpoint,
        foreground=True,
        nothreads=False,
        allow_other=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
