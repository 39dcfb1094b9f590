"""This machine as a process of Ebb sees it: the cores it may use.

One answer for every part that asks (the local backend sizing and pinning its workers, `ebb
run` and `ebb up` sizing their stacks, a worker sizing its stage processes' threads): the
cores this process may run on (its affinity mask: `taskset`, a container's cpuset), within its
cgroup's CPU quota (a container's `--cpus`, a pod's limit). `os.cpu_count()`, the machine's
every core, answers neither, and on a pinned host it disagreed with both.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def allowed_cores() -> list[int]:
    """The cores this process may run on, in order; [] where the platform does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def cgroup_quota(root: Path = CGROUP) -> float | None:
    """Cores the cgroup's CPU quota allows (None: no quota). cgroup v2's `cpu.max` ("max
    100000", or "150000 100000" for 1.5 cores), else v1's cfs quota and period."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for folder in (root / "cpu", root / "cpu,cpuacct", root):
        try:
            quota_us = int((folder / "cpu.cfs_quota_us").read_text())
            period_us = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def usable_cores(*, root: Path = CGROUP) -> float:
    """The cores this process may use: those of its affinity mask, within its cgroup's
    quota (which may be a fraction)."""
    affinity = len(allowed_cores()) or os.cpu_count() or 1
    quota = cgroup_quota(root)
    return min(float(affinity), quota) if quota is not None and quota > 0 else float(affinity)


def core_count(*, root: Path = CGROUP) -> int:
    """`usable_cores` as a count of whole cores, at least one: how many single-core workers
    this process may run side by side."""
    return max(1, math.floor(usable_cores(root=root)))
