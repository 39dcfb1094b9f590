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

A frame is a chunk of rows with their uids (see ebb.worker.chunks.frames,
ebb.worker.chunks.columns): the router's bookkeeping is per frame, never per row. Only when a
process dies does it work out which rows that process held, and what becomes of them
(ebb.worker.pipeline.ledger).

Each turn of the loop (`_step`) takes the requests of other threads
(ebb.worker.pipeline.mailbox), hands waiting frames to processes, tells stages whose input has
run dry not to wait for full batches, reads what the processes sent (burying those that died),
and lets the elastic scheduler measure (ebb.worker.pipeline.scaling). What it keeps: each
stage's processes (ebb.worker.pipeline.stagepool, ebb.worker.pipeline.processes), where rows go
next (ebb.worker.pipeline.conveyor), the rows kept until they are out
(ebb.worker.pipeline.ledger), shared memory (ebb.worker.chunks.segments); the watchdog
(ebb.worker.pipeline.watchdog) runs beside it.
"""

from __future__ import annotations

import logging
import selectors
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import assert_never

import pyarrow as pa

from .. import metrics
from ..chunks import frames
from ..chunks.columns import Columns
from ..chunks.frames import Kind
from ..chunks.segments import SegmentLedger
from ..chunks.shm import Arena, sweep_orphans
from ..resources import cpus
from ..stage.lifeline import name_this_thread
from .config import PipelineBroken, PipelineConfig, PipelineError, PipelineSetupError
from .conveyor import Conveyor, ErrorsCallback, ResultsCallback
from .enginemeter import EngineMeter
from .ledger import RowLedger
from .mailbox import Cancel, Flush, Mailbox, Stop, Submit
from .processes import ProcState, StageProcess, describe_exit
from .scaling import Scaler
from .stagepool import StagePools
from .stageserver import stage_context
from .watchdog import Watchdog

log = logging.getLogger(__name__)

_STARTUP_FAILURES_FATAL = 3
ROUTER_THREAD = "ebb-router"
"""The router thread's name, as the system shows it (for CPU by thread)."""
_DEPTHS_EVERY_S = 0.2
"""How often the router counts its stages' depths for other threads (a gauge's worth)."""
_WAIT_S = 0.1
"""How long a turn of the loop waits for a process to send something."""


class Router:
    """The thread that owns every stage process. Only its own thread touches its state;
    other threads talk to it through `submit`, `flush`, `cancel` and `stop`."""

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
        swept = sweep_orphans()
        if swept:
            log.info("removed %d shared-memory segments left by dead workers", swept)
        self.segments = SegmentLedger(Arena())
        self.rows = RowLedger()
        self.conveyor = Conveyor(
            self.specs,
            rows=self.rows,
            segments=self.segments,
            on_results=on_results,
            on_errors=on_errors,
        )
        self.mailbox = Mailbox(self.ctx)
        # One selector for the router's life (not one per wait): stage pipes and process
        # sentinels are registered as processes come and go.
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.mailbox.bell, selectors.EVENT_READ, None)
        cores = config.cpus if config.cpus is not None else cpus.detect()
        self.pools = StagePools(
            config, ctx=self.ctx, selector=self.selector, cores=cores, gpus=config.gpus
        )
        self.scaler = Scaler.for_pipeline(config, cores=cores)
        self.draining = False
        """The input has run dry (until more is submitted): stages need not wait for it."""
        self.announced_ready = False
        self.fatal = ""
        self._depths: tuple[int, ...] = (0,) * len(self.specs)
        """Rows waiting for or inside each stage, as the router last counted them."""
        self._depths_due = 0.0
        self.thread = threading.Thread(target=self._main, name="ebb-pipeline-router", daemon=True)
        self.watchdog = Watchdog(self.pools, batch_timeout_s=config.batch_timeout_s)
        self.engine_meter = EngineMeter()

    # -- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self.thread.start()
        self.watchdog.start()

    def submit(self, start: int, data: pa.RecordBatch | Columns, rows: int) -> None:
        """Rows for the first stage, under uids start..start+rows-1: the rows of an Arrow
        record batch (which travels as Arrow and becomes columns inside the stage process),
        or a chunk of columns."""
        self.mailbox.post(Submit(start, data, rows))

    def flush(self) -> None:
        self.mailbox.post(Flush())

    def cancel(self, start: int, rows: int) -> None:
        """Nobody waits for uids start..start+rows-1 any more: drop what of them has not
        reached a process yet (reported through `on_errors`)."""
        self.mailbox.post(Cancel(start, rows))

    def stop(self, grace_s: float) -> None:
        """Stop every process (each finishes what it holds, for up to grace_s) and the thread."""
        if self.thread.is_alive():
            self.watchdog.kill_all_after(time.monotonic() + grace_s + 1.0)
            self.mailbox.post(Stop(grace_s))
            self.thread.join()
        self.watchdog.stop()

    def depths(self) -> list[int]:
        """Rows waiting for or inside each stage, as the router last counted them (a few
        times a second, on its own thread: its backlogs are not ours to read)."""
        return list(self._depths)

    # -- the router thread -----------------------------------------------------------------

    def _main(self) -> None:
        name_this_thread(ROUTER_THREAD)
        grace_s = 0.0
        try:
            self.pools.start_all()
            while (stop := self._step()) is None:
                pass
            grace_s = stop
        except Exception as e:
            log.exception("pipeline router failed")
            self._fail(PipelineBroken(f"pipeline router failed: {type(e).__name__}: {e}"))
        finally:
            self._shutdown(grace_s)

    def _step(self) -> float | None:
        """One turn of the loop; the grace period the processes get once told to stop."""
        stop = self._take_requests()
        if stop is not None:
            return stop
        self._dispatch()
        self._flush_drained()
        self._wait_and_receive(_WAIT_S)
        self.conveyor.settle_joins()
        if self.scaler is not None and self.scaler.due(time.monotonic()):
            waiting = [self.conveyor.waiting(k) for k in range(len(self.pools))]
            self.scaler.tick(self.pools, waiting=waiting)
        self._publish_depths()
        return None

    def _take_requests(self) -> float | None:
        for request in self.mailbox.take():
            match request:
                case Submit(start, data, rows):
                    self.draining = False
                    self.conveyor.submit(start, data, rows)
                case Flush():
                    self.draining = True
                case Cancel(start, rows):
                    self.conveyor.cancel(start, rows)
                case Stop(grace_s):
                    return grace_s
                case _:
                    assert_never(request)
        return None

    def _dispatch(self) -> None:
        # Downstream first: what it frees is what lets upstream results move on.
        for k in reversed(range(len(self.pools))):
            self.pools[k].feed(self.conveyor.backlog[k], self.segments)

    def _flush_drained(self) -> None:
        """When the input is drained, tell each stage whose upstream is empty not to wait."""
        if not self.draining:
            return
        dry: list[bool] = []  # nothing waits in or before each stage
        for k, pool in enumerate(self.pools):
            if not all(dry[i] for i in self.conveyor.graph.inputs[k]):
                dry.append(False)
                continue
            pool.flush()
            dry.append(not self.conveyor.backlog[k] and not pool.load())

    def _wait_and_receive(self, timeout: float) -> None:
        dead: list[StageProcess] = []
        for key, _ in self.selector.select(timeout):
            if key.data is None:
                self.mailbox.silence()
                continue
            p, exited = key.data
            if p not in self.pools[p.stage]:
                continue  # buried earlier in this turn
            if exited or not self._receive_one(p):
                dead.append(p)
        for p in dict.fromkeys(dead):
            self._bury(p)
        self.segments.send_reclaims(self.pools.reclaim)

    def _publish_depths(self) -> None:
        now = time.monotonic()
        if now < self._depths_due:
            return
        self._depths_due = now + _DEPTHS_EVERY_S
        # One tuple, swapped in whole: a reader on another thread sees one count or the next.
        self._depths = tuple(
            self.conveyor.waiting(k) + pool.load() for k, pool in enumerate(self.pools)
        )
        self.engine_meter.read(self.pools)  # as often: the llm stages' engines' metrics

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
        for segment in h.released:
            self.segments.unmapped(p.pid, segment)
        match h.kind:
            case Kind.ITEMS | Kind.ERRORS | Kind.FANOUT:
                p.holding.remove(self.conveyor.take_output(p.stage, buf, h))
            case Kind.UNMAPPED:
                for segment in frames.payload(buf):
                    self.segments.unmapped(p.pid, segment)
            case Kind.READY:
                self._started(p)
            case Kind.SETUP_FAILED:
                message = str(frames.payload(buf))
                if not self.announced_ready:
                    self._fail(PipelineSetupError(message))  # it cannot start here: fail fast
                else:
                    # A replacement that cannot start (the GPU still holds the old process's
                    # memory, say): its exit counts as a failed start, retried a few times.
                    log.warning("stage %s process %d could not start: %s", p.name, p.slot, message)
            case Kind.RECYCLE:
                self._recycle(p)
            case Kind.FLUSH | Kind.STOP | Kind.RECLAIM | Kind.THREADS:
                raise PipelineBroken(f"stage {p.name} process {p.slot} sent {h.kind.name}")
            case _:
                assert_never(h.kind)

    def _recycle(self, p: StageProcess) -> None:
        if p.accepts_work:
            log.info("stage %s process %d is over its memory limit: recycling", p.name, p.slot)
            metrics.STAGE_RESTARTS.labels(p.name, "memory").inc()
            self.pools.recycle(p)
        else:  # told to stop already (the pipeline stops): it goes, nothing replaces it
            log.debug("stage %s process %d is over its memory limit, and stopping", p.name, p.slot)

    def _started(self, p: StageProcess) -> None:
        if p.state is not ProcState.STARTING:
            return  # the pipeline stopped it while it was starting
        p.mark_ready()
        log.debug(
            "stage %s process %d ready in %.2fs", p.name, p.slot, time.monotonic() - p.started
        )
        self.pools[p.stage].one_started()
        if not self.announced_ready and self.pools.all_started():
            self.announced_ready = True
            self.on_ready()

    def _bury(self, p: StageProcess) -> None:
        """A process exited: collect its last words, then retry or fail what it held."""
        self._receive(p)
        state = p.state  # what it was doing when it went
        self.pools.bury(p)
        killed = self.watchdog.verdict(p)
        self.segments.process_gone(p.pid, self.conveyor.segments_waiting())
        held = p.holding.uids()
        if state is ProcState.DRAINING and not len(held):
            return  # recycled, retired or stopped, cleanly
        if self.fatal:
            return
        if state is ProcState.STARTING and self._gives_up_starting(p):
            return
        how = killed or describe_exit(p.process.exitcode)
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
            self.pools.replace(p)

    def _gives_up_starting(self, p: StageProcess) -> bool:
        """`p` died while starting: whether its stage has failed to start too often (then
        the pipeline fails)."""
        if self.pools[p.stage].one_failed_to_start() < _STARTUP_FAILURES_FATAL:
            return False
        message = (
            f"stage {p.name!r} died {_STARTUP_FAILURES_FATAL} times while starting "
            f"(exit code {p.process.exitcode})"
        )
        # Before the pipeline was ever ready it cannot start here; after, it could, and what
        # keeps its replacements from starting passes (or not) elsewhere.
        error = PipelineBroken if self.announced_ready else PipelineSetupError
        self._fail(error(message))
        return True

    def _fail(self, error: PipelineError) -> None:
        if not self.fatal:
            self.fatal = str(error)
            log.error("pipeline failed: %s", error)
            self.on_fatal(error)

    def _shutdown(self, grace_s: float) -> None:
        self.pools.closed = True
        everyone = self.pools.everyone()
        try:
            self._stop_processes(everyone, grace_s)
        except Exception:
            # Whatever failed while they drained (a result we could not hand over), the
            # processes, their segments and our pipes must still go.
            log.exception("pipeline router: stopping the stage processes failed")
        self.pools.kill_all()
        self._depths = (0,) * len(self.specs)
        self.segments.close([p.pid for p in everyone], self.conveyor.segments_waiting())
        self.selector.close()
        self.mailbox.close()

    def _stop_processes(self, everyone: list[StageProcess], grace_s: float) -> None:
        """Ask every process to stop, and read what they send until they exit, for up to
        grace_s; any still alive then are killed by the caller."""
        self.pools.stop_all()
        deadline = time.monotonic() + grace_s
        for p in everyone:
            # Keep reading, or a stage blocked writing its last results would never exit.
            while p.process.is_alive() and time.monotonic() < deadline:
                if not self._receive(p):
                    p.process.join(timeout=0.5)
                    break
                p.process.join(timeout=0.05)
