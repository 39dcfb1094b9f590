"""Fan-out bookkeeping: the parts an item fanned out into, and gathering their results.

A fan-out stage turns one item into a list of parts; each part travels on as an item of its
own, under a new (negative) uid. The parts' results come back together as one list, in the
order of the parts, at the fan-in stage or at the end of the pipeline. Fan-out is per item by
nature (a detector's crops): this is the one place where the router keeps a record per item.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Family:
    """An item that fanned out, waiting for its parts."""

    parent: int
    results: list[Any]
    flags: int
    members: list[int] = field(default_factory=list)
    remaining: int = 0

    def __post_init__(self) -> None:
        self.remaining = len(self.results)


class Families:
    def __init__(self) -> None:
        self._families: dict[int, Family] = {}
        self._parts: dict[int, tuple[int, int]] = {}
        """A part's uid -> (its item's uid, its place among the parts)."""
        self._next_uid = -1

    def split(self, parent: int, count: int, flags: int) -> list[int]:
        """Name the `count` parts of `parent` (count > 0): their uids, in order."""
        family = Family(parent=parent, results=[None] * count, flags=flags)
        self._families[parent] = family
        first = self._next_uid
        self._next_uid -= count
        family.members = list(range(first, first - count, -1))
        for index, uid in enumerate(family.members):
            self._parts[uid] = (parent, index)
        return family.members

    def owner(self, uid: int) -> int | None:
        """The item a part belongs to (None: not a part, or one of a family now gone)."""
        found = self._parts.get(uid)
        return None if found is None else found[0]

    def place(self, uid: int) -> tuple[int, int] | None:
        """(item, index) of a part still awaited, forgetting it."""
        return self._parts.pop(uid, None)

    def gather(self, uid: int, value: Any) -> Family | None:
        """A part's result; the family once it is complete (and forgotten)."""
        found = self._parts.pop(uid, None)
        if found is None:
            return None  # a part of a family that failed or started over
        parent, index = found
        family = self._families[parent]
        family.results[index] = value
        family.remaining -= 1
        if family.remaining:
            return None
        del self._families[parent]
        return family

    def disband(self, parent: int) -> None:
        """Forget a family: results of its parts still in flight will be dropped."""
        family = self._families.pop(parent, None)
        if family is not None:
            for uid in family.members:
                self._parts.pop(uid, None)
