"""The body of one stage process: receive items, batch them, run the modelet, send results.

One thread reads the inbox pipe without pause (so the router never blocks on a busy stage);
the main thread assembles batches and runs them. A failing batch is bisected until each
failing item stands alone: only those items become errors. The batch board (shared memory)
tells the router what runs now and since when, so that it can kill a stage that hangs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pyarrow as pa

from ebb.common.spec import StageSpec

from . import frames
from .batcher import AdaptiveBatchSize, Batcher, Item
from .modelet import batch_callable, build_stage
from .reader import table_rows
from .shm import Arena

EXIT_SETUP_FAILED = 3
_MAX_ERROR_CHARS = 2000


class BatchBoard:
    """Shared memory where a stage process posts the batch it is running: when it started,
    and which uids are in it. The router reads it to kill an overdue batch, and to know,
    when a process dies, which of the items it held were in the batch that killed it."""

    def __init__(self, ctx: Any, capacity: int) -> None:
        self._started = ctx.Value("d", 0.0, lock=False)
        self._count = ctx.Value("i", 0, lock=False)
        self._uids = ctx.Array("q", capacity, lock=False)
        self._busy = ctx.Value("d", 0.0, lock=False)

    def post(self, uids: list[int]) -> None:
        n = min(len(uids), len(self._uids))
        self._uids[:n] = uids[:n]
        self._count.value = n
        self._started.value = time.monotonic()  # last: a reader seeing it sees the uids

    def clear(self) -> None:
        started = self._started.value
        if started:
            self._busy.value += time.monotonic() - started
        self._started.value = 0.0

    def busy_seconds(self, now: float) -> float:
        """Seconds spent running batches since the process started (the running one too)."""
        started = self._started.value
        return float(self._busy.value) + (now - started if started else 0.0)

    @property
    def started(self) -> float:
        """When the running batch started (monotonic, system-wide); 0.0 when idle."""
        return float(self._started.value)

    def running(self) -> list[int]:
        """The uids of the running batch; empty when idle."""
        if not self._started.value:
            return []
        return list(self._uids[: self._count.value])


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    spec: StageSpec
    code_paths: list[str]
    memory_limit_bytes: int | None = None


def _die_with_parent() -> None:
    """Linux: be killed if the worker that spawned us dies, even by SIGKILL."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def _checked(out: Any, expected: int) -> list[Any]:
    if not isinstance(out, list) or len(out) != expected:
        got = len(out) if isinstance(out, list) else type(out).__name__
        raise TypeError(f"returned {got} outputs for {expected} inputs")
    return out


def stage_main(
    config: StageConfig, inbox: Connection, outbox: Connection, board: BatchBoard
) -> None:
    """Entry point of a stage process (spawned by the pipeline router)."""
    _die_with_parent()
    # Ctrl-C goes to the whole process group; the worker decides when its stages stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name = config.spec.name
    try:
        modelet = build_stage(config.spec, code_paths=config.code_paths)
        setup = getattr(modelet, "setup", None)
        if callable(setup):
            setup()
        run = batch_callable(modelet, config.spec.modelet or config.spec.model or name)
    except BaseException as e:  # noqa: BLE001 - whatever user code raises, even SystemExit
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        outbox.send_bytes(frames.pack(frames.SETUP_FAILED, payload=f"stage {name!r}: {detail}"))
        outbox.close()
        sys.exit(EXIT_SETUP_FAILED)
    outbox.send_bytes(frames.pack(frames.READY, payload=os.getpid()))
    StageLoop(config, run, inbox, outbox, board).run()


class StageLoop:
    def __init__(
        self,
        config: StageConfig,
        run: Any,
        inbox: Connection,
        outbox: Connection,
        board: BatchBoard,
    ) -> None:
        self.name = config.spec.name
        self.run_batch = run
        self.memory_limit = config.memory_limit_bytes
        self.outbox = outbox
        self.board = board
        self.batcher = Batcher(max_size=config.spec.batch_size, max_wait_s=config.spec.batch_wait_s)
        self.sizer = (
            AdaptiveBatchSize(max_size=config.spec.batch_size)
            if config.spec.adaptive_batch
            else None
        )
        if self.sizer is not None:
            self.batcher.max_size = self.sizer.size
        self.messages: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.arena = Arena()
        self.reader = threading.Thread(target=self._read, args=(inbox,), daemon=True)
        self.stopping = False
        self.recycling = False
        self.fanout = config.spec.fanout
        self._counts: list[int] = []

    def _read(self, inbox: Connection) -> None:
        try:
            while True:
                self.messages.put(inbox.recv_bytes())
        except (EOFError, OSError):
            self.messages.put(None)  # the worker is gone, or closed our inbox

    def run(self) -> None:
        self.reader.start()
        while True:
            timeout = self.batcher.time_left(time.monotonic())
            if self.stopping:
                timeout = 0.0
            try:
                message = self.messages.get(timeout=timeout)
            except queue.Empty:
                message = b""
            # Take everything already delivered before deciding on a batch: a full batch
            # that is already here must not wait.
            while message is not None:
                if message:
                    self._handle(message)
                try:
                    message = self.messages.get_nowait()
                except queue.Empty:
                    break
            if message is None:
                self.stopping = True
            if self.stopping:
                self.batcher.flush()
            while self.batcher.ready(time.monotonic()):
                batch = self.batcher.take()
                self._run(batch)
                segments = Counter(i.segment for i in batch if i.segment)
                del batch  # the last references to views of shared memory, before unmapping
                for segment, n in segments.items():
                    self.arena.done(segment, n)
                self._check_memory()
            if self.stopping and not len(self.batcher):
                self.arena.close()
                self.outbox.close()
                return

    def _handle(self, message: bytes) -> None:
        h = frames.header(message)
        if h.kind == frames.ITEMS:
            values = frames.payload(message, arena=self.arena)
            if h.flags & frames.ARROW:
                schema, data = values
                values = table_rows(pa.ipc.read_record_batch(pa.py_buffer(data), schema), None)
            solo = bool(h.flags & frames.SOLO)
            self.batcher.add(h.uids, values, time.monotonic(), solo=solo, segment=h.segment)
        elif h.kind == frames.RECLAIM:
            for name in frames.payload(message):
                self.arena.reclaim(name)
        elif h.kind == frames.FLUSH:
            self.batcher.flush()
        elif h.kind == frames.STOP:
            self.stopping = True

    def _run(self, batch: list[Item]) -> None:
        if not batch:
            return
        solo = len(batch) == 1 and batch[0].solo
        self.board.post([i.uid for i in batch])
        started = time.perf_counter()
        try:
            ok_uids, ok_values, failed = self._isolate(
                [i.uid for i in batch], [i.value for i in batch]
            )
        finally:
            self.board.clear()
        if self.sizer is not None and not solo:
            self.batcher.max_size = self.sizer.observe(len(batch), time.perf_counter() - started)
        if ok_uids and self.fanout:
            ok_uids, ok_values, not_lists = self._fan_out(ok_uids, ok_values)
            failed += not_lists
        if ok_uids:
            flags = frames.SOLO if solo else 0
            try:
                message = frames.pack(
                    frames.ITEMS, ok_uids, ok_values, flags=flags, arena=self.arena
                )
                if self.fanout:
                    message = frames.splice(message, frames.FANOUT, ok_uids + self._counts)
            except Exception:  # noqa: BLE001 - some output cannot be pickled: find which
                message, unsendable = self._pack_each(ok_uids, ok_values, flags)
                failed += unsendable
            if message:
                self.outbox.send_bytes(message)
        if failed:
            self.outbox.send_bytes(
                frames.pack(frames.ERRORS, [u for u, _ in failed], [m for _, m in failed])
            )

    def _fan_out(
        self, uids: list[int], values: list[Any]
    ) -> tuple[list[int], list[Any], list[tuple[int, str]]]:
        """A fan-out stage's lists, flattened; the part counts go to `_counts`."""
        kept: list[int] = []
        parts: list[Any] = []
        failed: list[tuple[int, str]] = []
        self._counts = []
        for uid, value in zip(uids, values, strict=True):
            if isinstance(value, list | tuple):
                kept.append(uid)
                self._counts.append(len(value))
                parts.extend(value)
            else:
                kind = type(value).__name__
                problem = f"stage {self.name!r} fans out: it must return a list, not {kind}"
                failed.append((uid, problem))
        return kept, parts, failed

    def _pack_each(
        self, uids: list[int], values: list[Any], flags: int
    ) -> tuple[bytes, list[tuple[int, str]]]:
        """Pack the outputs that can be sent; the others fail their own items."""
        good_uids: list[int] = []
        good_values: list[Any] = []
        failed: list[tuple[int, str]] = []
        for uid, value in zip(uids, values, strict=True):
            try:
                frames.pack(frames.ITEMS, [uid], [value])
            except Exception as e:  # noqa: BLE001 - any pickling failure is this item's
                failed.append((uid, f"stage {self.name!r}: output cannot be sent: {_describe(e)}"))
            else:
                good_uids.append(uid)
                good_values.append(value)
        packed = (
            frames.pack(frames.ITEMS, good_uids, good_values, flags=flags, arena=self.arena)
            if good_uids
            else b""
        )
        return packed, failed

    def _isolate(
        self, uids: list[int], values: list[Any]
    ) -> tuple[list[int], list[Any], list[tuple[int, str]]]:
        """Run a batch; if it raises, bisect it so that only the failing items fail."""
        try:
            out = _checked(self.run_batch(values), len(values))
        except Exception as e:  # noqa: BLE001 - user code: any failure fails only its items
            if len(values) == 1:
                return [], [], [(uids[0], f"stage {self.name!r}: {_describe(e)}")]
        else:
            return uids, out, []
        mid = len(values) // 2
        left = self._isolate(uids[:mid], values[:mid])
        right = self._isolate(uids[mid:], values[mid:])
        return left[0] + right[0], left[1] + right[1], left[2] + right[2]

    def _check_memory(self) -> None:
        if self.memory_limit is None or self.recycling:
            return
        import psutil

        if psutil.Process().memory_info().rss > self.memory_limit:
            # Between batches, nothing half done: ask the router to stop feeding us, finish
            # what we hold, and exit; the router starts a fresh process in our place.
            self.recycling = True
            self.outbox.send_bytes(frames.pack(frames.RECYCLE))
