"""Each stage's processes: starting them, choosing one for a frame, stopping and burying them.

A stage runs `workers` processes, or between `min_workers` and `max_workers` as the elastic
scheduler decides (ebb.worker.pipeline.elastic). Each process has a slot, its place among its
stage's replicas: a replacement takes the slot of the process it replaces, an added one the lowest
free slot, so that a `cuda` stage's replicas stay spread over the worker's GPUs
(ebb.worker.resources.devices). The model stages on the CPU share the worker's cores
(ebb.worker.resources.cpus): whenever a process comes or goes, each model process is told its share
again.
"""

from __future__ import annotations

import logging
import selectors
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.context import ForkServerContext

from ebb.common.job import StageSpec

from ..chunks import frames
from ..chunks.frames import Kind
from ..chunks.segments import SegmentLedger
from ..resources import cpus, devices
from .config import PipelineConfig
from .processes import ProcState, StageProcess

log = logging.getLogger(__name__)

_SPAWN_TRIES = 3


class StagePool:
    """One stage's processes, whatever their state, in the order they started."""

    def __init__(self, stage: int, spec: StageSpec, *, frame_rows: int = 0) -> None:
        self.stage = stage
        self.spec = spec
        # Rows a process may hold before it is sent more: two batches, so that the next is
        # there as one ends, and, where a frame is larger than that (rows go out in frames
        # of 256 at least), two frames. A process sent its next frame only once it held
        # (nearly) nothing sat idle while the router turned its output round, each frame: a
        # tenth of its time at the default batch of 32, more on a machine whose cores the
        # models keep busy. An llm stage's engine takes its rows as they come: the batches
        # it runs at once and the next one.
        self.cap = (
            (spec.llm.concurrent_batches + 1) * spec.rows_per_batch
            if spec.llm
            else max(2 * spec.rows_per_batch, 2 * frame_rows)
        )
        self._procs: list[StageProcess] = []
        self.failed_starts = 0
        """Its processes that died while starting since one last started."""

    def one_started(self) -> None:
        """A process of it started: the count of failed starts begins again."""
        self.failed_starts = 0

    def one_failed_to_start(self) -> int:
        """A process of it died while starting: how many have since one last started."""
        self.failed_starts += 1
        return self.failed_starts

    def __len__(self) -> int:
        return len(self._procs)

    def __contains__(self, p: object) -> bool:
        return p in self._procs

    def __iter__(self) -> Iterator[StageProcess]:
        """Its processes as they are now: burying or spawning while iterating is safe, and so
        is iterating from another thread."""
        return iter(list(self._procs))

    def live(self) -> list[StageProcess]:
        """Its processes, starting or taking work (not on their way out)."""
        return [p for p in self._procs if p.counts_as_worker]

    def ready(self) -> list[StageProcess]:
        """Its processes that take work."""
        return [p for p in self._procs if p.accepts_work]

    def load(self) -> int:
        """Rows its processes hold."""
        return sum(p.load for p in self._procs)

    def pick(self, cap: int) -> StageProcess | None:
        """The least-loaded process that takes work and holds fewer than `cap` rows."""
        candidates = [p for p in self._procs if p.accepts_work and p.load < cap]
        return min(candidates, key=lambda p: p.load) if candidates else None

    def feed(self, backlog: deque[frames.Frame], segments: SegmentLedger) -> None:
        """Hand frames from `backlog` to the least-loaded processes, while one has room."""
        while backlog:
            target = self.pick(self.cap)
            if target is None:
                return
            frame = backlog.popleft()
            if not target.send(frame.buf):
                backlog.appendleft(frame)
                target.mark_dead()
                return
            target.holding.add(frame.uids)
            target.flushed = False
            if frame.segment:
                segments.mapped(target.pid, frame.segment)

    def flush(self) -> None:
        """Tell each process that holds rows not to wait for a full batch (once, until it is
        sent more)."""
        for p in self._procs:
            if p.load and not p.flushed and p.state is not ProcState.DEAD:
                p.flushed = p.send(frames.pack(Kind.FLUSH))

    def retire_one(self) -> StageProcess | None:
        """Stop the least-loaded process that takes work, for good (None: none does)."""
        candidates = self.ready()
        if not candidates:
            return None
        p = min(candidates, key=lambda q: q.load)
        p.drain("retire")
        return p

    def free_slot(self) -> int:
        """The slot a process added to the stage takes."""
        return devices.least_used_slot([p.slot for p in self.live()])

    def measure(self, now: float, tick_s: float) -> tuple[float, int, int]:
        """Since the last measure (if at least half a tick ago), how busy its processes that
        take work were (0..1, on average), with the rows they hold and those they run now."""
        ready = self.ready()
        shares = []
        for p in ready:
            busy = p.board.busy_seconds(now)
            elapsed = now - p.mark_time
            if elapsed > 0.5 * tick_s:
                shares.append(min(1.0, (busy - p.busy_mark) / elapsed))
            p.busy_mark, p.mark_time = busy, now
        utilization = sum(shares) / len(shares) if shares else 0.0
        running = sum(len(p.board.running()) for p in ready)
        return utilization, sum(p.load for p in ready), running

    def add(self, p: StageProcess) -> None:
        self._procs.append(p)

    def remove(self, p: StageProcess) -> None:
        self._procs.remove(p)

    def clear(self) -> None:
        self._procs.clear()


class StagePools:
    """Every stage's pool; starts, stops and buries their processes, and divides the cores
    among them. Only the router's thread changes it. Each process's outbox and sentinel are
    watched by the router's `selector`, keyed (process, is the sentinel)."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        ctx: ForkServerContext,
        selector: selectors.BaseSelector,
        cores: float,
        gpus: tuple[str, ...] | None,
    ) -> None:
        self.config = config
        self.specs = config.stages
        self.ctx = ctx
        self.selector = selector
        self.cores = cores
        """The worker's CPU budget, which its model stages' threads share
        (ebb.worker.resources.cpus)."""
        self.gpus = gpus
        """The worker's GPUs, over which each `cuda` stage's replicas spread
        (ebb.worker.resources.devices)."""
        self.pools = [
            StagePool(k, spec, frame_rows=config.frame_size()) for k, spec in enumerate(self.specs)
        ]
        self._all_spawned = False
        self.closed = False
        """Set when the router starts to stop: nothing is spawned from then on, since
        nothing would stop, watch or sweep it."""

    def __getitem__(self, stage: int) -> StagePool:
        return self.pools[stage]

    def __len__(self) -> int:
        return len(self.pools)

    def __iter__(self) -> Iterator[StagePool]:
        return iter(self.pools)

    def everyone(self) -> list[StageProcess]:
        return [p for pool in self.pools for p in pool]

    def by_pid(self, pid: int) -> StageProcess | None:
        return next((p for p in self.everyone() if p.pid == pid), None)

    def reclaim(self, pid: int, segments: list[str]) -> bool:
        """Hand `segments` back to the process `pid` that made them (False: it is gone)."""
        maker = self.by_pid(pid)
        return (
            maker is not None
            and maker.state is not ProcState.DEAD
            and maker.send(frames.pack(Kind.RECLAIM, payload=segments))
        )

    def all_started(self) -> bool:
        """Whether every process has been ready at least once (or still is)."""
        return all(p.state is not ProcState.STARTING for p in self.everyone())

    def start_all(self) -> None:
        """Start each stage's first `workers` processes."""
        for k, spec in enumerate(self.specs):
            for slot in range(spec.workers):
                self.spawn(k, slot)
        self._all_spawned = True

    def processes(self) -> list[int]:
        """Processes each stage runs (while the pipeline starts: will run)."""
        live = [len(pool.live()) for pool in self.pools]
        if self._all_spawned:
            return live
        return [max(n, s.workers) for n, s in zip(live, self.specs, strict=True)]

    def spawn(self, stage: int, slot: int) -> None:
        if self.closed:
            return
        processes = self.processes()
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
        self.pools[stage].add(p)
        self.selector.register(p.outbox, selectors.EVENT_READ, (p, False))
        self.selector.register(p.process.sentinel, selectors.EVENT_READ, (p, True))
        self.redivide_threads()

    def replace(self, p: StageProcess) -> None:
        """Start a process in the place (the slot) of `p`."""
        self.spawn(p.stage, p.slot)

    def recycle(self, p: StageProcess) -> None:
        """`p` is over its memory limit: it finishes what it holds, its successor starts now."""
        p.drain("recycle")
        self.replace(p)

    def retire(self, stage: int) -> bool:
        """Stop a process of `stage` for good (False: none takes work)."""
        if self.pools[stage].retire_one() is None:
            return False
        self.redivide_threads()
        return True

    def stop_all(self) -> None:
        """Tell every process not on its way out already to stop."""
        for p in self.everyone():
            if p.counts_as_worker:
                p.drain("stop")

    def kill_all(self) -> None:
        """The pipeline stops: every process still alive is killed, and all are forgotten."""
        for p in self.everyone():
            if p.process.is_alive():
                p.process.kill()
            p.process.join(timeout=5)
            p.close()
            if p.state is not ProcState.DEAD:
                p.mark_dead()
        for pool in self.pools:
            pool.clear()

    def bury(self, p: StageProcess) -> None:
        """`p` exited (its last words read): make sure it is gone, and forget it."""
        p.process.join(timeout=5)
        if p.process.is_alive():  # its pipe closed but it lingers: make sure it is gone
            p.process.kill()
            p.process.join(timeout=5)
        if p.state is not ProcState.DEAD:  # found gone already when a send to it failed
            p.mark_dead()
        self.selector.unregister(p.outbox)
        self.selector.unregister(p.process.sentinel)
        p.close()
        self.pools[p.stage].remove(p)

    def redivide_threads(self) -> None:
        """Tell each model process whose share of the cores changed (a process came or went)
        how many threads to run now."""
        threads = cpus.shares(self.specs, self.processes(), self.cores)
        for k, pool in enumerate(self.pools):
            for p in pool:
                if p.threads and p.threads != threads[k] and p.counts_as_worker:
                    log.info(
                        "stage %s process %d: %d thread(s), was %d",
                        p.name,
                        p.slot,
                        threads[k],
                        p.threads,
                    )
                    if p.send(frames.pack(Kind.THREADS, payload=threads[k])):
                        p.threads = threads[k]
