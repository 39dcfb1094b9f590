"""The cores a worker may use, and how its stage processes share them.

A model runtime left to its default starts a thread per core of the machine, and so does the
BLAS under numpy: two workers on two cores ran four OpenMP pools that spun against each other
(2.3x slower than one worker), and a pod asking for one CPU on a 64-core node would start 64
threads into a one-core quota. A worker's budget is the least of what it is told
(`EBB_CPUS`: its share of a machine the local backend splits among several workers, or the
`resources.cpu` of its pod), its cgroup's CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us`)
and its affinity mask (`ebb.common.host`, which every part of Ebb asks). Its stage processes
share it:

- a model stage (ONNX Runtime, TorchScript) whose `threads` is 0 gets the budget's share:
  the budget over the model processes it runs now, at least one thread each; when the
  elastic scheduler adds a model process or takes one away, the threads are divided again
  (and it adds one only while each still gets a core);
- a modelet stage's BLAS and OpenMP pools get one thread (`OMP_NUM_THREADS` and its kin,
  set before the stage processes' fork server imports numpy): its Python is single-threaded;
- an explicit `threads` always wins.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ebb.common import envvars, host
from ebb.common.host import CGROUP
from ebb.common.job import StageSpec

BLAS_THREADS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
"""What numpy's BLAS, OpenMP and numexpr read for the size of their thread pools."""


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
    affinity = len(host.allowed_cores()) or os.cpu_count() or 1
    return budget(told=told, quota=host.cgroup_quota(root), affinity=affinity)


def shares(stages: Sequence[StageSpec], processes: Sequence[int], cores: float) -> list[int]:
    """Intra-op threads for each process of each stage, given how many processes each stage
    runs now: the model stages on the CPU share the cores (at least one thread each), a model
    stage's explicit `threads` wins, a model on a GPU gets one (its CPU side feeds the device),
    and a modelet stage 0 (its BLAS is sized by `blas_environment`). The router asks again
    whenever the elastic scheduler adds or takes away a process, and re-divides."""
    on_cpu = sum(n for s, n in zip(stages, processes, strict=True) if _model_on_cpu(s))
    share = max(1, math.floor(cores / max(1, on_cpu)))
    out = []
    for s in stages:
        if not s.serves_models:
            out.append(0)
        elif s.threads:
            out.append(s.threads)
        else:
            out.append(share if _model_on_cpu(s) else 1)
    return out


def room_for_model_process(
    stages: Sequence[StageSpec], processes: Sequence[int], cores: float
) -> bool:
    """Whether one more model process on the CPU still gets a core of its own."""
    on_cpu = sum(n for s, n in zip(stages, processes, strict=True) if _model_on_cpu(s))
    return on_cpu + 1 <= max(1, math.floor(cores))


def _model_on_cpu(stage: StageSpec) -> bool:
    return stage.serves_models and not stage.device.startswith("cuda")


def pin(environ: Mapping[str, str]) -> None:
    """Pin this process to the cores its launcher chose (`EBB_CPU_SET`), if it chose any;
    processes it starts later inherit the mask, and `detect` counts it."""
    chosen = environ.get(envvars.CPU_SET, "")
    if not chosen or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, {int(c) for c in chosen.split(",")})
    except (ValueError, OSError) as e:  # cores we may not use: run unpinned, and say so
        print(f"ebb worker: cannot pin to cores {chosen!r}: {e}", file=sys.stderr)


def blas_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The BLAS and OpenMP pool sizes for stage processes: one thread each, where the user
    has not said otherwise."""
    return {name: "1" for name in BLAS_THREADS if name not in environ}
