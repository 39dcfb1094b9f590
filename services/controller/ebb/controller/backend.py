"""The seam between the reconciler and the place workers run: local processes or Kubernetes pods."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ebb.common import envvars
from ebb.common.errors import SpecError
from ebb.common.job import RUNTIME_MODULES, parse_job
from ebb.common.messaging.messages import JobStatus

from .policy.capacity import Bin, Resources, no_preference
from .policy.failures import Kind

Phase = Literal["starting", "running", "terminating", "succeeded", "failed"]

THIS_MACHINE = "local"
"""The one place the local backend runs workers: its capacity's bin and its workers' node."""


class LaunchRefused(Exception):
    """The cluster refused to start a worker for a reason no retry of ours mends (the
    controller lacks a permission): its job waits, and its status says why, until an
    operator mends it and a launch goes through."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    id: str
    job: str
    phase: Phase
    started_at: float
    """When the worker started, on the event loop's (monotonic) clock, as every backend gives
    it (Kubernetes: now minus the pod's age), so that the reconciler compares it with its
    own loop time."""
    exit_code: int | None = None
    reason: str = ""
    """Why it failed, in the backend's words (exit code, OOMKilled, Evicted...)."""
    failure: Kind | None = None
    """What kind of failure (see ebb.controller.policy.failures); None: not classified (a plain exit
    code)."""
    node: str = ""
    """Where it runs or ran (a node's name; the local backend's one place)."""
    tier: str = ""
    """The tier of its job it runs (`JobSpec.tiers`); "" for a job without tiers."""
    drained: bool = False
    """It ended because it was told to go (the controller gave its place back, or its tier or
    job needed it no more), in time: a drain, not a loss (with phase "succeeded")."""

    @property
    def alive(self) -> bool:
        return self.phase in ("starting", "running")

    @property
    def ended(self) -> bool:
        return self.phase in ("succeeded", "failed")


def _anywhere(_job: JobStatus, _tier: str) -> Callable[[Bin], bool]:
    return lambda _bin: True


def _one_slot(_job: JobStatus, _tier: str) -> Resources:
    return {"workers": 1.0}


def _in_name_order(_job: JobStatus, _tier: str) -> Callable[[Bin], int]:
    return no_preference


def _placeable(_job: JobStatus, _tier: str) -> str:
    return ""


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """Where workers could run now, and what one worker of a tier of a job needs."""

    bins: list[Bin]
    """Free resources, counting those of live workers as free: they are placed anew."""
    shape: Callable[[JobStatus, str], Resources] = field(default=_one_slot)
    """What one worker of (job, tier) requests ("": a job without tiers)."""
    eligible: Callable[[JobStatus, str], Callable[[Bin], bool]] = field(default=_anywhere)
    """Which bins a worker of (job, tier) may go to."""
    prefer: Callable[[JobStatus, str], Callable[[Bin], int]] = field(default=_in_name_order)
    """The order a worker of (job, tier) takes bins in: lower first (capacity.Demand)."""
    unplaceable: Callable[[JobStatus, str], str] = field(default=_placeable)
    """Why no place the backend knows, free or not, could ever take a worker of (job, tier)
    (the job waits, and its status says so); "" when some could."""

    @staticmethod
    def slots(n: int) -> Capacity:
        """`n` identical slots in one place (this machine)."""
        return Capacity(bins=[Bin(THIS_MACHINE, {"workers": float(max(0, n))})])


class ClusterBackend(Protocol):
    """Where workers run. Every method is idempotent: the reconciler may repeat itself."""

    changed: asyncio.Event
    """A wake-up, and nothing more: set when something a pass would see has changed (a
    worker ended, a node came or went, the tide lent or reclaimed a node), so that the next
    pass comes at once instead of at the next resync. It says nothing of what changed: the
    reconciler clears it before each pass and reads everything anew (`observe`,
    `capacity`), so a set during a pass brings one more, and many sets between two passes
    bring one."""

    async def observe(self) -> list[WorkerInfo]:
        """Every worker this backend knows of, ended ones included until `forget`."""
        ...

    async def capacity(self, jobs: list[JobStatus], workers: list[WorkerInfo]) -> Capacity:
        """Room for workers of these jobs, the live `workers` (of any phase but ended)
        counted as free unless they are terminating."""
        ...

    async def launch(self, job: JobStatus, worker_id: str, *, tier: str = "") -> None:
        """Start worker `worker_id` of `job`, running tier `tier` of it ("": the job has no
        tiers)."""
        ...

    async def terminate(self, worker_id: str, *, grace_s: float) -> None:
        """Ask a worker to drain and exit (SIGTERM); kill it if it is still there after grace_s."""
        ...

    async def forget(self, worker_id: str) -> None:
        """Drop an ended worker from `observe` once its outcome has been accounted for."""
        ...

    async def close(self, *, grace_s: float) -> None:
        """The controller stops: what becomes of the workers is the backend's to decide."""
        ...

    def agents(self) -> dict[str, Coroutine[Any, Any, None]]:
        """Long-lived tasks the backend needs (informers...), for the controller to own."""
        ...

    def grow_memory(self, job: str) -> None:
        """Workers of `job` were OOMKilled: ask for more memory from now on (if it can).
        `job` is a group's key (groups.group_key): the job's id, or `job/tier` for a tier."""
        ...


def job_environment(job: JobStatus, tier: str = "") -> dict[str, str]:
    """What a worker of `job` is told besides its connection: the model runtimes its stages
    (those of its tier, for a job with tiers) will import, for its fork server to import
    once before any stage starts."""
    try:
        spec = parse_job(job.spec) if job.spec else None
    except SpecError:
        return {}  # the worker finds out, and says so
    if spec is None:
        return {}
    pipeline = spec.pipeline
    runs = next((set(t.stages) for t in spec.tiers if t.name == tier), None) if tier else None
    if runs is None:
        modules = pipeline.runtime_modules()
    else:
        # Only its own stages' runtimes: a CPU tier has no use for the GPU tier's torch.
        stages = [s for s in pipeline.stages if s.name in runs]
        modules = sorted({RUNTIME_MODULES[r] for s in stages for r in s.runtimes()})
    return {envvars.STAGE_PRELOAD: ",".join(modules)} if modules else {}
