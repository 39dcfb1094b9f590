"""The tide on GPU nodes (fake API server, real controller and master): online GPU pods serving
models by day, batch GPU pods harvesting the GPUs they leave by night."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from ebb.client.sdk import EbbClient
from ebb.controller.policy.tidal import TidalConfig
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.fake_store import NODES as NODE_TYPE
from tests.k8s.fake_store import PODS, Change
from tests.k8s.harness import submit, tidal_state
from tests.k8s.test_kube_backend import running

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("controllers_rbac")]

GPU = "nvidia.com/gpu"
NODES = ("gpu-0", "gpu-1")


def gpu_nodes(kube: FakeKubeAPI, names: tuple[str, ...] = NODES) -> None:
    """Mixed nodes of 32 cores and 8 GPUs: by day they serve models."""
    for name in names:
        kube.add_node(
            name,
            labels={"ebb.io/pool": "mixed"},
            allocatable={"cpu": "32", "memory": "128Gi", GPU: "8", "pods": "110"},
        )


def serving(kube: FakeKubeAPI, names: list[str], *, gpus: int = 1, cpu: str = "2") -> None:
    """Online model servers: a few cores, mostly GPUs."""
    for name in names:
        kube.add_pod(
            {
                "metadata": {"name": name, "labels": {"ebb.io/workload": "online"}},
                "spec": {
                    "nodeSelector": {"ebb.io/pool": "mixed"},
                    "containers": [
                        {
                            "name": "serve",
                            "image": "serve",
                            "resources": {
                                "requests": {"cpu": cpu},
                                "limits": {GPU: str(gpus)},  # requests default to it
                            },
                        }
                    ],
                },
            },
            "default",
        )


def batch_gpus(h: Any, job: str) -> int:
    """GPUs the job's live pods hold on the mixed nodes."""
    return sum(
        int(c["resources"]["limits"].get(GPU, 0))
        for p in h.pods(job)
        if p["spec"].get("nodeName") in NODES
        for c in p["spec"]["containers"]
    )


def metric(name: str, resource: str = GPU) -> float:
    return REGISTRY.get_sample_value(name, {"resource": resource}) or 0.0


async def test_the_threshold_tide_sees_gpu_nodes_busy_by_their_gpus(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    nodes = ("gpu-0", "gpu-1", "gpu-2")
    gpu_nodes(kube, nodes)
    # Day: every GPU serves, on 6 of 96 cores. By the cores the pool would look idle.
    day = [f"serve-{n}" for n in range(6)]
    serving(kube, day, gpus=4, cpu="1")
    job = await submit(ebb, tmp_path / "job", workers=8, cpu=2, gpu=1)
    tide = TidalConfig(policy="threshold", sample_s=0.05, window=3, cooldown_s=0.0, lend_below=0.45)
    h = harness_factory(tidal=tide)
    lent: list[str] = []

    def note(change: Change) -> None:
        labels = change.obj["metadata"].get("labels") or {}
        if change.rt is NODE_TYPE and labels.get("ebb.io/tidal") in (
            "online2offline",
            "offline",
        ):
            lent.append(change.obj["metadata"]["name"])

    kube.store.subscribe(note)
    assert h.backend.harvester is not None
    harvester = h.backend.harvester
    samples: set[float] = set()

    def sampled() -> bool:
        if harvester.last_sample is not None:
            samples.add(harvester.last_sample)
        return len(samples) > 2 * tide.window

    await h.converge(lambda: running(kube, day) and sampled(), what="samples of a busy day")
    assert lent == []
    assert batch_gpus(h, job) == 0
    # Night: the servers go; the nodes are lent (one stays online) and batch pods take GPUs.
    for name in day:
        kube.store.remove(PODS, "default", name)
    await h.converge(
        lambda: (
            sum(tidal_state(kube, n) == "offline" for n in nodes) == 2 and batch_gpus(h, job) == 8
        ),
        what="2 GPU nodes lent and 8 batch GPU pods on them",
    )
