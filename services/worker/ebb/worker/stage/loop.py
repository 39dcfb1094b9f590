"""The body of one stage process: receive chunks of rows, batch them, run the modelet, send
results.

One thread reads the inbox pipe without pause (so the router never blocks on a busy stage);
the main thread cuts batches from the chunks and runs them, a batch at a time, as columns (an
llm stage fed by a server runs two at once, each on a thread of its own, so that the server
has the next batch's rows before the last of one finish: `concurrent_batches`).
A failing batch is bisected until each failing row stands alone: only those rows become
errors. The batch board (shared memory) tells the router what runs now and since when, so that
it can kill a stage that hangs. The outputs of batches run back to back go back together, as
one message (the router's cost is per message), unless a batch is slow. The loop, its
batches' outcomes and their bisection are one module (past 500 lines since batches may run
two at once): each step reads the state the one before left, and the serial and concurrent
paths share `_compute` and `_outcome`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, assert_never

import numpy as np
import pyarrow as pa

from ebb.common.job import StageSpec

from ..chunks import frames
from ..chunks.columns import (
    ROW_ERROR,
    VALUE,
    Columns,
    concat,
    from_arrow,
    from_rows,
    split_metrics,
    take,
    to_rows,
)
from ..chunks.frames import Kind
from ..chunks.shm import Arena
from ..llm.stage import LLMStage
from ..modelets.api import StageError, columns_callable, resolve_class, rows_callable
from ..modelets.multimodel import MultiModelStage
from ..modelets.runtimes import load_runtime
from .batcher import AdaptiveBatchSize, Batch, Batcher, row_lengths
from .board import BatchBoard
from .lifeline import die_with_parent, die_with_worker, name_this_thread
from .metering import MetricFailure, with_metrics

EXIT_SETUP_FAILED = 3
_MAX_ERROR_CHARS = 2000
_OUTPUT_ROWS = 4096
"""Rows of outputs sent in one message at most: the outputs of batches run back to back go
to the router together (its cost is per message: a default batch of 32 rows sent on its own
made the worker's router spend a quarter of a light model's CPU)."""
_OUTPUT_WAIT_S = 0.05
"""Longest an output waits for the next batch's to go with it: a slow batch's is sent alone,
so that the next stage and the job's progress never wait on a stage's later batches."""


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    spec: StageSpec
    code_paths: list[str]
    memory_limit_bytes: int | None = None
    environment: dict[str, str] | None = None
    """The worker's environment when it started this process. A stage process is forked
    from a server that started with the worker: without this it would see the environment of
    then, not of now (credentials or a store's endpoint the worker set since)."""
    worker_pid: int | None = None
    """The worker that started this process: when it is gone, so is this process."""


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def _row_errors(
    uids: np.ndarray, out: Any, stage: str
) -> tuple[list[tuple[np.ndarray, Any]], list[tuple[int, str]]]:
    """A batch's output less the rows its modelet said failed (its ROW_ERROR column), and
    those rows with their reasons."""
    if not isinstance(out, dict) or ROW_ERROR not in out:
        return [(uids, out)], []
    reasons = out.pop(ROW_ERROR)
    bad = np.array([r is not None for r in reasons], dtype=bool)
    failed = [
        (int(u), f"stage {stage!r}: {r}") for u, r in zip(uids[bad], reasons[bad], strict=True)
    ]
    if bad.all():
        return [], failed
    return [(uids[~bad], take(out, ~bad))], failed


def build_stage(spec: StageSpec, *, code_paths: list[str]) -> Any:
    """Instantiate a stage's modelet (user class or model runtime). Not yet set up."""
    for path in reversed(code_paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    if spec.model is not None:
        return load_runtime(spec)
    if spec.models is not None:
        return MultiModelStage(spec)
    if spec.llm is not None:
        return LLMStage(spec)
    assert spec.modelet is not None
    cls = resolve_class(spec.modelet)
    try:
        return cls(**spec.params)
    except Exception as e:
        raise StageError(f"{spec.modelet}(**params) failed: {type(e).__name__}: {e}") from e


def stage_main(
    config: StageConfig, inbox: Connection, outbox: Connection, board: BatchBoard
) -> None:
    """Entry point of a stage process (spawned by the pipeline router)."""
    die_with_parent()
    die_with_worker(config.worker_pid)
    if config.environment is not None:
        os.environ.clear()
        os.environ.update(config.environment)
    # Ctrl-C goes to the whole process group; the worker decides when its stages stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name = config.spec.name
    name_this_thread(f"ebb:{name}")
    try:
        modelet = build_stage(config.spec, code_paths=config.code_paths)
        setup = getattr(modelet, "setup", None)
        if callable(setup):
            setup()
        label = config.spec.modelet or config.spec.model or name
        # A fan-out stage returns a list of parts per row: it runs on rows, not columns.
        run_rows = rows_callable(modelet, label) if config.spec.fanout else None
        run = None if config.spec.fanout else columns_callable(modelet, label)
        set_threads = getattr(modelet, "set_threads", None)
        at_once = 1 if config.spec.fanout else int(getattr(modelet, "concurrent_batches", 1))
        set_progress = getattr(modelet, "set_progress", None)
        if callable(set_progress):
            set_progress(board.touch)  # an llm stage: its batch's timeout runs from its last token
        set_engine_report = getattr(modelet, "set_engine_report", None)
        if callable(set_engine_report):
            set_engine_report(board.report_engine)  # an llm stage: its engine's gauges
    except BaseException as e:  # noqa: BLE001 - whatever user code raises, even SystemExit
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        with contextlib.suppress(OSError):  # the worker may be gone already
            outbox.send_bytes(frames.pack(Kind.SETUP_FAILED, payload=f"stage {name!r}: {detail}"))
            outbox.close()
        sys.exit(EXIT_SETUP_FAILED)
    try:
        outbox.send_bytes(frames.pack(Kind.READY, payload=os.getpid()))
        StageLoop(
            config,
            run,
            inbox,
            outbox,
            board,
            run_rows=run_rows,
            set_threads=set_threads,
            concurrent_batches=at_once,
        ).run()
    except (BrokenPipeError, ConnectionResetError):
        # The worker that spawned us died (its end of the pipe is closed): nobody is left
        # to tell anything, and nothing we hold can reach the output. Leave quietly.
        sys.exit(0)


@dataclass(frozen=True)
class _Computed:
    """What running a batch made: the outputs of its parts that went through, its rows
    that failed, the metrics of earlier stages it carried round the modelet, its seconds."""

    pieces: list[tuple[np.ndarray, Any]]
    failed: list[tuple[int, str]]
    carried: Any
    seconds: float


class StageLoop:
    def __init__(
        self,
        config: StageConfig,
        run: Callable[[Columns], Columns] | None,
        inbox: Connection,
        outbox: Connection,
        board: BatchBoard,
        *,
        run_rows: Callable[[list[Any]], list[Any]] | None = None,
        set_threads: Callable[[int], None] | None = None,
        concurrent_batches: int = 1,
    ) -> None:
        spec = config.spec
        self.concurrent = max(1, concurrent_batches)
        """Batches run at once; above 1, each on a thread of `pool`."""
        self.running: dict[Future[_Computed], Batch] = {}
        self.pool = (
            ThreadPoolExecutor(self.concurrent, thread_name_prefix=f"ebb:{spec.name}-batch")
            if self.concurrent > 1
            else None
        )
        self.set_threads = set_threads
        """The model's thread count, changed between batches (Kind.THREADS)."""
        self.name = spec.name
        self.run_batch = run
        self.run_rows = run_rows
        """A fan-out stage's per-row function (one list of parts per row)."""
        self.memory_limit = config.memory_limit_bytes
        self.outbox = outbox
        self.board = board
        self.batcher = Batcher(
            max_size=spec.rows_per_batch,
            max_wait_s=spec.batch_wait_s,
            max_tokens=spec.batch_tokens,
            lengths=row_lengths(spec.length_column) if spec.length_column else None,
        )
        self.sizer = (
            AdaptiveBatchSize(max_size=spec.rows_per_batch) if spec.adaptive_batch else None
        )
        if self.sizer is not None:
            self.batcher.max_size = self.sizer.size
        self.messages: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.arena = Arena()
        self.reader = threading.Thread(target=self._read, args=(inbox,), daemon=True)
        self.stopping = False
        self.recycling = False
        self.fanout = spec.fanout
        self.metrics = spec.metrics
        self.outputs: list[tuple[np.ndarray, Columns]] = []
        """Outputs of batches run, not sent yet (`_flush`), in order."""
        self.output_rows = 0
        self.outputs_since = 0.0
        self.batch_s = 0.0
        """How long the last batch took to run."""
        self.held = Counter[str]()
        """Shared-memory rows of batches run whose outputs are not sent yet: an output may be
        a view of its input, so the input stays mapped until the output is packed."""

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
            if self.running and (self.stopping or len(self.running) >= self.concurrent):
                timeout = None  # a batch that ends wakes the loop (`_start`)
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
            self._collect()
            while len(self.running) < self.concurrent and self.batcher.ready(time.monotonic()):
                batch = self.batcher.take()
                if self.pool is not None and not batch.solo:
                    self._start(batch)
                    continue
                if self.running:
                    # A suspect (a row of a batch that killed a process) runs alone: should
                    # it kill this one too, the board blames it, not another batch's rows.
                    wait(self.running)
                    self._collect()
                messages, segments = self._run(batch), batch.segments
                del batch  # the last references to views of shared memory but the outputs'
                self._ran(segments, messages)
            self._flush()
            if self.stopping and not len(self.batcher) and not self.running:
                if self.pool is not None:
                    self.pool.shutdown()
                self.arena.close()
                self.outbox.close()
                return

    def _ran(self, segments: Any, messages: list[bytes]) -> None:
        """A batch's outcome sent (or held, to go with the next batches'); `segments`: the
        shared memory its rows came in."""
        self.held.update(segments)
        for message in messages:
            self._send(message)
        # Would the outputs held wait too long if the next batch took as long as this?
        waited = time.monotonic() - self.outputs_since + self.batch_s
        if self.output_rows >= _OUTPUT_ROWS or waited >= _OUTPUT_WAIT_S:
            self._flush()
        self._check_memory()

    def _start(self, batch: Batch) -> None:
        """Run a batch on a thread of the pool while others run; `_collect` takes its end."""
        if not len(batch):
            return
        assert self.pool is not None
        future = self.pool.submit(self._compute, batch)
        self.running[future] = batch
        self._post_running()
        future.add_done_callback(lambda _: self.messages.put(b""))  # wakes the loop

    def _collect(self) -> None:
        """The outcomes of the batches that ended on the pool's threads."""
        for future in [f for f in self.running if f.done()]:
            batch = self.running.pop(future)
            self._post_running()
            messages, segments = self._outcome(batch, future.result()), batch.segments
            del batch  # the last references to views of shared memory but the outputs'
            self._ran(segments, messages)

    def _post_running(self) -> None:
        """The board shows every batch running (their rows, since the latest began)."""
        self.board.clear()
        if self.running:
            self.board.post(np.concatenate([b.uids for b in self.running.values()]))

    def _send(self, message: bytes) -> None:
        self.outbox.send_bytes(message)

    def _flush(self) -> None:
        """Send the outputs held, as one message, and unmap the shared memory of the batches
        they came from (told with them: one message fewer for the router)."""
        messages: list[bytes] = []
        if self.outputs:
            failed: list[tuple[int, str]] = []
            uids = np.concatenate([u for u, _ in self.outputs])
            chunk = concat([c for _, c in self.outputs])
            self.outputs, self.output_rows = [], 0
            message = self._items_message(uids, chunk, failed, 0)
            del chunk
            if message:
                messages.append(message)
            if failed:
                failed_uids = [u for u, _ in failed]
                messages.append(frames.pack(Kind.ERRORS, failed_uids, [m for _, m in failed]))
        held, self.held = self.held, Counter[str]()
        unmapped = [name for name, n in held.items() if self.arena.done(name, n)]
        if unmapped:
            if messages:
                messages[0] = frames.with_released(messages[0], unmapped)
            else:
                messages.append(frames.pack(Kind.UNMAPPED, payload=unmapped))
        for message in messages:
            self._send(message)

    def _handle(self, message: bytes) -> None:
        h = frames.header(message)
        match h.kind:
            case Kind.ITEMS:
                self._take(message, h)
            case Kind.RECLAIM:
                for name in frames.payload(message):
                    self.arena.reclaim(name)
            case Kind.FLUSH:
                self.batcher.flush()
            case Kind.THREADS:
                if self.set_threads is not None:
                    self.set_threads(int(frames.payload(message)))
            case Kind.STOP:
                self.stopping = True
            case (
                Kind.ERRORS
                | Kind.FANOUT
                | Kind.UNMAPPED
                | Kind.READY
                | Kind.SETUP_FAILED
                | Kind.RECYCLE
            ):
                raise RuntimeError(f"stage {self.name!r} was sent {h.kind.name}, a stage's kind")
            case _:
                assert_never(h.kind)

    def _take(self, message: bytes, h: frames.Header) -> None:
        """Rows for this stage's batches; rows it cannot read fail, not the stage."""
        # A copy of the uids: the view would keep the whole message alive.
        uids = h.uids.copy()
        try:
            payload = frames.payload(message, arena=self.arena)
            if h.flags & frames.ARROW:
                schema, data = payload
                payload = from_arrow(pa.ipc.read_record_batch(pa.py_buffer(data), schema))
            self.batcher.add(
                uids,
                payload,
                time.monotonic(),
                solo=bool(h.flags & frames.SOLO),
                segment=h.segment,
            )
        except Exception as e:  # noqa: BLE001 - rows we cannot read or measure fail, not the stage
            if h.segment and self.arena.done(h.segment, len(uids)):
                self._send(frames.pack(Kind.UNMAPPED, payload=[h.segment]))
            problem = f"stage {self.name!r}: {_describe(e)}"
            self._send(frames.pack(Kind.ERRORS, uids, [problem] * len(uids)))

    def _run(self, batch: Batch) -> list[bytes]:
        """Run a batch; the messages that tell its outcome."""
        if not len(batch):
            return []
        self.board.post(batch.uids)
        try:
            computed = self._compute(batch)
        finally:
            self.board.clear()
        return self._outcome(batch, computed)

    def _compute(self, batch: Batch) -> _Computed:
        """The batch through the modelet (bisected where it raises). On a pool's thread
        when batches run at once: it touches nothing of the loop's."""
        started = time.perf_counter()
        # The metrics' values of earlier stages go round the modelet, not through it.
        columns, carried = split_metrics(batch.columns)
        pieces, failed = self._isolate(batch.uids, columns)
        return _Computed(pieces, failed, carried, time.perf_counter() - started)

    def _outcome(self, batch: Batch, computed: _Computed) -> list[bytes]:
        """The messages that tell a batch's outcome (its outputs held to go with the next
        batches', but a suspect's)."""
        messages: list[bytes] = []
        pieces, failed, carried = computed.pieces, computed.failed, computed.carried
        self.batch_s = computed.seconds
        if self.sizer is not None and not batch.solo:
            self.batcher.max_size = self.sizer.observe(len(batch), self.batch_s)
        flags = frames.SOLO if batch.solo else 0
        if pieces:
            uids = np.concatenate([u for u, _ in pieces])
            if self.fanout:
                message = self._fan_out_message(uids, [v for _, v in pieces], failed, flags)
            else:
                chunk = concat([c for _, c in pieces])
                try:
                    chunk = with_metrics(
                        chunk,
                        uids,
                        stage=self.name,
                        metrics=self.metrics,
                        batch_uids=batch.uids,
                        carried=carried,
                    )
                except MetricFailure as e:
                    failed += [(int(u), str(e)) for u in uids.tolist()]
                    message = b""
                else:
                    if flags:  # a row run alone (a suspect): its outcome goes at once
                        message = self._items_message(uids, chunk, failed, flags)
                    else:
                        self._hold(uids, chunk)
                        message = b""
            if message:
                messages.append(message)
        if failed:
            failed_uids = [u for u, _ in failed]
            messages.append(frames.pack(Kind.ERRORS, failed_uids, [m for _, m in failed]))
        return messages

    def _hold(self, uids: np.ndarray, chunk: Columns) -> None:
        """Keep a batch's output to send with the next batches' (`_flush`)."""
        if not self.outputs:
            self.outputs_since = time.monotonic()
        self.outputs.append((uids, chunk))
        self.output_rows += len(uids)

    def _items_message(
        self, uids: np.ndarray, chunk: Columns, failed: list[tuple[int, str]], flags: int
    ) -> bytes:
        try:
            return frames.pack(Kind.ITEMS, uids, chunk, flags=flags, arena=self.arena)
        except Exception:  # noqa: BLE001 - some output cannot be pickled: find which
            bad = self._unsendable_rows(chunk)
            failed += [(int(uids[i]), why) for i, why in bad.items()]
            keep = np.array([i not in bad for i in range(len(uids))], dtype=bool)
            if not keep.any():
                return b""
            return frames.pack(
                Kind.ITEMS, uids[keep], take(chunk, keep), flags=flags, arena=self.arena
            )

    def _fan_out_message(
        self, uids: np.ndarray, outputs: list[Any], failed: list[tuple[int, str]], flags: int
    ) -> bytes:
        """A fan-out stage's lists, flattened into one chunk of parts, with each row's count
        of parts. A row whose output is not a list, or has a part that cannot be sent, fails
        alone (with its parts)."""
        values = [v for out in outputs for v in out]
        kept: list[int] = []
        counts: list[int] = []
        parts: list[Any] = []
        for uid, value in zip(uids.tolist(), values, strict=True):
            if not isinstance(value, list | tuple):
                kind = type(value).__name__
                failed.append(
                    (uid, f"stage {self.name!r} fans out: it must return a list, not {kind}")
                )
                continue
            problem = frames.unsendable(value)
            if problem:
                failed.append((uid, f"stage {self.name!r}: output cannot be sent: {problem}"))
                continue
            kept.append(uid)
            counts.append(len(value))
            parts.extend(value)
        if not kept:
            return b""
        chunk = from_rows(parts) if parts else {VALUE: np.empty(0, dtype=object)}
        message = frames.pack(Kind.ITEMS, [], chunk, flags=flags, arena=self.arena)
        return frames.splice(message, Kind.FANOUT, kept + counts)

    def _unsendable_rows(self, chunk: Columns) -> dict[int, str]:
        """The rows (by index) whose values cannot be pickled, and why."""
        bad: dict[int, str] = {}
        for column in chunk.values():
            if column.dtype != object:
                continue
            for i, value in enumerate(column):
                problem = frames.unsendable([value])
                if problem and i not in bad:
                    bad[i] = f"stage {self.name!r}: output cannot be sent: {problem}"
        return bad

    def _isolate(
        self, uids: np.ndarray, batch: Columns
    ) -> tuple[list[tuple[np.ndarray, Any]], list[tuple[int, str]]]:
        """Run a batch; if it raises, bisect it so that only the failing rows fail. Returns
        the outputs of the parts that went through, and the rows that did not."""
        try:
            if self.run_rows is not None:
                out: Any = self.run_rows(to_rows(batch))
            else:
                assert self.run_batch is not None
                out = self.run_batch(batch)
        except Exception as e:  # noqa: BLE001 - user code: any failure fails only its rows
            if len(uids) == 1:
                return [], [(int(uids[0]), f"stage {self.name!r}: {_describe(e)}")]
        else:
            return _row_errors(uids, out, self.name)
        mid = len(uids) // 2
        left = self._isolate(uids[:mid], take(batch, slice(0, mid)))
        right = self._isolate(uids[mid:], take(batch, slice(mid, None)))
        return left[0] + right[0], left[1] + right[1]

    def _check_memory(self) -> None:
        # Stopping, we exit after what we hold anyway: a replacement now would only be one
        # more process to start (and load a model) while the pipeline shuts down.
        if self.memory_limit is None or self.recycling or self.stopping:
            return
        import psutil

        if psutil.Process().memory_info().rss > self.memory_limit:
            # Between batches, nothing half done: ask the router to stop feeding us, finish
            # what we hold, and exit; the router starts a fresh process in our place.
            self.recycling = True
            self._send(frames.pack(Kind.RECYCLE))
