"""Simulated workers on the fake cluster: one per worker pod the fake kubelet runs, speaking
the real lease protocol to a real shard master, their computing a wait on a compressed clock.

A worker leases shards of its tier (`MasterClient.lease` with the tier), takes the simulated
time its tier needs for the shard's rows, writes a placeholder file and a real commit record
(`OutputStore.create_commit`) in its tier's root (a tier before the last under the output
root's `_tiers/<tier>`: the hand-off the master turns into the next tier's shard), and commits,
as services/worker does. It renews its lease at a third of it, telling the rows done; a
renewal that asks for a split, or its pod's deletion, stops it: a deleted pod's worker leases
nothing more and carries on with its shard for its grace (DRAIN_S, less SPLIT_RESERVE_S), then
commits the rows done as a part of the shard (`split_at`); none done, it hands the shard back.
A worker that ends of itself (the job over, or its drain done) ends its pod, Succeeded.

Its lease of the next shard and its commit of the last overlap its computing, as a real
worker's read-ahead (a next shard leased while one computes) has them do: a worker computes
from where its last shard's computing ended, unless it waited for work. Unlike a real worker,
it computes one shard at a time, and its files hold no rows: nothing reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field

from ebb.common import envvars
from ebb.common.data.layout import CommitRecord, OutputFile, attempt_dir, tier_root
from ebb.common.data.output import OutputStore, new_commit
from ebb.common.errors import RemoteError
from ebb.common.job import JobSpec
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.messages import LeaseReply
from ebb.controller.kube.backend import APP, APP_LABEL
from ebb.controller.kube.podspec import TIER_LABEL
from ebb.worker.leases import renew_after
from ebb.worker.service import WorkerConfig
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.fake_store import PODS, TERMINAL_PHASES, Change, Obj

POD_GRACE_S = 60.0
"""A deleted pod's grace (Ebb's default): the fake kubelet is to end it this long after."""
DRAIN_S = POD_GRACE_S - 10.0
"""The worker's own grace: the pod's less the pod spec's margin (podspec: SHUTDOWN_GRACE_S)."""
SPLIT_RESERVE_S = WorkerConfig.split_reserve_s
"""The end of that grace a draining worker keeps for writing and committing its part."""
PLACEHOLDER = b"simulated rows\n"
"""Each committed file's content."""


@dataclass(frozen=True)
class SimClock:
    """Simulated seconds on the event loop's clock: one lasts `second_s` of it."""

    second_s: float
    origin: float
    """The loop's time at simulated 0."""

    def now(self) -> float:
        return (asyncio.get_running_loop().time() - self.origin) / self.second_s

    def wall(self, sim_s: float) -> float:
        return sim_s * self.second_s


@dataclass(frozen=True, kw_only=True)
class TierPace:
    """How a simulated worker of one tier spends its time."""

    name: str
    shard_s: float
    """Simulated seconds over a whole shard of `rows_per_shard` rows."""
    model_s: float
    """Of them, the seconds a GPU computes the model (0: the tier runs no model)."""
    last: bool
    """The tier whose commits are the job's output."""
    rows_per_shard: int


@dataclass
class Counts:
    """What the simulated workers did, over one run."""

    model_s: float = 0.0
    """GPU-seconds of model work in the rows of the commit records created."""
    commits: dict[str, int] = field(default_factory=dict)
    """Commit records created, per tier."""
    rows: dict[str, int] = field(default_factory=dict)
    """Their rows, per tier."""
    parts: int = 0
    """Of them, parts of a shard (a drain, or a split the master asked for)."""
    lost_races: int = 0
    """Commit records another attempt had created first."""
    released: int = 0
    """Shards handed back with no row done."""
    lost_leases: int = 0
    """Attempts abandoned because a renewal found the lease gone."""
    killed: int = 0
    """Workers whose pod ended before they did (its grace over, or killed)."""
    last_commit: float = 0.0
    """Simulated time of the last commit of the last tier."""
    first_handoff: float | None = None
    """Simulated time of the first commit of a tier before the last."""
    protocol_s: list[float] = field(default_factory=list)
    """Per attempt, the machine's seconds its lease and its commit took (requests, files)."""


class SimWorker:
    """The worker of one pod, simulated (see the module's text)."""

    def __init__(
        self,
        *,
        worker_id: str,
        job: JobSpec,
        pace: TierPace,
        master: MasterClient,
        clock: SimClock,
        counts: Counts,
    ) -> None:
        self.worker_id = worker_id
        self.job = job
        self.pace = pace
        self.per_row_s = pace.shard_s / pace.rows_per_shard
        self.master = master
        self.clock = clock
        self.counts = counts
        uri = job.output.uri
        self.store = OutputStore(uri if pace.last else tier_root(uri, pace.name))
        self.drain_at: float | None = None
        """When its pod was deleted (simulated), if it was."""
        self.free_at = -math.inf
        """When its last shard's computing ended (simulated)."""
        self.creating: set[asyncio.Task[CommitRecord]] = set()
        """Its commit record being created: that goes on if its pod is killed meanwhile."""
        self._woken = asyncio.Event()
        """Set when its pod is deleted, and from then on."""

    def told_to_go(self) -> None:
        if self.drain_at is None:
            self.drain_at = self.clock.now()
            self._woken.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.drain_at is None:
            asked, asked_sim = loop.time(), self.clock.now()
            reply = await self.master.lease(
                self.job.id, self.worker_id, ready=True, tier=self.pace.name
            )
            if reply.status == "end":
                return
            if reply.status == "wait":
                await self._nap(reply.retry_after_s)
                continue
            # A real worker leases its next shard and commits its last while it computes
            # (its read-ahead): its computing goes on from where it was, the requests and
            # files aside, unless it had nothing to do.
            await self._attempt(reply, max(self.free_at, asked_sim), leasing_s=loop.time() - asked)

    async def _nap(self, wall_s: float) -> None:
        """Sleep `wall_s` of the machine's time, or until the pod is deleted (at once if it
        is: a deletion that came while a request was out is not missed)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, wall_s)):
                await self._woken.wait()

    async def _attempt(self, reply: LeaseReply, started: float, *, leasing_s: float) -> None:
        """Compute the leased shard from simulated time `started`, and commit it."""
        shard = reply.shard
        assert shard is not None
        done_at = started + shard.rows * self.per_row_s
        renew_at = started + renew_after(reply.lease_s, reply.renew_in_s) / self.clock.second_s
        rows = shard.rows
        while True:
            now = self.clock.now()
            if now >= done_at:
                self.free_at = done_at
                break
            cut = math.inf
            if self.drain_at is not None:
                cut = self.drain_at + DRAIN_S - SPLIT_RESERVE_S
            if now >= cut:
                rows = self._rows_done(started, now, shard.rows)
                self.free_at = now
                break
            if now >= renew_at:
                try:
                    renewed = await self.master.renew(
                        reply.token,
                        worker=self.worker_id,
                        ready=True,
                        rows_done=self._rows_done(started, now, shard.rows),
                    )
                except RemoteError as e:
                    if not e.lease_lost:
                        raise
                    self.counts.lost_leases += 1
                    return
                if renewed.split:
                    self.free_at = self.clock.now()
                    rows = self._rows_done(started, self.free_at, shard.rows)
                    break
                after = renew_after(renewed.lease_s, renewed.renew_in_s)
                renew_at = now + after / self.clock.second_s
                continue
            pause = self.clock.wall(min(done_at, cut, renew_at) - now)
            if self.drain_at is None:
                await self._nap(pause)
            else:  # its drain is in `cut` already
                await asyncio.sleep(pause)
        if rows == 0:
            await self.master.release(
                reply.token, "drained before a row was done", worker=self.worker_id, retryable=True
            )
            self.counts.released += 1
            return
        loop = asyncio.get_running_loop()
        committing = loop.time()
        await self._commit(reply, rows)
        self.counts.protocol_s.append(leasing_s + loop.time() - committing)

    async def _create(self, record: CommitRecord) -> CommitRecord:
        """Create the attempt's commit record: ours, or the one that was there first."""
        won, existing = await asyncio.to_thread(self.store.create_commit, record)
        c = self.counts
        if won:
            c.commits[self.pace.name] = c.commits.get(self.pace.name, 0) + 1
            c.rows[self.pace.name] = c.rows.get(self.pace.name, 0) + record.rows
            c.parts += bool(record.split_at)
            c.model_s += record.rows / self.pace.rows_per_shard * self.pace.model_s
        else:
            c.lost_races += 1
        return existing

    def _rows_done(self, started: float, now: float, rows: int) -> int:
        return min(rows, int((now - started) / self.per_row_s))

    async def _commit(self, reply: LeaseReply, rows: int) -> None:
        shard = reply.shard
        assert shard is not None
        ext = "parquet" if self.pace.last else "arrow"
        path = f"{attempt_dir(shard.index, reply.attempt)}/part-00000.{ext}"
        await asyncio.to_thread(self.store.write_file, path, PLACEHOLDER)
        whole = rows >= shard.rows
        record = new_commit(
            job=self.job.id,
            shard=shard.index,
            attempt=reply.attempt,
            files=[OutputFile(path=path, rows=rows, bytes=len(PLACEHOLDER))],
            worker=self.worker_id,
            split_at=0 if whole else rows,
        )
        # Counted when the record is created, even if the pod is killed meanwhile: the
        # record stands, and the master makes its rows the shard's (or a part's).
        creating = asyncio.create_task(self._create(record), name=f"create-{self.worker_id}")
        self.creating.add(creating)
        creating.add_done_callback(self.creating.discard)
        record = await asyncio.shield(creating)
        try:
            await self.master.commit(
                reply.token, worker=self.worker_id, rows=record.rows, error_rows=0
            )
        except RemoteError as e:
            if not e.lease_lost:  # lost: the record stands, whoever holds the shard reports it
                raise
        c = self.counts
        if self.pace.last:
            c.last_commit = max(c.last_commit, self.clock.now())
        elif c.first_handoff is None:
            c.first_handoff = self.clock.now()


@dataclass
class PodLife:
    tier: str
    gpus: int
    bound_at: float | None = None
    """Simulated time the scheduler placed it on a node."""
    ended_at: float | None = None


class Fleet:
    """The simulated workers of a job's pods in `namespace`: one from when the fake kubelet
    runs a pod to when the pod ends, told to go when it is deleted. Learns the pods' lives
    from the fake API server's store, as they change."""

    def __init__(
        self,
        kube: FakeKubeAPI,
        *,
        namespace: str,
        job: JobSpec,
        paces: dict[str, TierPace],
        master: MasterClient,
        clock: SimClock,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.job = job
        self.paces = paces
        self.master = master
        self.clock = clock
        self.counts = Counts()
        self.pods: dict[str, PodLife] = {}
        self.workers: dict[str, SimWorker] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.finished: set[str] = set()
        """Pods whose worker ended of itself: their end is its doing."""
        self._unsubscribe = kube.store.subscribe(self._on_change)

    def _on_change(self, change: Change) -> None:
        if change.rt is not PODS:
            return
        pod, meta = change.obj, change.obj["metadata"]
        labels = meta.get("labels") or {}
        if meta.get("namespace") != self.namespace or labels.get(APP_LABEL) != APP:
            return
        name = meta["name"]
        life = self.pods.get(name)
        if life is None:
            life = self.pods[name] = PodLife(tier=labels.get(TIER_LABEL, ""), gpus=_gpus(pod))
        now = self.clock.now()
        if life.bound_at is None and pod["spec"].get("nodeName"):
            life.bound_at = now
        phase = (pod.get("status") or {}).get("phase")
        if change.type == "DELETED" or phase in TERMINAL_PHASES:
            if life.ended_at is not None:
                return
            life.ended_at = now
            task = self.tasks.get(name)
            if task is not None and not task.done() and name not in self.finished:
                task.cancel()  # killed: its lease is for the master to take back
                self.counts.killed += 1
            return
        worker = self.workers.get(name)
        if meta.get("deletionTimestamp"):
            if worker is not None:
                worker.told_to_go()
            return
        if phase == "Running" and worker is None:
            worker = SimWorker(
                worker_id=_worker_id(pod),
                job=self.job,
                pace=self.paces[life.tier],
                master=self.master,
                clock=self.clock,
                counts=self.counts,
            )
            self.workers[name] = worker
            self.tasks[name] = asyncio.create_task(self._live(name, worker), name=f"sim-{name}")

    async def _live(self, name: str, worker: SimWorker) -> None:
        await worker.run()
        self.finished.add(name)
        pod = self.kube.get_pod(name, self.namespace)
        if pod is not None and (pod.get("status") or {}).get("phase") not in TERMINAL_PHASES:
            self.kube.exit_pod(name, self.namespace)

    def check(self) -> None:
        """Raise what a simulated worker died of, if one did."""
        for task in self.tasks.values():
            if task.done() and not task.cancelled() and (e := task.exception()) is not None:
                raise RuntimeError(f"simulated worker {task.get_name()} failed") from e

    def live(self, tier: str) -> int:
        """The tier's pods now: placed or waiting to be, not ended."""
        return sum(1 for p in self.pods.values() if p.tier == tier and p.ended_at is None)

    def gpu_held_s(self, until: float, *, since: float = 0.0) -> float:
        """GPU-seconds the pods held from their placing to their end, between `since` and
        `until`."""
        held = 0.0
        for p in self.pods.values():
            if p.gpus and p.bound_at is not None:
                end = until if p.ended_at is None else min(p.ended_at, until)
                held += p.gpus * max(0.0, end - max(p.bound_at, since))
        return held

    async def close(self) -> None:
        self._unsubscribe()
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        creating = [t for w in self.workers.values() for t in w.creating]
        await asyncio.gather(*creating, return_exceptions=True)


def _gpus(pod: Obj) -> int:
    limits = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


def _worker_id(pod: Obj) -> str:
    """The id the controller gave the pod's worker (its environment), as it leases."""
    env = pod["spec"]["containers"][0].get("env") or []
    found = next((e.get("value") for e in env if e["name"] == envvars.WORKER_ID), None)
    return str(found or pod["metadata"]["name"])
