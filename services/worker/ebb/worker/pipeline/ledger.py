"""Rows kept until they are out of the pipeline, and who is to blame when a process dies.

The router's bookkeeping is per frame, never per row (see ebb.worker.pipeline.router). Only when a
process dies does it work out which rows that process held (processes.Holding); `blame` then decides
their fate: the batch that was running when it died is guilty, the rest of what it held is
innocent and goes round again as it was. A guilty row is sent again alone (whatever killed
the batch may have been a batch-mate); a row whose batch dies `max_item_crashes` times
becomes an error row. Rows are sent again from their source chunk, which the ledger keeps
until each of its rows has left the pipeline, as a result or as an error.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..chunks.columns import Columns, take, take_rows


@dataclass(eq=False, slots=True)
class Source:
    """Rows as they were submitted, kept until each is out, to send them again if needed."""

    start: int
    data: pa.RecordBatch | Columns
    rows: int
    left: int


@dataclass(frozen=True)
class Blame:
    """What becomes of the items a dead process held (fanned-out parts count as their item)."""

    innocent: list[int]
    """Held but not running: sent again as they were."""
    retry_alone: list[int]
    """In the batch that was running: sent again, each alone."""
    failed: list[int]
    """In the batch that was running, once too often: error rows."""
    batch: int
    """How many of the rows it held it was running (all of them, if it died between batches)."""

    @property
    def items(self) -> list[int]:
        """Every item it held, whatever becomes of it."""
        return self.innocent + self.retry_alone + self.failed


def blame(
    held: Iterable[int],
    running: Iterable[int],
    *,
    owner_of: Callable[[int], int | None],
    crashes: Mapping[int, int],
    max_item_crashes: int,
) -> Blame:
    """The fate of the rows a dead process `held` (a row twice if it was sent twice), given
    the rows its `running` batch had (as its board last said: possibly rows it no longer
    holds) and how many times each item was guilty before (`crashes`).

    A part of a fan-out (a negative uid) cannot be sent again on its own: its whole item starts
    over, and is guilty if any of its parts was running. `owner_of(part)` is its item, or None
    when that family already failed or started over (the part is then nobody's concern). Items
    keep the order in which they were first held."""
    held = list(held)
    # Blame the batch that was running when it died; died between batches: blame everything.
    batch = set(running).intersection(held) or set(held)
    guilty: dict[int, bool] = {}
    for uid in held:
        owner = owner_of(uid) if uid < 0 else uid
        if owner is None:
            continue
        guilty[owner] = guilty.get(owner, False) or uid in batch
    innocent: list[int] = []
    retry_alone: list[int] = []
    failed: list[int] = []
    for uid, is_guilty in guilty.items():
        if not is_guilty:
            innocent.append(uid)
        elif crashes.get(uid, 0) + 1 >= max_item_crashes:
            failed.append(uid)
        else:
            retry_alone.append(uid)
    return Blame(innocent, retry_alone, failed, batch=len(batch))


class RowLedger:
    """The sources of the rows inside the pipeline, and how often each item's batch died."""

    def __init__(self) -> None:
        self.sources: dict[int, Source] = {}
        """By the uid of their first row."""
        self.source_starts: list[int] = []
        """The sources' first uids, in order (to find a row's source by bisection)."""
        self.crashes: Counter[int] = Counter()
        """Items whose batch died while they were in it, and how many times."""

    def keep(self, start: int, data: pa.RecordBatch | Columns, rows: int) -> None:
        """Rows submitted under uids start..start+rows-1: kept until each is out."""
        self.sources[start] = Source(start, data, rows, rows)
        bisect.insort(self.source_starts, start)

    def release(self, uids: np.ndarray) -> None:
        """Rows that are out of the pipeline: their sources need not be kept for them."""
        uids = uids[uids >= 0]
        if self.crashes:
            for uid in uids.tolist():
                self.crashes.pop(uid, None)
        if not len(uids) or not self.source_starts:
            return
        starts = np.asarray(self.source_starts, dtype=np.int64)
        at = np.searchsorted(starts, uids, side="right") - 1
        for i, n in enumerate(np.bincount(at[at >= 0], minlength=len(starts)).tolist()):
            if n:
                source = self.sources[int(starts[i])]
                source.left -= n
                if source.left <= 0:
                    del self.sources[source.start]
                    self.source_starts.remove(source.start)

    def resend(
        self, uids: list[int], *, solo: bool
    ) -> list[tuple[np.ndarray, pa.RecordBatch | Columns]]:
        """Rows to send through the pipeline again, from the first stage, taken from their
        sources: grouped by source, or one per frame when they run alone."""
        out: list[tuple[np.ndarray, pa.RecordBatch | Columns]] = []
        by_source: dict[int, list[int]] = {}
        for uid in sorted(uids):
            at = bisect.bisect_right(self.source_starts, uid) - 1
            start = self.source_starts[at] if at >= 0 else -1
            if start < 0 or uid >= start + self.sources[start].rows:
                # Out of the pipeline already: a copy of it that ran in another branch.
                continue
            by_source.setdefault(start, []).append(uid)
        for start, members in by_source.items():
            source = self.sources[start]
            groups = [[u] for u in members] if solo else [members]
            for group in groups:
                index = np.asarray(group, dtype=np.int64) - start
                data: Any = source.data
                part = (
                    take_rows(data, index)
                    if isinstance(data, pa.RecordBatch)
                    else take(data, index)
                )
                out.append((np.asarray(group, dtype=np.int64), part))
        return out

    def convict(self, verdict: Blame) -> None:
        """Count a crash against each item found guilty."""
        for uid in verdict.retry_alone + verdict.failed:
            self.crashes[uid] += 1
