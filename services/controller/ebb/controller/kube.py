"""The Kubernetes backend: workers are pods made from a template; capacity is what the nodes
the job may use have free; the mixed pool is lent and reclaimed with the tide.

Three informers keep the picture: the nodes, every pod that is not finished (cluster-wide:
what the nodes have free is their allocatable minus what all their pods request), and the
worker pods of our namespace (finished ones too: how they ended is what the reconciler needs).
The reconciler reads them; writes are the pods it creates and deletes, and the tidal labels
on mixed nodes.

Batch workers go to the offline pool, or to mixed nodes in tidal state `offline` (lent), the
offline pool preferred; never to nodes where our pods keep failing (for a while).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import re
import time
from collections import defaultdict, deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio.client import ApiClient, AppsV1Api, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from ebb.common import envvars
from ebb.common.bus import NatsConfig
from ebb.common.messages import JobStatus
from ebb.common.spec import parse_job

from . import metrics
from .backend import Capacity, Phase, WorkerInfo
from .capacity import Bin, Resources, add, quantities
from .failures import Failure, classify
from .informer import Informer, Obj
from .tidal import LABEL as TIDAL
from .tidal import STATES, ForecastTide, MixedNode, State, TidalConfig, Tide

log = logging.getLogger(__name__)

APP = "ebb-worker"
APP_LABEL = "app.kubernetes.io/name"
JOB_LABEL = "ebb.io/job"
WORKER_LABEL = "ebb.io/worker"
_RESOURCES = ("cpu", "memory", "nvidia.com/gpu")
_MERGE_PATCH = {"_content_type": "application/merge-patch+json"}


@dataclass(frozen=True, kw_only=True)
class KubeConfig:
    namespace: str = "ebb"
    image: str = ""
    """Workers' image; empty: the controller's own (see `from_cluster`), so that a new
    release rolls workers forward with the controller."""
    image_pull_policy: str = "IfNotPresent"
    service_account: str | None = "ebb-worker"
    priority_class: str | None = None
    """priorityClassName of worker pods (a low one, so that online pods preempt them)."""
    nats: NatsConfig = field(default_factory=NatsConfig)
    """How workers reach NATS (URL, prefix). Credentials come from `nats_secret`."""
    nats_secret: str | None = "ebb-nats-worker"  # noqa: S105 - the Secret's name
    """A Secret with keys user/password/token/creds (each optional) for workers."""
    grace_s: int = 60
    """terminationGracePeriodSeconds: the time a worker has to drain on SIGTERM."""
    pool_label: str = "ebb.io/pool"
    online_selector: str = "ebb.io/workload=online"
    """Labels that mark online pods (whose load the tide follows)."""
    tidal: TidalConfig | None = field(default_factory=TidalConfig)
    """None: the mixed pool is never lent."""
    oom_factor: float = 1.5
    """An OOMKilled worker's successors ask for this much more memory..."""
    max_memory_gb: float = 64.0
    """...up to this."""
    avoid_after: int = 3
    """Failed worker pods on one node within `avoid_window_s` that make it one to avoid..."""
    avoid_window_s: float = 600.0
    avoid_for_s: float = 1800.0
    """...for this long."""
    owner: dict[str, str] | None = None
    """An ownerReference for worker pods (apiVersion, kind, name, uid)."""
    owner_deployment: str | None = None
    """Or: the Deployment (the controller's own) that owns worker pods, looked up at start,
    so that deleting Ebb deletes its workers too."""
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    env_from_secrets: list[str] = field(default_factory=lambda: ["ebb-storage"])
    """Secrets whose keys become workers' environment, if they exist: object-store
    credentials (AWS_ACCESS_KEY_ID...), for fsspec to read inputs and write outputs."""
    metrics_port: int | None = 9400
    """Workers serve /metrics here (annotated for Prometheus' pod discovery); None: not."""


async def from_cluster(
    config: KubeConfig, api: ApiClient, *, pod_name: str | None = None
) -> KubeConfig:
    """`config` completed from the cluster: the image of our own pod `pod_name` if none is
    set; the ownerReference of `owner_deployment`. What cannot be read stays unset, with a
    warning: workers run without either, they only outlive an uninstall or lag a release."""
    if not config.image and pod_name:
        try:
            pod = await CoreV1Api(api).read_namespaced_pod(pod_name, config.namespace)
            config = dataclasses.replace(config, image=str(pod.spec.containers[0].image))
        except ApiException as e:
            log.warning("cannot read our pod %s (%s %s)", pod_name, e.status, e.reason)
    if config.owner or not config.owner_deployment:
        return config
    try:
        found = await AppsV1Api(api).read_namespaced_deployment(
            config.owner_deployment, config.namespace
        )
    except ApiException as e:
        log.warning(
            "deployment %s/%s not readable (%s %s): worker pods get no owner",
            config.namespace,
            config.owner_deployment,
            e.status,
            e.reason,
        )
        return config
    owner = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": str(found.metadata.name),
        "uid": str(found.metadata.uid),
    }
    return dataclasses.replace(config, owner=owner)


def parse_time(value: str | None) -> float:
    if not value:
        return time.time()
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def pod_name(worker_id: str) -> str:
    """A worker id as a pod name (DNS-1123: lower case, digits and '-', 63 at most)."""
    name = re.sub(r"[^a-z0-9-]+", "-", worker_id.lower()).strip("-")
    return (name[:63].rstrip("-")) or "ebb-worker"


def requests_of(pod: Obj) -> Resources:
    total: Resources = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        requests = (container.get("resources") or {}).get("requests") or {}
        total = add(total, quantities({k: v for k, v in requests.items() if k in _RESOURCES}))
    return total


def selector_matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (`a=b,c!=d,e`), as used for online pods."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.strip()) != v.strip().lstrip("="):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _ready(node: Obj) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


class KubernetesBackend:
    def __init__(self, config: KubeConfig, api: ApiClient) -> None:
        self.config = config
        self.core = CoreV1Api(api)
        self.api: Any = self.core
        """The same client, for calls its type stubs describe too narrowly."""
        self.changed = asyncio.Event()
        """Set when the cluster changed: the reconciler may look again sooner."""
        ns = config.namespace
        self.nodes = Informer("nodes", self.core.list_node, on_change=self.changed.set)
        self.pods = Informer(
            "pods",
            self.core.list_pod_for_all_namespaces,
            field_selector="status.phase!=Succeeded,status.phase!=Failed",
            on_change=self.changed.set,
        )
        self.workers = Informer(
            "workers",
            lambda **kw: self.core.list_namespaced_pod(ns, **kw),
            label_selector=f"{APP_LABEL}={APP}",
            on_change=self.changed.set,
        )
        self.tide: Tide | ForecastTide | None = None
        if config.tidal is not None:
            forecast = config.tidal.policy == "forecast"
            self.tide = ForecastTide(config.tidal) if forecast else Tide(config.tidal)
        self._draining: set[str] = set()
        """Worker pods the tide has drained: terminating, whatever the cache says yet (the
        reconciler must not drain others in their stead)."""
        self._budget_cpu: float | None = None
        """forecast policy: CPU cores batch pods may take on lent mixed nodes (None: no cap)."""
        self._memory_factor: dict[str, float] = defaultdict(lambda: 1.0)
        self._specs: dict[str, JobStatus] = {}
        self._node_failures: dict[str, deque[float]] = defaultdict(deque)
        self._avoid_until: dict[str, float] = {}
        self._seen_failed: set[str] = set()

    # -- agents ----------------------------------------------------------------------------

    def agents(self) -> dict[str, Coroutine[Any, Any, None]]:
        agents = {
            "nodes": self.nodes.run(),
            "pods": self.pods.run(),
            "workers": self.workers.run(),
        }
        if self.tide is not None:
            agents["tide"] = self.tidal_loop()
        return agents

    async def synced(self) -> None:
        for informer in (self.nodes, self.pods, self.workers):
            await informer.synced.wait()

    # -- the ClusterBackend protocol --------------------------------------------------------

    async def observe(self) -> list[WorkerInfo]:
        await self.synced()
        now_wall = time.time()
        now = asyncio.get_running_loop().time()
        out = []
        self._draining &= {(p.get("metadata") or {}).get("name") for p in self.workers.values()}
        for pod in self.workers.values():
            meta = pod.get("metadata") or {}
            labels = meta.get("labels") or {}
            status = pod.get("status") or {}
            phase_name = status.get("phase", "Pending")
            failure = classify(pod)
            phase: Phase
            if phase_name == "Succeeded":
                phase = "succeeded"
            elif phase_name == "Failed" or failure is not None:
                phase = "failed"
            elif meta.get("deletionTimestamp") or meta.get("name") in self._draining:
                phase = "terminating"
            elif phase_name == "Running":
                phase = "running"
            else:
                phase = "starting"
            if phase == "failed":
                self._note_failure(pod, failure, now)
            age = max(0.0, now_wall - parse_time(meta.get("creationTimestamp")))
            out.append(
                WorkerInfo(
                    id=meta.get("name", ""),
                    job=labels.get(JOB_LABEL, ""),
                    phase=phase,
                    started_at=now - age,
                    reason=failure.reason if failure else "",
                    failure=failure.kind if failure else None,
                )
            )
        return out

    async def capacity(self, jobs: list[JobStatus], workers: list[WorkerInfo]) -> Capacity:
        await self.synced()
        for job in jobs:
            if job.spec is not None:
                self._specs[job.id] = job
        live = {w.id for w in workers if w.alive}
        used: dict[str, Resources] = defaultdict(dict)
        for pod in self.pods.values():
            node = (pod.get("spec") or {}).get("nodeName")
            name = (pod.get("metadata") or {}).get("name")
            ours = (pod.get("metadata") or {}).get("namespace") == self.config.namespace
            if node and not (ours and name in live):
                used[node] = add(used[node], requests_of(pod))
        now = asyncio.get_running_loop().time()
        bins = []
        pools: dict[str, Resources] = defaultdict(dict)
        for node in self.nodes.values():
            meta = node.get("metadata") or {}
            name = meta["name"]
            labels = meta.get("labels") or {}
            pool = labels.get(self.config.pool_label, "offline")
            lent = pool == "mixed" and labels.get(TIDAL) == "offline"
            if not (_ready(node) and (pool == "offline" or lent)):
                continue
            if self._avoid_until.get(name, 0.0) > now:
                continue
            allocatable = quantities((node.get("status") or {}).get("allocatable"))
            free = add({k: v for k, v in allocatable.items() if k in _RESOURCES}, used[name], -1.0)
            bins.append(Bin(name, free, rank=0 if pool == "offline" else 1))
        if self._budget_cpu is not None:
            # The tide's budget caps what new batch pods may take on the mixed pool; the pods
            # there already keep their place (draining them is the tide's call, not ours).
            offline_nodes = {
                n["metadata"]["name"]
                for n in self.nodes.values()
                if (n["metadata"].get("labels") or {}).get(self.config.pool_label, "offline")
                == "offline"
            }
            held = sum(
                requests_of(p).get("cpu", 0.0)
                for p in self.workers.values()
                if (p.get("metadata") or {}).get("name") in live
                and (p.get("spec") or {}).get("nodeName") not in offline_nodes
            )
            left = max(self._budget_cpu, held)
            for b in sorted((b for b in bins if b.rank == 1), key=lambda b: b.name):
                b.free["cpu"] = min(b.free.get("cpu", 0.0), max(0.0, left))
                left -= b.free["cpu"]
        for b in bins:
            pool = "offline" if b.rank == 0 else "mixed"
            pools[pool] = add(pools[pool], b.free)
        for pool, free in pools.items():
            for resource, amount in free.items():
                metrics.IDLE_CAPACITY.labels(pool, resource).set(amount)
        return Capacity(bins=bins, shape=self.shape)

    def shape(self, job: JobStatus) -> Resources:
        spec = parse_job(job.spec) if job.spec else None
        if spec is None:
            return {"cpu": 1.0, "memory": 2.0 * 2**30}
        memory = min(
            spec.resources.memory_gb * self._memory_factor[job.id], self.config.max_memory_gb
        )
        shape: Resources = {"cpu": spec.resources.cpu, "memory": memory * 2**30}
        if spec.resources.gpu:
            shape["nvidia.com/gpu"] = float(spec.resources.gpu)
        return shape

    async def launch(self, job: JobStatus, worker_id: str) -> None:
        status = self._specs.get(job.id, job)
        body = self.pod(status, worker_id)
        try:
            # A plain JSON map: the client sends it as it is (its stubs only know V1Pod).
            await self.api.create_namespaced_pod(self.config.namespace, body)
            log.info("created pod %s for job %s", body["metadata"]["name"], job.id)
        except ApiException as e:
            if e.status != 409:  # 409: it exists already (a repeated pass)
                raise

    async def terminate(self, worker_id: str, *, grace_s: float) -> None:
        await self._delete(worker_id, grace_s=int(grace_s))

    async def forget(self, worker_id: str) -> None:
        await self._delete(worker_id, grace_s=0)

    async def close(self, *, grace_s: float) -> None:
        """Worker pods outlive the controller: the next one adopts them."""
        del grace_s

    def grow_memory(self, job: str) -> None:
        self._memory_factor[job] *= self.config.oom_factor

    # -- pods --------------------------------------------------------------------------------

    def pod(self, job: JobStatus, worker_id: str) -> Obj:
        c = self.config
        shape = self.shape(job)
        requests = {"cpu": f"{shape['cpu']:g}", "memory": f"{int(shape['memory'])}"}
        limits = {"memory": requests["memory"]}
        if shape.get("nvidia.com/gpu"):
            limits["nvidia.com/gpu"] = f"{int(shape['nvidia.com/gpu'])}"
        env: list[dict[str, Any]] = [
            {"name": envvars.JOB, "value": job.id},
            {"name": envvars.WORKER_ID, "value": pod_name(worker_id)},
            {"name": envvars.NATS_URL, "value": c.nats.url},
            {"name": envvars.PREFIX, "value": c.nats.prefix},
            # Leave the drain a margin inside the pod's grace period.
            {"name": envvars.SHUTDOWN_GRACE_S, "value": str(max(1, c.grace_s - 10))},
            *({"name": k, "value": v} for k, v in c.env.items()),
        ]
        if c.metrics_port is not None:
            env.append({"name": envvars.METRICS_PORT, "value": str(c.metrics_port)})
        if c.nats_secret:
            for key, var in (
                ("user", envvars.NATS_USER),
                ("password", envvars.NATS_PASSWORD),
                ("token", envvars.NATS_TOKEN),
            ):
                ref = {"name": c.nats_secret, "key": key, "optional": True}
                env.append({"name": var, "valueFrom": {"secretKeyRef": ref}})
        avoid = sorted(
            n for n, t in self._avoid_until.items() if t > asyncio.get_running_loop().time()
        )
        fields = [{"key": "metadata.name", "operator": "NotIn", "values": avoid}] if avoid else []
        pool = c.pool_label
        terms = [
            {"matchExpressions": [{"key": pool, "operator": "In", "values": ["offline"]}]},
            {
                "matchExpressions": [
                    {"key": pool, "operator": "In", "values": ["mixed"]},
                    {"key": TIDAL, "operator": "In", "values": ["offline"]},
                ]
            },
        ]
        for term in terms:
            if fields:
                term["matchFields"] = fields
        metadata: Obj = {
            "name": pod_name(worker_id),
            "namespace": c.namespace,
            "labels": {
                **c.labels,
                APP_LABEL: APP,
                JOB_LABEL: job.id,
                WORKER_LABEL: pod_name(worker_id),
            },
        }
        if c.owner:
            metadata["ownerReferences"] = [{**c.owner, "controller": True}]
        if c.metrics_port is not None:
            metadata["annotations"] = {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(c.metrics_port),
            }
        spec: Obj = {
            "restartPolicy": "Never",  # we relaunch, knowing why it ended
            "terminationGracePeriodSeconds": c.grace_s,
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms},
                    # Evicted from a reclaimed node? The offline pool first.
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "preference": {
                                "matchExpressions": [
                                    {"key": pool, "operator": "In", "values": ["offline"]}
                                ]
                            },
                        }
                    ],
                }
            },
            "containers": [
                {
                    "name": "worker",
                    "image": c.image or "ebb:latest",
                    "imagePullPolicy": c.image_pull_policy,
                    "command": ["python", "-m", "ebb.worker"],
                    "env": env,
                    "envFrom": [
                        {"secretRef": {"name": name, "optional": True}}
                        for name in c.env_from_secrets
                    ],
                    "resources": {"requests": requests, "limits": limits},
                    # The worker writes why it gave up there; a crash without a word leaves
                    # the tail of its log instead. Either way the controller can say why.
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    **(
                        {"ports": [{"name": "metrics", "containerPort": c.metrics_port}]}
                        if c.metrics_port is not None
                        else {}
                    ),
                }
            ],
        }
        if c.service_account:
            spec["serviceAccountName"] = c.service_account
        if c.priority_class:
            spec["priorityClassName"] = c.priority_class
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}

    async def _delete(self, worker_id: str, *, grace_s: int) -> None:
        try:
            await self.core.delete_namespaced_pod(
                pod_name(worker_id), self.config.namespace, grace_period_seconds=grace_s
            )
        except ApiException as e:
            if e.status != 404:  # gone already is what we wanted; anything else: next pass
                log.warning("could not delete pod %s: %s %s", worker_id, e.status, e.reason)

    def _note_failure(self, pod: Obj, failure: Failure | None, now: float) -> None:
        """Count a failed pod against its node, once; a node failing too often is avoided."""
        uid = (pod.get("metadata") or {}).get("uid", "")
        node = (pod.get("spec") or {}).get("nodeName")
        if uid in self._seen_failed or not node:
            return
        self._seen_failed.add(uid)
        if failure is not None and failure.kind == "capacity":
            return  # evicted or preempted: not the node's fault
        history = self._node_failures[node]
        history.append(now)
        while history and history[0] < now - self.config.avoid_window_s:
            history.popleft()
        if len(history) >= self.config.avoid_after:
            self._avoid_until[node] = now + self.config.avoid_for_s
            history.clear()
            log.warning("node %s: worker pods keep failing there; avoiding it", node)

    # -- the tide --------------------------------------------------------------------------

    def mixed_nodes(self) -> list[tuple[Obj, MixedNode]]:
        batch: dict[str, int] = defaultdict(int)
        online: dict[str, float] = defaultdict(float)
        for pod in self.pods.values():
            node = (pod.get("spec") or {}).get("nodeName")
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if not node:
                continue
            if labels.get(APP_LABEL) == APP:
                batch[node] += 1
            elif selector_matches(labels, self.config.online_selector):
                online[node] += requests_of(pod).get("cpu", 0.0)
        out = []
        for node in self.nodes.values():
            meta = node.get("metadata") or {}
            labels = meta.get("labels") or {}
            if labels.get(self.config.pool_label) != "mixed":
                continue
            cpu = quantities((node.get("status") or {}).get("allocatable")).get("cpu", 1.0)
            label = labels.get(TIDAL, "online")
            state: State = next((s for s in STATES if s == label), "online")
            mixed = MixedNode(
                name=meta["name"],
                state=state,
                batch_pods=batch[meta["name"]],
                online_use=online[meta["name"]] / max(cpu, 1e-9),
            )
            out.append((node, mixed))
        return out

    def pending_online(self) -> tuple[int, float]:
        """Online pods that cannot be scheduled: how many, and their CPU requests."""
        count, cpu = 0, 0.0
        for pod in self.pods.values():
            labels = (pod.get("metadata") or {}).get("labels") or {}
            status = pod.get("status") or {}
            unscheduled = not (pod.get("spec") or {}).get("nodeName")
            pending = unscheduled and status.get("phase") == "Pending"
            if pending and selector_matches(labels, self.config.online_selector):
                count += 1
                cpu += requests_of(pod).get("cpu", 0.0)
        return count, cpu

    async def tidal_step(self, now: float) -> None:
        """One sample of the tide: measure, decide, relabel, drain what is reclaimed."""
        assert self.tide is not None
        await self.synced()
        mixed = self.mixed_nodes()
        load = sum(m.online_use for _, m in mixed)
        pending, pending_cpu = self.pending_online()
        node_cpu = [
            quantities((n.get("status") or {}).get("allocatable")).get("cpu", 1.0) for n, _ in mixed
        ]
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
            await self.api.patch_node(move.node, body, **_MERGE_PATCH)
            log.info("tide: node %s -> %s", move.node, move.to)
        if isinstance(self.tide, ForecastTide):
            self._budget_cpu = self.tide.budget * average
            metrics.TIDAL_BUDGET.set(self._budget_cpu)
            metrics.TIDAL_FORECAST.set(self.tide.expected * average)
            await self._drain_over_budget(mixed, self.tide.drain_above * average)
        reclaiming = {m.node for m in moves if m.to == "offline2online"}
        reclaiming |= {m.name for _, m in mixed if m.state == "offline2online"}
        for pod in self.pods.values():
            meta = pod.get("metadata") or {}
            if (
                (meta.get("labels") or {}).get(APP_LABEL) == APP
                and (pod.get("spec") or {}).get("nodeName") in reclaiming
                and not meta.get("deletionTimestamp")
            ):
                metrics.BATCH_EVICTIONS.inc()
                await self._delete(meta["name"], grace_s=self.config.grace_s)
        counts: dict[str, int] = defaultdict(int)
        harvested = 0.0
        after = {m.node: m.to for m in moves}
        for node, m in mixed:
            state = after.get(m.name, m.state)
            counts[state] += 1
            if state == "offline":
                harvested += quantities((node.get("status") or {}).get("allocatable")).get(
                    "cpu", 0.0
                )
        for state in ("online", "online2offline", "offline", "offline2online"):
            metrics.NODE_STATES.labels(state).set(counts[state])
        metrics.HARVESTED.set(harvested)
        if moves:
            self.changed.set()

    async def _drain_over_budget(self, mixed: list[tuple[Obj, MixedNode]], budget: float) -> None:
        """Drain batch pods on lent nodes beyond `budget` (CPU cores): the youngest first
        (their age stands in for their shards' progress, which we do not see)."""
        lent = {m.name for _, m in mixed if m.state in ("offline", "online2offline")}
        pods = [
            p
            for p in self.pods.values()
            if ((p.get("metadata") or {}).get("labels") or {}).get(APP_LABEL) == APP
            and (p.get("spec") or {}).get("nodeName") in lent
            and not (p.get("metadata") or {}).get("deletionTimestamp")
            and (p.get("metadata") or {}).get("name") not in self._draining
        ]
        used = sum(requests_of(p).get("cpu", 0.0) for p in pods)
        youngest = sorted(
            pods,
            key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]),
            reverse=True,
        )
        for pod in youngest:
            if used <= budget + 1e-9:
                break
            used -= requests_of(pod).get("cpu", 0.0)
            self._draining.add(pod["metadata"]["name"])
            metrics.BATCH_EVICTIONS.inc()
            await self._delete(pod["metadata"]["name"], grace_s=self.config.grace_s)

    async def tidal_loop(self) -> None:
        assert self.tide is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.tidal_step(loop.time())
            except ApiException as e:
                log.warning("tide: API error %s; next sample will try again", e.status)
            await asyncio.sleep(self.tide.config.sample_s)
