"""The router's view of one stage process: its pipes, what it holds, where it is in its life.

    STARTING --(it says READY)--> READY --drain(reason)--> DRAINING --> DEAD

A process takes work only while READY. Told to stop (drained), it works through what it
holds and takes nothing new; why it drains decides what happens once it exits: one
`recycle`d (over its memory limit) has its successor started already, one `retire`d (the
elastic scheduler gave it back) is not wanted, one told to `stop` goes with the pipeline.
A process still starting is drained only when the pipeline stops. Any process becomes DEAD
when its pipe breaks (it is gone; its sentinel will tell the router) or when the router
buries it; DEAD is final. `TRANSITIONS` is the map, checked in one place (`check_transition`).
"""

from __future__ import annotations

import enum
import os
import time
from multiprocessing.context import ForkServerContext
from typing import Literal

import numpy as np

from ebb.common import lifecycle
from ebb.common.job import StageSpec

from ..chunks import frames
from ..chunks.frames import Kind
from ..stage.board import BatchBoard
from ..stage.loop import StageConfig, stage_main
from .config import PipelineConfig

_EMPTY = np.empty(0, dtype=np.int64)


class Holding:
    """The uids a process holds (sent to it, not yet back), kept as the arrays of the frames
    that moved them: a count per frame on the hot path; the uids themselves are worked out
    only when someone asks (the process died)."""

    _COMPACT_AFTER = 64

    def __init__(self) -> None:
        self._sent: list[np.ndarray] = []
        self._back: list[np.ndarray] = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, uids: np.ndarray) -> None:
        self._sent.append(uids)
        self.count += len(uids)

    def remove(self, uids: np.ndarray) -> None:
        self._back.append(uids)
        self.count -= len(uids)
        if self.count <= 0:
            self._sent.clear()
            self._back.clear()
            self.count = 0
        elif len(self._back) > self._COMPACT_AFTER:
            self._compact()

    def uids(self) -> np.ndarray:
        self._compact()
        return self._sent[0] if self._sent else _EMPTY

    def _compact(self) -> None:
        if not self._back and len(self._sent) <= 1:
            return
        sent = np.concatenate(self._sent) if self._sent else _EMPTY
        left = _minus(sent, np.concatenate(self._back)) if self._back else sent
        self._sent = [left] if len(left) else []
        self._back.clear()
        self.count = len(left)


def _minus(sent: np.ndarray, back: np.ndarray) -> np.ndarray:
    """`sent` less `back`, as multisets: a row sent to a process twice (it went round again
    after a crash further on) and back once is still held once."""
    values, counts = np.unique(sent, return_counts=True)
    gone, gone_counts = np.unique(back, return_counts=True)
    at = np.searchsorted(gone, values).clip(max=max(len(gone) - 1, 0))
    if len(gone):
        counts = counts - np.where(gone[at] == values, gone_counts[at], 0)
    left: np.ndarray = np.repeat(values, counts.clip(min=0))
    return left


class ProcState(enum.Enum):
    STARTING = "starting"
    """Started; setting up its modelet (or model), not yet taking work."""
    READY = "ready"
    """Set up and taking work."""
    DRAINING = "draining"
    """Told to stop: it finishes what it holds, and takes nothing new."""
    DEAD = "dead"
    """Gone: its pipe broke, or it exited and was buried."""


DrainReason = Literal["stop", "recycle", "retire"]
"""Why a process drains: the pipeline stops; it is over its memory limit (its successor
starts at once); the elastic scheduler gave it back (nobody takes its place)."""

TRANSITIONS: dict[ProcState, frozenset[ProcState]] = {
    ProcState.STARTING: frozenset({ProcState.READY, ProcState.DRAINING, ProcState.DEAD}),
    ProcState.READY: frozenset({ProcState.DRAINING, ProcState.DEAD}),
    ProcState.DRAINING: frozenset({ProcState.DEAD}),
    ProcState.DEAD: frozenset(),
}


def check_transition(old: ProcState, new: ProcState) -> None:
    """Raise IllegalTransition unless a process may go from `old` to `new` (a bug in the
    router)."""
    lifecycle.check(TRANSITIONS, old, new, what="a stage process")


class StageProcess:
    """One stage process and the router's view of it. Only the router's thread moves it
    through its lifecycle."""

    def __init__(
        self,
        ctx: ForkServerContext,
        stage: int,
        slot: int,
        spec: StageSpec,
        config: PipelineConfig,
        *,
        environment: dict[str, str] | None = None,
    ) -> None:
        """`spec` as this process is handed it: its threads and its device
        (ebb.worker.resources.devices), `environment` what its environment must say besides the
        worker's."""
        self.stage = stage
        self.slot = slot
        self.name = spec.name
        inbox_r, self.inbox = ctx.Pipe(duplex=False)
        self.outbox, outbox_w = ctx.Pipe(duplex=False)
        # The uids of every batch it runs at once (an llm stage's server: two).
        at_once = spec.llm.concurrent_batches if spec.llm is not None else 1
        self.board = BatchBoard(ctx, spec.rows_per_batch * at_once)
        stage_config = StageConfig(
            spec=spec,
            code_paths=config.code_paths,
            memory_limit_bytes=config.memory_limit_bytes,
            environment={**os.environ, **(environment or {})},
            worker_pid=os.getpid(),
        )
        self.process = ctx.Process(
            target=stage_main,
            args=(stage_config, inbox_r, outbox_w, self.board),
            name=f"ebb-stage-{spec.name}-{slot}",
        )
        self.threads = spec.threads
        """The intra-op threads it was told to run (0: not a model stage)."""
        self.device = spec.device
        self.started = time.monotonic()
        try:
            self.process.start()
        except BaseException:
            self.inbox.close()
            self.outbox.close()
            raise
        finally:
            # Our copies of the child's ends must go, or we would never see EOF when it dies.
            inbox_r.close()
            outbox_w.close()
        self.holding = Holding()
        """Rows sent to this process and not yet returned."""
        self.state = ProcState.STARTING
        self.drain_reason: DrainReason | None = None
        self.flushed = False
        """Told not to wait for a full batch since it was last sent rows."""
        self.busy_mark = 0.0
        self.mark_time = time.monotonic()

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None  # started in __init__
        return pid

    @property
    def load(self) -> int:
        return self.holding.count

    @property
    def accepts_work(self) -> bool:
        """Rows may be sent to it."""
        return self.state is ProcState.READY

    @property
    def counts_as_worker(self) -> bool:
        """One of its stage's processes, now or once it has started: not on its way out."""
        return self.state in (ProcState.STARTING, ProcState.READY)

    @property
    def needs_successor(self) -> bool:
        """Whether a new process takes its place when it dies: not when it was recycled (its
        successor started then) or retired (nobody wants one)."""
        return self.drain_reason not in ("recycle", "retire")

    def mark_ready(self) -> None:
        self._move(ProcState.READY)

    def drain(self, reason: DrainReason) -> None:
        """Tell it to stop: it finishes what it holds first. If it cannot be told, it is gone."""
        self._move(ProcState.DRAINING)
        self.drain_reason = reason
        if not self.send(frames.pack(Kind.STOP)):
            self.mark_dead()

    def mark_dead(self) -> None:
        self._move(ProcState.DEAD)

    def _move(self, new: ProcState) -> None:
        check_transition(self.state, new)
        self.state = new

    def send(self, buf: bytes) -> bool:
        try:
            self.inbox.send_bytes(buf)
            return True
        except OSError:  # the process is gone; its sentinel will tell the router
            return False

    def close(self) -> None:
        for conn in (self.inbox, self.outbox):
            conn.close()


def describe_exit(code: int | None) -> str:
    """How a process ended, by its exit code, as a sentence's predicate."""
    if code is None:
        return "vanished"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
