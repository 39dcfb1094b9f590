"""The Kubernetes backend's settings: where and how worker pods run, and the tide."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ebb.common.messaging.natsconfig import NatsConfig

from ..policy.pools import PoolPolicy
from ..policy.tidal import TidalConfig
from .views import RESOURCES


@dataclass(frozen=True, kw_only=True)
class KubeConfig:
    namespace: str = "ebb"
    image: str = ""
    """Workers' image; empty: the one the controller's own pod runs, by digest (see
    `from_cluster`), so that a new release rolls workers forward with the controller and
    no worker runs an older or newer build than its controller."""
    image_pull_policy: str = "IfNotPresent"
    service_account: str | None = "ebb-worker"
    priority_class: str | None = None
    """priorityClassName of worker pods (a low one, so that online pods preempt them)."""
    nats: NatsConfig = field(default_factory=NatsConfig)
    """How workers reach NATS: its URL and subject prefix, nothing else of it. Their
    credentials: each worker pod's own, minted by a controller that has the workers'
    signing key (ebb.controller.kube.credentials); without one, `nats_secret`."""
    nats_secret: str | None = "ebb-nats-worker"  # noqa: S105 - the Secret's name
    """Read only by a controller without the workers' signing key: a Secret that all
    workers share, whose keys `user`, `password` and `token` (each optional, as is the
    Secret) become their NATS user, password and token. With the key, each pod mounts a
    Secret of its own instead and this one is not named. None: no shared Secret."""
    grace_s: int = 60
    """terminationGracePeriodSeconds: the time a worker has to drain on SIGTERM."""
    pool_label: str = "ebb.io/pool"
    pools: PoolPolicy = field(default_factory=PoolPolicy)
    """How a job that leaves its pool to us (`resources.pool: auto`) is placed: short jobs
    on lent mixed nodes first, long or often-reclaimed ones on the offline pool first."""
    gpu_type_label: str = "nvidia.com/gpu.product"
    """The node label whose value a job's `resources.gpu_type` must equal (the one NVIDIA's
    GPU feature discovery sets): its workers' pods select it."""
    online_selector: str = "ebb.io/workload=online"
    """Labels that mark online pods (whose load the tide follows)."""
    tidal: TidalConfig | None = field(default_factory=TidalConfig)
    """None: the mixed pool is never lent."""
    gpu_resource: str = "nvidia.com/gpu"
    """The extended resource a job's `resources.gpu` asks for (`amd.com/gpu` on AMD nodes;
    name it in `resources` too)."""
    resources: list[str] = field(default_factory=lambda: list(RESOURCES))
    """The resources capacity and the tide count: CPU, memory and NVIDIA GPUs, and any
    extended resource named here (`amd.com/gpu`, say) that workers or online pods ask for."""
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
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Workers' pod tolerations (Kubernetes' own form): onto tainted nodes, a GPU pool say."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels a worker's node must have, besides the pool (a GPU model, say); a job's
    `node_selector` (and a tier's, and its `gpu_type`) go over these, label by label."""
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    env_from_secrets: list[str] = field(default_factory=lambda: ["ebb-storage-worker"])
    """Secrets whose keys become workers' environment, if they exist: the workers' own
    object-store credentials (AWS_ACCESS_KEY_ID...), for fsspec to read inputs and write
    outputs. Never the master's (ebb-storage-master): workers run user code."""
    metrics_port: int | None = 9400
    """Workers serve /metrics here (annotated for Prometheus' pod discovery); None: not."""
    model_cache_url: str | None = "http://ebb-model-cache:8080"
    """The node model cache (k8s/base/model-cache.yaml: a DaemonSet behind a Service whose
    internalTrafficPolicy is Local, so that a worker reaches the one on its own node), from
    which workers copy their models; a worker whose node has none reads from the store. None:
    workers always read models from the store."""
