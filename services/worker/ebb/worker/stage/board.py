"""The batch board: a stage process's shared-memory mailbox for what it runs now."""

from __future__ import annotations

import time
from multiprocessing.context import BaseContext

import numpy as np

ENGINE_FIELDS = ("in_flight", "held_tokens", "restarts", "prompt_tokens", "output_tokens")
"""What an llm stage posts of its engine: requests in flight now and the tokens (prompt plus
`max_tokens`) they hold; since the process started, the times the engine was made again and
the prompt and output tokens of the rows it generated."""


class BatchBoard:
    """Shared memory where a stage process posts the batch it is running: when it started,
    and which uids are in it. The router reads it to kill an overdue batch, and to know,
    when a process dies, which of the items it held were in the batch that killed it."""

    def __init__(self, ctx: BaseContext, capacity: int) -> None:
        self._started = ctx.Value("d", 0.0, lock=False)
        self._count = ctx.Value("i", 0, lock=False)
        self._uids = ctx.Array("q", capacity, lock=False)
        self._busy = ctx.Value("d", 0.0, lock=False)
        self._progress = ctx.Value("d", 0.0, lock=False)
        self._engine = ctx.Array("q", len(ENGINE_FIELDS), lock=False)
        """An llm stage's engine (ENGINE_FIELDS)."""

    def post(self, uids: np.ndarray) -> None:
        n = min(len(uids), len(self._uids))
        np.frombuffer(self._uids, dtype=np.int64)[:n] = uids[:n]
        self._count.value = n
        now = time.monotonic()
        self._progress.value = now
        self._started.value = now  # last: a reader seeing it sees the uids

    def clear(self) -> None:
        started = self._started.value
        if started:
            self._busy.value += time.monotonic() - started
        self._started.value = 0.0

    def busy_seconds(self, now: float) -> float:
        """Seconds spent running batches since the process started (the running one too)."""
        started = self._started.value
        return float(self._busy.value) + (now - started if started else 0.0)

    def touch(self) -> None:
        """The running batch made progress (an `llm` stage: a token, a finished row): its
        timeout counts from now, so a long batch that keeps generating is not taken for a
        hung one."""
        self._progress.value = time.monotonic()

    def report_engine(self, **values: int) -> None:
        """An llm stage's engine, some of ENGINE_FIELDS."""
        for name, value in values.items():
            self._engine[ENGINE_FIELDS.index(name)] = value

    @property
    def engine(self) -> dict[str, int]:
        """ENGINE_FIELDS as the stage last reported them."""
        return {name: int(self._engine[k]) for k, name in enumerate(ENGINE_FIELDS)}

    @property
    def last_progress(self) -> float:
        """When the running batch started or last made progress; 0.0 when idle."""
        started = float(self._started.value)
        return max(started, float(self._progress.value)) if started else 0.0

    @property
    def started(self) -> float:
        """When the running batch started (monotonic, system-wide); 0.0 when idle."""
        return float(self._started.value)

    def running(self) -> np.ndarray:
        """The uids of the running batch; empty when idle."""
        if not self._started.value:
            return np.empty(0, dtype=np.int64)
        return np.frombuffer(self._uids, dtype=np.int64)[: self._count.value].copy()
