"""A worker's pod, as a pure function of what it is for: no cluster, no clock, no state."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ebb.common import envvars
from ebb.common.job import JobSpec
from ebb.common.job.placement import PoolMode

from ..policy.capacity import Resources
from ..policy.pools import MIXED, OFFLINE, preferred
from ..policy.tidal import LABEL as TIDAL
from .config import KubeConfig
from .informer import Obj
from .placement import Placement

APP = "ebb-worker"
APP_LABEL = "app.kubernetes.io/name"
JOB_LABEL = "ebb.io/job"
TIER_LABEL = "ebb.io/tier"
"""The tier of its job a worker pod runs (`JobSpec.tiers`); absent for a job without tiers."""
WORKER_LABEL = "ebb.io/worker"
DEFAULT_IMAGE = "ebb:latest"
CREDENTIALS_KEY = "creds"
"""The key of a worker's credentials Secret that holds its .creds text."""
CREDENTIALS_DIR = "/var/run/secrets/ebb/nats"
"""Where a worker pod mounts its credentials Secret."""
_CREDENTIALS_VOLUME = "nats-credentials"


def pod_name(worker_id: str) -> str:
    """A worker id as a pod name (DNS-1123: lower case, digits and '-', 63 at most)."""
    name = re.sub(r"[^a-z0-9-]+", "-", worker_id.lower()).strip("-")
    return (name[:63].rstrip("-")) or "ebb-worker"


def credentials_secret_name(pod: str) -> str:
    """The Secret that holds the NATS credentials of the worker that runs in pod `pod`."""
    return f"{pod}-nats"


def credentials_secret(pod: Obj, creds: str) -> Obj:
    """The Secret of worker pod `pod` (as created: it has a uid) with its .creds text, owned by
    the pod: Kubernetes' garbage collector deletes it with the pod."""
    meta = pod["metadata"]
    owner = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": meta["name"],
        "uid": meta["uid"],
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": credentials_secret_name(meta["name"]),
            "namespace": meta["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "ownerReferences": [owner],
        },
        "type": "Opaque",
        # Written once: a credential is replaced with its pod, never in place.
        "immutable": True,
        "stringData": {CREDENTIALS_KEY: creds},
    }


def mounted_credentials(pod: Obj) -> str | None:
    """The credentials Secret a worker pod mounts, if it mounts one."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        if volume.get("name") == _CREDENTIALS_VOLUME:
            name = (volume.get("secret") or {}).get("secretName")
            return str(name) if name else None
    return None


def pod_placement(
    config: KubeConfig, job: JobSpec | None = None, tier: str = "", *, pool: PoolMode = "any"
) -> Placement:
    """Where a worker of tier `tier` of `job` ("": a job without tiers) may run: the
    controller's node selector and tolerations, the job's over them, its tier's over those,
    and the GPU type its resources name (`config.gpu_type_label`) over all; in `pool`."""
    where = Placement(
        node_selector=dict(config.node_selector),
        tolerations=[dict(t) for t in config.tolerations],
        pool=pool,
    )
    if job is None:
        return where
    where = where.over(job.node_selector, job.tolerations)
    found = next((t for t in job.tiers if t.name == tier), None) if tier else None
    if found is not None:
        where = where.over(found.node_selector, found.tolerations)
    resources = found.resources if found is not None else job.resources
    if resources.gpu_type:
        # Last: the GPU the workers' resources ask for is what they need, whatever a
        # selector of wider reach says of the same label.
        where = where.over({config.gpu_type_label: resources.gpu_type}, [])
    return where


def worker_pod(
    job: str,
    config: KubeConfig,
    *,
    worker_id: str,
    shape: Resources,
    avoid: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    own_credentials: bool = False,
    tier: str = "",
    placement: Placement | None = None,
) -> Obj:
    """The pod of worker `worker_id` of job `job`: requests `shape`, runs `config.image`,
    on the pools its placement allows, never on a node named in `avoid`.

    `tier`: the tier of the job it runs ("": the job has none), labelled and passed to the
    worker; `placement`: its pools, node selector and tolerations (None: `config`'s, on
    the offline pool first, then lent mixed nodes).

    `own_credentials`: the worker connects to NATS with a credential of its own, read from
    the Secret `credentials_secret_name(pod name)` (mounted, never in the environment: any
    reader of pods would see it there), which the controller creates once the pod exists;
    the kubelet starts the container once it does. Otherwise: `config.nats_secret`."""
    c = config
    name = pod_name(worker_id)
    requests = {"cpu": f"{shape['cpu']:g}", "memory": f"{int(shape['memory'])}"}
    limits = {"memory": requests["memory"]}
    if shape.get(c.gpu_resource):
        # An extended resource is asked as a limit (its request defaults to it).
        limits[c.gpu_resource] = f"{int(shape[c.gpu_resource])}"
    labels = {**c.labels, APP_LABEL: APP, JOB_LABEL: job, WORKER_LABEL: name}
    if tier:
        labels[TIER_LABEL] = tier
    metadata: Obj = {"name": name, "namespace": c.namespace, "labels": labels}
    if c.owner:
        metadata["ownerReferences"] = [{**c.owner, "controller": True}]
    if c.metrics_port is not None:
        metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(c.metrics_port),
        }
    container: Obj = {
        "name": "worker",
        "image": c.image or DEFAULT_IMAGE,
        "imagePullPolicy": c.image_pull_policy,
        "command": ["python", "-m", "ebb.worker", *(["--tier", tier] if tier else [])],
        "env": _environment(
            job, c, name, env or {}, own_credentials=own_credentials, cpus=shape["cpu"]
        ),
        "envFrom": [{"secretRef": {"name": s, "optional": True}} for s in c.env_from_secrets],
        "resources": {"requests": requests, "limits": limits},
        # The worker writes why it gave up there; a crash without a word leaves the tail of
        # its log instead. Either way the controller can say why.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # The Pod Security "restricted" level: workers run user code.
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        # Stage processes hand tensors over in shared memory; a container's own /dev/shm is
        # 64 MiB, too little for a batch of images.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],  # noqa: S108 - a mount point
    }
    volumes: list[Obj] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if own_credentials:
        container["volumeMounts"].append(
            {"name": _CREDENTIALS_VOLUME, "mountPath": CREDENTIALS_DIR, "readOnly": True}
        )
        secret = {"secretName": credentials_secret_name(name)}
        volumes.append({"name": _CREDENTIALS_VOLUME, "secret": secret})
    if c.metrics_port is not None:
        container["ports"] = [{"name": "metrics", "containerPort": c.metrics_port}]
    where = placement if placement is not None else pod_placement(c)
    spec: Obj = {
        "restartPolicy": "Never",  # we relaunch, knowing why it ended
        "terminationGracePeriodSeconds": c.grace_s,
        "affinity": {"nodeAffinity": node_affinity(c.pool_label, where.pool, sorted(avoid))},
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    if where.tolerations:
        spec["tolerations"] = [dict(t) for t in where.tolerations]
    if where.node_selector:
        spec["nodeSelector"] = dict(where.node_selector)
    if c.service_account:
        spec["serviceAccountName"] = c.service_account
    if c.priority_class:
        spec["priorityClassName"] = c.priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _environment(
    job: str,
    c: KubeConfig,
    name: str,
    extra: Mapping[str, str],
    *,
    own_credentials: bool,
    cpus: float,
) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": envvars.JOB, "value": job},
        {"name": envvars.WORKER_ID, "value": name},
        # The cores it asked for: with no CPU limit (so that it may burst into idle cores)
        # no quota tells its runtimes, which would start a thread per core of the node.
        {"name": envvars.CPUS, "value": f"{cpus:g}"},
        {"name": envvars.NATS_URL, "value": c.nats.url},
        {"name": envvars.PREFIX, "value": c.nats.prefix},
        # Leave the drain a margin inside the pod's grace period.
        {"name": envvars.SHUTDOWN_GRACE_S, "value": str(max(1, c.grace_s - 10))},
        *({"name": k, "value": v} for k, v in {**c.env, **extra}.items()),
    ]
    if c.metrics_port is not None:
        env.append({"name": envvars.METRICS_PORT, "value": str(c.metrics_port)})
    if c.model_cache_url is not None:
        env.append({"name": envvars.MODEL_CACHE_URL, "value": c.model_cache_url})
    if own_credentials:
        creds = f"{CREDENTIALS_DIR}/{CREDENTIALS_KEY}"
        env.append({"name": envvars.NATS_CREDS, "value": creds})
    elif c.nats_secret:
        for key, var in (
            ("user", envvars.NATS_USER),
            ("password", envvars.NATS_PASSWORD),
            ("token", envvars.NATS_TOKEN),
        ):
            ref = {"name": c.nats_secret, "key": key, "optional": True}
            env.append({"name": var, "valueFrom": {"secretKeyRef": ref}})
    return env


def node_affinity(pool_label: str, mode: PoolMode, avoid: list[str]) -> Obj:
    """The pools pods placed in `mode` may run on (ebb.controller.policy.pools), required: the
    offline pool, and, unless `offline`, mixed nodes lent to batch work (tidal state `offline`); the
    pool they go to first, preferred; never a node in `avoid`."""
    offline = {"key": pool_label, "operator": "In", "values": [OFFLINE]}
    mixed = {"key": pool_label, "operator": "In", "values": [MIXED]}
    lent = {"key": TIDAL, "operator": "In", "values": ["offline"]}
    terms: list[Obj] = [{"matchExpressions": [offline]}]
    if mode != "offline":
        terms.append({"matchExpressions": [mixed, lent]})
    if avoid:
        fields = [{"key": "metadata.name", "operator": "NotIn", "values": avoid}]
        for term in terms:
            term["matchFields"] = fields
    affinity: Obj = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
    if mode != "offline":
        first = offline if preferred(mode) == OFFLINE else mixed
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": 100, "preference": {"matchExpressions": [first]}}
        ]
    return affinity
