"""Requests from other threads to the router's thread, and the pipe that wakes it for them.

The router waits on a selector (its processes' pipes and sentinels); a request put in a plain
queue would wait there until some process spoke. So each request also writes a byte to a pipe
the selector watches, and the router empties both when it wakes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

import pyarrow as pa

from ..chunks.columns import Columns


@dataclass(frozen=True, slots=True)
class Submit:
    """Rows for the first stage(s), under uids start..start+rows-1."""

    start: int
    data: pa.RecordBatch | Columns
    rows: int


@dataclass(frozen=True, slots=True)
class Flush:
    """The input has run dry for now: stages need not wait for full batches."""


@dataclass(frozen=True, slots=True)
class Cancel:
    """Nobody waits for uids start..start+rows-1 any more."""

    start: int
    rows: int


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop every process (each finishes what it holds, for up to grace_s) and the thread."""

    grace_s: float


Request = Submit | Flush | Cancel | Stop
"""What another thread may ask of the router."""


class Mailbox:
    def __init__(self, ctx: BaseContext) -> None:
        self._requests: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def bell(self) -> Connection:
        """What the router's selector watches: readable while a request may wait."""
        conn: Connection = self._wake_r
        return conn

    def post(self, request: Request) -> None:
        """From any thread: a request for the router."""
        self._requests.put(request)
        with self._lock:
            if not self._closed:  # stopped: a request now has nobody to wake
                self._wake_w.send_bytes(b"")

    def silence(self) -> None:
        """The router woke: empty the bell."""
        while self._wake_r.poll():
            self._wake_r.recv_bytes()

    def take(self) -> Iterator[Request]:
        """The requests that wait, oldest first."""
        while True:
            try:
                yield self._requests.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake_r.close()
            self._wake_w.close()
