"""The Kubernetes backend: workers are pods made from a template; capacity is what the nodes
the job may use have free; the mixed pool is lent and reclaimed with the tide.

Three informers keep the picture: the nodes, every pod that is not finished (cluster-wide:
what the nodes have free is their allocatable minus what all their pods request), and the
worker pods of our namespace (finished ones too: how they ended is what the reconciler needs).
The reconciler reads them; writes are the pods it creates and deletes, the tidal labels
on mixed nodes (ebb.controller.kube.harvest), and (given a signer) each worker pod's NATS
credentials Secret (ebb.controller.kube.credentials).

Batch workers go to the offline pool, or to mixed nodes in tidal state `offline` (lent), in
the order their job's pool mode says (ebb.controller.kube.placer); never to nodes where our pods
keep failing (for a while).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import defaultdict
from collections.abc import Coroutine
from typing import Any

from kubernetes_asyncio.client import ApiClient, AppsV1Api, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from ebb.common.messaging.identity import WorkerSigner
from ebb.common.messaging.messages import JobStatus

from .. import metrics
from ..backend import Capacity, LaunchRefused, Phase, WorkerInfo, job_environment
from ..groups import group_key, job_spec, tier_resources
from ..policy.avoidance import NodeAvoidance
from ..policy.capacity import Bin, Resources, add
from ..policy.failures import Failure, classify, disruption
from ..policy.pools import MIXED, OFFLINE
from ..policy.tidal import LABEL as TIDAL
from ..policy.tidal import ForecastTide, Tide
from .config import KubeConfig
from .credentials import CredentialIssuer
from .harvest import TidalHarvester
from .informer import Informer, Obj
from .placement import Placement
from .placer import Placer
from .podspec import (
    APP,
    APP_LABEL,
    JOB_LABEL,
    TIER_LABEL,
    WORKER_LABEL,
    pod_name,
    worker_pod,
)
from .views import NodeView, PodView, parse_time, selector_matches

__all__ = ["APP", "APP_LABEL", "JOB_LABEL", "TIER_LABEL", "WORKER_LABEL", "KubeConfig"]
__all__ += ["KubernetesBackend"]
__all__ += ["from_cluster", "pod_name", "repository", "running_image", "selector_matches"]

log = logging.getLogger(__name__)

REMOVED = "its pod was removed before it ended (deleted by force, or with its node)"


def repository(image: str) -> str:
    """An image reference without its tag or digest: `registry:5000/ebb:1.2` ->
    `registry:5000/ebb` (a registry's port is not a tag)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def running_image(spec_image: str, image_id: str) -> str:
    """The image a container runs, by digest: `repo@sha256:...` from the kubelet's imageID
    (`[docker-pullable://]repo@sha256:...`), so that pods made from it run the very same
    build even after the tag moves; the reference as given where the runtime reported no
    digest (an image built on the node, say)."""
    _, at, digest = image_id.rpartition("@")
    if not at or not digest.startswith("sha256:"):
        return spec_image
    return f"{repository(spec_image)}@{digest}"


def forbidden(e: ApiException, what: str) -> str:
    """Why the API server refused the controller `what` (a 403), in its own words: they
    name the verb, the resource and the ServiceAccount."""
    message = ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        message = str(json.loads(e.body or b"").get("message") or "")
    return (
        f"the controller may not {what}: {message or e.reason} (k8s/base/rbac.yaml grants "
        "the controller's ServiceAccount what it needs)"
    )


async def from_cluster(
    config: KubeConfig, api: ApiClient, *, pod_name: str | None = None
) -> KubeConfig:
    """`config` completed from the cluster: if it names no image, the image our own pod
    `pod_name` runs, by digest; the ownerReference of `owner_deployment`. What cannot be read
    stays unset, with a warning: workers run without either, they only outlive an uninstall
    or lag a release."""
    if not config.image and pod_name:
        try:
            pod = await CoreV1Api(api).read_namespaced_pod(pod_name, config.namespace)
        except ApiException as e:
            log.warning("cannot read our pod %s (%s %s)", pod_name, e.status, e.reason)
        else:
            ours = pod.spec.containers[0]
            statuses = (pod.status and pod.status.container_statuses) or []
            image_id = next((str(s.image_id or "") for s in statuses if s.name == ours.name), "")
            image = running_image(str(ours.image), image_id)
            if "@" not in image:
                log.warning("no digest for our image %s: workers run it by tag", image)
            config = dataclasses.replace(config, image=image)
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


class KubernetesBackend:
    def __init__(
        self, config: KubeConfig, api: ApiClient, *, signer: WorkerSigner | None = None
    ) -> None:
        self.config = config
        self.core = CoreV1Api(api)
        self.api: Any = self.core
        """The same client, for calls its type stubs describe too narrowly."""
        self.credentials = CredentialIssuer(self.api, signer) if signer is not None else None
        """Gives each worker pod a NATS credential of its own, minted by `signer`; None:
        workers share `config.nats_secret`."""
        self.changed = asyncio.Event()
        """Set when an informer lists anew or sees a node or pod change, and when the tide
        moves a node (see ClusterBackend.changed)."""
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
            on_delete=self._removed_pod,
        )
        self._removed: dict[str, Obj] = {}
        """Worker pods removed from the API since the last pass, as they last were, but those
        this controller removed itself (`forget`)."""
        self._forgotten: set[str] = set()
        """Pods `forget` deleted, until their removal is seen."""
        self.harvester: TidalHarvester | None = None
        """The tide: lends and reclaims mixed nodes (None: no tidal config)."""
        if config.tidal is not None:
            forecast = config.tidal.policy == "forecast"
            tide = ForecastTide(config.tidal) if forecast else Tide(config.tidal)
            self.harvester = TidalHarvester(self, tide)
        self._memory_factor: dict[str, float] = defaultdict(lambda: 1.0)
        """Per group (groups.group_key): how much more memory than its spec says."""
        self._specs: dict[str, JobStatus] = {}
        self.avoidance = NodeAvoidance(
            after=config.avoid_after, window_s=config.avoid_window_s, for_s=config.avoid_for_s
        )
        self.placer = Placer(
            config, drained=self.harvester.reclaimed if self.harvester is not None else None
        )
        """Each group's pool mode, node selector and tolerations, and its reclaims."""

    # -- agents ----------------------------------------------------------------------------

    def agents(self) -> dict[str, Coroutine[Any, Any, None]]:
        agents = {
            "nodes": self.nodes.run(),
            "pods": self.pods.run(),
            "workers": self.workers.run(),
        }
        if self.harvester is not None:
            agents["tide"] = self.harvester.run()
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
        pods = [PodView(p) for p in self.workers.values()]
        draining = self.harvester.forget_gone(pods) if self.harvester else set()
        if self.credentials is not None:
            await self.credentials.repair(pods)
        # Pods removed since the last pass that it never saw end. One removed before it ended
        # (deleted by force: its processes killed, or soon to be; or with its node; or
        # preempted, and gone before a pass saw it go) is lost to the cluster: its shards are
        # nobody's fault, and the master frees them now rather than when their leases run
        # out. One that drained and exited 0 is a drain. One that failed as it was told to go
        # is left to its leases: its end says nothing sure.
        current = {pod.name for pod in pods}
        removed = [
            pod
            for pod in (PodView(o) for name, o in self._removed.items() if name not in current)
            if pod.phase != "Failed"
        ]
        gone = {pod.name for pod in removed}
        self._removed.clear()
        self.placer.note_pods([*pods, *removed], map(NodeView, self.nodes.values()))
        for pod in [*pods, *removed]:
            failure = classify(pod.obj)
            if failure is None and pod.name in gone and pod.phase != "Succeeded":
                failure = disruption(pod.obj) or Failure("capacity", REMOVED)
            phase: Phase
            if pod.phase == "Succeeded":
                phase = "succeeded"
            elif pod.phase == "Failed" or failure is not None:
                phase = "failed"
            elif pod.meta.deleting or pod.name in draining:
                phase = "terminating"
            elif pod.phase == "Running":
                phase = "running"
            else:
                phase = "starting"
            if phase == "failed":
                self.avoidance.note_failure(
                    pod_uid=pod.meta.uid, node=pod.node, failure=failure, now=now
                )
            age = max(0.0, now_wall - parse_time(pod.meta.created or None))
            # Exited 0 once it was told to go (deleted, or drained by the harvester): a drain.
            drained = phase == "succeeded" and (pod.meta.deleting or pod.name in draining)
            out.append(
                WorkerInfo(
                    id=pod.name,
                    job=pod.meta.labels.get(JOB_LABEL, ""),
                    phase=phase,
                    started_at=now - age,
                    reason=failure.reason if failure else "",
                    failure=failure.kind if failure else None,
                    node=pod.node,
                    tier=pod.meta.labels.get(TIER_LABEL, ""),
                    drained=drained,
                )
            )
        return out

    async def capacity(self, jobs: list[JobStatus], workers: list[WorkerInfo]) -> Capacity:
        await self.synced()
        for job in jobs:
            if job.spec is not None:
                self._specs[job.id] = job
        self.placer.forget_ended({j.id for j in jobs})
        live = {w.id for w in workers if w.alive}
        used: dict[str, Resources] = defaultdict(dict)
        for pod in map(PodView, self.pods.values()):
            ours = pod.meta.namespace == self.config.namespace
            if pod.node and not (ours and pod.name in live):
                used[pod.node] = add(used[pod.node], pod.requests(self.config.resources))
        now = asyncio.get_running_loop().time()
        bins = []
        pools: dict[str, Resources] = defaultdict(dict)
        nodes = {n.name: n for n in map(NodeView, self.nodes.values())}
        for node in nodes.values():
            labels = node.meta.labels
            # A node without the label is in no pool: the pods' node affinity names the pools,
            # so counting it would promise room they can never take.
            pool = labels.get(self.config.pool_label, "")
            lent = pool == MIXED and labels.get(TIDAL) == "offline"
            if not (node.ready and (pool == OFFLINE or lent)):
                continue
            if self.avoidance.avoids(node.name, now):
                continue
            allocatable = node.allocatable()
            counted = {k: v for k, v in allocatable.items() if k in self.config.resources}
            free = add(counted, used[node.name], -1.0)
            bins.append(Bin(node.name, free, pool=pool))
        budget = self.harvester.budget if self.harvester else None
        if budget is not None:
            # The tide's budget caps what new batch pods may take on the mixed pool, resource by
            # resource; the pods there already keep their place (draining them is the tide's
            # call, not ours).
            offline_nodes = {
                n.name
                for n in map(NodeView, self.nodes.values())
                if n.meta.labels.get(self.config.pool_label) == OFFLINE
            }
            held: Resources = {}
            for p in map(PodView, self.workers.values()):
                if p.name in live and p.node not in offline_nodes:
                    held = add(held, p.requests(self.config.resources))
            mixed = sorted((b for b in bins if b.pool == MIXED), key=lambda b: b.name)
            for resource, allowed in budget.items():
                left = max(allowed, held.get(resource, 0.0))
                for b in mixed:
                    b.free[resource] = min(b.free.get(resource, 0.0), max(0.0, left))
                    left -= b.free[resource]
        for b in bins:
            pools[b.pool] = add(pools[b.pool], b.free)
        for pool, free in pools.items():
            for resource, amount in free.items():
                metrics.IDLE_CAPACITY.labels(pool, resource).set(amount)
        return Capacity(
            bins=bins,
            shape=self.shape,
            eligible=self.placer.eligible(list(nodes.values())),
            prefer=self.placer.prefer,
            unplaceable=self.placer.unplaceable(list(nodes.values()), self.shape),
        )

    def shape(self, job: JobStatus, tier: str = "") -> Resources:
        """What one worker of tier `tier` of `job` requests ("": a job without tiers)."""
        resources = tier_resources(job_spec(job), tier)
        if resources is None:
            return {"cpu": 1.0, "memory": 2.0 * 2**30}
        grown = self._memory_factor[group_key(job.id, tier)]
        memory = min(resources.memory_gb * grown, self.config.max_memory_gb)
        shape: Resources = {"cpu": resources.cpu, "memory": memory * 2**30}
        if resources.gpu:
            shape[self.config.gpu_resource] = float(resources.gpu)
        return shape

    def placement(self, job: JobStatus, tier: str = "") -> Placement:
        """Where tier `tier`'s pods may run (see Placer.placement)."""
        return self.placer.placement(job, tier)

    async def launch(self, job: JobStatus, worker_id: str, *, tier: str = "") -> None:
        status = self._specs.get(job.id, job)
        body = worker_pod(
            job.id,
            self.config,
            worker_id=worker_id,
            shape=self.shape(status, tier),
            avoid=self.avoidance.avoided(asyncio.get_running_loop().time()),
            env=job_environment(status, tier),
            own_credentials=self.credentials is not None,
            tier=tier,
            placement=self.placement(status, tier),
        )
        try:
            # A plain JSON map: the client sends it as it is (its stubs only know V1Pod).
            created = await self.api.create_namespaced_pod(self.config.namespace, body)
            of_tier = f" (tier {tier})" if tier else ""
            log.info("created pod %s for job %s%s", body["metadata"]["name"], job.id, of_tier)
        except ApiException as e:
            if e.status == 403:
                raise LaunchRefused(forbidden(e, "create worker pods")) from e
            if e.status != 409:  # 409: it exists already (a repeated pass)
                raise
            return  # its Secret, if it lacks one, comes with the next pass's observe()
        if self.credentials is not None:
            uid = str(created.metadata.uid)
            try:
                await self.credentials.issue({**body, "metadata": {**body["metadata"], "uid": uid}})
            except ApiException as e:
                if e.status == 403:
                    # The pod waits for its Secret (the next passes try again): say why.
                    raise LaunchRefused(forbidden(e, "create worker pods' credentials")) from e
                raise

    async def terminate(self, worker_id: str, *, grace_s: float) -> None:
        await self.delete_pod(worker_id, grace_s=int(grace_s))

    async def forget(self, worker_id: str) -> None:
        name = pod_name(worker_id)
        if f"{self.config.namespace}/{name}" in self.workers.items:
            self._forgotten.add(name)  # its removal is ours, not news
        await self.delete_pod(worker_id, grace_s=0)

    def _removed_pod(self, obj: Obj) -> None:
        name = PodView(obj).name
        if name in self._forgotten:
            self._forgotten.discard(name)
        else:
            self._removed[name] = obj

    async def close(self, *, grace_s: float) -> None:
        """Worker pods outlive the controller: the next one adopts them."""
        del grace_s

    def grow_memory(self, job: str) -> None:
        self._memory_factor[job] *= self.config.oom_factor

    # -- pods --------------------------------------------------------------------------------

    async def delete_pod(self, worker_id: str, *, grace_s: int) -> None:
        try:
            await self.core.delete_namespaced_pod(
                pod_name(worker_id), self.config.namespace, grace_period_seconds=grace_s
            )
        except ApiException as e:
            if e.status != 404:  # gone already is what we wanted; anything else: next pass
                log.warning("could not delete pod %s: %s %s", worker_id, e.status, e.reason)
