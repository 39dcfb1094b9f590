"""The watchdog: kills stage processes whose batch overran its timeout, and at shutdown, past
the grace period, every one.

A thread of its own: the router may be blocked writing to the very process that hangs (a full
pipe), and only the kill frees it. It only reads the processes (their state, their batch
board, which is shared memory the process writes); why it killed one it keeps itself, for the
router to ask when it buries that process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable

from .processes import ProcState, StageProcess
from .stagepool import StagePool

log = logging.getLogger(__name__)

_EVERY_S = 0.2


class Watchdog:
    def __init__(self, pools: Iterable[StagePool], *, batch_timeout_s: float) -> None:
        self._pools = pools
        self._timeout = batch_timeout_s
        self._stop = threading.Event()
        self._kill_all_after = 0.0
        self._verdicts: dict[StageProcess, str] = {}
        """Why it killed each process it killed, until the router asks."""
        self.thread = threading.Thread(
            target=self._watch, name="ebb-pipeline-watchdog", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def kill_all_after(self, deadline: float) -> None:
        """Kill every process still alive at `deadline` (monotonic): the pipeline stops."""
        self._kill_all_after = deadline

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def verdict(self, p: StageProcess) -> str:
        """How `p` died if the watchdog killed it ("was killed ..."), else ""; forgets it."""
        return self._verdicts.pop(p, "")

    def _watch(self) -> None:
        while not self._stop.wait(_EVERY_S):
            now = time.monotonic()
            for pool in self._pools:
                for p in pool:
                    if p.state is ProcState.DEAD or p in self._verdicts:
                        continue
                    # Counted from the batch's last progress: its start, or (an llm stage) its
                    # last token. A batch that makes none for the timeout is hung.
                    progressed = p.board.last_progress
                    if self._kill_all_after and now > self._kill_all_after:
                        self._verdicts[p] = "was killed at shutdown"
                    elif progressed and now - progressed > self._timeout:
                        self._verdicts[p] = f"was killed after a batch ran over {self._timeout:g}s"
                        log.warning(
                            "stage %s process %d: batch over %gs, killing it",
                            p.name,
                            p.slot,
                            self._timeout,
                        )
                    else:
                        continue
                    with contextlib.suppress(OSError, ValueError, AttributeError):
                        p.process.kill()
