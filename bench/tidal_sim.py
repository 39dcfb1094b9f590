"""Benchmark 6: tidal harvesting of the mixed pool, over four traces of online CPU load and one
of online GPU load.

A cluster of 20 nodes (6 online, 8 mixed, 6 offline; 8 cores each) on the fake Kubernetes
API server of the tests, a real shard master on a real nats-server, and the real controller
(Kubernetes backend, reconciler, tide). Time is compressed: one simulated minute lasts a
fraction of a second. The simulator turns a trace of online load on the mixed pool into online
pods (2 cores each, priority 0) that the fake scheduler places, preempting batch pods for them
when there is no room (batch pods run at the `ebb-batch` PriorityClass of k8s/, -20, never
preempting), or leaves Pending when even that finds none.

One long batch job asks for as many workers (2 cores each) as it can get. A worker finishes a
shard (10,000 rows) every 10 minutes it runs. What a worker told to go costs is counted twice
over the same events: with whole shards, as before splitting, a worker drained or preempted
loses the rows it had done of its shard; with splitting, it commits them as a part of the
shard (`split_at`) and the rest is queued first, so that only a worker gone without a graceful
deletion (killed without notice: a deletion with no grace period, a node lost, an eviction)
loses its rows. Rows are counted by the whole minute a worker was on its shard when it was
told to go, in both columns. Three policies, each over the same trace:

- tidal: the `forecast` policy (TidalConfig's defaults, in simulated time): lend by the core
  against a forecast of online demand 3 minutes ahead (level, trend, same time on earlier
  days), 25% of the pool kept free for online pods, preemption for the rest;
- naive: the `threshold` policy on the last sample alone, no cool-down (whole nodes lent below
  45% utilisation and reclaimed over 70% or when an online pod is Pending);
- never lend: the mixed pool is left to online pods.

The traces, each seeded:

- diurnal: one day, a quiet night (~10% of the pool) and a busy afternoon (~85%), with a 2%
  chance each minute of a one-minute spike of +30%;
- week: seven such days, each with its own amplitude and peak hour, lighter weekends;
- flash crowd: the diurnal day, but at 03:00, in the quiet of the night, a surge takes the
  load from ~10% to 85% of the pool in two minutes, holds it for 40 minutes and ebbs over an
  hour;
- cluster trace: a day in the manner of the online containers of Alibaba's cluster-trace-v2018
  (github.com/alibaba/clusterdata: about 4,000 machines over 8 days, online containers and
  batch jobs co-located; Jiang et al., "Characterizing Co-located Workloads in Alibaba Cloud
  Datacenters", IEEE TCC, find the containers' CPU use cycling daily). Not its data (nothing
  is downloaded) nor a fit to it: a high base (35% of the pool), a daily cycle drawn as a
  morning and a larger evening hump (Gaussian, +30% at 10:30 and +40% at 20:30), and noise
  correlated over minutes (AR(1), 0.97, 1.2% a minute) instead of spikes.

- GPU diurnal: two days of the diurnal shape on a GPU cluster (2 online, 8 mixed and 2 offline
  nodes of 64 cores, 512 GiB and 8 GPUs), whose online pods serve models, a GPU each (and 6
  cores, 48 GiB), and whose batch workers ask for the same, a GPU each: the GPUs bind, not the
  cores. Load, idle capacity and harvest are counted in GPUs, node-hours in GPU node-hours (a
  node's 8 GPUs for an hour); the tide budgets each resource apart (tidal.py).

Drains, in simulated time: every deletion of a batch pod here is graceful (the controller's
drains and the scheduler's preemptions alike give a grace period of 1 s of the machine's time
or more: 200 simulated minutes), and the fake kubelet ends a deleted pod a quarter of a
simulated minute (15 s) after it. That is the drain of a worker whose shutdown grace is 15 s (a
pod grace of 25 s, less the pod spec's 10 s margin): it lets its shard run for 10 s, then stops
it at its next batch and has its split reserve, min(5 s, grace / 2) = 5 s, to write the part
(at most 9,000 rows here) and create its commit record; the sim takes it that they fit in
those 5 s. A worker without splitting waited out its grace for its shard just as long, so the
drains, and every other figure, are the same in both columns; a pod gone before its drain was
over would lose its rows in both. The 10 s a worker computes after it was told to go are not
counted, nor the batch still in its pipeline when it stops (which goes back with the rest):
both are below the minute. With Ebb's default pod grace (60 s: a worker drains for 50 s, the
stop at 45 s), a reclaimed core would come back 35 s later than here.

Reported: harvested node-hours (batch pods' cores on mixed nodes) as a share of the idle
node-hours there were (mixed nodes the online load did not need at 70% utilisation, minute by
minute, as before) and of all the cores online pods left free; online pod-minutes Pending past
the first minute (preemption takes a fraction of one); batch pods drained by the controller
and preempted by the scheduler; shards lost with them; rows lost with them, with whole shards
and with splitting; rows completed, with whole shards and with splitting (the committed parts
added).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from kubernetes_asyncio.client import ApiClient

from ebb.client.sdk import EbbClient
from ebb.common.job import parse_job
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.embedded import EmbeddedNats
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.kube.backend import APP, APP_LABEL, KubeConfig, KubernetesBackend
from ebb.controller.policy.tidal import TidalConfig
from ebb.controller.reconcile import Reconciler, ReconcilerConfig
from ebb.shard_master.service import MasterConfig, ShardMaster
from ebb.worker.service import WorkerConfig
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.fake_store import PODS, TERMINAL_PHASES, Change, Obj, ResourceType
from tests.k8s.manifests import find

from .common import Context, Section, table
from .tidal_traces import CPU_CLUSTER, DAY_MINUTES, GPU_CLUSTER, TRACES, Cluster, Trace

SHARD_MINUTES = 10
ROWS_PER_SHARD = 10_000
ROWS_PER_MINUTE = ROWS_PER_SHARD // SHARD_MINUTES
DRAIN_S = 15.0
"""A batch pod's drain, in simulated seconds: the fake kubelet ends a deleted pod this long
after its deletion, well inside its grace period. It stands for a worker whose shutdown grace
is this long: it commits the rows done of its shard as a part by its end."""
SPLIT_RESERVE_S = min(WorkerConfig.split_reserve_s, DRAIN_S / 2)
"""The end of that grace the worker keeps for writing and committing the part."""
IDLE_AT = 0.7
"""Idle capacity: the mixed nodes online load would not need if each ran at this share."""
POLICIES = ("tidal", "naive", "never lend")
BATCH_CLASS = find("PriorityClass", "ebb-batch")

# --------------------------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    harvested_node_hours: float = 0.0
    idle_node_hours: float = 0.0
    free_node_hours: float = 0.0
    """Every core online pods left free on the mixed pool."""
    pending_pod_minutes: int = 0
    pending_beyond_latency: int = 0
    """Pending pod-minutes past a pod's first minute (preemption takes a fraction of one)."""
    drained: int = 0
    preempted: int = 0
    killed: int = 0
    """Running batch pods gone without a graceful deletion: killed without notice."""
    shards_lost: int = 0
    rows_lost: int = 0
    """Rows done of the shards lost: what drains, preemptions and kills cost with whole
    shards."""
    rows_lost_split: int = 0
    """What they cost with splitting: the rows of pods killed without notice, or gone before
    their drain was over."""
    parts: int = 0
    rows_in_parts: int = 0
    """With splitting: the parts drained and preempted workers committed, and their rows."""
    shortest_drain_s: float = math.inf
    """The shortest time, in simulated seconds, from a deletion to the end of a pod that had
    rows to commit."""
    rows: int = 0
    series: dict[str, list[float]] = field(
        default_factory=lambda: {"load": [], "harvested": [], "batch": [], "pending": []}
    )
    """Minute by minute: online load (nodes), batch cores on mixed nodes (nodes), running batch
    pods, pending online pods."""

    @property
    def rows_with_splitting(self) -> int:
        """Rows completed had the drained and preempted workers committed their parts."""
        return self.rows + self.rows_in_parts

    @property
    def share(self) -> float:
        return self.harvested_node_hours / self.idle_node_hours if self.idle_node_hours else 0.0

    @property
    def share_of_free(self) -> float:
        return self.harvested_node_hours / self.free_node_hours if self.free_node_hours else 0.0


@dataclass(frozen=True)
class Drain:
    """A batch pod told to go, gracefully, with rows done of its shard."""

    rows: int
    since: float
    """When it was deleted (the event loop's clock)."""


class PodStore(Protocol):
    """Where the simulator reads pods: the fake API server's store, or a watch of a real
    one (bench/tidal_plane.py)."""

    def subscribe(self, listener: Callable[[Change], None]) -> Callable[[], None]: ...

    def view(self, rt: ResourceType, namespace: str | None = None) -> list[Obj]: ...


class OnlinePods(Protocol):
    """How the trace's online load becomes online pods."""

    async def scale(self, wanted: int) -> None: ...


class FakeOnlinePods:
    """Online pods added to the fake API server one by one (2 cores each, priority 0, on
    the mixed pool), the newest removed first (the Pending ones, if any), gone at once:
    load that left."""

    def __init__(self, kube: FakeKubeAPI, cluster: Cluster) -> None:
        self.kube = kube
        self.cluster = cluster
        self.online: list[str] = []
        self._next = 0

    async def scale(self, wanted: int) -> None:
        while len(self.online) < wanted:
            name = f"web-{self._next}"
            self._next += 1
            requests = dict(self.cluster.online_pod)
            # An extended resource (a GPU) is asked as a limit; the request defaults to it.
            limits = {k: v for k, v in requests.items() if "/" in k}
            self.kube.add_pod(
                {
                    "metadata": {"name": name, "labels": {"ebb.io/workload": "online"}},
                    "spec": {
                        "nodeSelector": {"ebb.io/pool": "mixed"},
                        "containers": [
                            {
                                "name": "web",
                                "image": "web",
                                "resources": {"requests": requests, "limits": limits},
                            }
                        ],
                    },
                },
                "online",
            )
            self.online.append(name)
        while len(self.online) > wanted:
            self.kube.store.remove(PODS, "online", self.online.pop())


class Simulator:
    def __init__(
        self,
        store: PodStore,
        namespace: str,
        *,
        minute_s: float,
        cluster: Cluster = CPU_CLUSTER,
    ) -> None:
        self.store = store
        self.cluster = cluster
        self.namespace = namespace
        self.minute_s = minute_s
        self.progress: dict[str, int] = {}
        """Running batch pod -> minutes on its current shard."""
        self.draining: dict[str, Drain] = {}
        """Batch pod deleted gracefully with rows done -> its drain, until the pod ends."""
        self.pending_for: dict[str, int] = {}
        """Online pod -> minutes it has been Pending."""
        self.result = RunResult()
        self._clock = asyncio.get_running_loop().time
        store.subscribe(self._on_change)

    def _on_change(self, change: Change) -> None:
        if change.rt is not PODS or change.type == "ADDED":
            return
        meta = change.obj["metadata"]
        if meta.get("namespace") != self.namespace:
            return
        was_marked = bool(((change.prev or {}).get("metadata") or {}).get("deletionTimestamp"))
        marked = change.type == "DELETED" or bool(meta.get("deletionTimestamp"))
        if marked and not was_marked:
            # A pod deleted at once (no grace period) is DELETED with no deletion mark first.
            graceful = change.type != "DELETED" and meta.get("deletionGracePeriodSeconds", 0) > 0
            self._told_to_go(change.obj, graceful=graceful)
        phase = (change.obj.get("status") or {}).get("phase")
        if change.type == "DELETED" or phase in TERMINAL_PHASES:
            self._ended(meta["name"])

    def _told_to_go(self, pod: Obj, *, graceful: bool) -> None:
        """A batch pod marked for deletion: drained by the controller or preempted by the
        scheduler. With whole shards, its rows done are lost either way; with splitting, a
        graceful deletion lets it commit them as a part, once its drain is over."""
        r, name = self.result, pod["metadata"]["name"]
        conditions = pod.get("status", {}).get("conditions") or []
        if any(c.get("reason") == "PreemptionByScheduler" for c in conditions):
            r.preempted += 1
        else:
            r.drained += 1
        running = name in self.progress
        rows = self.progress.pop(name, 0) * ROWS_PER_MINUTE
        if rows:
            r.shards_lost += 1
            r.rows_lost += rows
        if graceful:
            if rows:
                self.draining[name] = Drain(rows=rows, since=self._clock())
        elif running:
            r.killed += 1
            r.rows_lost_split += rows

    def _ended(self, name: str) -> None:
        """A batch pod ended (its containers gone) or deleted."""
        r = self.result
        drain = self.draining.pop(name, None)
        if drain is not None:
            lived = self._clock() - drain.since
            r.shortest_drain_s = min(r.shortest_drain_s, lived / self.minute_s * 60)
            # Its worker's part is committed by the end of its grace (DRAIN_S); a nanosecond
            # of slack for the clock's rounding.
            if lived >= DRAIN_S / 60 * self.minute_s - 1e-9:
                r.parts += 1
                r.rows_in_parts += drain.rows
            else:
                r.rows_lost_split += drain.rows
            return
        if name not in self.progress:
            return
        # Ended while running, never told to go: killed without notice (evicted, node lost).
        rows = self.progress.pop(name) * ROWS_PER_MINUTE
        r.killed += 1
        if rows:
            r.shards_lost += 1
            r.rows_lost += rows
            r.rows_lost_split += rows

    def finish(self) -> None:
        """The trace is over: a drain still under way has nothing to cut it short, and its
        part is committed."""
        for drain in self.draining.values():
            self.result.parts += 1
            self.result.rows_in_parts += drain.rows
        self.draining.clear()

    def minute(self, load: float) -> None:
        """Account one simulated minute; `load`: online demand, in the cluster's resource."""
        r, c = self.result, self.cluster
        mixed = c.nodes["mixed"]
        pool = mixed * c.per_node
        needed = math.ceil(load / (IDLE_AT * c.per_node)) if load else 0
        r.idle_node_hours += max(0, mixed - max(needed, 1)) / 60
        r.free_node_hours += max(0.0, pool - load) / c.per_node / 60
        pending = {
            p["metadata"]["name"]
            for p in self.store.view(PODS, "online")
            if p["status"].get("phase") == "Pending"
        }
        self.pending_for = {name: self.pending_for.get(name, 0) + 1 for name in pending}
        r.pending_pod_minutes += len(pending)
        r.pending_beyond_latency += sum(1 for minutes in self.pending_for.values() if minutes > 1)
        running: dict[str, str] = {
            p["metadata"]["name"]: p["spec"].get("nodeName", "")
            for p in self.store.view(PODS, self.namespace)
            if p["metadata"].get("labels", {}).get(APP_LABEL) == APP
            and p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
        }
        for name in list(self.progress):
            if name not in running:
                del self.progress[name]  # not Running, yet not ended: nothing of it is counted
        on_mixed = sum(1 for node in running.values() if node.startswith("mixed-"))
        harvested = on_mixed * c.batch_units / c.per_node
        r.harvested_node_hours += harvested / 60
        r.series["load"].append(load / c.per_node)
        r.series["harvested"].append(harvested)
        r.series["batch"].append(len(running))
        r.series["pending"].append(len(pending))
        for name in running:
            done = self.progress.get(name, 0) + 1
            if done >= SHARD_MINUTES:
                r.rows += ROWS_PER_SHARD
                done = 0
            self.progress[name] = done


def _tidal_config(policy: str, minute_s: float) -> TidalConfig | None:
    if policy == "never lend":
        return None
    if policy == "naive":
        return TidalConfig(policy="threshold", sample_s=minute_s, window=1, cooldown_s=0.0)
    return TidalConfig(sample_s=minute_s, lead_s=3 * minute_s, period_s=DAY_MINUTES * minute_s)


async def _run(
    ctx: Context, trace: Trace, policy: str, loads: list[float], minute_s: float
) -> RunResult:
    root = ctx.dir(f"tidal-{time.monotonic_ns()}")
    data = root / "rows.parquet"
    # A shard a row group (a planner never cuts one): 1,000 shards, more than workers.
    pq.write_table(pa.table({"id": np.arange(1_000)}), data, row_group_size=1)
    nats = EmbeddedNats(state_dir=root / "nats")
    await asyncio.to_thread(nats.start)
    master = None
    try:
        config = NatsConfig(url=nats.url)
        master = ShardMaster(MasterConfig(nats=config, id="sim", data_roots=[str(root)]))
        master_task = asyncio.create_task(master.run())
        await master.ready.wait()
        async with FakeKubeAPI(
            start_delay=minute_s / 4, terminate_delay=DRAIN_S / 60 * minute_s
        ) as kube:
            kube.add_namespace("ebb")
            kube.add_namespace("online")
            kube.add("priorityclasses", BATCH_CLASS)
            for pool, count in trace.cluster.nodes.items():
                for n in range(count):
                    kube.add_node(
                        f"{pool}-{n}",
                        labels={"ebb.io/pool": pool},
                        allocatable=dict(trace.cluster.allocatable),
                    )
            client = await EbbClient.connect(config)
            try:
                spec = parse_job(
                    {
                        "name": "long-batch",
                        "input": {"uri": str(data), "rows_per_shard": 1},
                        "pipeline": {"stages": [{"modelet": "ebb.worker.modelets:Identity"}]},
                        "output": {"uri": str(root / "out")},
                        "resources": {"min_workers": 1, "max_workers": 200, **trace.cluster.batch},
                    }
                )
                await client.submit(spec)
                tide = _tidal_config(policy, minute_s)
                sim = Simulator(kube.store, "ebb", minute_s=minute_s, cluster=trace.cluster)
                online = FakeOnlinePods(kube, trace.cluster)
                api = kube.api_client()
                try:
                    result = await drive(ctx, api, client, config, tide, sim, online, loads)
                finally:
                    await api.close()
            finally:
                await client.close()
        master.request_stop()
        await master_task
        return result
    finally:
        await asyncio.to_thread(nats.stop)


async def drive(
    ctx: Context,
    api: ApiClient,
    client: EbbClient,
    config: NatsConfig,
    tide: TidalConfig | None,
    sim: Simulator,
    online: OnlinePods,
    loads: list[float],
) -> RunResult:
    """The controller on `api` through the trace, a simulated minute at a time."""
    minute_s = sim.minute_s
    backend = KubernetesBackend(
        KubeConfig(
            namespace="ebb",
            nats=config,
            tidal=tide,
            grace_s=1,  # longer than the kubelet's end of a pod: a drain takes DRAIN_S
            priority_class=BATCH_CLASS["metadata"]["name"],
        ),
        api,
    )
    reconciler = Reconciler(
        master=MasterClient(client.nc, config, backoff=Backoff(attempts=1)),
        backend=backend,
        config=ReconcilerConfig(relaunch_backoff=Backoff(first_s=minute_s, max_s=minute_s)),
    )
    # The informers run as agents; the tide's sample is taken here, once a simulated minute,
    # on the simulated clock, so that a one-minute spike is one sample whatever the machine's
    # pace (the tide's own loop would sample on the wall clock).
    coroutines = backend.agents()
    if "tide" in coroutines:
        coroutines.pop("tide").close()
    agents = [asyncio.create_task(a) for a in coroutines.values()]
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for minute, load in enumerate(loads):
            await online.scale(round(load / sim.cluster.online_units))
            try:
                if backend.harvester is not None:
                    await backend.harvester.step(minute * minute_s)
                await reconciler.reconcile_once()
            except Exception as e:
                ctx.log(f"  reconcile failed: {e!r}")
            sim.minute(load)
            delay = start + (minute + 1) * minute_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
        sim.finish()
    finally:
        for task in agents:
            task.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
    return sim.result


def _splitting_note(results: dict[str, dict[str, RunResult]]) -> str:
    """What splitting kept, over every run."""
    runs = [r for by_policy in results.values() for r in by_policy.values()]
    lost = sum(r.rows_lost for r in runs)
    lost_split = sum(r.rows_lost_split for r in runs)
    share = f" ({lost_split / lost:.1%} of it)" if lost else ""
    shortest = min(r.shortest_drain_s for r in runs)
    drains = (
        f"the shortest drain of a pod with rows done lasted {shortest:.1f} simulated s (a "
        f"worker's grace of {DRAIN_S:.0f} s, of which {SPLIT_RESERVE_S:.0f} s kept for the part)"
        if math.isfinite(shortest)
        else "no pod with rows done ended its drain within a trace"
    )
    return (
        f"Over every run, drains and preemptions cost {lost:,} rows with whole shards and "
        f"{lost_split:,} with splitting{share}: {sum(r.parts for r in runs):,} parts "
        f"committed, {sum(r.killed for r in runs)} batch pods killed without notice; {drains}."
    )


def _table(cluster: Cluster, results: dict[str, dict[str, RunResult]]) -> str:
    """One cluster's traces: node-hours are of its resource (GPU node-hours on GPU nodes)."""
    rows: list[list[Any]] = []
    for trace_name, by_policy in results.items():
        for policy, r in by_policy.items():
            rows.append(
                [
                    trace_name,
                    policy,
                    f"{r.harvested_node_hours:.1f}",
                    f"{r.idle_node_hours:.1f}",
                    f"{r.share:.0%}",
                    f"{r.share_of_free:.0%}",
                    r.pending_pod_minutes,
                    r.pending_beyond_latency,
                    r.drained,
                    r.preempted,
                    r.shards_lost,
                    f"{r.rows_lost:,}",
                    f"{r.rows_lost_split:,}",
                    f"{r.rows:,}",
                    f"{r.rows_with_splitting:,}",
                ]
            )
    unit = "GPU " if cluster.unit == "GPU" else ""
    free = "GPUs" if cluster.unit == "GPU" else "cores"
    return table(
        [
            "trace",
            "policy",
            f"harvested {unit}node-hours",
            f"idle {unit}node-hours",
            "harvested share of idle",
            f"of all free {free}",
            "online pending pod-minutes",
            "of which past the first minute",
            "batch pods drained",
            "batch pods preempted",
            "shards lost",
            "rows lost, whole shards",
            "rows lost, with splitting",
            "rows completed, whole shards",
            "rows completed, with splitting",
        ],
        rows,
    )


def run(ctx: Context) -> Section:
    # The simulation is driven minute by minute (the tide samples on the simulated clock), so
    # the figures do not depend on this, only the run time does, if the machine keeps up.
    minute_s = 0.005
    results: dict[str, dict[str, RunResult]] = {}
    started = time.perf_counter()
    for trace in TRACES:
        days = trace.days if not ctx.quick else min(trace.days, 3)
        minutes = days * DAY_MINUTES if not ctx.smoke else 60
        loads = trace.load(minutes)
        results[trace.name] = {}
        for policy in POLICIES:
            r = asyncio.run(_run(ctx, trace, policy, loads, minute_s))
            results[trace.name][policy] = r
            ctx.log(
                f"  {trace.name} / {policy}: harvest {r.share:.0%} (of free {r.share_of_free:.0%})"
                f", pending past 1 min {r.pending_beyond_latency}, drained {r.drained}, "
                f"preempted {r.preempted}, killed {r.killed}, lost {r.shards_lost}, "
                f"rows lost {r.rows_lost:,} (with splitting {r.rows_lost_split:,}), "
                f"rows {r.rows:,} (with splitting {r.rows_with_splitting:,})"
            )
    seconds = time.perf_counter() - started
    first = TRACES[0].name
    clusters = {t.cluster.name: t.cluster for t in TRACES}
    return Section(
        title="6. Tidal harvesting of the mixed pool",
        intro=__doc__ or "",
        tables=[
            _table(c, {t.name: results[t.name] for t in TRACES if t.cluster is c})
            for c in clusters.values()
        ],
        slug="tidal",
        plot={"kind": "timeline", "series": {p: r.series for p, r in results[first].items()}},
        summary={
            f"{t}/{p}": {
                "share": r.share,
                "pending_beyond_latency": r.pending_beyond_latency,
                "drained": r.drained,
                "preempted": r.preempted,
                "killed": r.killed,
                "shards_lost": r.shards_lost,
                "rows_lost": r.rows_lost,
                "rows_lost_split": r.rows_lost_split,
                "rows": r.rows,
                "rows_with_splitting": r.rows_with_splitting,
            }
            for t, by_policy in results.items()
            for p, r in by_policy.items()
        },
        notes=[
            f"Simulated minutes of {minute_s * 1000:.0f} ms ({seconds / 60:.1f} minutes in all); "
            f"8 mixed nodes of {CPU_CLUSTER.per_node} cores, or of {GPU_CLUSTER.per_node} GPUs. "
            f"The plot is the {first} trace. "
            "Idle node-hours count, each minute, the mixed nodes the online load did not need at "
            f"{IDLE_AT:.0%} utilisation (the measure of earlier runs); a policy that fills more "
            "than that goes over 100%. The share of all free cores divides by every core online "
            "pods left free, headroom included. `python -m bench --only tidal` reruns this "
            "section alone and leaves the others as they are.",
            _splitting_note(results),
        ],
    )
