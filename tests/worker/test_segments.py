"""Who reads which shared-memory segment, and handing each back to its maker once read."""

from __future__ import annotations

import os

import pytest

from ebb.worker.chunks import shm
from ebb.worker.chunks.segments import SegmentLedger, maker_of
from ebb.worker.chunks.shm import Arena

MAKER, OTHER_MAKER, READER = 101, 102, 201


class Makers:
    """The processes segments are handed back to, all alive: what each was told."""

    def __init__(self) -> None:
        self.told: list[tuple[int, list[str]]] = []

    def tell(self, pid: int, names: list[str]) -> bool:
        self.told.append((pid, names))
        return True


def test_a_segment_goes_back_to_its_maker_once_read_all_reclaims_at_once() -> None:
    segments, makers = SegmentLedger(Arena()), Makers()
    first, second, third = f"ebb-{MAKER}-1", f"ebb-{MAKER}-2", f"ebb-{OTHER_MAKER}-1"
    assert maker_of(first) == MAKER
    for name in (first, second, third):
        segments.mapped(READER, name)
    assert segments.in_flight(["ebb-7-7"]) == {first, second, third, "ebb-7-7"}
    segments.unmapped(READER, first)
    segments.unmapped(READER, third)
    segments.done(second)  # read by the router itself

    segments.send_reclaims(makers.tell)
    assert makers.told == [(MAKER, [first, second]), (OTHER_MAKER, [third])]
    assert segments.in_flight([]) == {second}  # still mapped by its reader, as far as we know
    makers.told.clear()
    segments.send_reclaims(makers.tell)
    assert makers.told == []  # each told once
    segments.close([], [])


def test_what_a_dead_reader_mapped_goes_back_to_the_makers() -> None:
    segments, makers = SegmentLedger(Arena()), Makers()
    segments.mapped(READER, f"ebb-{MAKER}-1")
    segments.mapped(READER + 1, f"ebb-{MAKER}-2")
    segments.process_gone(READER, waiting=[])
    segments.send_reclaims(makers.tell)
    assert makers.told == [(MAKER, [f"ebb-{MAKER}-1"])]
    assert segments.in_flight([]) == {f"ebb-{MAKER}-2"}
    segments.close([], [])


@pytest.mark.skipif(not shm.AVAILABLE, reason="no shared memory here: buffers stay in pipes")
def test_the_routers_own_segments_go_back_to_its_arena() -> None:
    arena = Arena(min_bytes=1)
    segments = SegmentLedger(arena)
    try:
        name, _ = arena.store([memoryview(bytearray(16))])
        segments.mapped(READER, name)
        segments.unmapped(READER, name)
        makers = Makers()
        segments.send_reclaims(makers.tell)
        assert makers.told == []  # nobody to tell: the arena has it back, for reuse
        again, _ = arena.store([memoryview(bytearray(16))])
        assert again == name
        segments.done(again)
    finally:
        segments.close([], [])


@pytest.mark.skipif(not shm.AVAILABLE, reason="no shared memory here: buffers stay in pipes")
def test_segments_of_a_maker_that_is_gone_are_unlinked() -> None:
    maker = Arena(min_bytes=1)  # another process's, as far as the ledger can tell
    segments = SegmentLedger(Arena())
    try:
        name, _ = maker.store([memoryview(bytearray(16))])
        segments.mapped(READER, name)
        segments.unmapped(READER, name)
        segments.send_reclaims(lambda pid, names: False)
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
    finally:
        segments.close([], [])
        maker.close()
