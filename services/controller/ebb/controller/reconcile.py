"""The level-triggered reconcile step around a pure plan (ebb.controller.groups).

Each pass looks at the whole world (running jobs from the master, workers from the backend)
and makes it right, whatever happened before: desired workers per group (a job, or one tier
of a job with tiers: ebb.controller.groups) = its fair share of capacity, capped by its max and by
the shards it has left, at least its min; launch the missing, drain the surplus, drain workers
of jobs that ended, relaunch failed workers after a capped exponential backoff (per group).
Nothing is remembered between passes but that backoff, the evidence against each job
(crashes in a row, workers whose pipeline could not start), and what the master has yet to
hear.

Every worker that ends badly is told to the master at once (`worker_ended`), with whether its
shards are to blame: a worker the cluster took (preempted, evicted, its node lost, killed from
outside) or that could not start its pipeline gives its shards back with no penalty; one that
crashed or ran out of memory while computing them counts as their failed attempt.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ebb.common.errors import BusError, ErrorCode, RemoteError
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.messages import TERMINAL_JOB_STATES, JobStatus
from ebb.common.runner import GRACE_S

from . import metrics
from .backend import Capacity, ClusterBackend, LaunchRefused, WorkerInfo
from .groups import (
    Plan,
    group_key,
    job_of,
    new_worker_id,
    placement_news,
    plan,
    rows_done,
    share,
)
from .policy.failures import Kind
from .policy.setupfailures import SetupFailures, SetupPolicy

__all__ = ["Plan", "Reconciler", "ReconcilerConfig", "plan", "share"]

log = logging.getLogger(__name__)


def ever_ready(job: JobStatus | None, tier: str = "") -> bool:
    """Some worker of `job` (of its tier `tier`) has started its pipeline: it said so, or
    committed a shard. Each tier runs a pipeline of its own: one tier's workers starting
    theirs says nothing of another's."""
    if job is None:
        return False
    if tier:
        state = next((t for t in job.tiers if t.name == tier), None)
        return state is not None and (
            state.workers_ready > 0 or state.rows_done > 0 or state.shards.get("DONE", 0) > 0
        )
    return job.workers_ready > 0 or job.rows_done > 0 or job.shards.get("DONE", 0) > 0


def nodes_for(job: JobStatus | None, capacity: Capacity, tier: str = "") -> set[str]:
    """The nodes tier `tier` of `job` could run on now."""
    if job is None:
        return set()
    fits = capacity.eligible(job, tier)
    return {b.name for b in capacity.bins if fits(b)}


_BLAMED: frozenset[Kind] = frozenset({"oom", "crash"})
"""Ends a shard can cause: its attempts count as failed. Any other end is not the shards'."""


@dataclass(frozen=True, kw_only=True)
class Notice:
    """What the master is to hear of a worker that ended badly, or drained (told to go:
    counted apart from those lost)."""

    job: str
    worker: str
    kind: Kind | Literal["drained"]
    reason: str

    @property
    def blame(self) -> bool:
        return self.kind in _BLAMED


@dataclass(frozen=True, kw_only=True)
class ReconcilerConfig:
    worker_grace_s: float = GRACE_S
    """Time a drained worker has to finish its shard before it is killed."""
    relaunch_backoff: Backoff = field(default_factory=lambda: Backoff(first_s=1.0, max_s=60.0))
    healthy_after_s: float = 60.0
    """A worker that ran this long before failing restarts the backoff from its first step."""
    max_crashes: int = 5
    """Workers of a job that crash in a row before the job fails: its own code, not the
    cluster, is what fails. A worker that lived healthy_after_s, a shard committed since the
    last crash, or a worker killed from outside (not a crash) starts the count again."""
    setup: SetupPolicy = field(default_factory=SetupPolicy)
    """When workers whose pipeline cannot start fail the job (see
    ebb.controller.policy.setupfailures)."""
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
        """Rows a group (a job, or a tier of one) had done at its last crash: more since
        then means its workers work."""
        self.not_before: dict[str, float] = {}
        """Per group (a job's id, or `job/tier`): no launch before this (relaunch backoff)."""
        self.last_plan: Plan | None = None
        self.failed_jobs: dict[str, str] = {}
        """Jobs this controller failed, and why (until the master confirms they ended)."""
        self.specs: dict[str, dict[str, Any]] = {}
        """The spec of each running job. A spec never changes, so each is fetched once, on
        its own: all of them in one reply could exceed what NATS carries."""
        self.setup_failures: dict[str, SetupFailures] = {}
        """Per group (a job, or one tier of it): its workers that could not start their
        pipeline."""
        self.to_tell: dict[tuple[str, str], Notice] = {}
        """Workers that ended badly, until the master has heard (job, worker) -> notice."""
        self.refused: dict[str, str] = {}
        """Per group: why the cluster refused its last launch (LaunchRefused), until one
        goes through."""

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
                    rows_done=rows_done(job, w.tier) if job else 0,
                    ready=ever_ready(job, w.tier),
                    nodes=nodes_for(job, capacity, w.tier),
                )
                await self.backend.forget(w.id)
        await self._tell_master(set(by_id))
        await self._fail_jobs(running)
        self.forget_ended({j.id for j in running})
        jobs = [j for j in jobs if j.id not in self.failed_jobs]
        decided = plan(
            jobs=jobs, workers=live, capacity=capacity, now=now, not_before=self.not_before
        )
        for key, count in decided.launch.items():
            group = decided.groups[key]
            try:
                for _ in range(count):
                    worker_id = new_worker_id(group.job.id, group.tier)
                    await self.backend.launch(group.job, worker_id, tier=group.tier)
            except LaunchRefused as e:
                # Not the pass's failure: the other groups are still served, and the job
                # says why it waits (_tell_placement) until an operator mends it.
                if self.refused.get(key) != e.reason:
                    log.error("workers of %s cannot start: %s", key, e.reason)
                self.refused[key] = e.reason
            else:
                if self.refused.pop(key, None) is not None:
                    log.info("workers of %s start again", key)
        for worker_id in decided.terminate:
            await self.backend.terminate(worker_id, grace_s=self.config.worker_grace_s)
        await self._tell_placement(decided, capacity)
        self._publish(workers, decided)
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

        `rows_done`: the rows the worker's group (its job, or its tier of it) has done so
        far (progress since the last crash clears the job's count).
        `ready`: some worker of the job has started its pipeline. `nodes`: where the
        worker's tier of the job could run now. Crashes are counted per job; relaunches
        wait per group."""
        job = worker.job
        group = group_key(job, worker.tier)
        if worker.phase == "succeeded":
            self._forgive(job)
            if worker.drained:
                notice = Notice(job=job, worker=worker.id, kind="drained", reason=worker.reason)
                self.to_tell[(job, worker.id)] = notice
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
            self.backend.grow_memory(group)
        healthy = now - worker.started_at > self.config.healthy_after_s
        if healthy or rows_done > self.progress.get(group, rows_done):
            self._forgive(job)
        self.progress[group] = rows_done
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
        self.not_before[group] = now + delay
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
        # By tier: a tier whose workers cannot start fails the job, whatever the others do.
        failures = self.setup_failures.setdefault(group_key(job, worker.tier), SetupFailures())
        failures.note(worker=worker.id, node=worker.node, reason=worker.reason)
        verdict = failures.verdict(
            self.config.setup, ever_ready=ready, nodes_available=len(nodes | failures.nodes)
        )
        if verdict:
            self.failed_jobs.setdefault(job, verdict)
            return
        delay = self.config.setup_backoff.delay(len(failures.workers) - 1)
        key = group_key(job, worker.tier)
        self.not_before[key] = max(self.not_before.get(key, 0.0), now + delay)
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

    async def _tell_placement(self, decided: Plan, capacity: Capacity) -> None:
        """Tell the master which groups wait for a place no node could ever give them (or for
        a permission the cluster refused them), and why, and which need not any more:
        whenever its status says otherwise (level-triggered: a master that restarted, and
        forgot, hears it again on the next pass)."""
        for key, reason in placement_news(decided, capacity, self.refused).items():
            group = decided.groups[key]
            try:
                await self.master.placement(group.job.id, group.tier, reason)
            except BusError as e:
                log.info("the master did not hear where %s can run yet (%s)", key, e)
                return  # unreachable now: the next pass tells it
            except RemoteError as e:
                log.warning("the master refused word of where %s can run: %s", key, e)
                continue
            if not reason:
                log.info("workers of %s can be placed again", key)
            elif key not in self.refused:  # a refusal was logged as it came
                log.warning("workers of %s wait: no node could ever take them: %s", key, reason)

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
            self.progress,  # by group, as not_before: a job's id, or `job/tier`
            self.not_before,
            self.setup_failures,
            self.refused,
        )
        for table in tables:
            for key in [k for k in table if job_of(k) not in running]:
                del table[key]

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

    def _publish(self, workers: list[WorkerInfo], decided: Plan) -> None:
        actual: dict[str, int] = defaultdict(int)
        for w in workers:
            if w.alive:
                actual[group_key(w.job, w.tier)] += 1
        for key, group in decided.groups.items():
            labels = (group.job.id, group.tier)
            metrics.WORKERS_DESIRED.labels(*labels).set(decided.desired.get(key, 0))
            metrics.WORKERS_ACTUAL.labels(*labels).set(actual.get(key, 0))
