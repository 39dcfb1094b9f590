"""Capacity: what resources are free where, and how many workers of each job fit in them.

Resources are maps of name -> amount: "cpu" (cores), "memory" (bytes), "nvidia.com/gpu", or, for
the local backend, "workers" (slots). A Bin is one place workers can go (a node, or this
machine). `allocate` decides how many workers each job should have by placing them, one by one,
in fair order: every job's minimum first (higher priority first), then one worker at a time to
the highest-priority jobs that can use one, the least-served first among equals (a job in tiers
is one job: the workers of all its tiers count in its share). Each worker goes to the first bin
that fits it in its own job's order of preference (the offline pool first for one job, lent
mixed nodes first for another).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Resources = dict[str, float]

_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
    "Ei": 2.0**60,
}


def parse_quantity(value: str | float) -> float:
    """A Kubernetes quantity ("500m", "2Gi", "1.5", "1e3") as a number of base units."""
    if isinstance(value, int | float):
        return float(value)
    m = _QUANTITY.match(value.strip())
    if m is None or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def quantities(values: dict[str, str] | None) -> Resources:
    return {k: parse_quantity(v) for k, v in (values or {}).items()}


def add(a: Resources, b: Resources, sign: float = 1.0) -> Resources:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + sign * v
    return out


def total(amounts: Iterable[Resources]) -> Resources:
    """The sum of `amounts`, resource by resource."""
    out: Resources = {}
    for a in amounts:
        out = add(out, a)
    return out


def fits(free: Resources, need: Resources) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0)


@dataclass
class Bin:
    """A place workers can go, and what it has free for them."""

    name: str
    free: Resources
    pool: str = ""
    """The pool it is in (Kubernetes: its node's pool label, `offline` or `mixed`); "" where
    there are no pools (the local backend's machine)."""


def no_preference(_bin: Bin) -> int:
    return 0


@dataclass(frozen=True, kw_only=True)
class Demand:
    """What a job asks of capacity."""

    job: str
    want: int
    """Workers it could use now (its max, capped by the work it has left)."""
    min_workers: int
    priority: int
    submitted_at: float
    shape: Resources
    """What one worker requests."""
    eligible: Callable[[Bin], bool] = field(default=lambda _: True)
    prefer: Callable[[Bin], int] = field(default=no_preference)
    """Its order of bins: lower fills first (bins by name among equals)."""
    owner: str = ""
    """The job whose share its workers count in ("": its own, `job`): the tiers of one job
    share one, so that a job in two tiers gets no more than a job in one."""

    @property
    def share_of(self) -> str:
        return self.owner or self.job


def allocate(demands: Iterable[Demand], bins: list[Bin]) -> dict[str, int]:
    """Desired workers per job: as many as fit, shared by priority, then equally."""
    order = sorted(demands, key=lambda d: (-d.priority, d.submitted_at, d.job))
    alloc = {d.job: 0 for d in order}
    free = [Bin(b.name, dict(b.free), b.pool) for b in sorted(bins, key=lambda b: b.name)]
    # Each job's own order of the same bins: what one takes, the others see taken.
    ordered = {d.job: sorted((b for b in free if d.eligible(b)), key=d.prefer) for d in order}

    def place(d: Demand) -> bool:
        for b in ordered[d.job]:
            if fits(b.free, d.shape):
                b.free = add(b.free, d.shape, -1.0)
                alloc[d.job] += 1
                return True
        return False

    for d in order:
        while alloc[d.job] < min(d.min_workers, d.want) and place(d):
            pass
    served: Counter[str] = Counter()
    for d in order:
        served[d.share_of] += alloc[d.job]
    for priority in sorted({d.priority for d in order}, reverse=True):
        group = [d for d in order if d.priority == priority]
        while True:
            hungry = [d for d in group if alloc[d.job] < d.want]
            placed = False
            # The least-served job first, and within it its least-served demand (a tier).
            for d in sorted(hungry, key=lambda d: (served[d.share_of], alloc[d.job])):
                if place(d):
                    served[d.share_of] += 1
                    placed = True
                    break
            if not placed:
                break
    return alloc
