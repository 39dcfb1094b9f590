"""The GPUs a worker may use, and which of them each replica of a GPU stage runs on.

A worker sees the GPUs its launcher gave it: `CUDA_VISIBLE_DEVICES` where it is set (by the
user, or by a launcher that splits a machine), else `NVIDIA_VISIBLE_DEVICES` (set by the NVIDIA
container runtime to what Kubernetes' device plugin assigned the pod), else every GPU NVML
can see. A stage on `device: cuda` runs `workers` processes on each of them (min and max
likewise), replica `slot` on the worker's GPU `slot % count`; a stage on `cuda:N` runs on
the worker's GPU N only.

Each replica is handed exactly one GPU, as Ray hands an actor its GPUs: its
`CUDA_VISIBLE_DEVICES` names that one, so inside the process it is `cuda:0`, and user code
that asks torch for "cuda" lands on the right device. `EBB_DEVICE` tells a modelet the
device it was given.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ebb.common import envvars
from ebb.common.job import StageSpec

DEVICE_ENV = envvars.DEVICE

_NONE = frozenset({"", "none", "void", "-1", "nodevfiles"})


def visible(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The ids of the GPUs this worker may use, as CUDA_VISIBLE_DEVICES would name them;
    None when nothing says (no variable, no NVML): a `cuda` stage then runs as it asks."""
    environ = os.environ if environ is None else environ
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = environ.get(name)
        if value is None:
            continue
        value = value.strip()
        if value.lower() in _NONE:
            return ()
        if value.lower() == "all":
            break  # every GPU of the machine: NVML counts them
        return tuple(v.strip() for v in value.split(",") if v.strip())
    count = _nvml_count()
    return None if count is None else tuple(str(i) for i in range(count))


def _nvml_count() -> int | None:
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    return None


NO_GPU = "set `device: cpu` on it, or run the job where a GPU is (resources.gpu)"
"""What to change when a GPU stage finds no GPU."""


def spread(stages: Sequence[StageSpec], gpus: Sequence[str] | None) -> list[StageSpec]:
    """`stages` with each `device: cuda` stage's process counts per GPU made per worker:
    `workers: N` on a worker with two GPUs runs N on each. A ValueError says what to change
    when a stage asks for a GPU this worker does not have."""
    for s in stages:
        if not s.device.startswith("cuda") or gpus is None:
            continue
        if not gpus:
            raise ValueError(
                f"stage {s.name!r} runs on {s.device}, and no CUDA device is visible to this "
                f"worker: {NO_GPU}"
            )
        index = s.device.partition(":")[2]
        if index and int(index) >= len(gpus):
            raise ValueError(
                f"stage {s.name!r} runs on {s.device}, and this worker has {len(gpus)} GPU(s) "
                f"({', '.join(gpus)}): use `device: cuda` to spread it over them"
            )
    if not gpus:
        return list(stages)
    count = len(gpus)
    out = []
    for s in stages:
        if s.device != "cuda":
            out.append(s)
            continue
        assert s.min_workers is not None and s.max_workers is not None
        out.append(
            replace(
                s,
                workers=s.workers * count,
                min_workers=s.min_workers * count,
                max_workers=s.max_workers * count,
            )
        )
    return out


def placement(device: str, slot: int, gpus: Sequence[str] | None) -> tuple[str, dict[str, str]]:
    """The device replica `slot` of a stage on `device` is handed, and what its environment
    must say for it (its one GPU). `cuda:N` names the worker's N-th GPU."""
    if not device.startswith("cuda"):
        return device, {DEVICE_ENV: device}
    if not gpus:
        # Nothing says which GPUs are ours: the stage runs as it asks, and finds out.
        return device, {DEVICE_ENV: device}
    index = device.partition(":")[2]
    gpu = gpus[int(index)] if index else gpus[slot % len(gpus)]
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": gpu, DEVICE_ENV: "cuda:0"}


def least_used_slot(slots: Sequence[int]) -> int:
    """The slot a new replica takes: the lowest free one, so that replicas added and taken
    away by the elastic scheduler stay spread evenly over the GPUs."""
    taken = set(slots)
    slot = 0
    while slot in taken:
        slot += 1
    return slot
