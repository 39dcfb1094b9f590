"""The router: the thread that owns every stage process and moves frames between them.

    coordinator (asyncio)  --submit-->  router thread  --pipe-->  stage 0 process(es)
                                             ^  |                        |
                                             |  +------pipe-->  stage 1 process(es)  ...
                                             +----- results / errors ----+

Every process has a private inbox pipe and a private outbox pipe; the router moves frames
between them (as bytes, without unpickling) and hands each frame to the least-loaded process of
the next stage. Private pipes, not queues shared by several processes, because a process
killed while holding a shared queue's lock, or halfway through writing to it, wedges or
corrupts it for everyone; a private pipe dies with its process.

A frame is a chunk of rows with their uids (see frames.py, columns.py): the router's
bookkeeping is per frame, never per row. Only when a process dies does it work out which rows
that process held, and what becomes of them (ledger.py). Where rows go between stages, and
out, is the conveyor's concern (conveyor.py).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import pyarrow as pa

from . import cpus, devices, frames, metrics
from .columns import Columns
from .conveyor import Conveyor, ErrorsCallback, ResultsCallback
from .elastic import DeviceMonitor, ElasticScheduler, StageLoad
from .ledger import RowLedger
from .processes import ProcState, StageProcess, describe_exit
from .segments import SegmentLedger
from .settings import PipelineBroken, PipelineConfig, PipelineError, PipelineSetupError
from .shm import Arena, sweep_orphans
from .stage import name_this_thread
from .stageserver import stage_context

log = logging.getLogger(__name__)

_STARTUP_FAILURES_FATAL = 3
_SPAWN_TRIES = 3
ROUTER_THREAD = "ebb-router"
"""The router thread's name, as the system shows it (for CPU by thread)."""
_DEPTHS_EVERY_S = 0.2
"""How often the router counts its stages' depths for other threads (a gauge's worth)."""


class Router:
    """The thread that owns every stage process. Only its own thread touches its state;
    other threads talk to it through `submit`, `flush` and `stop`."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        on_results: ResultsCallback,
        on_errors: ErrorsCallback,
        on_ready: Callable[[], None],
        on_fatal: Callable[[PipelineError], None],
    ) -> None:
        """`on_fatal` gets a PipelineSetupError when the pipeline could not start, a
        PipelineBroken when it stopped working after it had started; at most once."""
        self.config = config
        self.specs = config.stages
        self.on_ready = on_ready
        self.on_fatal = on_fatal
        self.ctx = stage_context()
        self.procs: list[list[StageProcess]] = [[] for _ in self.specs]
        self.segments = SegmentLedger(Arena())
        swept = sweep_orphans()
        if swept:
            log.info("removed %d shared-memory segments left by dead workers", swept)
        self.rows = RowLedger()
        self.conveyor = Conveyor(
            self.specs,
            rows=self.rows,
            segments=self.segments,
            on_results=on_results,
            on_errors=on_errors,
        )
        self.startup_failures: Counter[int] = Counter()
        self.requests: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = self.ctx.Pipe(duplex=False)
        # One selector for the router's life (not one per wait): stage pipes and process
        # sentinels are registered as processes come and go.
        self.selector = selectors.DefaultSelector()
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.cores = config.cpus if config.cpus is not None else cpus.detect()
        """The worker's CPU budget, which its model stages' threads share (cpus.py)."""
        self.gpus = config.gpus
        """The worker's GPUs, over which each `cuda` stage's replicas spread (devices.py)."""
        self._all_spawned = False
        scalable = any(s.min_workers != s.max_workers for s in self.specs)
        self.elastic = ElasticScheduler(config.elastic) if scalable else None
        self.monitor = DeviceMonitor(cores=self.cores, gpus=self.gpus) if scalable else None
        self._next_tick = time.monotonic() + config.elastic.tick_s
        self._wake_lock = threading.Lock()
        self.draining = False
        self.announced_ready = False
        self.shutting_down = False
        """Set when the router starts to stop: nothing is spawned from then on, since
        nothing would stop, watch or sweep it."""
        self.fatal = ""
        self._depths: tuple[int, ...] = (0,) * len(self.specs)
        """Rows waiting for or inside each stage, as the router last counted them."""
        self._depths_due = 0.0
        self._wake_closed = False
        self.thread = threading.Thread(target=self._main, name="ebb-pipeline-router", daemon=True)
        self._watchdog_stop = threading.Event()
        self._kill_all_after = 0.0
        self._kills: dict[StageProcess, str] = {}
        """Why the watchdog killed each process it killed, until the router buries it: the
        watchdog's own record, so that only the router's thread moves a process's state."""
        self.watchdog = threading.Thread(
            target=self._watchdog, name="ebb-pipeline-watchdog", daemon=True
        )

    # -- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self.thread.start()
        self.watchdog.start()

    def submit(self, start: int, data: pa.RecordBatch | Columns, rows: int) -> None:
        """Rows for the first stage, under uids start..start+rows-1: the rows of an Arrow
        record batch (which travels as Arrow and becomes columns inside the stage process),
        or a chunk of columns."""
        self.requests.put(("submit", start, data, rows))
        self._wake()

    def flush(self) -> None:
        self.requests.put(("flush",))
        self._wake()

    def cancel(self, start: int, rows: int) -> None:
        """Nobody waits for uids start..start+rows-1 any more: drop what of them has not
        reached a process yet (reported through `on_errors`)."""
        self.requests.put(("cancel", start, rows))
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
        """Rows waiting for or inside each stage, as the router last counted them (a few
        times a second, on its own thread: its backlogs are not ours to read)."""
        return list(self._depths)

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_closed:  # stopped: a request now has nobody to wake
                self._wake_w.send_bytes(b"")

    # -- the router thread -----------------------------------------------------------------

    def _main(self) -> None:
        name_this_thread(ROUTER_THREAD)
        grace_s = 0.0
        try:
            for k, spec in enumerate(self.specs):
                for slot in range(spec.workers):
                    self._spawn(k, slot)
            self._all_spawned = True
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
                self._publish_depths()
        except Exception as e:
            log.exception("pipeline router failed")
            self._fail(PipelineBroken(f"pipeline router failed: {type(e).__name__}: {e}"))
        finally:
            self._shutdown(grace_s)

    def _publish_depths(self) -> None:
        now = time.monotonic()
        if now < self._depths_due:
            return
        self._depths_due = now + _DEPTHS_EVERY_S
        # One tuple, swapped in whole: a reader on another thread sees one count or the next.
        self._depths = tuple(
            self.conveyor.waiting(k) + sum(p.load for p in self.procs[k])
            for k in range(len(self.specs))
        )

    def _processes(self) -> list[int]:
        """Processes each stage runs (while the pipeline starts: will run)."""
        live = [sum(1 for p in procs if p.counts_as_worker) for procs in self.procs]
        if self._all_spawned:
            return live
        return [max(n, s.workers) for n, s in zip(live, self.specs, strict=True)]

    def _spawn(self, stage: int, slot: int) -> None:
        if self.shutting_down:
            return
        processes = self._processes()
        if self._all_spawned:
            processes[stage] += 1
        threads = cpus.shares(self.specs, processes, self.cores)
        spec = self.specs[stage]
        device, environment = devices.placement(spec.device, slot, self.gpus)
        handed = replace(spec, threads=threads[stage], device=device)
        if handed.threads or device != "cpu":
            log.info(
                "stage %s process %d: %d thread(s) on %s%s",
                spec.name,
                slot,
                handed.threads,
                device,
                f" (GPU {environment['CUDA_VISIBLE_DEVICES']})"
                if "CUDA_VISIBLE_DEVICES" in environment
                else "",
            )
        for attempt in range(_SPAWN_TRIES):
            try:
                p = StageProcess(
                    self.ctx, stage, slot, handed, self.config, environment=environment
                )
                break
            except (EOFError, ConnectionError) as e:
                # The fork server died under us (killed from outside, as the OOM killer
                # would): not the job's fault. The next start finds it gone and starts a
                # new one (multiprocessing's ensure_running), which imports all again.
                if attempt + 1 == _SPAWN_TRIES:
                    raise
                log.warning("stage server lost (%s: %s); starting a new one", type(e).__name__, e)
                time.sleep(0.1 * (attempt + 1))  # until the dead server can be reaped
        self.procs[stage].append(p)
        self.selector.register(p.outbox, selectors.EVENT_READ, (p, False))
        self.selector.register(p.process.sentinel, selectors.EVENT_READ, (p, True))
        self._redivide_threads()

    def _redivide_threads(self) -> None:
        """Tell each model process whose share of the cores changed (a process came or went)
        how many threads to run now."""
        threads = cpus.shares(self.specs, self._processes(), self.cores)
        for k, procs in enumerate(self.procs):
            for p in procs:
                if p.threads and p.threads != threads[k] and p.counts_as_worker:
                    log.info(
                        "stage %s process %d: %d thread(s), was %d",
                        p.name,
                        p.slot,
                        threads[k],
                        p.threads,
                    )
                    if p.send(frames.pack(frames.THREADS, payload=threads[k])):
                        p.threads = threads[k]

    def _take_requests(self) -> float | None:
        while True:
            try:
                request = self.requests.get_nowait()
            except queue.Empty:
                return None
            if request[0] == "submit":
                _, start, data, rows = request
                self.draining = False
                self.conveyor.submit(start, data, rows)
            elif request[0] == "flush":
                self.draining = True
            elif request[0] == "cancel":
                _, start, rows = request
                self.conveyor.cancel(start, rows)
            elif request[0] == "stop":
                return float(request[1])

    def _dispatch(self) -> None:
        # Downstream first: what it frees is what lets upstream results move on.
        for k in reversed(range(len(self.specs))):
            spec = self.specs[k]
            cap = 2 * spec.batch_size
            backlog = self.conveyor.backlog[k]
            while backlog:
                candidates = [p for p in self.procs[k] if p.accepts_work and p.load < cap]
                if not candidates:
                    break
                target = min(candidates, key=lambda p: p.load)
                frame = backlog.popleft()
                if not target.send(frame.buf):
                    backlog.appendleft(frame)
                    target.mark_dead()
                    break
                target.holding.add(frame.uids)
                target.flushed = False
                if frame.segment:
                    self.segments.mapped(target.process.pid, frame.segment)

    def _flush_drained(self) -> None:
        """When the input is drained, tell each stage whose upstream is empty not to wait."""
        if not self.draining:
            return
        for k in range(len(self.specs)):
            for p in self.procs[k]:
                if p.load and not p.flushed and p.state is not ProcState.DEAD:
                    p.flushed = p.send(frames.pack(frames.FLUSH))
            if self.conveyor.backlog[k] or any(p.load for p in self.procs[k]):
                break

    def _wait_and_receive(self, timeout: float) -> None:
        dead: list[StageProcess] = []
        for key, _ in self.selector.select(timeout):
            if key.data is None:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
                continue
            p, exited = key.data
            if p not in self.procs[p.stage]:
                continue  # buried earlier in this turn
            if exited or not self._receive_one(p):
                dead.append(p)
        for p in dict.fromkeys(dead):
            self._bury(p)
        self.segments.send_reclaims(self._tell_maker)

    def _receive(self, p: StageProcess) -> bool:
        """Read every message a process has sent. False once its outbox reports EOF."""
        conn: Connection = p.outbox
        try:
            while conn.poll():
                self._handle(p, conn.recv_bytes())
        except (EOFError, OSError):
            return False
        return True

    def _receive_one(self, p: StageProcess) -> bool:
        """Read one message of a process whose outbox is readable (the selector reports it
        again while more wait: no poll, which costs a selector of its own, per message)."""
        try:
            self._handle(p, p.outbox.recv_bytes())
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, p: StageProcess, buf: bytes) -> None:
        h = frames.header(buf)
        kind = h.kind
        for segment in h.released:
            self.segments.unmapped(p.process.pid, segment)
        if kind in (frames.ITEMS, frames.ERRORS, frames.FANOUT):
            p.holding.remove(self.conveyor.take_output(p.stage, buf, h))
        elif kind == frames.UNMAPPED:
            for segment in frames.payload(buf):
                self.segments.unmapped(p.process.pid, segment)
        elif kind == frames.READY:
            self._started(p)
        elif kind == frames.SETUP_FAILED:
            message = str(frames.payload(buf))
            if not self.announced_ready:
                self._fail(PipelineSetupError(message))  # it cannot start here: fail fast
            else:
                # A replacement that cannot start (the GPU still holds the old process's
                # memory, say): its exit counts as a failed start, retried a few times.
                log.warning("stage %s process %d could not start: %s", p.name, p.slot, message)
        elif kind == frames.RECYCLE:
            if p.accepts_work:
                log.info("stage %s process %d is over its memory limit: recycling", p.name, p.slot)
                metrics.STAGE_RESTARTS.labels(p.name, "memory").inc()
                p.drain("recycle")
                self._spawn(p.stage, p.slot)
            else:  # told to stop already (the pipeline stops): it goes, nothing replaces it
                log.debug(
                    "stage %s process %d is over its memory limit, and stopping", p.name, p.slot
                )

    def _started(self, p: StageProcess) -> None:
        if p.state is not ProcState.STARTING:
            return  # the pipeline stopped it while it was starting
        p.mark_ready()
        log.debug(
            "stage %s process %d ready in %.2fs", p.name, p.slot, time.monotonic() - p.started
        )
        self.startup_failures[p.stage] = 0
        if not self.announced_ready and all(
            q.state is not ProcState.STARTING for s in self.procs for q in s
        ):
            self.announced_ready = True
            self.on_ready()

    def _tell_maker(self, pid: int, segments: list[str]) -> bool:
        maker = next((p for stage in self.procs for p in stage if p.process.pid == pid), None)
        return (
            maker is not None
            and maker.state is not ProcState.DEAD
            and maker.send(frames.pack(frames.RECLAIM, payload=segments))
        )

    def _bury(self, p: StageProcess) -> None:
        """A process exited: collect its last words, then retry or fail what it held."""
        self._receive(p)
        state = p.state  # what it was doing when it went
        p.process.join(timeout=5)
        if p.process.is_alive():  # its pipe closed but it lingers: make sure it is gone
            p.process.kill()
            p.process.join(timeout=5)
        if p.state is not ProcState.DEAD:  # found gone already when a send to it failed
            p.mark_dead()
        killed = self._kills.pop(p, "")
        self.selector.unregister(p.outbox)
        self.selector.unregister(p.process.sentinel)
        p.close()
        self.procs[p.stage].remove(p)
        self.segments.process_gone(p.process.pid, self.conveyor.segments_waiting())
        code = p.process.exitcode
        held = p.holding.uids()
        if state is ProcState.DRAINING and not len(held):
            return  # recycled, retired or stopped, cleanly
        if self.fatal:
            return
        if state is ProcState.STARTING:
            self.startup_failures[p.stage] += 1
            if self.startup_failures[p.stage] >= _STARTUP_FAILURES_FATAL:
                message = (
                    f"stage {p.name!r} died {_STARTUP_FAILURES_FATAL} times while starting "
                    f"(exit code {code})"
                )
                # Before the pipeline was ever ready it cannot start here; after, it could,
                # and what keeps its replacements from starting passes (or not) elsewhere.
                error = PipelineBroken if self.announced_ready else PipelineSetupError
                self._fail(error(message))
                return
        how = killed or describe_exit(code)
        metrics.STAGE_RESTARTS.labels(p.name, "timeout" if killed else "died").inc()
        verdict = self.conveyor.take_back(
            held,
            p.board.running(),
            max_item_crashes=self.config.max_item_crashes,
            error=f"stage {p.name!r}: its process {how} while running this row, every time",
        )
        if len(held):
            log.warning(
                "stage %s process %d %s; %d rows in its batch, %d more queued",
                p.name,
                p.slot,
                how,
                verdict.batch,
                len(held) - verdict.batch,
            )
        if p.needs_successor:
            self._spawn(p.stage, p.slot)

    def _rebalance(self) -> None:
        """One tick of the elastic scheduler: measure each stage, maybe add or retire one."""
        assert self.elastic is not None and self.monitor is not None
        now = time.monotonic()
        self._next_tick = now + self.config.elastic.tick_s
        loads: list[StageLoad] = []
        self.monitor.sample(now)
        processes = self._processes()
        for k, spec in enumerate(self.specs):
            live = [p for p in self.procs[k] if p.accepts_work]
            shares = []
            for p in live:
                busy = p.board.busy_seconds(now)
                elapsed = now - p.mark_time
                if elapsed > 0.5 * self.config.elastic.tick_s:
                    shares.append(min(1.0, (busy - p.busy_mark) / elapsed))
                p.busy_mark, p.mark_time = busy, now
            utilization = sum(shares) / len(shares) if shares else 0.0
            running = sum(len(p.board.running()) for p in live)
            waiting = self.conveyor.waiting(k) + sum(p.load for p in live) - running
            assert spec.min_workers is not None and spec.max_workers is not None
            most = spec.max_workers
            on_cpu = spec.model is not None and not spec.device.startswith("cuda")
            # Another model process only while each still gets a core of its own.
            if on_cpu and not cpus.room_for_model_process(self.specs, processes, self.cores):
                most = min(most, processes[k])
            loads.append(
                StageLoad(
                    stage=k,
                    workers=processes[k],
                    min_workers=spec.min_workers,
                    max_workers=most,
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
                slot = devices.least_used_slot(
                    [p.slot for p in self.procs[k] if p.counts_as_worker]
                )
                log.info("elastic: stage %s gets a process (%d)", name, loads[k].workers + 1)
                self._spawn(k, slot)
            else:
                candidates = [p for p in self.procs[k] if p.accepts_work]
                if candidates:
                    p = min(candidates, key=lambda q: q.load)
                    log.info(
                        "elastic: stage %s gives a process back (%d)", name, loads[k].workers - 1
                    )
                    p.drain("retire")
                    self._redivide_threads()
        for k, spec in enumerate(self.specs):
            alive = [p for p in self.procs[k] if p.counts_as_worker]
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
                    if p.state is ProcState.DEAD or p in self._kills:
                        continue
                    started = p.board.started
                    if self._kill_all_after and now > self._kill_all_after:
                        self._kills[p] = "was killed at shutdown"
                    elif started and now - started > timeout:
                        self._kills[p] = f"was killed after a batch ran over {timeout:g}s"
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

    def _fail(self, error: PipelineError) -> None:
        if not self.fatal:
            self.fatal = str(error)
            log.error("pipeline failed: %s", error)
            self.on_fatal(error)

    def _shutdown(self, grace_s: float) -> None:
        self.shutting_down = True
        everyone = [p for stage in self.procs for p in stage]
        try:
            self._stop_processes(everyone, grace_s)
        except Exception:
            # Whatever failed while they drained (a result we could not hand over), the
            # processes, their segments and our pipes must still go.
            log.exception("pipeline router: stopping the stage processes failed")
        for p in everyone:
            if p.process.is_alive():
                p.process.kill()
            p.process.join(timeout=5)
            p.close()
            if p.state is not ProcState.DEAD:
                p.mark_dead()
        self.procs = [[] for _ in self.specs]
        self._depths = (0,) * len(self.specs)
        self.segments.close([p.process.pid for p in everyone], self.conveyor.segments_waiting())
        self.selector.close()
        with self._wake_lock:
            self._wake_closed = True
            self._wake_r.close()
            self._wake_w.close()

    def _stop_processes(self, everyone: list[StageProcess], grace_s: float) -> None:
        """Ask every process to stop, and read what they send until they exit, for up to
        grace_s; any still alive then are killed by the caller."""
        for p in everyone:
            if p.counts_as_worker:
                p.drain("stop")
        deadline = time.monotonic() + grace_s
        for p in everyone:
            # Keep reading, or a stage blocked writing its last results would never exit.
            while p.process.is_alive() and time.monotonic() < deadline:
                if not self._receive(p):
                    p.process.join(timeout=0.5)
                    break
                p.process.join(timeout=0.05)
