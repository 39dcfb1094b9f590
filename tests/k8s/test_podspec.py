"""A worker's pod as a pure function, against golden specs; the views; node avoidance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ebb.common import schema
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.kube.backend import KubeConfig
from ebb.controller.kube.podspec import credentials_secret_name, pod_name, worker_pod
from ebb.controller.kube.views import NodeView, PodView
from ebb.controller.policy.avoidance import NodeAvoidance
from ebb.controller.policy.capacity import Resources
from ebb.controller.policy.failures import Failure

from .manifests import find

GOLDEN = Path(__file__).parent / "golden"

CASES: dict[str, tuple[KubeConfig, Resources, list[str]]] = {
    "default": (KubeConfig(tidal=None), {"cpu": 2.0, "memory": 4.0 * 2**30}, []),
    "everything": (
        KubeConfig(
            namespace="batch",
            image="registry.example/ebb:1.2",
            image_pull_policy="Always",
            service_account=None,
            priority_class="ebb-batch",
            nats=NatsConfig(url="nats://nats.batch:4222", prefix="p2"),
            nats_secret=None,
            grace_s=120,
            pool_label="example.io/pool",
            tidal=None,
            owner={
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": "ebb-controller",
                "uid": "u-1",
            },
            labels={"team": "search"},
            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            node_selector={"nvidia.com/gpu.product": "H100"},
            env={"HF_HOME": "/cache"},
            env_from_secrets=["s3", "gcs"],
            metrics_port=None,
            model_cache_url="http://model-cache.batch:8080",
        ),
        {"cpu": 0.5, "memory": 1.5 * 2**30, "nvidia.com/gpu": 1.0},
        ["node-b", "node-a"],
    ),
}


def test_a_worker_pod_with_a_credential_of_its_own_is_its_golden_spec() -> None:
    """It mounts its own credentials Secret and names the file; no shared Secret, nothing
    secret in its environment."""
    config, shape, avoid = CASES["default"]
    pod = worker_pod(
        "job-7f3a",
        config,
        worker_id="Worker_7F3A.host-1",
        shape=shape,
        avoid=avoid,
        own_credentials=True,
    )
    golden = json.loads((GOLDEN / "worker_pod_own_credentials.json").read_text())
    assert pod == golden
    assert _secrets_read(pod["spec"]) == {"ebb-storage-worker", "worker-7f3a-host-1-nats"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_worker_pod_is_its_golden_spec(case: str) -> None:
    config, shape, avoid = CASES[case]
    pod = worker_pod("job-7f3a", config, worker_id="Worker_7F3A.host-1", shape=shape, avoid=avoid)
    golden = json.loads((GOLDEN / f"worker_pod_{case}.json").read_text())
    assert pod == golden
    # Pure: the same arguments give the same pod, and the arguments are left as they were.
    assert worker_pod(
        "job-7f3a", config, worker_id="Worker_7F3A.host-1", shape=shape, avoid=avoid
    ) == json.loads(json.dumps(pod))
    assert avoid == CASES[case][2]


def test_workers_find_the_node_model_cache_the_base_deploys_unless_told_not_to() -> None:
    def env(config: KubeConfig) -> dict[str, str]:
        pod = worker_pod("j", config, worker_id="w", shape={"cpu": 1.0, "memory": 1.0})
        return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}

    url = env(KubeConfig(tidal=None))["EBB_MODEL_CACHE_URL"]
    service = find("Service", "ebb-model-cache")
    assert url == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert "EBB_MODEL_CACHE_URL" not in env(KubeConfig(tidal=None, model_cache_url=None))


def test_the_pod_names_its_worker_as_a_pod_name_may_be_spelled() -> None:
    assert pod_name("Worker_7F3A.host-1") == "worker-7f3a-host-1"
    assert pod_name("x" * 70 + "-y") == "x" * 63
    assert pod_name("__") == "ebb-worker"


def test_views_answer_for_fields_the_api_left_out() -> None:
    bare = PodView({})
    assert (bare.name, bare.node, bare.phase, bare.requests()) == ("", "", "Pending", {})
    assert (bare.meta.labels, bare.meta.deleting, bare.meta.created) == ({}, False, "")
    pod = PodView(
        {
            "metadata": {
                "name": "p",
                "labels": {"a": "b"},
                "deletionTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {
                "nodeName": "n1",
                "containers": [
                    {"resources": {"requests": {"cpu": "500m", "ephemeral-storage": "1Gi"}}},
                    {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
                    {},
                ],
            },
            "status": {"phase": "Running"},
        }
    )
    assert (pod.name, pod.node, pod.phase, pod.meta.deleting) == ("p", "n1", "Running", True)
    assert pod.requests() == {"cpu": 1.5, "memory": 2.0**30}
    assert NodeView({}).ready is False
    assert NodeView({}).cpu(default=1.0) == 1.0
    node = {
        "metadata": {"name": "n1"},
        "status": {
            "allocatable": {"cpu": "4", "memory": "8Gi"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    assert NodeView(node).ready and NodeView(node).cpu(default=1.0) == 4.0
    assert not NodeView({**node, "spec": {"unschedulable": True}}).ready


def test_a_node_is_avoided_after_failures_within_the_window_and_only_for_a_while() -> None:
    avoidance = NodeAvoidance(after=2, window_s=10.0, for_s=100.0)
    crash = Failure("crash", "exit code 1")
    avoidance.note_failure(pod_uid="a", node="n1", failure=crash, now=0.0)
    avoidance.note_failure(pod_uid="a", node="n1", failure=crash, now=1.0)  # the same pod
    evicted = Failure("capacity", "Evicted")
    avoidance.note_failure(pod_uid="b", node="n1", failure=evicted, now=2.0)  # not the node's
    avoidance.note_failure(pod_uid="c", node="", failure=crash, now=2.0)  # never scheduled
    assert avoidance.avoided(3.0) == []
    avoidance.note_failure(pod_uid="d", node="n1", failure=crash, now=20.0)  # window passed
    assert avoidance.avoided(21.0) == []
    avoidance.note_failure(pod_uid="e", node="n1", failure=None, now=25.0)
    assert avoidance.avoided(26.0) == ["n1"]
    assert avoidance.avoids("n1", 124.9) and not avoidance.avoids("n1", 125.0)
    assert not avoidance.avoids("n2", 26.0)


def _secrets_read(pod_spec: dict[str, Any]) -> set[str]:
    """Every Secret a pod's containers read, through envFrom, env or a volume."""
    names: set[str] = {
        v["secret"]["secretName"] for v in pod_spec.get("volumes") or [] if "secret" in v
    }
    for c in pod_spec["containers"]:
        names |= {s["secretRef"]["name"] for s in c.get("envFrom") or [] if "secretRef" in s}
        for e in c.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
    return names


def test_workers_get_their_own_storage_credentials_never_the_masters() -> None:
    """k8s/base as deployed: the controller's configuration decides the Secrets worker pods
    read; the master reads its own, which no worker pod is given."""
    text = find("ConfigMap", "ebb-controller-config")["data"]["controller.yaml"]
    config = schema.load(KubeConfig, yaml.safe_load(text))
    pod = worker_pod(
        "job-1",
        config,
        worker_id="w-1",
        shape={"cpu": 1.0, "memory": 2**30},
        avoid=[],
        own_credentials=True,  # the deployed controller has the workers' signing key
    )
    worker_secrets = _secrets_read(pod["spec"])
    master = find("Deployment", "ebb-master")["spec"]["template"]["spec"]
    master_storage = {s["secretRef"]["name"] for s in master["containers"][0]["envFrom"]}
    assert master_storage == {"ebb-storage-master"}
    assert worker_secrets == {"ebb-storage-worker", credentials_secret_name("w-1")}
    assert not worker_secrets & _secrets_read(master)
    controller = find("Deployment", "ebb-controller")["spec"]["template"]["spec"]
    assert not worker_secrets & _secrets_read(controller)


def test_the_configuration_names_the_secrets_workers_get() -> None:
    config = KubeConfig(tidal=None, env_from_secrets=["team-a-storage"], nats_secret=None)
    pod = worker_pod(
        "job-1", config, worker_id="w-1", shape={"cpu": 1.0, "memory": 2**30}, avoid=[]
    )
    (container,) = pod["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": "team-a-storage", "optional": True}}]
    assert _secrets_read(pod["spec"]) == {"team-a-storage"}


def test_a_gpu_worker_asks_for_the_gpu_resource_the_controller_names() -> None:
    nats = NatsConfig(url="nats://ebb-nats:4222")
    shape: Resources = {"cpu": 4.0, "memory": 8.0 * 2**30, "amd.com/gpu": 2.0}
    amd = KubeConfig(nats=nats, gpu_resource="amd.com/gpu")
    limits = worker_pod("j", amd, worker_id="w", shape=shape)["spec"]["containers"][0]["resources"][
        "limits"
    ]
    assert limits == {"memory": str(8 * 2**30), "amd.com/gpu": "2"}
    # On the default config that shape asks for no NVIDIA GPU it does not name.
    nvidia = worker_pod("j", KubeConfig(nats=nats), worker_id="w", shape=shape)
    assert "nvidia.com/gpu" not in nvidia["spec"]["containers"][0]["resources"]["limits"]
