"""The level-triggered reconcile step, and the pure function at its heart.

Each pass looks at the whole world (running jobs from the master, workers from the backend)
and makes it right, whatever happened before: desired workers per job = its fair share of
capacity, capped by its max and by the shards it has left, at least its min; launch the
missing, drain the surplus, drain workers of jobs that ended, relaunch failed workers after
a capped exponential backoff. Nothing is remembered between passes but that backoff, the
evidence against each job (crashes in a row, workers whose pipeline could not start), and
what the master has yet to hear.

Every worker that ends badly is told to the master at once (`worker_ended`), with whether its
shards are to blame: a worker the cluster took (preempted, evicted, its node lost, killed from
outside) or that could not start its pipeline gives its shards back with no penalty; one that
crashed or ran out of memory while computing them counts as their failed attempt.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from ebb.common.api import MasterClient
from ebb.common.bus import Backoff
from ebb.common.errors import BusError, ErrorCode, RemoteError
from ebb.common.messages import TERMINAL_JOB_STATES, JobStatus

from . import metrics
from .backend import Capacity, ClusterBackend, WorkerInfo
from .capacity import Demand, allocate
from .failures import Kind
from .setup import SetupFailures, SetupPolicy

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


def ever_ready(job: JobStatus | None) -> bool:
    """Some worker of `job` has started its pipeline: it said so, or committed a shard."""
    return job is not None and (
        job.workers_ready > 0 or job.rows_done > 0 or job.shards.get("DONE", 0) > 0
    )


def nodes_for(job: JobStatus | None, capacity: Capacity) -> set[str]:
    """The nodes `job` could run on now."""
    if job is None:
        return set()
    fits = capacity.eligible(job)
    return {b.name for b in capacity.bins if fits(b)}


_BLAMED: frozenset[Kind] = frozenset({"oom", "crash"})
"""Ends a shard can cause: its attempts count as failed. Any other end is not the shards'."""


@dataclass(frozen=True, kw_only=True)
class Notice:
    """What the master is to hear of a worker that ended badly."""

    job: str
    worker: str
    kind: Kind
    reason: str

    @property
    def blame(self) -> bool:
        return self.kind in _BLAMED


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
    max_crashes: int = 5
    """Workers of a job that crash in a row before the job fails: its own code, not the
    cluster, is what fails. A worker that lived healthy_after_s, a shard committed since the
    last crash, or a worker killed from outside (not a crash) starts the count again."""
    setup: SetupPolicy = field(default_factory=SetupPolicy)
    """When workers whose pipeline cannot start fail the job (see setup.py)."""
    setup_backoff: Backoff = field(default_factory=lambda: Backoff(first_s=0.5, max_s=5.0))
    """Relaunch delay after a worker could not start its pipeline: short, so that a job that
    cannot start anywhere fails in seconds, and one that can is not held back."""


class Reconciler:
    def __init__(
        self, *, master: MasterClient, backend: ClusterBackend, config: ReconcilerConfig
    ) -> None:
        self.master = master
        self.backend = backend
        self.config = config
        self.failures: dict[str, int] = defaultdict(int)
        """Crashes in a row, per job."""
        self.crashes: dict[str, list[str]] = defaultdict(list)
        """How the workers of those crashes ended (the evidence when the job fails)."""
        self.progress: dict[str, int] = {}
        """Rows a job had done at its last crash: more since then means its workers work."""
        self.not_before: dict[str, float] = {}
        self.last_plan: Plan | None = None
        self.failed_jobs: dict[str, str] = {}
        """Jobs this controller failed, and why (until the master confirms they ended)."""
        self.specs: dict[str, dict[str, Any]] = {}
        """The spec of each running job. A spec never changes, so each is fetched once, on
        its own: all of them in one reply could exceed what NATS carries."""
        self.setup_failures: dict[str, SetupFailures] = {}
        """Per job: its workers that could not start their pipeline."""
        self.to_tell: dict[tuple[str, str], Notice] = {}
        """Workers that ended badly, until the master has heard (job, worker) -> notice."""

    async def reconcile_once(self) -> Plan:
        """One pass: observe, decide, act. Safe to call at any time, any number of times."""
        loop = asyncio.get_running_loop()
        status = await self.master.status(active_only=True)
        running = [j for j in status.jobs if j.state == "RUNNING"]
        jobs = await self._with_specs(running)
        workers = await self.backend.observe()
        now = loop.time()
        live = [w for w in workers if not w.ended]
        capacity = await self.backend.capacity(jobs, live)
        by_id = {j.id: j for j in jobs}
        for w in workers:
            if w.ended:
                job = by_id.get(w.job)
                self.account(
                    w,
                    now,
                    rows_done=job.rows_done if job else 0,
                    ready=ever_ready(job),
                    nodes=nodes_for(job, capacity),
                )
                await self.backend.forget(w.id)
        await self._tell_master(set(by_id))
        await self._fail_jobs(running)
        self.forget_ended({j.id for j in running})
        jobs = [j for j in jobs if j.id not in self.failed_jobs]
        decided = plan(
            jobs=jobs, workers=live, capacity=capacity, now=now, not_before=self.not_before
        )
        for job_id, count in decided.launch.items():
            for _ in range(count):
                await self.backend.launch(by_id[job_id], f"{job_id[:40]}-{secrets.token_hex(3)}")
        for worker_id in decided.terminate:
            await self.backend.terminate(worker_id, grace_s=self.config.worker_grace_s)
        self._publish(jobs, workers, decided)
        self.last_plan = decided
        return decided

    async def _with_specs(self, jobs: list[JobStatus]) -> list[JobStatus]:
        """`jobs` with their specs. A job whose spec the master cannot send cannot run (its
        workers could not read it either): it fails, with the reason."""
        self.specs = {j.id: self.specs[j.id] for j in jobs if j.id in self.specs}
        out = []
        for job in jobs:
            spec = self.specs.get(job.id)
            if spec is None:
                try:
                    spec = (await self.master.job(job.id, include_spec=True)).spec
                except RemoteError as e:
                    if e.code != ErrorCode.TOO_LARGE:
                        raise
                    log.error("job %s: the master cannot send its spec: %s", job.id, e.message)
                    self.failed_jobs.setdefault(job.id, f"its spec is too large to send: {e}")
                if spec is None:
                    continue
                self.specs[job.id] = spec
            out.append(replace(job, spec=spec))
        return out

    def account(
        self,
        worker: WorkerInfo,
        now: float,
        *,
        rows_done: int,
        ready: bool = False,
        nodes: set[str] | None = None,
    ) -> None:
        """Learn from a worker that ended: relaunch at once, later, with more memory, or not;
        and what the master is to hear of it. No I/O.

        `rows_done`: the job's rows done so far (progress since the last crash clears it).
        `ready`: some worker of the job has started its pipeline. `nodes`: where the job
        could run now."""
        job = worker.job
        if worker.phase == "succeeded":
            self._forgive(job)
            return
        kind: Kind = worker.failure or "crash"
        metrics.WORKER_FAILURES.labels(job, kind).inc()
        notice = Notice(job=job, worker=worker.id, kind=kind, reason=worker.reason)
        self.to_tell[(job, worker.id)] = notice
        if kind == "capacity":  # evicted, preempted, killed from outside: nobody's fault
            log.info("worker %s of job %s lost its place (%s)", worker.id, job, worker.reason)
            self._forgive(job)
            return
        if kind == "fatal":
            self.failed_jobs.setdefault(job, f"workers cannot run: {worker.reason}")
            return
        if kind == "setup":
            self._setup_failed(worker, now, ready=ready, nodes=nodes or set())
            return
        if kind == "oom":
            self.backend.grow_memory(job)
        healthy = now - worker.started_at > self.config.healthy_after_s
        if healthy or rows_done > self.progress.get(job, rows_done):
            self._forgive(job)
        self.progress[job] = rows_done
        step = self.failures[job]
        self.failures[job] = step + 1
        self.crashes[job] = [*self.crashes[job], worker.reason][-self.config.max_crashes :]
        if kind == "crash" and self.failures[job] >= self.config.max_crashes:
            ends = "; ".join(self.crashes[job])
            self.failed_jobs.setdefault(
                job,
                f"{self.failures[job]} workers crashed in a row with no shard committed "
                f"between them: {ends}",
            )
            return
        delay = self.config.relaunch_backoff.delay(step)
        self.not_before[job] = now + delay
        log.warning(
            "worker %s of job %s failed (%s: %s); relaunching in %.1fs",
            worker.id,
            job,
            kind,
            worker.reason,
            delay,
        )

    def _setup_failed(
        self, worker: WorkerInfo, now: float, *, ready: bool, nodes: set[str]
    ) -> None:
        """A worker could not start its pipeline: its node's fault (relaunch soon, elsewhere
        where the backend avoids failing nodes) until the evidence says it is the job's."""
        job = worker.job
        failures = self.setup_failures.setdefault(job, SetupFailures())
        failures.note(worker=worker.id, node=worker.node, reason=worker.reason)
        verdict = failures.verdict(
            self.config.setup, ever_ready=ready, nodes_available=len(nodes | failures.nodes)
        )
        if verdict:
            self.failed_jobs.setdefault(job, verdict)
            return
        delay = self.config.setup_backoff.delay(len(failures.workers) - 1)
        self.not_before[job] = max(self.not_before.get(job, 0.0), now + delay)
        log.warning(
            "worker %s of job %s could not start its pipeline (%s); relaunching in %.1fs",
            worker.id,
            job,
            worker.reason,
            delay,
        )

    async def _tell_master(self, running: set[str]) -> None:
        """Tell the master of every worker that ended badly, so that the leases it held end
        now rather than when they expire. Idempotent on the master's side: a notice whose
        answer was lost is sent again on the next pass."""
        for key, notice in list(self.to_tell.items()):
            if notice.job not in running:
                del self.to_tell[key]  # the job ended: its leases are void already
                continue
            try:
                await self.master.worker_ended(
                    notice.job,
                    notice.worker,
                    kind=notice.kind,
                    blame=notice.blame,
                    reason=notice.reason,
                )
            except BusError as e:
                log.info("the master did not hear of worker %s yet (%s)", notice.worker, e)
                return  # unreachable now: the next pass tells it
            except RemoteError as e:
                if e.retryable:
                    log.info("the master did not hear of worker %s yet (%s)", notice.worker, e)
                    return
                log.warning("the master refused word of worker %s: %s", notice.worker, e)
            del self.to_tell[key]

    def _forgive(self, job: str) -> None:
        """The job's workers are not crash-looping: start counting again."""
        self.failures.pop(job, None)
        self.crashes.pop(job, None)

    def forget_ended(self, running: set[str]) -> None:
        """Drop what we learnt of jobs that no longer run. A job that is resumed starts
        with a clean slate: the crashes that ended its first run do not count again."""
        tables: tuple[dict[str, Any], ...] = (
            self.failures,
            self.crashes,
            self.progress,
            self.not_before,
            self.setup_failures,
        )
        for table in tables:
            for job in [j for j in table if j not in running]:
                del table[job]

    async def _fail_jobs(self, running: list[JobStatus]) -> None:
        """Tell the master about jobs that cannot run. Until it has heard, ask again."""
        active = {j.id for j in running}
        for job, reason in list(self.failed_jobs.items()):
            if job not in active:
                del self.failed_jobs[job]  # ended (by us, or otherwise)
                continue
            log.error("job %s cannot run: %s", job, reason)
            reply = await self.master.fail(job, reason)
            if reply.state in TERMINAL_JOB_STATES:
                # Heard: asking again could fail the job a second time once it is resumed.
                del self.failed_jobs[job]

    def _publish(self, jobs: list[JobStatus], workers: list[WorkerInfo], decided: Plan) -> None:
        actual: dict[str, int] = defaultdict(int)
        for w in workers:
            if w.alive:
                actual[w.job] += 1
        for job in jobs:
            metrics.WORKERS_DESIRED.labels(job.id).set(decided.desired.get(job.id, 0))
            metrics.WORKERS_ACTUAL.labels(job.id).set(actual.get(job.id, 0))
