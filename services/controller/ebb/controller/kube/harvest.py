"""The tide on a Kubernetes cluster: each sample measures the mixed pool's online load and the
online pods waiting, per resource (CPU, memory, GPUs...), lets the policy
(ebb.controller.policy.tidal) decide which nodes to lend or reclaim, labels them so, and drains the
batch pods on nodes being reclaimed (and, under the forecast policy, those holding more of a
resource than its budget, the youngest first). What it lends, the backend's capacity counts. It also
counts what batch pods harvest: node-hours per resource (GPU node-hours on GPU nodes).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Protocol

from kubernetes_asyncio.client.exceptions import ApiException

from .. import metrics
from ..policy.capacity import add, total
from ..policy.tidal import LABEL as TIDAL
from ..policy.tidal import STATES, Amounts, ForecastTide, MixedNode, Move, State, Tide
from .config import KubeConfig
from .informer import Informer
from .podspec import APP, APP_LABEL, JOB_LABEL
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


@dataclass
class MixedPool:
    """The mixed pool as one sample sees it: each node, what online pods ask of it, and the
    batch pods on it."""

    nodes: list[tuple[NodeView, MixedNode]]
    allocatable: dict[str, Amounts]
    """Per node: its allocatable, of the resources counted."""
    online: Amounts
    """Online pods' requests on the pool, per resource."""
    batch: list[PodView]
    """Batch (worker) pods placed on the pool's nodes."""
    asked: dict[str, Amounts]
    """What each of them requests, by pod name (read once a sample)."""
    unready: set[str]
    """Nodes cordoned or not reporting Ready: no pod is placed there, so they count in no
    capacity and are neither lent nor reclaimed (as `capacity()` of the backend skips them);
    batch pods on one being reclaimed are drained all the same."""

    def usable(self) -> list[MixedNode]:
        return [m for node, m in self.nodes if node.name not in self.unready]

    def capacity(self) -> Amounts:
        return total(a for n, a in self.allocatable.items() if n not in self.unready)

    def average(self, resource: str) -> float:
        """A usable node's allocatable of `resource`, on average over those that have some."""
        have = [
            a[resource]
            for n, a in self.allocatable.items()
            if n not in self.unready and a.get(resource, 0.0) > 0
        ]
        return sum(have) / len(have) if have else 0.0


class TidalHarvester:
    def __init__(self, cluster: Cluster, tide: Tide | ForecastTide) -> None:
        self.cluster = cluster
        self.tide = tide
        self.draining: set[str] = set()
        """Worker pods the tide has drained: terminating, whatever the cache says yet (the
        reconciler must not drain others in their stead)."""
        self.budget: Amounts | None = None
        """forecast policy: what batch pods may take of each resource on lent mixed nodes
        (None: no cap)."""
        self.last_sample: float | None = None
        self.reclaimed: Counter[str] = Counter()
        """Per job (its pods' job label): worker pods the tide drained (ebb.controller.kube.placer
        reads it)."""

    def forget_gone(self, pods: list[PodView]) -> set[str]:
        """The pods still draining, of those that exist."""
        self.draining &= {pod.name for pod in pods}
        return self.draining

    def mixed_pool(self) -> MixedPool:
        resources = self.cluster.config.resources
        views = [
            n
            for n in map(NodeView, self.cluster.nodes.values())
            if n.meta.labels.get(self.cluster.config.pool_label) == "mixed"
        ]
        names = {n.name for n in views}
        batch: list[PodView] = []
        online: dict[str, Amounts] = defaultdict(dict)
        for pod in map(PodView, self.cluster.pods.values()):
            if pod.node not in names:
                continue
            if pod.meta.labels.get(APP_LABEL) == APP:
                batch.append(pod)
            elif selector_matches(pod.meta.labels, self.cluster.config.online_selector):
                online[pod.node] = add(online[pod.node], pod.requests(resources))
        allocatable = {
            n.name: {k: v for k, v in n.allocatable().items() if k in resources} for n in views
        }
        on_node = Counter(p.node for p in batch)
        nodes = []
        for node in views:
            label = node.meta.labels.get(TIDAL, "online")
            state: State = next((s for s in STATES if s == label), "online")
            has = allocatable[node.name]
            use = [v / has[k] for k, v in online[node.name].items() if has.get(k, 0.0) > 0]
            mixed = MixedNode(
                name=node.name,
                state=state,
                batch_pods=on_node[node.name],
                online_use=max(use, default=0.0),
            )
            nodes.append((node, mixed))
        return MixedPool(
            nodes=nodes,
            allocatable=allocatable,
            online=total(online.values()),
            batch=batch,
            asked={p.name: p.requests(resources) for p in batch},
            unready={n.name for n in views if not n.ready},
        )

    def pending_online(self, pool: MixedPool) -> tuple[int, Amounts]:
        """Online pods the scheduler found no room for that a node of the mixed pool could
        take: how many, and their requests. A pod merely not bound yet (just created, being
        bound, gated, waiting for a volume) is no sign of demand, nor one pinned to another
        pool: reclaiming a node would do nothing for it."""
        count, asked = 0, Amounts()
        labels = [n.meta.labels for n, _ in pool.nodes if n.name not in pool.unready]
        for pod in map(PodView, self.cluster.pods.values()):
            if pod.node or pod.phase != "Pending" or not pod.unschedulable:
                continue
            if not selector_matches(pod.meta.labels, self.cluster.config.online_selector):
                continue
            if any(pod.could_run_on(node) for node in labels):
                count += 1
                asked = add(asked, pod.requests(self.cluster.config.resources))
        return count, asked

    async def step(self, now: float) -> None:
        """One sample of the tide: measure, decide, relabel, drain what is reclaimed."""
        await self.cluster.synced()
        pool = self.mixed_pool()
        pending, pending_asked = self.pending_online(pool)
        if isinstance(self.tide, ForecastTide):
            moves = self.tide.decide(
                now,
                demand=add(pool.online, pending_asked),
                capacity=pool.capacity(),
                nodes=pool.usable(),
            )
        else:
            # In nodes: each node's share of the resource its online pods use most of.
            waiting = [v / pool.average(k) for k, v in pending_asked.items() if pool.average(k)]
            moves = self.tide.decide(
                now,
                online_load=sum(m.online_use for m in pool.usable()),
                pending_online=pending,
                pending_load=max(waiting, default=0.0),
                nodes=pool.usable(),
            )
        if moves:
            log.debug("tide: %d online pods pending: %s", pending, moves)
        for move in moves:
            body = {"metadata": {"labels": {TIDAL: move.to}}}
            await self.cluster.api.patch_node(move.node, body, **_MERGE_PATCH)
            log.info("tide: node %s -> %s", move.node, move.to)
        if isinstance(self.tide, ForecastTide):
            self.budget = dict(self.tide.budget)
            for resource, amount in self.tide.budget.items():
                metrics.TIDAL_BUDGET.labels(resource).set(amount)
            for resource, amount in self.tide.expected.items():
                metrics.TIDAL_FORECAST.labels(resource).set(amount)
            await self._drain_over_budget(pool, self.tide.drain_above)
        reclaiming = {m.node for m in moves if m.to == "offline2online"}
        reclaiming |= {m.name for _, m in pool.nodes if m.state == "offline2online"}
        for pod in pool.batch:
            if pod.node in reclaiming:
                await self._drain(pod)
        self._account(pool, moves, now)
        if moves:
            self.cluster.changed.set()

    def _account(self, pool: MixedPool, moves: list[Move], now: float) -> None:
        """The metrics of one sample: nodes per state, what is lent, and the node-hours batch
        pods harvested since the last sample, per resource."""
        counts: dict[str, int] = defaultdict(int)
        lent: Amounts = {}
        after = {m.node: m.to for m in moves}
        for node, m in pool.nodes:
            state = after.get(m.name, m.state)
            counts[state] += 1
            if state == "offline" and node.name not in pool.unready:
                lent = add(lent, pool.allocatable[node.name])
        for state in STATES:
            metrics.NODE_STATES.labels(state).set(counts[state])
        # What batch pods hold, each resource as a share of its node's: node-equivalents, so
        # that one GPU of an 8-GPU node is an eighth of a GPU node.
        held: Amounts = {}
        for pod in pool.batch:
            has = pool.allocatable.get(pod.node, {})
            asked = pool.asked[pod.name]
            held = add(held, {k: v / has[k] for k, v in asked.items() if has.get(k, 0.0) > 0})
        hours = (now - self.last_sample) / 3600 if self.last_sample is not None else 0.0
        self.last_sample = now
        for resource in self.cluster.config.resources:
            metrics.LENT.labels(resource).set(lent.get(resource, 0.0))
            metrics.HARVESTED_NODES.labels(resource).set(held.get(resource, 0.0))
            if hours > 0:
                metrics.HARVESTED_NODE_HOURS.labels(resource).inc(held.get(resource, 0.0) * hours)

    async def _drain_over_budget(self, pool: MixedPool, budget: Amounts) -> None:
        """Drain batch pods on lent nodes holding more of a resource than `budget` allows:
        of those holding it, the youngest first (their age stands in for their shards'
        progress, which we do not see)."""
        lent = {m.name for _, m in pool.nodes if m.state in ("offline", "online2offline")}
        pods = [p for p in pool.batch if p.node in lent and not self._gone(p)]
        used = total(pool.asked[p.name] for p in pods)
        youngest = sorted(pods, key=lambda p: (p.meta.created, p.name), reverse=True)
        for resource, allowed in budget.items():
            for pod in youngest:
                if used.get(resource, 0.0) <= allowed + 1e-9:
                    break
                asked = pool.asked[pod.name]
                if self._gone(pod) or asked.get(resource, 0.0) <= 0:
                    continue
                used = add(used, asked, -1.0)
                await self._drain(pod)

    def _gone(self, pod: PodView) -> bool:
        """Terminating, or drained already (by a sample whose deletion the cache has not
        shown yet)."""
        return pod.meta.deleting or pod.name in self.draining

    async def _drain(self, pod: PodView) -> None:
        """Delete a batch pod gracefully (its worker drains), counted against its job once:
        recorded as draining, so that a later sample on a cache that lags does not drain
        (nor count) it again."""
        if self._gone(pod):
            return
        self.draining.add(pod.name)
        metrics.BATCH_EVICTIONS.inc()
        self.reclaimed[pod.meta.labels.get(JOB_LABEL, "")] += 1
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
