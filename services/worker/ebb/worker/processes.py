"""The router's view of one stage process: its pipes and what it holds."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ebb.common.spec import StageSpec

from .settings import PipelineConfig
from .stage import BatchBoard, StageConfig, stage_main

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


class StageProcess:
    """One stage process and the router's view of it."""

    def __init__(
        self,
        ctx: Any,
        stage: int,
        slot: int,
        spec: StageSpec,
        config: PipelineConfig,
        *,
        environment: dict[str, str] | None = None,
    ) -> None:
        """`spec` as this process is handed it: its threads and its device (devices.py),
        `environment` what its environment must say besides the worker's."""
        self.stage = stage
        self.slot = slot
        self.name = spec.name
        inbox_r, self.inbox = ctx.Pipe(duplex=False)
        self.outbox, outbox_w = ctx.Pipe(duplex=False)
        self.board = BatchBoard(ctx, spec.batch_size)
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
        return self.holding.count

    def send(self, buf: bytes) -> bool:
        try:
            self.inbox.send_bytes(buf)
            return True
        except OSError:  # the process is gone; its sentinel will tell the router
            return False

    def close(self) -> None:
        for conn in (self.inbox, self.outbox):
            conn.close()
