"""This machine's cores, as the local backend divides them among its workers."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable


def allowed_cores() -> list[int]:
    """The cores this process may run on, in order; [] where the platform does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def machine_cores() -> int:
    """How many cores this process may run on."""
    return len(allowed_cores()) or os.cpu_count() or 1


def least_held(cores: Iterable[int], held: Counter[int], count: int) -> tuple[int, ...]:
    """`count` of `cores` that no worker is pinned to, in order (the least held, and the
    lowest among equals, when there are not that many free)."""
    return tuple(sorted(sorted(cores, key=lambda core: (held[core], core))[:count]))
