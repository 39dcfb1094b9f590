"""How a stage process is tied to its worker, and how it shows in `top`: Linux process
controls (prctl, pidfd), each a no-op where the platform lacks it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading


def die_with_parent() -> None:
    """Linux: be killed if our parent dies, even by SIGKILL. The parent is the fork server,
    which leaves when no process of the worker's is left to use it (see die_with_worker)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def name_this_thread(name: str) -> None:
    """Linux: the name `top`, `ps -L` and /proc show for the calling thread (the first 15
    bytes): a stage process shows as `ebb:<stage>`, not as one more `python`."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def die_with_worker(pid: int | None) -> None:
    """Leave as soon as the worker that started us is gone, even while user code hangs.

    The fork server (our parent) leaves once every holder of its lifeline is gone, and each
    process it forks holds one: a stage hung in user code when its worker was SIGKILLed kept
    the server, and so itself, alive for good. A thread waits on the worker's pidfd (Linux
    5.3+) instead; a healthy stage would notice the closed pipe anyway."""
    if pid is None or not hasattr(os, "pidfd_open"):
        return
    try:
        lifeline = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)  # gone already
    except OSError:
        return  # no pidfds here: the pipe and the parent-death signal remain

    def wait_for_the_worker() -> None:
        select.select([lifeline], [], [])  # readable once the worker has exited
        os._exit(0)

    threading.Thread(target=wait_for_the_worker, name="ebb-stage-lifeline", daemon=True).start()
