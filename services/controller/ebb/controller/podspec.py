"""A worker's pod, as a pure function of what it is for: no cluster, no clock, no state."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ebb.common import envvars

from .capacity import Resources
from .informer import Obj
from .kube_settings import KubeConfig
from .tidal import LABEL as TIDAL

APP = "ebb-worker"
APP_LABEL = "app.kubernetes.io/name"
JOB_LABEL = "ebb.io/job"
WORKER_LABEL = "ebb.io/worker"
DEFAULT_IMAGE = "ebb:latest"


def pod_name(worker_id: str) -> str:
    """A worker id as a pod name (DNS-1123: lower case, digits and '-', 63 at most)."""
    name = re.sub(r"[^a-z0-9-]+", "-", worker_id.lower()).strip("-")
    return (name[:63].rstrip("-")) or "ebb-worker"


def worker_pod(
    job: str,
    config: KubeConfig,
    *,
    worker_id: str,
    shape: Resources,
    avoid: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Obj:
    """The pod of worker `worker_id` of job `job`: requests `shape`, runs `config.image`,
    on the offline pool or a lent mixed node, never on a node named in `avoid`."""
    c = config
    name = pod_name(worker_id)
    requests = {"cpu": f"{shape['cpu']:g}", "memory": f"{int(shape['memory'])}"}
    limits = {"memory": requests["memory"]}
    if shape.get("nvidia.com/gpu"):
        limits["nvidia.com/gpu"] = f"{int(shape['nvidia.com/gpu'])}"
    metadata: Obj = {
        "name": name,
        "namespace": c.namespace,
        "labels": {**c.labels, APP_LABEL: APP, JOB_LABEL: job, WORKER_LABEL: name},
    }
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
        "command": ["python", "-m", "ebb.worker"],
        "env": _environment(job, c, name, env or {}),
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
    if c.metrics_port is not None:
        container["ports"] = [{"name": "metrics", "containerPort": c.metrics_port}]
    spec: Obj = {
        "restartPolicy": "Never",  # we relaunch, knowing why it ended
        "terminationGracePeriodSeconds": c.grace_s,
        "affinity": {"nodeAffinity": _node_affinity(c.pool_label, sorted(avoid))},
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if c.tolerations:
        spec["tolerations"] = [dict(t) for t in c.tolerations]
    if c.node_selector:
        spec["nodeSelector"] = dict(c.node_selector)
    if c.service_account:
        spec["serviceAccountName"] = c.service_account
    if c.priority_class:
        spec["priorityClassName"] = c.priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _environment(
    job: str, c: KubeConfig, name: str, extra: Mapping[str, str]
) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": envvars.JOB, "value": job},
        {"name": envvars.WORKER_ID, "value": name},
        {"name": envvars.NATS_URL, "value": c.nats.url},
        {"name": envvars.PREFIX, "value": c.nats.prefix},
        # Leave the drain a margin inside the pod's grace period.
        {"name": envvars.SHUTDOWN_GRACE_S, "value": str(max(1, c.grace_s - 10))},
        *({"name": k, "value": v} for k, v in {**c.env, **extra}.items()),
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
    return env


def _node_affinity(pool: str, avoid: list[str]) -> Obj:
    """The offline pool, or a mixed node lent to batch work (preferring the offline pool,
    where no reclaim evicts it); never a node in `avoid`."""
    offline = {"key": pool, "operator": "In", "values": ["offline"]}
    terms: list[Obj] = [
        {"matchExpressions": [offline]},
        {
            "matchExpressions": [
                {"key": pool, "operator": "In", "values": ["mixed"]},
                {"key": TIDAL, "operator": "In", "values": ["offline"]},
            ]
        },
    ]
    if avoid:
        fields = [{"key": "metadata.name", "operator": "NotIn", "values": avoid}]
        for term in terms:
            term["matchFields"] = fields
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": {"matchExpressions": [offline]}}
        ],
    }
