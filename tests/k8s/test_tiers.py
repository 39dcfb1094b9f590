"""Tiers of a job scaled apart on the fake API server, through the real kubernetes-asyncio
client: a CPU tier on CPU nodes, a GPU tier on tainted GPU nodes, each pod with the resources,
node selector, tolerations, label and `--tier` of its own tier.

The master's answers come from tests/scripted_master.py over a real nats-server: each tier's
backlog and back-pressure are the test's to set, pass by pass.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY

from ebb.common import envvars
from ebb.common.job import parse_job
from ebb.common.messaging.messages import JobStatus, TierStatus
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.kube.backend import KubeConfig
from ebb.controller.kube.placement import Placement, tolerated
from ebb.controller.kube.podspec import TIER_LABEL, pod_placement, worker_pod
from tests.helpers import job_spec
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.harness import Harness, offline
from tests.scripted_master import ScriptedMaster

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("controllers_rbac")]

JOB = "tiered"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture
async def harness(
    kube: FakeKubeAPI, nats_config: NatsConfig, nc: NATS, scripted: ScriptedMaster
) -> AsyncIterator[Harness]:
    del scripted  # answering before the first pass
    h = Harness(kube, nats_config, nc, tidal=None)
    yield h
    await h.close()


def cluster(kube: FakeKubeAPI) -> None:
    """4 CPU nodes of 8 cores; 2 GPU nodes of 4 cores and a GPU each, tainted for GPU pods."""
    for n in range(4):
        offline(kube, f"cpu-{n}", labels={"pool": "cpu"})
    for n in range(2):
        kube.add_node(
            f"gpu-{n}",
            labels={"ebb.io/pool": "offline", "pool": "gpu"},
            allocatable={"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1", "pods": "110"},
            taints=[GPU_TAINT],
        )


def tiered_spec(folder: Path) -> dict[str, Any]:
    """Decoding on CPU pods (2 cores each, up to 40), the model on GPU pods (up to 4)."""
    stages: list[dict[str, Any]] = [
        {
            "name": "decode",
            "modelet": "ebb.worker.modelets:Features",
            "params": {"columns": ["features"]},
        },
        {"name": "model", "model": str(folder / "model.onnx")},
    ]
    spec = job_spec(folder, stages=stages, workers=(1, 40))
    spec["id"] = JOB
    spec["tiers"] = [
        {
            "name": "cpu",
            "stages": ["decode"],
            "resources": {"min_workers": 1, "max_workers": 40, "cpu": 2, "memory_gb": 2},
            "node_selector": {"pool": "cpu"},
        },
        {
            "name": "gpu",
            "stages": ["model"],
            "resources": {"min_workers": 1, "max_workers": 4, "cpu": 2, "memory_gb": 8, "gpu": 1},
            "node_selector": {"pool": "gpu"},
            "tolerations": [GPU_TOLERATION],
        },
    ]
    return spec


def status(
    spec: dict[str, Any], *, cpu: dict[str, int], gpu: dict[str, int], cpu_held: bool = False
) -> JobStatus:
    """The job as the master tells it: each tier's shards, the first held back or not."""
    shards = {s: cpu.get(s, 0) + gpu.get(s, 0) for s in ("TODO", "DOING", "DONE")}
    return JobStatus(
        id=JOB,
        name=JOB,
        state="RUNNING",
        shards=shards,
        min_workers=1,
        max_workers=40,
        spec=spec,
        tiers=[
            TierStatus(name="cpu", shards=cpu, held_back=cpu_held),
            TierStatus(name="gpu", shards=gpu),
        ],
    )


def of_tier(h: Harness, tier: str) -> list[dict[str, Any]]:
    return [p for p in h.pods(JOB) if p["metadata"]["labels"].get(TIER_LABEL) == tier]


def counts(h: Harness) -> tuple[int, int]:
    return len(of_tier(h, "cpu")), len(of_tier(h, "gpu"))


def desired(tier: str) -> float | None:
    return REGISTRY.get_sample_value("ebb_workers_desired", {"job_id": JOB, "tier": tier})


async def test_a_cpu_bound_tier_scales_out_on_cpu_nodes_while_the_gpu_tier_keeps_to_its_backlog(
    kube: FakeKubeAPI, scripted: ScriptedMaster, harness: Harness, tmp_path: Path
) -> None:
    cluster(kube)
    spec = tiered_spec(tmp_path)
    # Decoding has 100 shards to do; the model has none yet: it keeps its one worker waiting.
    scripted.set(status(spec, cpu={"TODO": 90, "DOING": 10}, gpu={}))
    h = harness
    # 4 CPU nodes x 8 cores, 2 cores a pod: 16. The GPU nodes' cores are not the CPU tier's.
    await h.converge(lambda: counts(h) == (16, 1), what="16 CPU-tier pods and 1 GPU-tier pod")
    await kube.wait_for(
        lambda: all(p["status"].get("phase") == "Running" for p in h.pods(JOB)), what="running"
    )
    assert {p["spec"]["nodeName"] for p in of_tier(h, "cpu")} == {f"cpu-{n}" for n in range(4)}
    assert of_tier(h, "gpu")[0]["spec"]["nodeName"] in {"gpu-0", "gpu-1"}
    assert (desired("cpu"), desired("gpu")) == (16.0, 1.0)

    cpu_pod, gpu_pod = of_tier(h, "cpu")[0], of_tier(h, "gpu")[0]
    cpu_box, gpu_box = cpu_pod["spec"]["containers"][0], gpu_pod["spec"]["containers"][0]
    assert cpu_box["command"] == ["python", "-m", "ebb.worker", "--tier", "cpu"]
    assert gpu_box["command"] == ["python", "-m", "ebb.worker", "--tier", "gpu"]
    assert cpu_box["resources"]["requests"] == {"cpu": "2", "memory": str(2 * 2**30)}
    assert "nvidia.com/gpu" not in cpu_box["resources"]["limits"]
    # The API server defaults a request from the GPU limit, as Kubernetes does.
    gpu_requests = {"cpu": "2", "memory": str(8 * 2**30), "nvidia.com/gpu": "1"}
    assert gpu_box["resources"]["requests"] == gpu_requests
    assert gpu_box["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert cpu_pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert gpu_pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert GPU_TOLERATION in gpu_pod["spec"]["tolerations"]
    assert GPU_TOLERATION not in cpu_pod["spec"].get("tolerations", [])
    # Each tier's fork server imports the runtimes of its own stages only.
    cpu_env = {e["name"]: e.get("value") for e in cpu_box["env"]}
    gpu_env = {e["name"]: e.get("value") for e in gpu_box["env"]}
    assert envvars.STAGE_PRELOAD not in cpu_env
    assert gpu_env[envvars.STAGE_PRELOAD] == "onnxruntime"
    assert (cpu_env[envvars.CPUS], gpu_env[envvars.CPUS]) == ("2", "2")

    # Hand-offs arrive for the model: 3 shards, but 2 GPUs in the cluster.
    scripted.set(status(spec, cpu={"TODO": 80, "DOING": 10, "DONE": 10}, gpu={"TODO": 3}))
    await h.converge(lambda: counts(h) == (16, 2), what="a second GPU-tier pod")
    assert {p["spec"]["nodeName"] for p in of_tier(h, "gpu")} == {"gpu-0", "gpu-1"}
    assert (desired("cpu"), desired("gpu")) == (16.0, 2.0)


async def test_a_held_back_tier_gets_no_more_workers_and_a_finished_one_none(
    kube: FakeKubeAPI, scripted: ScriptedMaster, harness: Harness, tmp_path: Path
) -> None:
    cluster(kube)
    spec = tiered_spec(tmp_path)
    scripted.set(status(spec, cpu={"TODO": 100}, gpu={"TODO": 2}))
    h = harness
    await h.converge(lambda: counts(h) == (16, 2), what="16 CPU-tier pods and 2 GPU-tier pods")
    # The hand-offs waiting for the GPU tier are at their bound: decoding is held back. A
    # new CPU node comes, and the held-back tier takes none of it.
    scripted.set(status(spec, cpu={"TODO": 80}, gpu={"TODO": 20}, cpu_held=True))
    offline(kube, "cpu-4", labels={"pool": "cpu"})
    await h.converge(lambda: len(h.backend.nodes.values()) == 7, what="the new node seen")
    decided = await h.reconciler.reconcile_once()
    assert decided.desired[f"{JOB}/cpu"] == 16 and counts(h) == (16, 2)
    # Released: the new node's room goes to it.
    scripted.set(status(spec, cpu={"TODO": 80}, gpu={"TODO": 20}))
    await h.converge(lambda: counts(h) == (20, 2), what="4 more CPU-tier pods")
    # Decoding is done: its pods are drained; the model's stay, its backlog still there.
    scripted.set(status(spec, cpu={"DONE": 100}, gpu={"TODO": 18, "DOING": 2}))
    await h.converge(lambda: counts(h) == (0, 2), what="the CPU tier drained")
    assert (desired("cpu"), desired("gpu")) == (0.0, 2.0)


def test_a_tiers_pod_carries_its_tier_over_the_controllers_placement(tmp_path: Path) -> None:
    config = KubeConfig(
        tidal=None,
        node_selector={"zone": "a", "pool": "any"},
        tolerations=[{"key": "batch", "operator": "Exists"}],
    )
    placement = pod_placement(config, parse_job(tiered_spec(tmp_path)), "gpu")
    pod = worker_pod(
        "job-1",
        config,
        worker_id="job-1-gpu-abc123",
        shape={"cpu": 2.0, "memory": 2.0**30, "nvidia.com/gpu": 1.0},
        tier="gpu",
        placement=placement,
    )
    assert pod["metadata"]["labels"][TIER_LABEL] == "gpu"
    assert pod["spec"]["containers"][0]["command"][-2:] == ["--tier", "gpu"]
    assert pod["spec"]["nodeSelector"] == {"zone": "a", "pool": "gpu"}  # the tier's wins
    assert pod["spec"]["tolerations"] == [{"key": "batch", "operator": "Exists"}, GPU_TOLERATION]
    # A job without tiers: no label, no flag, the controller's placement as it was.
    plain = worker_pod("job-1", config, worker_id="w", shape={"cpu": 1.0, "memory": 1.0})
    assert TIER_LABEL not in plain["metadata"]["labels"]
    assert plain["spec"]["containers"][0]["command"] == ["python", "-m", "ebb.worker"]
    assert plain["spec"]["nodeSelector"] == {"zone": "a", "pool": "any"}


@pytest.mark.parametrize(
    ("taint", "toleration", "tolerates"),
    [
        (GPU_TAINT, GPU_TOLERATION, True),
        (GPU_TAINT, {"key": "nvidia.com/gpu", "value": "present"}, True),  # any effect
        (GPU_TAINT, {"key": "nvidia.com/gpu", "value": "absent"}, False),
        (GPU_TAINT, {"operator": "Exists"}, True),  # every taint
        (GPU_TAINT, {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, False),
        (GPU_TAINT, {"key": "other", "operator": "Exists"}, False),
    ],
)
def test_tolerations_match_taints_as_the_scheduler_matches_them(
    taint: dict[str, str], toleration: dict[str, str], tolerates: bool
) -> None:
    assert tolerated(taint, [toleration]) is tolerates


def test_a_placement_admits_nodes_by_labels_and_the_taints_that_bar() -> None:
    gpu = Placement(node_selector={"pool": "gpu"}, tolerations=[GPU_TOLERATION])
    plain = Placement()
    gpu_labels = {"pool": "gpu"}
    assert gpu.admits(gpu_labels, [GPU_TAINT])
    assert not gpu.admits({"pool": "cpu"}, [])
    assert not plain.admits(gpu_labels, [GPU_TAINT])
    # PreferNoSchedule only discourages: the node may still take the pod.
    assert plain.admits(gpu_labels, [{**GPU_TAINT, "effect": "PreferNoSchedule"}])
