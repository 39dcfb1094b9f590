"""Named lifecycles: the states a thing may be in, the moves between them as data, one check.

Each lifecycle of Ebb (a shard's and a job's in the master; a stage process's and a lease's in
the worker) is a map from each state to the states it may go to. `check` is the one check of a
move against its map, and `IllegalTransition` the one error: a move the map does not allow is a
bug, refused before anything changes (a service may raise a subclass of its own tree).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from enum import Enum
from typing import TypeVar

from .errors import EbbError

S = TypeVar("S", bound=Hashable)


class IllegalTransition(EbbError):
    """A thing was about to move where its lifecycle does not go: a bug, refused."""


def check(
    moves: Mapping[S, Collection[S]],
    old: S,
    new: S,
    *,
    what: str,
    error: type[IllegalTransition] = IllegalTransition,
) -> None:
    """Raise `error` unless `what` (a shard, a stage process...) may go from `old` to `new`."""
    if new not in moves[old]:
        raise error(f"{what} cannot go from {_name(old)} to {_name(new)}")


def _name(state: Hashable) -> str:
    return str(state.value) if isinstance(state, Enum) else str(state)
