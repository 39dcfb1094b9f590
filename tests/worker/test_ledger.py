"""What becomes of the rows a dead stage process held, and the sources kept to send them again."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pytest

from ebb.common.job import StageSpec
from ebb.worker.chunks import frames
from ebb.worker.chunks.columns import VALUE, Columns
from ebb.worker.chunks.segments import SegmentLedger
from ebb.worker.chunks.shm import Arena
from ebb.worker.pipeline.conveyor import Conveyor
from ebb.worker.pipeline.ledger import Blame, RowLedger, blame

FAMILY = {-1: 10, -2: 10, -3: 10, -4: 20, -5: 20}
"""Parts of fan-outs still awaited: item 10 fanned out into -1..-3, item 20 into -4 and -5."""


@dataclass(frozen=True)
class Case:
    held: list[int]
    running: list[int]
    innocent: list[int]
    retry_alone: list[int]
    failed: list[int] = field(default_factory=list)
    batch: int = 0
    crashes: dict[int, int] = field(default_factory=dict)
    max_item_crashes: int = 2


CASES = {
    "killed mid-batch: its batch is retried alone, what it had queued goes round as it was": Case(
        held=[0, 1, 2, 3, 4, 5, 6, 7],
        running=[0, 1, 2, 3],
        innocent=[4, 5, 6, 7],
        retry_alone=[0, 1, 2, 3],
        batch=4,
    ),
    "killed idle, between batches: everything it held is suspect": Case(
        held=[4, 5, 6], running=[], innocent=[], retry_alone=[4, 5, 6], batch=3
    ),
    "its board names a batch it no longer holds: as if idle": Case(
        held=[8, 9], running=[0, 1], innocent=[], retry_alone=[8, 9], batch=2
    ),
    "a row whose batch died before dies with it again: an error row": Case(
        held=[4, 5, 6],
        running=[5, 6],
        crashes={5: 1},
        innocent=[4],
        retry_alone=[6],
        failed=[5],
        batch=2,
    ),
    "a row innocent this time goes round as it was, whatever its past": Case(
        held=[4, 5], running=[5], crashes={4: 1}, innocent=[4], retry_alone=[5], batch=1
    ),
    "one crash allowed: guilty rows are error rows at once": Case(
        held=[1, 2, 3],
        running=[2],
        max_item_crashes=1,
        innocent=[1, 3],
        retry_alone=[],
        failed=[2],
        batch=1,
    ),
    "a fanned-out part in the batch: its whole item starts over, alone": Case(
        held=[-1, -2, -3, 11], running=[-2], innocent=[11], retry_alone=[10], batch=1
    ),
    "parts of an item only queued: the item goes round as it was": Case(
        held=[-4, -5, 12], running=[12], innocent=[20], retry_alone=[12], batch=1
    ),
    "an item whose parts killed its batch twice fails whole": Case(
        held=[-1, -2, -4],
        running=[-1, -2],
        crashes={10: 1},
        innocent=[20],
        retry_alone=[],
        failed=[10],
        batch=2,
    ),
    "a part of a family that already failed or started over is nobody's concern": Case(
        held=[-9, 3], running=[-9], innocent=[3], retry_alone=[], batch=1
    ),
    "a row sent twice (it went round after a crash further on) is one item": Case(
        held=[7, 7, 8], running=[7], innocent=[8], retry_alone=[7], batch=1
    ),
    "items keep the order in which they were first held": Case(
        held=[9, 3, -1, 5, -2], running=[], innocent=[], retry_alone=[9, 3, 10, 5], batch=5
    ),
    "nothing held, nothing to blame": Case(held=[], running=[2], innocent=[], retry_alone=[]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_blame(case: Case) -> None:
    verdict = blame(
        case.held,
        case.running,
        owner_of=FAMILY.get,
        crashes=case.crashes,
        max_item_crashes=case.max_item_crashes,
    )
    assert verdict == Blame(case.innocent, case.retry_alone, case.failed, batch=case.batch)


def _columns(start: int, rows: int) -> Columns:
    return {VALUE: np.arange(start, start + rows, dtype=np.int64) * 10}


def test_a_source_is_kept_until_each_of_its_rows_is_out() -> None:
    ledger = RowLedger()
    ledger.keep(0, _columns(0, 4), 4)
    ledger.keep(4, _columns(4, 2), 2)
    ledger.release(np.asarray([0, 1, 4, -3], dtype=np.int64))  # a part is no source's row
    assert sorted(ledger.sources) == [0, 4]
    ledger.release(np.asarray([2, 3], dtype=np.int64))
    assert list(ledger.sources) == [4] and ledger.source_starts == [4]
    assert ledger.sources[4].left == 1


def test_rows_are_resent_from_their_sources_grouped_or_alone() -> None:
    ledger = RowLedger()
    ledger.keep(0, _columns(0, 4), 4)
    batch = pa.record_batch({"x": pa.array([40, 50, 60], type=pa.int64())})
    ledger.keep(4, batch, 3)

    grouped = ledger.resend([5, 1, 3, 6], solo=False)
    assert [uids.tolist() for uids, _ in grouped] == [[1, 3], [5, 6]]
    columns, arrow = grouped[0][1], grouped[1][1]
    assert isinstance(columns, dict) and columns[VALUE].tolist() == [10, 30]
    assert isinstance(arrow, pa.RecordBatch) and arrow.column("x").to_pylist() == [50, 60]

    alone = ledger.resend([3, 1], solo=True)
    assert [uids.tolist() for uids, _ in alone] == [[1], [3]]


def test_a_crash_is_counted_against_the_guilty_until_the_row_is_out() -> None:
    ledger = RowLedger()
    ledger.keep(0, _columns(0, 4), 4)
    ledger.convict(Blame(innocent=[0], retry_alone=[1], failed=[2], batch=2))
    assert dict(ledger.crashes) == {1: 1, 2: 1}
    ledger.release(np.asarray([2], dtype=np.int64))
    assert dict(ledger.crashes) == {1: 1}


def test_what_a_dead_process_held_goes_round_again_or_out_as_errors() -> None:
    """The conveyor acts on the verdict: the guilty alone and flagged so, the innocent
    together, the twice guilty out as errors with the reason given."""
    errors: list[tuple[list[int], list[str]]] = []
    ledger = RowLedger()
    arena = Arena()
    conveyor = Conveyor(
        [StageSpec(name="s", modelet="m:M", batch_size=8)],
        rows=ledger,
        segments=SegmentLedger(arena),
        on_results=lambda uids, chunk: None,
        on_errors=lambda uids, messages: errors.append((uids.tolist(), messages)),
    )
    try:
        conveyor.submit(0, _columns(0, 8), 8)
        conveyor.backlog[0].clear()  # as if sent to the process that is now dead
        ledger.crashes[3] = 1
        held = np.arange(8, dtype=np.int64)
        verdict = conveyor.take_back(
            held, np.asarray([2, 3]), max_item_crashes=2, error="its process died"
        )
        assert verdict == Blame([0, 1, 4, 5, 6, 7], [2], [3], batch=2)
        sent = [(f.uids.tolist(), f.flags) for f in conveyor.backlog[0]]
        assert sent == [([2], frames.SOLO), ([0, 1, 4, 5, 6, 7], 0)]
        assert errors == [([3], ["its process died"])]
        assert ledger.crashes == {2: 1}
        assert ledger.sources[0].left == 7
    finally:
        arena.close()
