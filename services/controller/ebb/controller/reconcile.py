"""The level-triggered reconcile step, and the pure function at its heart.

Each pass looks at the whole world (running jobs from the master, workers from the backend)
and makes it right, whatever happened before: desired workers per job = its fair share of
capacity, capped by its max and by the shards it has left, at least its min; launch the
missing, drain the surplus, drain workers of jobs that ended, relaunch failed workers after
a capped exponential backoff. Nothing is remembered between passes but that backoff.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import defaultdict
from dataclasses import dataclass, field

from ebb.common.api import MasterClient
from ebb.common.bus import Backoff
from ebb.common.messages import JobStatus

from . import metrics
from .backend import Capacity, ClusterBackend, WorkerInfo
from .capacity import Demand, allocate

log = logging.getLogger(__name__)


def wanted(job: JobStatus) -> int:
    """Workers a job could use now, before capacity is considered."""
    remaining = job.shards.get("TODO", 0) + job.shards.get("DOING", 0)
    if job.state != "RUNNING" or remaining == 0:
        return 0
    return min(job.max_workers, max(job.min_workers, remaining))


def demand(job: JobStatus, capacity: Capacity) -> Demand:
    return Demand(
        job=job.id,
        want=wanted(job),
        min_workers=job.min_workers,
        priority=job.priority,
        submitted_at=job.submitted_at,
        shape=capacity.shape(job),
        eligible=capacity.eligible(job),
    )


def share(jobs: list[JobStatus], slots: int) -> dict[str, int]:
    """Split `slots` identical worker slots between jobs (see capacity.allocate)."""
    return allocate([demand(j, Capacity.slots(slots)) for j in jobs], Capacity.slots(slots).bins)


@dataclass(frozen=True, kw_only=True)
class Plan:
    desired: dict[str, int]
    launch: dict[str, int] = field(default_factory=dict)
    """Job id -> workers to start."""
    terminate: list[str] = field(default_factory=list)
    """Worker ids to drain."""
    held_back: dict[str, float] = field(default_factory=dict)
    """Jobs short of workers but in relaunch backoff: seconds left."""


def plan(
    *,
    jobs: list[JobStatus],
    workers: list[WorkerInfo],
    capacity: Capacity,
    now: float,
    not_before: dict[str, float],
) -> Plan:
    """What to change, given what is. Pure: no I/O, no clock, no memory.

    `capacity` counts the resources of the live workers of these jobs as free (they are
    placed again, from scratch, by `allocate`) and those of draining workers as taken."""
    live = [w for w in workers if not w.ended]
    desired = allocate([demand(j, capacity) for j in jobs], capacity.bins)
    alive: dict[str, list[WorkerInfo]] = defaultdict(list)
    for w in live:
        if w.alive:
            alive[w.job].append(w)
    launch: dict[str, int] = {}
    terminate: list[str] = []
    held_back: dict[str, float] = {}
    for job_id, target in desired.items():
        have = alive.get(job_id, [])
        if len(have) < target:
            wait = not_before.get(job_id, 0.0) - now
            if wait > 0:
                held_back[job_id] = wait
            else:
                launch[job_id] = target - len(have)
        elif len(have) > target:
            # The youngest go first: the oldest are the most likely to be mid-shard.
            surplus = sorted(have, key=lambda w: w.started_at, reverse=True)
            terminate += [w.id for w in surplus[: len(have) - target]]
    for job_id, have in alive.items():
        if job_id not in desired:  # the job ended, or is unknown to the master
            terminate += [w.id for w in have]
    return Plan(desired=desired, launch=launch, terminate=terminate, held_back=held_back)


@dataclass(frozen=True, kw_only=True)
class ReconcilerConfig:
    worker_grace_s: float = 30.0
    """Time a drained worker has to finish its shard before it is killed."""
    relaunch_backoff: Backoff = field(default_factory=lambda: Backoff(first_s=1.0, max_s=60.0))
    healthy_after_s: float = 60.0
    """A worker that ran this long before failing restarts the backoff from its first step."""


class Reconciler:
    def __init__(
        self, *, master: MasterClient, backend: ClusterBackend, config: ReconcilerConfig
    ) -> None:
        self.master = master
        self.backend = backend
        self.config = config
        self.failures: dict[str, int] = defaultdict(int)
        self.not_before: dict[str, float] = {}
        self.last_plan: Plan | None = None

    async def reconcile_once(self) -> Plan:
        """One pass: observe, decide, act. Safe to call at any time, any number of times."""
        loop = asyncio.get_running_loop()
        status = await self.master.status(active_only=True)
        jobs = [j for j in status.jobs if j.state == "RUNNING"]
        workers = await self.backend.observe()
        now = loop.time()
        for w in workers:
            if w.ended:
                self._account(w, now)
                await self.backend.forget(w.id)
        capacity = await self.backend.capacity(jobs, [w for w in workers if not w.ended])
        decided = plan(
            jobs=jobs,
            workers=[w for w in workers if not w.ended],
            capacity=capacity,
            now=now,
            not_before=self.not_before,
        )
        by_id = {j.id: j for j in jobs}
        for job_id, count in decided.launch.items():
            for _ in range(count):
                await self.backend.launch(by_id[job_id], f"{job_id[:40]}-{secrets.token_hex(3)}")
        for worker_id in decided.terminate:
            await self.backend.terminate(worker_id, grace_s=self.config.worker_grace_s)
        self._publish(jobs, workers, decided)
        self.last_plan = decided
        return decided

    def _account(self, worker: WorkerInfo, now: float) -> None:
        if worker.phase == "succeeded":
            self.failures.pop(worker.job, None)
            return
        if now - worker.started_at > self.config.healthy_after_s:
            self.failures[worker.job] = 0
        step = self.failures[worker.job]
        self.failures[worker.job] = step + 1
        delay = self.config.relaunch_backoff.delay(step)
        self.not_before[worker.job] = now + delay
        metrics.WORKER_FAILURES.labels(worker.job, worker.reason or "unknown").inc()
        log.warning(
            "worker %s of job %s failed (%s); relaunching in %.1fs",
            worker.id,
            worker.job,
            worker.reason,
            delay,
        )

    def _publish(self, jobs: list[JobStatus], workers: list[WorkerInfo], decided: Plan) -> None:
        actual: dict[str, int] = defaultdict(int)
        for w in workers:
            if w.alive:
                actual[w.job] += 1
        for job in jobs:
            metrics.WORKERS_DESIRED.labels(job.id).set(decided.desired.get(job.id, 0))
            metrics.WORKERS_ACTUAL.labels(job.id).set(actual.get(job.id, 0))
