"""Benchmark 22: the tide against kube-scheduler. Section 6's simulation of the mixed pool, on a
control plane built from Kubernetes' own code instead of the fake API server.

The cluster, the trace and Ebb's side are section 6's: 20 nodes (6 online, 8 mixed, 6 offline;
8 cores each), one long batch job asking for as many 2-core workers as it can get, a real
shard master on a real nats-server and the real controller (Kubernetes backend, reconciler,
tide) driven a simulated minute at a time. What changes is everything Kubernetes does:
etcd, kube-apiserver, kube-controller-manager and kube-scheduler of one release
(tests/controlplane), simulated nodes (kubelets that run nothing: a pod starts a quarter of a
simulated minute after it is placed and ends 15 simulated seconds after its deletion, the
drain of section 6), and the online load as a Deployment (`ebb.io/workload: online`, priority
0, 2 cores a pod, on the mixed pool) scaled along the trace: the ReplicaSet controller makes
and removes its pods, and kube-scheduler places them, preempting batch pods (the `ebb-batch`
PriorityClass of k8s/, -20) where there is no room, or leaves them Pending. The same trace and
policy on the fake API server run beside it, at the same pace, in the same run.

A control plane keeps its own clocks (the scheduler's retries, the controllers' periods), so
time cannot be compressed as in section 6: a simulated minute lasts `MINUTE_S` here, and the
trace is a window of the diurnal day, from its quiet night into its busy afternoon.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from kubernetes_asyncio.client import ApiClient, AppsV1Api

from ebb.client.sdk import EbbClient
from ebb.common.job import parse_job
from ebb.common.messaging.embedded import EmbeddedNats
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.kube.informer import Informer, key
from ebb.shard_master.service import MasterConfig, ShardMaster
from tests.controlplane import ControlPlane
from tests.controlplane.nodes import NodesThread, SimulatedNodes
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.fake_store import PODS, Change, Obj, ResourceType

from .common import Context, Section, table
from .tidal_sim import (
    BATCH_CLASS,
    DRAIN_S,
    FakeOnlinePods,
    OnlinePods,
    RunResult,
    Simulator,
    _tidal_config,
    drive,
)
from .tidal_traces import CPU_CLUSTER, TRACES, Cluster, Trace

MINUTE_S = 1.0
"""A simulated minute, in seconds of the machine's time, on both servers."""
WINDOW = (4 * 60, 16 * 60)
"""The diurnal day's minutes run: 04:00 to 16:00, the night's ebb into the afternoon's peak."""
POLICY = "tidal"


class PlanePods(Informer):
    """Every pod of the control plane, as the simulator reads the fake's store: a view by
    namespace, and each change with the state before it."""

    def __init__(self, api: ApiClient) -> None:
        from kubernetes_asyncio.client import CoreV1Api

        super().__init__("sim-pods", CoreV1Api(api).list_pod_for_all_namespaces)
        self._listeners: list[Callable[[Change], None]] = []

    def subscribe(self, listener: Callable[[Change], None]) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def view(self, rt: ResourceType, namespace: str | None = None) -> list[Obj]:
        assert rt is PODS
        return [
            o
            for o in self.items.values()
            if namespace is None or o["metadata"].get("namespace") == namespace
        ]

    def _apply(self, event: Obj) -> None:
        kind = str(event.get("type"))
        obj = event.get("object") or {}
        prev = self.items.get(key(obj)) if kind in ("MODIFIED", "DELETED") else None
        super()._apply(event)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            version = int((obj.get("metadata") or {}).get("resourceVersion") or 0)
            change = Change(rv=version, type=kind, rt=PODS, obj=obj, prev=prev)
            for listener in list(self._listeners):
                listener(change)


class DeploymentOnlinePods:
    """The online load as a Deployment scaled along the trace: the ReplicaSet controller makes
    its pods and removes the surplus (Pending ones first), at once (no grace period)."""

    def __init__(self, api: ApiClient, cluster: Cluster) -> None:
        self.apps: Any = AppsV1Api(api)  # plain JSON maps: the stubs know only models
        self.cluster = cluster
        self.replicas = 0

    async def create(self) -> None:
        requests = dict(self.cluster.online_pod)
        limits = {k: v for k, v in requests.items() if "/" in k}
        labels = {"app": "web", "ebb.io/workload": "online"}
        await self.apps.create_namespaced_deployment(
            "online",
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "web"},
                "spec": {
                    "replicas": 0,
                    "selector": {"matchLabels": {"app": "web"}},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "terminationGracePeriodSeconds": 0,
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
                },
            },
        )

    async def scale(self, wanted: int) -> None:
        if wanted != self.replicas:
            await self.apps.patch_namespaced_deployment_scale(
                "web", "online", {"spec": {"replicas": wanted}}
            )
            self.replicas = wanted


async def _with_job(
    root: Path, cluster: Cluster, run: Callable[[EbbClient, NatsConfig], Any]
) -> RunResult:
    """A real master on a real nats-server with section 6's long batch job submitted, for
    `run(client, nats)`."""
    data = root / "rows.parquet"
    pq.write_table(pa.table({"id": np.arange(1_000)}), data, row_group_size=1)
    nats = EmbeddedNats(state_dir=root / "nats")
    await asyncio.to_thread(nats.start)
    try:
        config = NatsConfig(url=nats.url)
        master = ShardMaster(MasterConfig(nats=config, id="sim", data_roots=[str(root)]))
        master_task = asyncio.create_task(master.run())
        await master.ready.wait()
        try:
            async with await EbbClient.connect(config) as client:
                spec = parse_job(
                    {
                        "name": "long-batch",
                        "input": {"uri": str(data), "rows_per_shard": 1},
                        "pipeline": {"stages": [{"modelet": "ebb.worker.modelets:Identity"}]},
                        "output": {"uri": str(root / "out")},
                        "resources": {"min_workers": 1, "max_workers": 200, **cluster.batch},
                    }
                )
                await client.submit(spec)
                result: RunResult = await run(client, config)
                return result
        finally:
            master.request_stop()
            await master_task
    finally:
        await asyncio.to_thread(nats.stop)


async def _on_plane(ctx: Context, trace: Trace, loads: list[float]) -> RunResult:
    root = ctx.dir(f"tidal-plane-{time.monotonic_ns()}")
    cluster = trace.cluster
    plane = ControlPlane(root / "plane")
    await asyncio.to_thread(plane.start)
    try:
        objects = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ebb"}},
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "online"}},
            BATCH_CLASS,
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "ebb-worker", "namespace": "ebb"},
            },
        ]
        (root / "objects.json").write_text(
            json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
        )
        await asyncio.to_thread(plane.kubectl, "apply", "-f", str(root / "objects.json"))
        nodes = {
            f"{pool}-{n}": {"ebb.io/pool": pool}
            for pool, count in cluster.nodes.items()
            for n in range(count)
        }

        def make(api: ApiClient) -> SimulatedNodes:
            return SimulatedNodes(
                api,
                nodes,
                allocatable=dict(cluster.allocatable),
                start_delay=MINUTE_S / 4,
                terminate_delay=DRAIN_S / 60 * MINUTE_S,
            )

        with NodesThread(plane, make=make):
            async with plane.api_client() as api:
                pods = PlanePods(api)
                watching = asyncio.create_task(pods.run())
                try:
                    await pods.synced.wait()
                    online = DeploymentOnlinePods(api, cluster)
                    await online.create()

                    async def run(client: EbbClient, config: NatsConfig) -> RunResult:
                        sim = Simulator(pods, "ebb", minute_s=MINUTE_S, cluster=cluster)
                        tide = _tidal_config(POLICY, MINUTE_S)
                        return await drive(ctx, api, client, config, tide, sim, online, loads)

                    return await _with_job(root, cluster, run)
                finally:
                    watching.cancel()
                    await asyncio.gather(watching, return_exceptions=True)
    finally:
        await asyncio.to_thread(plane.stop)


async def _on_fake(ctx: Context, trace: Trace, loads: list[float]) -> RunResult:
    root = ctx.dir(f"tidal-fake-{time.monotonic_ns()}")
    cluster = trace.cluster
    async with FakeKubeAPI(
        start_delay=MINUTE_S / 4, terminate_delay=DRAIN_S / 60 * MINUTE_S
    ) as kube:
        kube.add_namespace("ebb")
        kube.add_namespace("online")
        kube.add("priorityclasses", BATCH_CLASS)
        for pool, count in cluster.nodes.items():
            for n in range(count):
                kube.add_node(
                    f"{pool}-{n}",
                    labels={"ebb.io/pool": pool},
                    allocatable=dict(cluster.allocatable),
                )
        online: OnlinePods = FakeOnlinePods(kube, cluster)
        api = kube.api_client()
        try:

            async def run(client: EbbClient, config: NatsConfig) -> RunResult:
                sim = Simulator(kube.store, "ebb", minute_s=MINUTE_S, cluster=cluster)
                tide = _tidal_config(POLICY, MINUTE_S)
                return await drive(ctx, api, client, config, tide, sim, online, loads)

            return await _with_job(root, cluster, run)
        finally:
            await api.close()


def run(ctx: Context) -> Section | None:
    if shutil.which("go") is None:
        ctx.log("  no Go here: the control plane cannot be built; the report keeps its figures")
        return None
    trace = next(t for t in TRACES if t.name == "diurnal" and t.cluster is CPU_CLUSTER)
    start, end = WINDOW if not ctx.smoke else (WINDOW[1] - 3, WINDOW[1])
    loads = trace.load(end)[start:]
    results: dict[str, RunResult] = {}
    started = time.perf_counter()
    for server, measure in (("fake API server", _on_fake), ("control plane", _on_plane)):
        r = asyncio.run(measure(ctx, trace, loads))
        results[server] = r
        ctx.log(
            f"  {server}: harvest {r.share:.0%} (of free {r.share_of_free:.0%}), pending past "
            f"1 min {r.pending_beyond_latency}, drained {r.drained}, preempted {r.preempted}, "
            f"killed {r.killed}"
        )
    seconds = time.perf_counter() - started
    rows = [
        [
            server,
            f"{r.harvested_node_hours:.1f}",
            f"{r.idle_node_hours:.1f}",
            f"{r.share:.0%}",
            f"{r.share_of_free:.0%}",
            r.pending_pod_minutes,
            r.pending_beyond_latency,
            r.drained,
            r.preempted,
            r.killed,
        ]
        for server, r in results.items()
    ]
    return Section(
        title="22. The tide against kube-scheduler",
        intro=__doc__ or "",
        tables=[
            table(
                [
                    "Kubernetes",
                    "harvested node-hours",
                    "idle node-hours",
                    "harvested share of idle",
                    "of all free cores",
                    "online pending pod-minutes",
                    "of which past the first minute",
                    "batch pods drained",
                    "batch pods preempted",
                    "batch pods killed",
                ],
                rows,
            )
        ],
        slug="tidalplane",
        summary={
            server: {
                "share": r.share,
                "pending_beyond_latency": r.pending_beyond_latency,
                "preempted": r.preempted,
            }
            for server, r in results.items()
        },
        notes=[
            f"The diurnal trace from minute {start} to {end}, the `{POLICY}` policy, simulated "
            f"minutes of {MINUTE_S:g} s on both ({seconds / 60:.1f} minutes in all). "
            "`python -m bench --only tidalplane` reruns this section alone.",
            _verdict(results["fake API server"], results["control plane"]),
        ],
    )


def _verdict(fake: RunResult, plane: RunResult) -> str:
    ratio = plane.share_of_free / fake.share_of_free if fake.share_of_free else 0.0
    return (
        f"On kube-scheduler the tide harvests {plane.share_of_free:.0%} of the free cores "
        f"against {fake.share_of_free:.0%} on the fake API server ({ratio:.2f}x), with "
        f"{plane.pending_beyond_latency} online pod-minutes Pending past the first minute "
        f"(the fake: {fake.pending_beyond_latency}): what section 6 measures on the fake holds "
        "on the real scheduler, preemption and the ReplicaSet controller included."
        if plane.pending_beyond_latency == 0 and ratio >= 0.9
        else f"On kube-scheduler the tide harvests {plane.share_of_free:.0%} of the free "
        f"cores against {fake.share_of_free:.0%} on the fake API server ({ratio:.2f}x), "
        f"with {plane.pending_beyond_latency} online pod-minutes Pending past the first "
        f"minute (the fake: {fake.pending_beyond_latency}): short of section 6's claim."
    )
