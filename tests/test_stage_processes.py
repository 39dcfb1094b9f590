"""A stage process's lifecycle, as the router sees it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ebb.worker import frames
from ebb.worker.processes import (
    TRANSITIONS,
    Holding,
    IllegalTransition,
    ProcState,
    StageProcess,
    check_transition,
)

STARTING, READY, DRAINING, DEAD = ProcState


class Inbox:
    """A process's inbox pipe: what was sent to it, or broken (the process is gone)."""

    def __init__(self, *, broken: bool = False) -> None:
        self.broken = broken
        self.sent: list[int] = []

    def send_bytes(self, buf: bytes) -> None:
        if self.broken:
            raise BrokenPipeError
        self.sent.append(frames.header(buf).kind)


def _process(slot: int, state: ProcState, load: int = 0, *, broken: bool = False) -> StageProcess:
    """The router's view of a process, without the process (none of it is touched here)."""
    p = StageProcess.__new__(StageProcess)
    p.stage, p.slot, p.name = 0, slot, "s"
    p.inbox = Inbox(broken=broken)
    p.state, p.drain_reason, p.flushed = state, None, False
    p.holding = Holding()
    if load:
        p.holding.add(np.arange(load, dtype=np.int64))
    return p


ALLOWED = {
    (STARTING, READY),
    (STARTING, DRAINING),  # the pipeline stops while it starts
    (STARTING, DEAD),
    (READY, DRAINING),
    (READY, DEAD),
    (DRAINING, DEAD),
}


@pytest.mark.parametrize(("old", "new"), list(itertools.product(ProcState, ProcState)))
def test_a_process_moves_only_along_its_lifecycle(old: ProcState, new: ProcState) -> None:
    assert ((old, new) in ALLOWED) == (new in TRANSITIONS[old])
    if (old, new) in ALLOWED:
        check_transition(old, new)
    else:
        with pytest.raises(IllegalTransition):
            check_transition(old, new)


def test_what_each_state_lets_a_process_do() -> None:
    assert [_process(0, s).accepts_work for s in ProcState] == [False, True, False, False]
    assert [_process(0, s).counts_as_worker for s in ProcState] == [True, True, False, False]


def test_a_drained_process_is_told_to_stop_and_one_that_cannot_be_told_is_gone() -> None:
    p = _process(0, READY)
    p.drain("recycle")
    assert (p.state, p.drain_reason) == (DRAINING, "recycle")
    assert p.inbox.sent == [frames.STOP]
    assert not p.needs_successor  # it has one already
    gone = _process(1, READY, broken=True)
    gone.drain("stop")
    assert gone.state is DEAD and gone.needs_successor
    with pytest.raises(IllegalTransition):
        p.mark_ready()
