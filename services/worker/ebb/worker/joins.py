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
    all of them have sent it, with their columns together.

    Rows are only put aside as they come (`add`); `settle`, once per turn of the router's
    loop, finds the rows every input has sent and takes them out, in a few numpy calls per
    input whatever the number of frames that came: the cost is per turn, not per batch of
    each branch."""

    def __init__(self, inputs: list[int], names: list[str], *, resent: Settled) -> None:
        self.inputs = inputs
        self.names = names
        """Each input stage's name: a result that is not a map becomes a column so named."""
        self.resent = resent
        """Rows sent through the branches again: more than one copy may reach this join."""
        self.passed = Settled()
        """Rows of `resent` this join let through: a later copy is dropped."""
        self._pending: list[list[tuple[np.ndarray, Columns]]] = [[] for _ in inputs]
        self._came = False
        """Rows came since the last `settle`."""

    def __len__(self) -> int:
        """Rows waiting here for another branch (counted once per branch that sent them)."""
        return sum(len(u) for pieces in self._pending for u, _ in pieces)

    def add(self, stage: int, uids: np.ndarray, chunk: Columns) -> None:
        """Rows from `stage`, put aside until `settle`."""
        if len(self.passed):
            # Once a row sent again has gone on, no copy of it is let through again.
            fresh = ~self.passed.mask(uids)
            uids, chunk = uids[fresh], take(chunk, fresh)
        if len(uids):
            self._pending[self.inputs.index(stage)].append((uids, chunk))
            self._came = True

    def settle(self) -> tuple[np.ndarray, Columns]:
        """The rows every input has sent (possibly none), joined, in the order of their uids;
        they wait here no more."""
        if not self._came:
            return np.empty(0, dtype=np.int64), {}
        self._came = False
        slots = [self._gather(k) for k in range(len(self.inputs))]
        if any(not len(uids) for uids, _ in slots):
            return np.empty(0, dtype=np.int64), {}
        complete = slots[0][0]
        for uids, _ in slots[1:]:
            complete = np.intersect1d(complete, uids, assume_unique=True)
        if not len(complete):
            return complete, {}
        again = self.resent.mask(complete)
        if again.any():
            self.passed.add(complete[again].tolist())
        joined: Columns = {}
        for k, (uids, chunk) in enumerate(slots):
            # `uids` is sorted (see _gather): where each complete row is, and what is left.
            at = np.searchsorted(uids, complete)
            left = np.ones(len(uids), dtype=bool)
            left[at] = False
            self._pending[k] = [(uids[left], take(chunk, left))] if left.any() else []
            part = take(chunk, at)
            own, metrics = split_metrics(part)
            if is_plain(own):
                part = {self.names[k]: own[VALUE], **{METRIC + m: v for m, v in metrics.items()}}
            for column, values in part.items():
                joined.setdefault(column, values)
        return complete, joined

    def drop(self, uids: np.ndarray) -> None:
        """Forget these rows wherever they wait (they failed in some branch)."""
        for k, pieces in enumerate(self._pending):
            kept = []
            for held, chunk in pieces:
                gone = np.isin(held, uids)
                if not gone.any():
                    kept.append((held, chunk))
                elif not gone.all():
                    kept.append((held[~gone], take(chunk, ~gone)))
            self._pending[k] = kept

    def _gather(self, slot: int) -> tuple[np.ndarray, Columns]:
        """A slot's rows as one chunk, sorted by uid, a uid once (the first copy that came),
        kept as the slot's one piece."""
        pieces = self._pending[slot]
        if not pieces:
            return np.empty(0, dtype=np.int64), {}
        if len(pieces) == 1:
            uids, chunk = pieces[0]
        else:
            uids = np.concatenate([u for u, _ in pieces])
            chunk = concat([c for _, c in pieces])
        unique, first = np.unique(uids, return_index=True)
        if len(unique) < len(uids) or not (first == np.arange(len(first))).all():
            uids, chunk = unique, take(chunk, first)
        self._pending[slot] = [(uids, chunk)]
        return uids, chunk
