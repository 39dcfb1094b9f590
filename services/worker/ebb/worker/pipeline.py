"""The modelet pipeline: stage processes, the router thread that feeds them, and the asyncio
coordinator that pairs every result with the future waiting for its uid.

    coordinator (asyncio)  --submit-->  router thread  --pipe-->  stage 0 process(es)
                                             ^  |                        |
                                             |  +------pipe-->  stage 1 process(es)  ...
                                             +----- results / errors ----+

Every process has a private inbox pipe and a private outbox pipe; the router moves frames
between them (as bytes, without unpickling) and hands each frame to the least-loaded process of
the next stage. Private pipes, not queues shared by several processes, because a process
killed while holding a shared queue's lock, or halfway through writing to it, wedges or
corrupts it for everyone; a private pipe dies with its process. The router also knows exactly
which items each process holds, so when one dies (crash, OOM kill, or killed by the router
because a batch overran its timeout) those items, and only those, are sent again, one per
batch; an item whose batch dies twice becomes an error row.

Memory is bounded by the coordinator, which never has more than `max_inflight` items inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import pyarrow as pa

from ebb.common.spec import StageSpec

from . import frames, metrics
from .elastic import DeviceMonitor, ElasticScheduler, ElasticSettings, StageLoad
from .shm import Arena, remove_all_of, sweep_orphans, unlink
from .stage import BatchBoard, StageConfig, stage_main

log = logging.getLogger(__name__)

Outcome = tuple[bool, Any]
"""(True, output) for an item that made it through, (False, error message) for one that did not."""

_STARTUP_FAILURES_FATAL = 3


class PipelineError(Exception):
    pass


class PipelineSetupError(PipelineError):
    """A stage cannot start (bad modelet, model file, import error): no retry will help."""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    stages: list[StageSpec]
    code_paths: list[str] = field(default_factory=list)
    batch_timeout_s: float = 300.0
    """A batch running longer gets its process killed; its items are retried once, alone."""
    memory_limit_bytes: int | None = None
    """A stage process above this RSS is recycled between batches."""
    max_inflight: int = 0
    """Items inside the pipeline at most (0: enough to keep every stage process busy)."""
    max_item_crashes: int = 2
    """An item whose batch's process dies this many times becomes an error."""
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    """How the elastic scheduler decides (used when any stage has min_workers < max_workers)."""
    start_timeout_s: float = 300.0

    def inflight_limit(self) -> int:
        if self.max_inflight:
            return self.max_inflight
        busy = sum(2 * (s.max_workers or s.workers) * s.batch_size for s in self.stages)
        return max(busy + 2 * self.frame_size(), 4 * self.frame_size())

    def frame_size(self) -> int:
        return max(16, min(256, self.stages[0].batch_size))


@dataclass(frozen=True, slots=True)
class _ArrowRow:
    """Where to find an item that came in as a row of an Arrow batch (to send it again)."""

    batch: pa.RecordBatch
    index: int


@dataclass(frozen=True, slots=True)
class Frame:
    """Items on their way to a stage, as the bytes that will be sent."""

    buf: bytes
    uids: list[int]
    flags: int
    segment: str = ""


@dataclass(eq=False)
class Family:
    """An item that fanned out, waiting for its parts."""

    parent: int
    results: list[Any]
    flags: int
    members: list[int] = field(default_factory=list)
    remaining: int = 0

    def __post_init__(self) -> None:
        self.remaining = len(self.results)


class _StageProcess:
    """One stage process and the router's view of it."""

    def __init__(
        self, ctx: Any, stage: int, slot: int, spec: StageSpec, config: PipelineConfig
    ) -> None:
        self.stage = stage
        self.slot = slot
        self.name = spec.name
        inbox_r, self.inbox = ctx.Pipe(duplex=False)
        self.outbox, outbox_w = ctx.Pipe(duplex=False)
        self.board = BatchBoard(ctx, spec.batch_size)
        stage_config = StageConfig(
            spec=spec, code_paths=config.code_paths, memory_limit_bytes=config.memory_limit_bytes
        )
        self.process = ctx.Process(
            target=stage_main,
            args=(stage_config, inbox_r, outbox_w, self.board),
            name=f"ebb-stage-{spec.name}-{slot}",
        )
        self.process.start()
        # Our copies of the child's ends must go, or we would never see EOF when it dies.
        inbox_r.close()
        outbox_w.close()
        self.held: dict[int, None] = {}
        """uids sent to this process and not yet returned (an ordered set)."""
        self.ready = False
        self.recycling = False
        self.stopping = False
        self.flushed = False
        self.dead = False
        self.retired = False
        """Stopped by the elastic scheduler: not to be replaced."""
        self.kill_reason = ""
        self.busy_mark = 0.0
        self.mark_time = time.monotonic()

    @property
    def load(self) -> int:
        return len(self.held)

    def send(self, buf: bytes) -> bool:
        try:
            self.inbox.send_bytes(buf)
            return True
        except OSError:  # the process is gone; its sentinel will tell the router
            return False

    def close(self) -> None:
        for conn in (self.inbox, self.outbox):
            conn.close()


class Router:
    """The thread that owns every stage process. Only its own thread touches its state;
    other threads talk to it through `submit`, `flush` and `stop`."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        on_results: Callable[[list[int], list[Any]], None],
        on_errors: Callable[[list[int], list[str]], None],
        on_ready: Callable[[], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        self.config = config
        self.specs = config.stages
        self.on_results = on_results
        self.on_errors = on_errors
        self.on_ready = on_ready
        self.on_fatal = on_fatal
        self.ctx = mp.get_context("spawn")
        self.procs: list[list[_StageProcess]] = [[] for _ in self.specs]
        self.backlog: list[deque[Frame]] = [deque() for _ in self.specs]
        self.arena = Arena()
        swept = sweep_orphans()
        if swept:
            log.info("removed %d shared-memory segments left by dead workers", swept)
        self.segment_left: dict[str, int] = {}
        """Segments a stage process has mapped -> its items not yet back from it."""
        self.uid_segment: dict[int, str] = {}
        """Items inside a stage process -> the segment their value came in."""
        self.originals: dict[int, Any] = {}
        fanouts = [k for k, s in enumerate(self.specs) if s.fanout]
        fanins = [k for k, s in enumerate(self.specs) if s.fanin]
        self.fanout_stage: int | None = fanouts[0] if fanouts else None
        self.fanin_stage: int | None = fanins[0] if fanins else None
        self.families: dict[int, Family] = {}
        self.children: dict[int, tuple[int, int]] = {}
        """Fanned-out parts (negative uids) -> (their item's uid, their place in it)."""
        self._next_child = -1
        self.crashes: Counter[int] = Counter()
        self.startup_failures: Counter[int] = Counter()
        self.requests: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = self.ctx.Pipe(duplex=False)
        scalable = any(s.min_workers != s.max_workers for s in self.specs)
        self.elastic = ElasticScheduler(config.elastic) if scalable else None
        self.monitor = DeviceMonitor() if scalable else None
        self._next_tick = time.monotonic() + config.elastic.tick_s
        self._wake_lock = threading.Lock()
        self.draining = False
        self.announced_ready = False
        self.fatal = ""
        self.thread = threading.Thread(target=self._main, name="ebb-pipeline-router", daemon=True)
        self._watchdog_stop = threading.Event()
        self._kill_all_after = 0.0
        self.watchdog = threading.Thread(
            target=self._watchdog, name="ebb-pipeline-watchdog", daemon=True
        )

    # -- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self.thread.start()
        self.watchdog.start()

    def submit(self, uids: list[int], values: list[Any] | pa.RecordBatch) -> None:
        """Items for the first stage: Python values, or the rows of an Arrow record batch
        (which travels as Arrow, and becomes rows inside the stage process)."""
        self.requests.put(("submit", uids, values))
        self._wake()

    def flush(self) -> None:
        self.requests.put(("flush",))
        self._wake()

    def stop(self, grace_s: float) -> None:
        """Stop every process (each finishes what it holds, for up to grace_s) and the thread."""
        if self.thread.is_alive():
            self._kill_all_after = time.monotonic() + grace_s + 1.0
            self.requests.put(("stop", grace_s))
            self._wake()
            self.thread.join()
        self._watchdog_stop.set()
        if self.watchdog.is_alive():
            self.watchdog.join()

    def depths(self) -> list[int]:
        """Items waiting for or inside each stage (approximate: read without locking)."""
        return [
            sum(len(f.uids) for f in list(self.backlog[k])) + sum(p.load for p in self.procs[k])
            for k in range(len(self.specs))
        ]

    def _wake(self) -> None:
        with self._wake_lock:
            self._wake_w.send_bytes(b"")

    # -- the router thread -----------------------------------------------------------------

    def _main(self) -> None:
        grace_s = 0.0
        try:
            for k, spec in enumerate(self.specs):
                for slot in range(spec.workers):
                    self._spawn(k, slot)
            while True:
                stop = self._take_requests()
                if stop is not None:
                    grace_s = stop
                    break
                self._dispatch()
                self._flush_drained()
                self._wait_and_receive(0.1)
                if self.elastic is not None and time.monotonic() >= self._next_tick:
                    self._rebalance()
        except Exception as e:
            log.exception("pipeline router failed")
            self._fail(f"pipeline router failed: {type(e).__name__}: {e}")
        finally:
            self._shutdown(grace_s)

    def _spawn(self, stage: int, slot: int) -> None:
        self.procs[stage].append(
            _StageProcess(self.ctx, stage, slot, self.specs[stage], self.config)
        )

    def _take_requests(self) -> float | None:
        while True:
            try:
                request = self.requests.get_nowait()
            except queue.Empty:
                return None
            if request[0] == "submit":
                _, uids, values = request
                self.draining = False
                if isinstance(values, pa.RecordBatch):
                    self.originals.update((uid, _ArrowRow(values, i)) for i, uid in enumerate(uids))
                    self._enqueue_arrow(uids, values, 0)
                else:
                    self.originals.update(zip(uids, values, strict=True))
                    self._enqueue(0, uids, values)
            elif request[0] == "flush":
                self.draining = True
            elif request[0] == "stop":
                return float(request[1])

    def _dispatch(self) -> None:
        # Downstream first: what it frees is what lets upstream results move on.
        for k in reversed(range(len(self.specs))):
            spec = self.specs[k]
            cap = 2 * spec.batch_size
            backlog = self.backlog[k]
            while backlog:
                candidates = [
                    p
                    for p in self.procs[k]
                    if p.ready and not (p.recycling or p.stopping or p.dead) and p.load < cap
                ]
                if not candidates:
                    break
                target = min(candidates, key=lambda p: p.load)
                frame = backlog.popleft()
                if not target.send(frame.buf):
                    backlog.appendleft(frame)
                    target.dead = True
                    break
                target.held.update(dict.fromkeys(frame.uids))
                target.flushed = False
                if frame.segment:
                    left = self.segment_left.get(frame.segment, 0)
                    self.segment_left[frame.segment] = left + len(frame.uids)
                    for uid in frame.uids:
                        self.uid_segment[uid] = frame.segment

    def _flush_drained(self) -> None:
        """When the input is drained, tell each stage whose upstream is empty not to wait."""
        if not self.draining:
            return
        for k in range(len(self.specs)):
            for p in self.procs[k]:
                if p.held and not p.flushed and p.ready and not p.dead:
                    p.flushed = p.send(frames.pack(frames.FLUSH))
            if self.backlog[k] or any(p.held for p in self.procs[k]):
                break

    def _wait_and_receive(self, timeout: float) -> None:
        by_conn: dict[Any, _StageProcess] = {}
        by_sentinel: dict[int, _StageProcess] = {}
        for stage in self.procs:
            for p in stage:
                by_conn[p.outbox] = p
                by_sentinel[p.process.sentinel] = p
        ready = wait([self._wake_r, *by_conn, *by_sentinel], timeout=timeout)
        dead: list[_StageProcess] = []
        for obj in ready:
            if obj is self._wake_r:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
            elif isinstance(obj, int):
                dead.append(by_sentinel[obj])
            else:
                p = by_conn[obj]
                if not self._receive(p):
                    dead.append(p)
        for p in dict.fromkeys(dead):
            self._bury(p)

    def _receive(self, p: _StageProcess) -> bool:
        """Read every message a process has sent. False once its outbox reports EOF."""
        conn: Connection = p.outbox
        try:
            while conn.poll():
                self._handle(p, conn.recv_bytes())
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, p: _StageProcess, buf: bytes) -> None:
        h = frames.header(buf)
        kind, uids = h.kind, h.uids
        if kind in (frames.ITEMS, frames.ERRORS):
            for uid in uids:
                p.held.pop(uid, None)
                self._release(uid)
        if kind == frames.FANOUT:
            parents, counts = uids[: len(uids) // 2], uids[len(uids) // 2 :]
            for uid in parents:
                p.held.pop(uid, None)
                self._release(uid)
            metrics.BATCH_SIZE.labels(p.name).observe(len(parents))
            self._fan_out_frame(p.stage, buf, parents, counts, h)
        if kind == frames.ITEMS:
            metrics.BATCH_SIZE.labels(p.name).observe(len(uids))
            try:
                self._route(p.stage, Frame(buf, uids, h.flags, h.segment))
            except Exception as e:  # noqa: BLE001 - e.g. a result type we cannot import
                self._fail_items(
                    uids, [f"stage {p.name!r}: its result could not be read: {e!r}"] * len(uids)
                )
        elif kind == frames.ERRORS:
            self._fail_items(uids, frames.payload(buf))
        elif kind == frames.READY:
            p.ready = True
            self.startup_failures[p.stage] = 0
            if not self.announced_ready and all(q.ready for s in self.procs for q in s):
                self.announced_ready = True
                self.on_ready()
        elif kind == frames.SETUP_FAILED:
            message = str(frames.payload(buf))
            if not self.announced_ready:
                self._fail(message)  # the configuration is wrong: fail fast
            else:
                # A replacement that cannot start (the GPU still holds the old process's
                # memory, say): its exit counts as a failed start, retried a few times.
                log.warning("stage %s process %d could not start: %s", p.name, p.slot, message)
        elif kind == frames.RECYCLE:
            log.info("stage %s process %d is over its memory limit: recycling", p.name, p.slot)
            metrics.STAGE_RESTARTS.labels(p.name, "memory").inc()
            p.recycling = True
            p.stopping = p.send(frames.pack(frames.STOP))
            self._spawn(p.stage, p.slot)

    # -- where items go next -----------------------------------------------------------------

    def _route(self, stage: int, frame: Frame) -> None:
        """Items that came out of `stage`: on to the next stage, into a fan-out, back to
        their family, or out of the pipeline."""
        after = stage + 1
        if (
            after < len(self.specs)
            and stage != self.fanout_stage
            and not self._gathers_after(stage)
        ):
            self.backlog[after].append(frame)  # as it came: no unpickling here
            return
        try:
            values = frames.payload(frame.buf, arena=self.arena, copy=True)
        finally:
            if frame.segment:
                self._segment_done(frame.segment)
        if stage == self.fanout_stage:
            self._fan_out(stage, values, frame.uids, frame.flags)
        elif self._gathers_after(stage):
            self._gather(values, frame.uids)
        else:
            self._finish(frame.uids)
            self.on_results(frame.uids, values)

    def _enqueue(self, stage: int, uids: list[int], values: list[Any], flags: int = 0) -> None:
        """Pack items for `stage` (large buffers into shared memory) and queue them."""
        self._enqueue_payload(stage, uids, values, flags)

    def _enqueue_payload(self, stage: int, uids: list[int], payload: Any, flags: int) -> None:
        buf = frames.pack(frames.ITEMS, uids, payload, flags=flags, arena=self.arena)
        self.backlog[stage].append(Frame(buf, uids, flags, frames.header(buf).segment))

    def _enqueue_arrow(self, uids: list[int], batch: pa.RecordBatch, flags: int) -> None:
        """Rows for the first stage as Arrow IPC: one copy into shared memory, no pickling of
        row values, and the conversion to rows happens in the stage process, in parallel."""
        payload = (batch.schema, batch.serialize())
        self._enqueue_payload(0, uids, payload, flags | frames.ARROW)

    def _release(self, uid: int) -> None:
        """An item left the stage process that mapped its segment; the last one out unlinks."""
        segment = self.uid_segment.pop(uid, None)
        if segment is None:
            return
        left = self.segment_left[segment] - 1
        if left:
            self.segment_left[segment] = left
        else:
            del self.segment_left[segment]
            self._segment_done(segment)

    def _segments_in_flight(self) -> set[str]:
        in_backlog = {f.segment for b in self.backlog for f in b if f.segment}
        return in_backlog | set(self.segment_left)

    def _segment_done(self, segment: str) -> None:
        """Nobody reads `segment` any more: back to the process that made it, for reuse."""
        if self.arena.owns(segment):
            self.arena.reclaim(segment)
            return
        producer = int(segment.split("-")[1])
        for stage in self.procs:
            for p in stage:
                if (
                    p.process.pid == producer
                    and not p.dead
                    and p.send(frames.pack(frames.RECLAIM, payload=[segment]))
                ):
                    return
        unlink(segment)  # its maker is gone

    def _gathers_after(self, stage: int) -> bool:
        """Is the end of `stage` where the items of a fan-out come back together?"""
        if self.fanout_stage is None or stage < self.fanout_stage:
            return False
        return stage + 1 == (self.fanin_stage if self.fanin_stage is not None else len(self.specs))

    def _fan_out_frame(
        self, stage: int, buf: bytes, parents: list[int], counts: list[int], h: frames.Header
    ) -> None:
        """A fan-out stage's output: name each part (a new uid) and send the frame's bytes on
        to the next stage as they are."""
        if self._gathers_after(stage):  # nothing between the fan-out and the gathering
            values = frames.payload(buf, arena=self.arena, copy=True)
            if h.segment:
                self._segment_done(h.segment)
            at = 0
            for parent, count in zip(parents, counts, strict=True):
                self._complete(parent, list(values[at : at + count]), h.flags)
                at += count
            return
        children: list[int] = []
        for parent, count in zip(parents, counts, strict=True):
            if count == 0:
                self._complete(parent, [], h.flags)
                continue
            family = Family(parent=parent, results=[None] * count, flags=h.flags)
            self.families[parent] = family
            for index in range(count):
                child = self._next_child
                self._next_child -= 1
                self.children[child] = (parent, index)
                family.members.append(child)
                children.append(child)
        if children:
            forwarded = frames.splice(buf, frames.ITEMS, children)
            self.backlog[stage + 1].append(Frame(forwarded, children, h.flags, h.segment))
        elif h.segment:
            self._segment_done(h.segment)

    def _fan_out(self, stage: int, values: list[Any], uids: list[int], flags: int) -> None:
        children: list[int] = []
        child_values: list[Any] = []
        for uid, value in zip(uids, values, strict=True):
            if not isinstance(value, list | tuple):
                name = self.specs[stage].name
                kind = type(value).__name__
                problem = f"stage {name!r} fans out: it must return a list per item, not {kind}"
                self._fail_items([uid], [problem])
            elif not value or self._gathers_after(stage):
                self._complete(uid, list(value), flags)
            else:
                family = Family(parent=uid, results=[None] * len(value), flags=flags)
                self.families[uid] = family
                for index, part in enumerate(value):
                    child = self._next_child
                    self._next_child -= 1
                    self.children[child] = (uid, index)
                    family.members.append(child)
                    children.append(child)
                    child_values.append(part)
        if children:
            self._enqueue(stage + 1, children, child_values, flags)

    def _gather(self, values: list[Any], uids: list[int]) -> None:
        for uid, value in zip(uids, values, strict=True):
            found = self.children.pop(uid, None)
            if found is None:
                continue  # a child of a family that failed or started over
            parent, index = found
            family = self.families[parent]
            family.results[index] = value
            family.remaining -= 1
            if family.remaining == 0:
                del self.families[parent]
                self._complete(parent, family.results, family.flags)

    def _complete(self, parent: int, results: list[Any], flags: int) -> None:
        """A fanned-out item has all its parts: on to the fan-in stage, or out."""
        if self.fanin_stage is not None:
            self._enqueue(self.fanin_stage, [parent], [results], flags)
        else:
            self._finish([parent])
            self.on_results([parent], [results])

    def _fail_items(self, uids: list[int], messages: list[str]) -> None:
        """Errors: an item fails; a fanned-out part fails its whole item, once."""
        out_uids: list[int] = []
        out_messages: list[str] = []
        for uid, message in zip(uids, messages, strict=True):
            if uid < 0:
                found = self.children.pop(uid, None)
                if found is None:
                    continue
                parent, index = found
                self._disband(parent)
                out_uids.append(parent)
                out_messages.append(f"part {index} of its fan-out: {message}")
            else:
                out_uids.append(uid)
                out_messages.append(message)
        if out_uids:
            self._finish(out_uids)
            self.on_errors(out_uids, out_messages)

    def _disband(self, parent: int) -> None:
        """Forget a family: results of its parts still in flight will be dropped."""
        family = self.families.pop(parent, None)
        if family is not None:
            for child in family.members:
                self.children.pop(child, None)

    def _finish(self, uids: list[int]) -> None:
        for uid in uids:
            self.originals.pop(uid, None)
            self.crashes.pop(uid, None)

    def _bury(self, p: _StageProcess) -> None:
        """A process exited: collect its last words, then retry or fail what it held."""
        self._receive(p)
        p.process.join(timeout=5)
        if p.process.is_alive():  # its pipe closed but it lingers: make sure it is gone
            p.process.kill()
            p.process.join(timeout=5)
        p.dead = True
        p.close()
        self.procs[p.stage].remove(p)
        # Its free segments die with it; those still on their way to a reader stay until read.
        remove_all_of(p.process.pid, keep=self._segments_in_flight())
        code = p.process.exitcode
        if p.stopping and not p.held:
            return  # recycled or stopped, cleanly
        if self.fatal:
            return
        if not p.ready:
            self.startup_failures[p.stage] += 1
            if self.startup_failures[p.stage] >= _STARTUP_FAILURES_FATAL:
                self._fail(
                    f"stage {p.name!r} died {_STARTUP_FAILURES_FATAL} times while starting "
                    f"(exit code {code})"
                )
                return
        how = p.kill_reason or _exit_description(code)
        metrics.STAGE_RESTARTS.labels(p.name, "timeout" if p.kill_reason else "died").inc()
        # Blame the batch that was running when it died; the rest of what it held is
        # innocent and simply goes round again. Died between batches: blame everything.
        running = set(p.board.running()) & p.held.keys() or set(p.held)
        if p.held:
            log.warning(
                "stage %s process %d %s; %d items in its batch, %d more queued",
                p.name,
                p.slot,
                how,
                len(running),
                len(p.held) - len(running),
            )
        for uid in p.held:
            self._release(uid)
        failed: list[int] = []
        blamed: dict[int, bool] = {}
        for uid in p.held:
            # A fanned-out part cannot be sent again on its own: its whole item starts over.
            owner = self.children[uid][0] if uid in self.children else uid
            if uid < 0 and owner == uid:
                continue  # a part of a family that already failed or started over
            blamed[owner] = blamed.get(owner, False) or uid in running
        for uid, guilty in blamed.items():
            self._disband(uid)
            if not guilty:
                self._resubmit(uid, solo=False)
                continue
            self.crashes[uid] += 1
            if self.crashes[uid] >= self.config.max_item_crashes:
                failed.append(uid)
            else:
                # Alone this time: whatever killed the batch may have been a batch-mate.
                self._resubmit(uid, solo=True)
        if failed:
            self._finish(failed)
            message = f"stage {p.name!r}: its process {how} while running this row, every time"
            self.on_errors(failed, [message] * len(failed))
        if not (p.recycling or p.retired):  # those were replaced already, or not wanted
            self._spawn(p.stage, p.slot)

    def _resubmit(self, uid: int, *, solo: bool) -> None:
        """Send an item through the pipeline again, from the first stage."""
        original = self.originals[uid]
        flags = frames.SOLO if solo else 0
        if isinstance(original, _ArrowRow):
            self._enqueue_arrow([uid], original.batch.slice(original.index, 1), flags)
        else:
            self._enqueue(0, [uid], [original], flags)

    def _rebalance(self) -> None:
        """One tick of the elastic scheduler: measure each stage, maybe add or retire one."""
        assert self.elastic is not None and self.monitor is not None
        now = time.monotonic()
        self._next_tick = now + self.config.elastic.tick_s
        loads: list[StageLoad] = []
        for k, spec in enumerate(self.specs):
            live = [p for p in self.procs[k] if p.ready and not (p.stopping or p.dead)]
            shares = []
            for p in live:
                busy = p.board.busy_seconds(now)
                elapsed = now - p.mark_time
                if elapsed > 0.5 * self.config.elastic.tick_s:
                    shares.append(min(1.0, (busy - p.busy_mark) / elapsed))
                p.busy_mark, p.mark_time = busy, now
            utilization = sum(shares) / len(shares) if shares else 0.0
            running = sum(len(p.board.running()) for p in live)
            waiting = (
                sum(len(f.uids) for f in self.backlog[k]) + sum(p.load for p in live) - running
            )
            assert spec.min_workers is not None and spec.max_workers is not None
            loads.append(
                StageLoad(
                    stage=k,
                    workers=len([p for p in self.procs[k] if not (p.stopping or p.dead)]),
                    min_workers=spec.min_workers,
                    max_workers=spec.max_workers,
                    utilization=utilization,
                    waiting=waiting,
                    device_busy=self.monitor.busy(spec.device),
                )
            )
            metrics.STAGE_UTILIZATION.labels(spec.name).set(utilization)
        decision = self.elastic.decide(now, loads)
        if decision is not None:
            action, k = decision
            name = self.specs[k].name
            if action == "add":
                slot = max((p.slot for p in self.procs[k]), default=-1) + 1
                log.info("elastic: stage %s gets a process (%d)", name, loads[k].workers + 1)
                self._spawn(k, slot)
            else:
                candidates = [p for p in self.procs[k] if p.ready and not (p.stopping or p.dead)]
                if candidates:
                    p = min(candidates, key=lambda q: q.load)
                    log.info(
                        "elastic: stage %s gives a process back (%d)", name, loads[k].workers - 1
                    )
                    p.retired = True
                    p.stopping = p.send(frames.pack(frames.STOP))
        for k, spec in enumerate(self.specs):
            alive = [p for p in self.procs[k] if not (p.stopping or p.dead)]
            metrics.STAGE_WORKERS.labels(spec.name).set(len(alive))

    def _watchdog(self) -> None:
        """Kill stage processes whose batch overran its timeout; at shutdown, past the grace
        period, kill every one. A thread of its own: the router may be blocked writing to
        the very process that hangs (a full pipe), and only the kill frees it."""
        timeout = self.config.batch_timeout_s
        while not self._watchdog_stop.wait(0.2):
            now = time.monotonic()
            for stage in list(self.procs):
                for p in list(stage):
                    if p.dead or p.kill_reason:
                        continue
                    started = p.board.started
                    if self._kill_all_after and now > self._kill_all_after:
                        p.kill_reason = "was killed at shutdown"
                    elif started and now - started > timeout:
                        p.kill_reason = f"was killed after a batch ran over {timeout:g}s"
                        log.warning(
                            "stage %s process %d: batch over %gs, killing it",
                            p.name,
                            p.slot,
                            timeout,
                        )
                    else:
                        continue
                    with contextlib.suppress(OSError, ValueError, AttributeError):
                        p.process.kill()

    def _fail(self, message: str) -> None:
        if not self.fatal:
            self.fatal = message
            log.error("pipeline failed: %s", message)
            self.on_fatal(message)

    def _shutdown(self, grace_s: float) -> None:
        everyone = [p for stage in self.procs for p in stage]
        for p in everyone:
            if not p.stopping:
                p.stopping = p.send(frames.pack(frames.STOP))
        deadline = time.monotonic() + grace_s
        for p in everyone:
            # Keep reading, or a stage blocked writing its last results would never exit.
            while p.process.is_alive() and time.monotonic() < deadline:
                if not self._receive(p):
                    p.process.join(timeout=0.5)
                    break
                p.process.join(timeout=0.05)
        for p in everyone:
            if p.process.is_alive():
                p.process.kill()
            p.process.join(timeout=5)
            p.close()
        self.procs = [[] for _ in self.specs]
        for segment in self._segments_in_flight():
            unlink(segment)
        for p in everyone:
            remove_all_of(p.process.pid, keep=set())
        self.segment_left.clear()
        self.uid_segment.clear()
        self.arena.close()
        self._wake_r.close()
        self._wake_w.close()


def _exit_description(code: int | None) -> str:
    if code is None:
        return "vanished"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Run:
    """The outcomes of one `Pipeline.run`, filled in by uid as results come back."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.outcomes: list[Outcome] = [(False, "no result")] * n
        self.remaining = n
        self.finished: asyncio.Future[None] = loop.create_future()

    def set(self, index: int, outcome: Outcome) -> None:
        self.outcomes[index] = outcome
        self.remaining -= 1
        if self.remaining == 0 and not self.finished.done():
            self.finished.set_result(None)


def _table_frames(table: pa.Table, frame: int) -> Iterator[tuple[int, pa.RecordBatch]]:
    start = 0
    for batch in table.to_batches(max_chunksize=frame):
        if batch.num_rows:
            yield start, batch
            start += batch.num_rows


class Pipeline:
    """The asyncio side: `run(values)` returns one Outcome per value, in order."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self._router: Router | None = None
        self._pending: dict[int, tuple[_Run, int]] = {}
        """The items inside, by uid: whose run awaits each, and where in its outcomes."""
        self._next_uid = 0
        self._inflight = 0
        self._limit = config.inflight_limit()
        self._space = asyncio.Event()
        self._space.set()
        self._ready = asyncio.Event()
        self._fatal = ""

    @property
    def failed(self) -> str:
        return self._fatal

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def threadsafe(fn: Callable[..., None]) -> Callable[..., None]:
            def call(*args: Any) -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(fn, *args)

            return call

        self._router = Router(
            self.config,
            on_results=threadsafe(self._on_results),
            on_errors=threadsafe(self._on_errors),
            on_ready=threadsafe(self._ready.set),
            on_fatal=threadsafe(self._on_fatal),
        )
        self._router.start()
        try:
            await asyncio.wait_for(self._ready.wait(), self.config.start_timeout_s)
        except TimeoutError:
            raise PipelineSetupError(
                f"stages not ready after {self.config.start_timeout_s:g}s"
            ) from None
        if self._fatal:
            raise PipelineSetupError(self._fatal)

    async def run(self, values: Sequence[Any] | pa.Table) -> list[Outcome]:
        """One Outcome per value (or per row of an Arrow table), in order."""
        if self._fatal:
            raise PipelineSetupError(self._fatal)
        router = self._router
        assert router is not None, "start() the pipeline first"
        n = len(values)
        base = self._next_uid
        self._next_uid += n
        run = _Run(asyncio.get_running_loop(), n)
        self._pending.update((base + i, (run, i)) for i in range(n))
        frame = self.config.frame_size()
        chunks: Iterator[tuple[int, Any]]
        if isinstance(values, pa.Table):
            chunks = _table_frames(values, frame)
        else:
            chunks = ((s, list(values[s : s + frame])) for s in range(0, n, frame))
        try:
            for start, chunk in chunks:
                size = len(chunk)
                while self._inflight and self._inflight + size > self._limit:
                    self._space.clear()
                    await self._space.wait()
                if self._fatal:
                    raise PipelineSetupError(self._fatal)
                self._inflight += size
                router.submit(list(range(base + start, base + start + size)), chunk)
            router.flush()
            if n:
                await run.finished
            if self._fatal:
                raise PipelineSetupError(self._fatal)
            return run.outcomes
        finally:
            for uid in range(base, base + n):
                self._pending.pop(uid, None)

    def _on_results(self, uids: list[int], values: list[Any]) -> None:
        for uid, value in zip(uids, values, strict=True):
            self._resolve(uid, (True, value))
        self._returned(len(uids))

    def _on_errors(self, uids: list[int], messages: list[str]) -> None:
        for uid, message in zip(uids, messages, strict=True):
            self._resolve(uid, (False, message))
        self._returned(len(uids))

    def _resolve(self, uid: int, outcome: Outcome) -> None:
        found = self._pending.pop(uid, None)
        if found is not None:  # else: its run was cancelled (a lost lease), or it is a repeat
            run, index = found
            run.set(index, outcome)

    def _returned(self, n: int) -> None:
        self._inflight = max(0, self._inflight - n)
        if self._inflight + self.config.frame_size() <= self._limit:
            self._space.set()

    def _on_fatal(self, message: str) -> None:
        self._fatal = message
        self._ready.set()
        self._space.set()
        # Wake every waiter; `run` sees `_fatal` and raises once, for all of them.
        for run, index in list(self._pending.values()):
            run.set(index, (False, message))
        self._pending.clear()

    def depths(self) -> list[int]:
        return self._router.depths() if self._router else []

    async def stop(self, *, grace_s: float = 10.0) -> None:
        router, self._router = self._router, None
        if router is not None:
            await asyncio.to_thread(router.stop, grace_s)
