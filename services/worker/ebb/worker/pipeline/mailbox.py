"""Requests from other threads to the router's thread, and the pipe that wakes it for them.

The router waits on a selector (its processes' pipes and sentinels); a request put in a plain
queue would wait there until some process spoke. So each request also writes a byte to a pipe
the selector watches, and the router empties both when it wakes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any


class Mailbox:
    def __init__(self, ctx: Any) -> None:
        self._requests: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def bell(self) -> Connection:
        """What the router's selector watches: readable while a request may wait."""
        conn: Connection = self._wake_r
        return conn

    def post(self, *request: Any) -> None:
        """From any thread: a request for the router (its kind first, then its arguments)."""
        self._requests.put(request)
        with self._lock:
            if not self._closed:  # stopped: a request now has nobody to wake
                self._wake_w.send_bytes(b"")

    def silence(self) -> None:
        """The router woke: empty the bell."""
        while self._wake_r.poll():
            self._wake_r.recv_bytes()

    def take(self) -> Iterator[tuple[Any, ...]]:
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
