"""Benchmark 6: tidal harvesting of the mixed pool over a simulated day.

A cluster of 20 nodes (6 online, 8 mixed, 6 offline; 8 cores each) on the fake Kubernetes
API server of the tests, a real shard master on a real nats-server, and the real controller
(Kubernetes backend, reconciler, tide). Time is compressed: one simulated minute lasts a
fraction of a second. Online load on the mixed pool follows a 24-hour diurnal curve (a quiet
night, a busy day) with one-minute spikes; the simulator turns it into online pods (2 cores
each) that the fake scheduler places, or leaves Pending when there is no room.

One long batch job asks for as many workers (2 cores each) as it can get. A worker finishes a
shard every 10 minutes it runs; a worker drained off a reclaimed node loses the shard it was
on (nothing half-done is ever committed). Two policies, each over the same day:

- tidal: utilisation sampled every minute, median of 3, a 20-minute cool-down after a
  reclaim (the defaults of TidalConfig, in simulated time);
- naive: the last sample alone, no cool-down.

Reported: harvested node-hours (lent mixed nodes) as a fraction of the idle node-hours there
were (mixed nodes the online load did not need, at the reclaim threshold, minute by minute);
online pod-minutes spent Pending; batch pods drained off reclaimed nodes; rows completed.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from prometheus_client import REGISTRY

from ebb.client.sdk import EbbClient
from ebb.common.api import MasterClient
from ebb.common.bus import Backoff, NatsConfig
from ebb.common.embedded import EmbeddedNats
from ebb.common.spec import parse_job
from ebb.controller.kube import APP, APP_LABEL, KubeConfig, KubernetesBackend
from ebb.controller.reconcile import Reconciler, ReconcilerConfig
from ebb.controller.tidal import LABEL as TIDAL
from ebb.controller.tidal import TidalConfig
from ebb.shard_master.service import MasterConfig, ShardMaster
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.fake_store import PODS

from .common import Context, Section, table

NODES = {"online": 6, "mixed": 8, "offline": 6}
CORES = 8
ONLINE_POD_CORES = 2
BATCH_POD_CORES = 2
SHARD_MINUTES = 10
ROWS_PER_SHARD = 10_000
DAY_MINUTES = 24 * 60


def online_cores(minute: int, rng: random.Random) -> float:
    """Online requests on the mixed pool at `minute` of the day, in cores: a night trough
    (~10% of the pool), a day plateau (~85%), and a 2% chance of a one-minute spike."""
    pool = NODES["mixed"] * CORES
    phase = 2 * math.pi * (minute - 4 * 60) / DAY_MINUTES  # lowest at 4:00, highest at 16:00
    level = 0.475 - 0.375 * math.cos(phase)
    if rng.random() < 0.02:
        level += 0.3
    return max(0.0, level * pool)


@dataclass
class DayResult:
    harvested_node_hours: float = 0.0
    idle_node_hours: float = 0.0
    pending_pod_minutes: int = 0
    pending_beyond_latency: int = 0
    """Pending pod-minutes past a pod's first minute (one sample: the reclaim latency)."""
    evictions: int = 0
    rows: int = 0
    series: dict[str, list[float]] = field(
        default_factory=lambda: {"load": [], "lent": [], "batch": [], "pending": []}
    )
    """Minute by minute: online load (nodes), lent nodes, running batch pods, pending pods."""


class Simulator:
    def __init__(self, kube: FakeKubeAPI, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.online: list[str] = []
        self.progress: dict[str, int] = {}
        self.pending_for: dict[str, int] = {}
        """Online pod -> minutes it has been Pending."""
        """Running batch pod -> minutes on its current shard."""
        self.result = DayResult()
        self._next = 0

    def set_online_pods(self, wanted: int) -> None:
        while len(self.online) < wanted:
            name = f"web-{self._next}"
            self._next += 1
            self.kube.add_pod(
                {
                    "metadata": {"name": name, "labels": {"ebb.io/workload": "online"}},
                    "spec": {
                        "nodeSelector": {"ebb.io/pool": "mixed"},
                        "containers": [
                            {
                                "name": "web",
                                "image": "web",
                                "resources": {"requests": {"cpu": str(ONLINE_POD_CORES)}},
                            }
                        ],
                    },
                },
                "online",
            )
            self.online.append(name)
        while len(self.online) > wanted:
            # The newest first (the Pending ones, if any), gone at once: load that left.
            self.kube.store.remove(PODS, "online", self.online.pop())

    def minute(self, reclaim_above: float, load: float) -> None:
        """Account one simulated minute."""
        r = self.result
        lent = sum(
            1
            for name in (f"mixed-{n}" for n in range(NODES["mixed"]))
            if ((self.kube.get_node(name) or {}).get("metadata", {}).get("labels") or {}).get(TIDAL)
            == "offline"
        )
        r.harvested_node_hours += lent / 60
        needed = math.ceil(load / (reclaim_above * CORES)) if load else 0
        r.idle_node_hours += max(0, NODES["mixed"] - max(needed, 1)) / 60
        pending = {
            p["metadata"]["name"]
            for p in self.kube.list_pods("online")
            if p["status"].get("phase") == "Pending"
        }
        self.pending_for = {name: self.pending_for.get(name, 0) + 1 for name in pending}
        r.pending_pod_minutes += len(pending)
        r.pending_beyond_latency += sum(1 for minutes in self.pending_for.values() if minutes > 1)
        running = {
            p["metadata"]["name"]
            for p in self.kube.list_pods(self.namespace, label_selector=f"{APP_LABEL}={APP}")
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        }
        for name in list(self.progress):
            if name not in running:
                del self.progress[name]  # drained or gone: its shard in progress is lost
        r.series["load"].append(load / CORES)
        r.series["lent"].append(lent)
        r.series["batch"].append(len(running))
        r.series["pending"].append(len(pending))
        for name in running:
            done = self.progress.get(name, 0) + 1
            if done >= SHARD_MINUTES:
                r.rows += ROWS_PER_SHARD
                done = 0
            self.progress[name] = done


async def _day(ctx: Context, policy: str, minute_s: float, minutes: int) -> DayResult:
    root = ctx.dir(f"tidal-{policy}-{time.monotonic_ns()}")
    data = root / "rows.parquet"
    pq.write_table(pa.table({"id": np.arange(20_000)}), data)
    nats = EmbeddedNats(state_dir=root / "nats")
    await asyncio.to_thread(nats.start)
    master = None
    try:
        config = NatsConfig(url=nats.url)
        master = ShardMaster(MasterConfig(nats=config, id="sim", data_roots=[str(root)]))
        master_task = asyncio.create_task(master.run())
        await master.ready.wait()
        async with FakeKubeAPI(start_delay=minute_s / 4, terminate_delay=minute_s / 4) as kube:
            kube.add_namespace("ebb")
            kube.add_namespace("online")
            for pool, count in NODES.items():
                for n in range(count):
                    kube.add_node(
                        f"{pool}-{n}",
                        labels={"ebb.io/pool": pool},
                        allocatable={"cpu": str(CORES), "memory": "64Gi", "pods": "110"},
                    )
            client = await EbbClient.connect(config)
            try:
                spec = parse_job(
                    {
                        "name": "long-batch",
                        "input": {"uri": str(data), "rows_per_shard": 1},
                        "pipeline": {"stages": [{"modelet": "ebb.worker.modelets:Identity"}]},
                        "output": {"uri": str(root / "out")},
                        "resources": {
                            "min_workers": 1,
                            "max_workers": 200,
                            "cpu": BATCH_POD_CORES,
                            "memory_gb": 1,
                        },
                    }
                )
                await client.submit(spec)
                tide = TidalConfig(
                    sample_s=minute_s,
                    window=3 if policy == "tidal" else 1,
                    cooldown_s=20 * minute_s if policy == "tidal" else 0.0,
                )
                result = await _run_day(
                    ctx, kube, client, config, tide, minute_s=minute_s, minutes=minutes
                )
            finally:
                await client.close()
        master.request_stop()
        await master_task
        return result
    finally:
        await asyncio.to_thread(nats.stop)


async def _run_day(
    ctx: Context,
    kube: FakeKubeAPI,
    client: EbbClient,
    config: NatsConfig,
    tide: TidalConfig,
    *,
    minute_s: float,
    minutes: int,
) -> DayResult:
    api = kube.api_client()
    backend = KubernetesBackend(
        KubeConfig(namespace="ebb", nats=config, tidal=tide, grace_s=0), api
    )
    reconciler = Reconciler(
        master=MasterClient(client.nc, config, backoff=Backoff(attempts=1)),
        backend=backend,
        config=ReconcilerConfig(relaunch_backoff=Backoff(first_s=minute_s, max_s=minute_s)),
    )
    agents = [asyncio.create_task(a) for a in backend.agents().values()]
    sim = Simulator(kube, "ebb")
    rng = random.Random(7)
    evicted = 0.0
    before = REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0.0
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for minute in range(minutes):
            load = online_cores(minute, rng)
            sim.set_online_pods(round(load / ONLINE_POD_CORES))
            try:
                await reconciler.reconcile_once()
            except Exception as e:
                ctx.log(f"  reconcile failed: {e!r}")
            sim.minute(tide.reclaim_above, load)
            delay = start + (minute + 1) * minute_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
        evicted = (REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0.0) - before
    finally:
        for task in agents:
            task.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
        await api.close()
    sim.result.evictions = int(evicted)
    return sim.result


def run(ctx: Context) -> Section:
    minute_s = 0.05 if not ctx.quick else 0.02
    minutes = DAY_MINUTES if not ctx.smoke else 120
    results = {p: asyncio.run(_day(ctx, p, minute_s, minutes)) for p in ("tidal", "naive")}
    rows = []
    for policy, r in results.items():
        share = r.harvested_node_hours / r.idle_node_hours if r.idle_node_hours else float("nan")
        rows.append(
            [
                policy,
                f"{r.harvested_node_hours:.1f}",
                f"{r.idle_node_hours:.1f}",
                f"{share:.0%}",
                r.pending_pod_minutes,
                r.pending_beyond_latency,
                r.evictions,
                f"{r.rows:,}",
            ]
        )
        ctx.log(f"  {policy}: {rows[-1]}")
    return Section(
        title="6. Tidal harvesting of the mixed pool over a day",
        intro=__doc__ or "",
        tables=[
            table(
                [
                    "policy",
                    "harvested node-hours",
                    "idle node-hours",
                    "harvested share",
                    "online pending pod-minutes",
                    "of which past the first minute",
                    "batch pods drained",
                    "rows completed",
                ],
                rows,
            )
        ],
        slug="tidal",
        plot={"kind": "timeline", "series": {p: r.series for p, r in results.items()}},
        summary={
            p: {
                "share": r.harvested_node_hours / max(r.idle_node_hours, 1e-9),
                "pending": r.pending_pod_minutes,
                "pending_beyond_latency": r.pending_beyond_latency,
                "evictions": r.evictions,
                "rows": r.rows,
            }
            for p, r in results.items()
        },
        notes=[
            f"{minutes} simulated minutes of {minute_s * 1000:.0f} ms; 8 mixed nodes of {CORES} "
            "cores. The idle node-hours count, each minute, the mixed nodes the online load did "
            "not need at the reclaim threshold (so a perfect policy lends all of them)."
        ],
    )
