"""The tide on a Kubernetes cluster: each sample measures the mixed pool's online load and the
online pods waiting, lets the policy (tidal.py) decide which nodes to lend or reclaim, labels
them so, and drains the batch pods on nodes being reclaimed (and, under the forecast policy,
those beyond its budget, the youngest first). What it lends, the backend's capacity counts.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any, Protocol

from kubernetes_asyncio.client.exceptions import ApiException

from . import metrics
from .informer import Informer
from .kube_settings import KubeConfig
from .podspec import APP, APP_LABEL
from .tidal import LABEL as TIDAL
from .tidal import STATES, ForecastTide, MixedNode, State, Tide
from .views import NodeView, PodView, selector_matches

log = logging.getLogger(__name__)

_MERGE_PATCH = {"_content_type": "application/merge-patch+json"}


class Cluster(Protocol):
    """What the tide needs of the Kubernetes backend: its caches, its API, and its ways to
    drain a pod and to say that capacity changed."""

    config: KubeConfig
    api: Any
    nodes: Informer
    pods: Informer
    changed: asyncio.Event

    async def synced(self) -> None: ...

    async def delete_pod(self, worker_id: str, *, grace_s: int) -> None: ...


class TidalHarvester:
    def __init__(self, cluster: Cluster, tide: Tide | ForecastTide) -> None:
        self.cluster = cluster
        self.tide = tide
        self.draining: set[str] = set()
        """Worker pods the tide has drained: terminating, whatever the cache says yet (the
        reconciler must not drain others in their stead)."""
        self.budget_cpu: float | None = None
        """forecast policy: CPU cores batch pods may take on lent mixed nodes (None: no cap)."""

    def forget_gone(self, pods: list[PodView]) -> set[str]:
        """The pods still draining, of those that exist."""
        self.draining &= {pod.name for pod in pods}
        return self.draining

    def mixed_nodes(self) -> list[tuple[NodeView, MixedNode]]:
        batch: dict[str, int] = defaultdict(int)
        online: dict[str, float] = defaultdict(float)
        for pod in map(PodView, self.cluster.pods.values()):
            labels = pod.meta.labels
            if not pod.node:
                continue
            if labels.get(APP_LABEL) == APP:
                batch[pod.node] += 1
            elif selector_matches(labels, self.cluster.config.online_selector):
                online[pod.node] += pod.cpu()
        out = []
        for node in map(NodeView, self.cluster.nodes.values()):
            labels = node.meta.labels
            if labels.get(self.cluster.config.pool_label) != "mixed":
                continue
            label = labels.get(TIDAL, "online")
            state: State = next((s for s in STATES if s == label), "online")
            mixed = MixedNode(
                name=node.name,
                state=state,
                batch_pods=batch[node.name],
                online_use=online[node.name] / max(node.cpu(default=1.0), 1e-9),
            )
            out.append((node, mixed))
        return out

    def pending_online(self) -> tuple[int, float]:
        """Online pods that cannot be scheduled: how many, and their CPU requests."""
        count, cpu = 0, 0.0
        for pod in map(PodView, self.cluster.pods.values()):
            pending = not pod.node and pod.phase == "Pending"
            if pending and selector_matches(pod.meta.labels, self.cluster.config.online_selector):
                count += 1
                cpu += pod.cpu()
        return count, cpu

    async def step(self, now: float) -> None:
        """One sample of the tide: measure, decide, relabel, drain what is reclaimed."""
        await self.cluster.synced()
        mixed = self.mixed_nodes()
        load = sum(m.online_use for _, m in mixed)
        pending, pending_cpu = self.pending_online()
        node_cpu = [n.cpu(default=1.0) for n, _ in mixed]
        average = sum(node_cpu) / len(node_cpu) if node_cpu else 1.0
        moves = self.tide.decide(
            now,
            online_load=load,
            pending_online=pending,
            pending_load=pending_cpu / max(average, 1e-9),
            nodes=[m for _, m in mixed],
        )
        if moves:
            log.debug("tide: load %.2f nodes, %d online pods pending: %s", load, pending, moves)
        for move in moves:
            body = {"metadata": {"labels": {TIDAL: move.to}}}
            await self.cluster.api.patch_node(move.node, body, **_MERGE_PATCH)
            log.info("tide: node %s -> %s", move.node, move.to)
        if isinstance(self.tide, ForecastTide):
            self.budget_cpu = self.tide.budget * average
            metrics.TIDAL_BUDGET.set(self.budget_cpu)
            metrics.TIDAL_FORECAST.set(self.tide.expected * average)
            await self._drain_over_budget(mixed, self.tide.drain_above * average)
        reclaiming = {m.node for m in moves if m.to == "offline2online"}
        reclaiming |= {m.name for _, m in mixed if m.state == "offline2online"}
        for pod in map(PodView, self.cluster.pods.values()):
            if (
                pod.meta.labels.get(APP_LABEL) == APP
                and pod.node in reclaiming
                and not pod.meta.deleting
            ):
                metrics.BATCH_EVICTIONS.inc()
                await self.cluster.delete_pod(pod.name, grace_s=self.cluster.config.grace_s)
        counts: dict[str, int] = defaultdict(int)
        harvested = 0.0
        after = {m.node: m.to for m in moves}
        for node, m in mixed:
            state = after.get(m.name, m.state)
            counts[state] += 1
            if state == "offline":
                harvested += node.cpu(default=0.0)
        for state in ("online", "online2offline", "offline", "offline2online"):
            metrics.NODE_STATES.labels(state).set(counts[state])
        metrics.HARVESTED.set(harvested)
        if moves:
            self.cluster.changed.set()

    async def _drain_over_budget(
        self, mixed: list[tuple[NodeView, MixedNode]], budget: float
    ) -> None:
        """Drain batch pods on lent nodes beyond `budget` (CPU cores): the youngest first
        (their age stands in for their shards' progress, which we do not see)."""
        lent = {m.name for _, m in mixed if m.state in ("offline", "online2offline")}
        pods = [
            p
            for p in map(PodView, self.cluster.pods.values())
            if p.meta.labels.get(APP_LABEL) == APP
            and p.node in lent
            and not p.meta.deleting
            and p.name not in self.draining
        ]
        used = sum(p.cpu() for p in pods)
        youngest = sorted(pods, key=lambda p: (p.meta.created, p.name), reverse=True)
        for pod in youngest:
            if used <= budget + 1e-9:
                break
            used -= pod.cpu()
            self.draining.add(pod.name)
            metrics.BATCH_EVICTIONS.inc()
            await self.cluster.delete_pod(pod.name, grace_s=self.cluster.config.grace_s)

    async def run(self) -> None:
        """Sample the tide every `sample_s`, for as long as the controller leads."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.step(loop.time())
            except ApiException as e:
                log.warning("tide: API error %s; next sample will try again", e.status)
            await asyncio.sleep(self.tide.config.sample_s)
