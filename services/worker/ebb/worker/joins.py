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

from ebb.common.spec import StageSpec

from .columns import METRIC, VALUE, Columns, concat, is_plain, split_metrics, take


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


class Join:
    """Rows from several stages (`inputs`, in the order named), each row let through once
    all of them have sent it, with their columns together."""

    def __init__(self, inputs: list[int], names: list[str], *, resent: Settled) -> None:
        self.inputs = inputs
        self.names = names
        """Each input stage's name: a result that is not a map becomes a column so named."""
        self.resent = resent
        """Rows sent through the branches again: more than one copy may reach this join."""
        self.passed = Settled()
        """Rows of `resent` this join let through: a later copy is dropped."""
        self._pending: list[list[tuple[np.ndarray, Columns]]] = [[] for _ in inputs]

    def __len__(self) -> int:
        """Rows waiting here for another branch (counted once per branch that sent them)."""
        return sum(len(u) for pieces in self._pending for u, _ in pieces)

    def add(self, stage: int, uids: np.ndarray, chunk: Columns) -> tuple[np.ndarray, Columns]:
        """Rows from `stage`; the rows this completes (possibly none), joined."""
        slot = self.inputs.index(stage)
        # A copy of a row sent again: the first one that came stays, and once the row has
        # gone on, none is let through again.
        fresh = ~(self._holds(slot, uids) | self.passed.mask(uids))
        if not fresh.all():
            uids, chunk = uids[fresh], take(chunk, fresh)
        if not len(uids):
            return uids, {}
        self._pending[slot].append((uids, chunk))
        complete = uids
        for other in range(len(self.inputs)):
            if other != slot and len(complete):
                complete = complete[self._holds(other, complete)]
        if not len(complete):
            return complete, {}
        again = self.resent.mask(complete)
        if again.any():
            self.passed.add(complete[again].tolist())
        parts = [self._take(k, complete) for k in range(len(self.inputs))]
        joined: Columns = {}
        for k, part in enumerate(parts):
            own, metrics = split_metrics(part)
            named = part
            if is_plain(own):
                named = {self.names[k]: own[VALUE], **{METRIC + m: v for m, v in metrics.items()}}
            for column, values in named.items():
                joined.setdefault(column, values)
        return complete, joined

    def drop(self, uids: np.ndarray) -> None:
        """Forget these rows wherever they wait (they failed in some branch)."""
        for slot in range(len(self.inputs)):
            if self._holds(slot, uids).any():
                self._take(slot, uids[self._holds(slot, uids)])

    def _holds(self, slot: int, uids: np.ndarray) -> np.ndarray:
        """Which of `uids` wait in `slot`."""
        found = np.zeros(len(uids), dtype=bool)
        for held, _ in self._pending[slot]:
            found |= np.isin(uids, held)
        return found

    def _take(self, slot: int, uids: np.ndarray) -> Columns:
        """Remove these rows (all waiting in `slot`) from it: their columns, in this order."""
        taken_uids: list[np.ndarray] = []
        taken: list[Columns] = []
        left: list[tuple[np.ndarray, Columns]] = []
        for held, chunk in self._pending[slot]:
            hit = np.isin(held, uids)
            if hit.any():
                taken_uids.append(held[hit])
                taken.append(chunk if hit.all() else take(chunk, hit))
            if not hit.all():
                left.append((held[~hit], take(chunk, ~hit)) if hit.any() else (held, chunk))
        self._pending[slot] = left
        found = np.concatenate(taken_uids)
        rows = concat(taken)
        order = np.argsort(found, kind="stable")
        # Place each row at the position of its uid in `uids`.
        where = np.searchsorted(found[order], uids)
        return take(rows, order[where])
