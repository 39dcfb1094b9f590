"""Branches and joins: where a pipeline that is not a chain sends rows, and how the columns of
a row's branches come back together.

A stage may read the output of any stage listed before it (`after` in its spec). Stages that
read the same stage are branches: each gets its own copy of the rows, and runs them with its
own processes and batches. A stage that reads several stages is a join, and so is the end of
the pipeline when several stages are read by none: a row goes on from a join once every
branch it waits for has sent it back, with the columns of all of them (`Join`).

A row runs through the branches independently, so it can come back to a join more than once
(a process died holding it, and the row was sent again from the first stage, through every
branch) or after it failed in another branch. `Settled` remembers the rows whose fate is told
(an error, or a result after such a resend), so that a late copy is dropped, never told twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ebb.common.job import StageSpec

from ..chunks.columns import METRIC, VALUE, Columns, concat, is_plain, split_metrics, take


@dataclass(frozen=True)
class Graph:
    """Who reads whom, by stage index (stages are listed after those they read)."""

    inputs: list[list[int]]
    """Each stage's inputs; an empty list: the rows as read."""
    names: list[str]

    @classmethod
    def of(cls, specs: list[StageSpec], inputs: list[list[int]]) -> Graph:
        return cls(inputs, [s.name for s in specs])

    @property
    def sources(self) -> list[int]:
        """The stages that read the rows as submitted."""
        return [k for k, reads in enumerate(self.inputs) if not reads]

    def readers(self, stage: int) -> list[int]:
        return [k for k, reads in enumerate(self.inputs) if stage in reads]

    @property
    def sinks(self) -> list[int]:
        """The stages nobody reads: their rows leave the pipeline (joined, if several)."""
        return [k for k in range(len(self.inputs)) if not self.readers(k)]

    @property
    def is_chain(self) -> bool:
        return all(reads == ([k - 1] if k else []) for k, reads in enumerate(self.inputs))


class Settled:
    """Rows whose fate has been told while copies of them may still run in other branches:
    a copy that reaches a join later is dropped. Told fates are rare (an error, a row sent
    again after a crash), so a set; the oldest rows are forgotten past a bound, as by then
    no copy of them is left anywhere."""

    def __init__(self, bound: int = 1 << 16) -> None:
        self._uids: set[int] = set()
        self._bound = bound

    def __len__(self) -> int:
        return len(self._uids)

    def __contains__(self, uid: int) -> bool:
        return uid in self._uids

    def add(self, uids: list[int]) -> None:
        self._uids.update(uids)
        if len(self._uids) > self._bound:
            # Uids grow with the rows submitted: the smallest are the oldest.
            keep = sorted(self._uids)[len(self._uids) // 2 :]
            self._uids = set(keep)

    def mask(self, uids: np.ndarray) -> np.ndarray:
        """Which of these uids are settled (all False, quickly, when none is)."""
        if not self._uids:
            return np.zeros(len(uids), dtype=bool)
        return np.fromiter((u in self._uids for u in uids.tolist()), dtype=bool, count=len(uids))


class _Slot:
    """The rows one input of a join has sent that wait for the others: the chunks as they
    came, and an index of their uids kept sorted (rows mostly come in order: appending is the
    common case), with where each row is."""

    def __init__(self) -> None:
        self.chunks: dict[int, Columns] = {}
        self.left: dict[int, int] = {}
        """Rows of each chunk still waiting."""
        self.uids = np.empty(0, dtype=np.int64)
        self.chunk_of = np.empty(0, dtype=np.int64)
        self.row_of = np.empty(0, dtype=np.int64)
        self._next = 0

    def __len__(self) -> int:
        return len(self.uids)

    def add(self, uids: np.ndarray, chunk: Columns, *, copies: bool) -> None:
        """Rows that came. `copies`: some may be here already (copies of rows sent again):
        the first copy that came stays."""
        rows = np.arange(len(uids), dtype=np.int64)
        if copies and len(self.uids):
            here = self.holds(uids)
            if here.any():
                uids, rows = uids[~here], rows[~here]
        if len(uids) > 1 and not (uids[1:] > uids[:-1]).all():
            uids, first = np.unique(uids, return_index=True)  # sorted, one copy of each
            rows = rows[first]
        if not len(uids):
            return
        key = self._next
        self._next += 1
        self.chunks[key] = chunk
        self.left[key] = len(uids)
        self.uids = np.concatenate([self.uids, uids])
        self.chunk_of = np.concatenate([self.chunk_of, np.full(len(uids), key)])
        self.row_of = np.concatenate([self.row_of, rows])
        if len(self.uids) > len(uids) and self.uids[-len(uids) - 1] > uids[0]:
            order = np.argsort(self.uids, kind="stable")  # came out of order: sort again
            self.uids, self.chunk_of, self.row_of = (
                self.uids[order],
                self.chunk_of[order],
                self.row_of[order],
            )

    def holds(self, uids: np.ndarray) -> np.ndarray:
        """Which of `uids` wait here."""
        at = np.searchsorted(self.uids, uids)
        found = at < len(self.uids)
        found[found] = self.uids[at[found]] == uids[found]
        return found

    def take(self, uids: np.ndarray) -> Columns:
        """Take out these rows (sorted, all waiting here): their columns, in this order."""
        at = np.searchsorted(self.uids, uids)
        chunk_of, row_of = self.chunk_of[at], self.row_of[at]
        if chunk_of[0] == chunk_of[-1] and (chunk_of == chunk_of[0]).all():
            keys, counts = [int(chunk_of[0])], [len(chunk_of)]
            part = take(self.chunks[keys[0]], row_of)
        else:
            found, found_counts = np.unique(chunk_of, return_counts=True)
            keys, counts = found.tolist(), found_counts.tolist()
            order = np.argsort(chunk_of, kind="stable")
            pieces = [take(self.chunks[key], row_of[chunk_of == key]) for key in keys]
            part = take(concat(pieces), np.argsort(order, kind="stable"))
        for key, taken in zip(keys, counts, strict=True):
            self.left[key] -= taken
            if not self.left[key]:
                del self.left[key], self.chunks[key]
        keep = np.ones(len(self.uids), dtype=bool)
        keep[at] = False
        self.uids, self.chunk_of, self.row_of = (
            self.uids[keep],
            self.chunk_of[keep],
            self.row_of[keep],
        )
        return part


class Join:
    """Rows from several stages (`inputs`, in the order named), each row let through once
    all of them have sent it, with their columns together.

    Rows are put aside as they come (`add`); `settle`, once per turn of the router's loop,
    looks only at the rows that came since the last: a row completes when its last copy
    comes. Its cost follows the rows that came, found by bisection in each input's index,
    not the rows waiting (a slow branch leaves the others' rows waiting in thousands)."""

    def __init__(self, inputs: list[int], names: list[str], *, resent: Settled) -> None:
        self.inputs = inputs
        self.names = names
        """Each input stage's name: a result that is not a map becomes a column so named."""
        self.resent = resent
        """Rows sent through the branches again: more than one copy may reach this join."""
        self.passed = Settled()
        """Rows of `resent` this join let through: a later copy is dropped."""
        self._slots = [_Slot() for _ in inputs]
        self._came: list[np.ndarray] = []
        """The uids that came since the last `settle`."""

    def __len__(self) -> int:
        """Rows waiting here for another branch (counted once per branch that sent them)."""
        return sum(len(slot) for slot in self._slots)

    def add(self, stage: int, uids: np.ndarray, chunk: Columns) -> None:
        """Rows from `stage`, put aside until `settle`."""
        if len(self.passed):
            # Once a row sent again has gone on, no copy of it is let through again.
            fresh = ~self.passed.mask(uids)
            uids, chunk = uids[fresh], take(chunk, fresh)
        if len(uids):
            slot = self._slots[self.inputs.index(stage)]
            slot.add(uids, chunk, copies=len(self.resent) > 0)
            self._came.append(uids)

    def settle(self) -> tuple[np.ndarray, Columns]:
        """The rows every input has sent (possibly none), joined, in the order of their uids;
        they wait here no more."""
        if not self._came:
            return np.empty(0, dtype=np.int64), {}
        came, self._came = self._came, []
        # A row completes when its last copy comes: only those that came can.
        complete = came[0] if len(came) == 1 else np.unique(np.concatenate(came))
        if len(came) == 1 and len(complete) > 1 and not (complete[1:] > complete[:-1]).all():
            complete = np.unique(complete)
        for slot in self._slots:
            complete = complete[slot.holds(complete)]
            if not len(complete):
                return complete, {}
        again = self.resent.mask(complete)
        if again.any():
            self.passed.add(complete[again].tolist())
        joined: Columns = {}
        for k, slot in enumerate(self._slots):
            part = slot.take(complete)
            own, metrics = split_metrics(part)
            if is_plain(own):
                part = {self.names[k]: own[VALUE], **{METRIC + m: v for m, v in metrics.items()}}
            for column, values in part.items():
                joined.setdefault(column, values)
        return complete, joined

    def drop(self, uids: np.ndarray) -> None:
        """Forget these rows wherever they wait (they failed in some branch)."""
        for slot in self._slots:
            here = uids[slot.holds(uids)]
            if len(here):
                slot.take(np.sort(here))
