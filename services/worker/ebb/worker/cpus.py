"""The cores a worker may use, and how its stage processes share them.

A model runtime left to its default starts a thread per core of the machine, and so does the
BLAS under numpy: two workers on two cores ran four OpenMP pools that spun against each other
(2.3x slower than one worker), and a pod asking for one CPU on a 64-core node would start 64
threads into a one-core quota. A worker's budget is the least of what it is told
(`EBB_CPUS`: its share of a machine the local backend splits among several workers, or the
`resources.cpu` of its pod), its cgroup's CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us`)
and its affinity mask. Its stage processes share it:

- a model stage (ONNX Runtime, TorchScript) whose `threads` is 0 gets the budget's share:
  the budget over the model stages' processes, at least one thread each;
- a modelet stage's BLAS and OpenMP pools get one thread (`OMP_NUM_THREADS` and its kin,
  set before the stage processes' fork server imports numpy): its Python is single-threaded;
- an explicit `threads` always wins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ebb.common import envvars
from ebb.common.spec import StageSpec

CGROUP = Path("/sys/fs/cgroup")

BLAS_THREADS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
"""What numpy's BLAS, OpenMP and numexpr read for the size of their thread pools."""


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


def budget(*, told: float | None, quota: float | None, affinity: int) -> float:
    """The cores a worker may use: the least of what applies."""
    return min(c for c in (told, quota, float(affinity)) if c is not None and c > 0)


def detect(environ: Mapping[str, str] | None = None, *, root: Path = CGROUP) -> float:
    """This process's budget, from its environment, its cgroup and its affinity mask."""
    environ = os.environ if environ is None else environ
    told: float | None = None
    with_told = environ.get(envvars.CPUS, "")
    if with_told:
        try:
            told = float(with_told)
        except ValueError:
            told = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    return budget(told=told, quota=cgroup_quota(root), affinity=affinity)


def with_threads(stages: list[StageSpec], cores: float) -> list[StageSpec]:
    """`stages` with each model stage's `threads: 0` made its share of `cores`."""
    model_processes = sum(s.max_workers or s.workers for s in stages if s.model is not None)
    if not model_processes:
        return stages
    share = max(1, math.floor(cores / model_processes))
    return [
        replace(s, threads=share) if s.model is not None and not s.threads else s for s in stages
    ]


def blas_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The BLAS and OpenMP pool sizes for stage processes: one thread each, where the user
    has not said otherwise."""
    return {name: "1" for name in BLAS_THREADS if name not in environ}
