"""A stage process's lifecycle, and how a stage's pool chooses among its processes."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import cast

import numpy as np
import pytest

from ebb.common.job import StageSpec
from ebb.common.job.llm import LLMSpec
from ebb.common.lifecycle import IllegalTransition
from ebb.worker.chunks import frames
from ebb.worker.chunks.segments import SegmentLedger
from ebb.worker.chunks.shm import Arena
from ebb.worker.pipeline.processes import (
    TRANSITIONS,
    Holding,
    ProcState,
    StageProcess,
    check_transition,
)
from ebb.worker.pipeline.stagepool import StagePool

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
    p.inbox = cast(Connection, Inbox(broken=broken))
    p.state, p.drain_reason, p.flushed = state, None, False
    p.holding = Holding()
    if load:
        p.holding.add(np.arange(load, dtype=np.int64))
    return p


def _pool(*processes: StageProcess) -> StagePool:
    pool = StagePool(0, StageSpec(name="s", modelet="m:M", batch_size=4))
    for p in processes:
        pool.add(p)
    return pool


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
    assert cast(Inbox, p.inbox).sent == [frames.Kind.STOP]
    assert not p.needs_successor  # it has one already
    gone = _process(1, READY, broken=True)
    gone.drain("stop")
    assert gone.state is DEAD and gone.needs_successor
    with pytest.raises(IllegalTransition):
        p.mark_ready()


def test_a_frame_goes_to_the_least_loaded_process_that_takes_work_and_has_room() -> None:
    light, busy = _process(0, READY, load=3), _process(1, READY, load=1)
    starting, draining = _process(2, STARTING), _process(3, DRAINING)
    pool = _pool(light, starting, busy, draining)
    assert pool.pick(cap=8) is busy
    assert pool.pick(cap=1) is None  # every one that takes work is full
    assert pool.live() == [light, starting, busy]
    assert pool.load() == 4


def test_a_process_may_hold_two_batches_or_two_frames_whichever_is_more() -> None:
    """The next frame is there as one ends: a process idle while the router turns its output
    round idles each frame. An llm stage's engine takes rows as they come: the two batches it
    runs at once and the next; a `tokenize_only` stage, one batch and the next."""
    model = StageSpec(name="m", model="m.onnx", batch_size=32)
    assert StagePool(0, model, frame_rows=256).cap == 512
    assert StagePool(0, replace(model, batch_size=1_024), frame_rows=1_024).cap == 2_048
    llm = StageSpec(name="g", llm=LLMSpec(model="/models/tiny"), batch_size=16)
    assert StagePool(0, llm, frame_rows=256).cap == 48
    tokenize = StageSpec(
        name="t", llm=LLMSpec(model="/models/tiny", tokenize_only=True), batch_size=16
    )
    assert StagePool(0, tokenize, frame_rows=256).cap == 32


def test_frames_go_out_while_a_process_has_room_a_broken_pipe_means_it_is_gone() -> None:
    segments = SegmentLedger(Arena())
    first, second = _process(0, READY), _process(1, READY, broken=True)
    pool = _pool(first, second)
    uids = [np.arange(i * 4, i * 4 + 4, dtype=np.int64) for i in range(4)]
    backlog = deque(frames.Frame(frames.pack(frames.Kind.ITEMS, u, {}), u, 0, "") for u in uids)
    pool.feed(backlog, segments)
    # The first frame went to the first; the second failed on the broken pipe and waits.
    assert first.load == 4 and second.state is DEAD and len(backlog) == 3
    pool.feed(backlog, segments)
    assert first.load == 8 and len(backlog) == 2  # its cap: two batches
    segments.close([], [])


def test_a_retired_process_is_the_least_loaded_and_its_slot_is_the_next_one_taken() -> None:
    a, b, c = _process(0, READY, load=2), _process(1, READY, load=0), _process(2, READY, load=5)
    pool = _pool(a, b, c)
    assert pool.retire_one() is b
    assert (b.state, b.drain_reason) == (DRAINING, "retire") and not b.needs_successor
    assert pool.free_slot() == 1
    assert _pool(_process(0, STARTING), _process(1, DRAINING)).retire_one() is None
