"""This machine's cores, as the local backend divides them among its workers (what it may use
is `ebb.common.host`'s answer, as for every part of Ebb)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ebb.common.host import allowed_cores, usable_cores

__all__ = ["allowed_cores", "least_held", "machine_cores"]


def machine_cores() -> float:
    """The cores this process may use (its affinity within its cgroup's quota)."""
    return usable_cores()


def least_held(cores: Iterable[int], held: Counter[int], count: int) -> tuple[int, ...]:
    """`count` of `cores` that no worker is pinned to, in order (the least held, and the
    lowest among equals, when there are not that many free)."""
    return tuple(sorted(sorted(cores, key=lambda core: (held[core], core))[:count]))
