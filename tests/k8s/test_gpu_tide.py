"""The tide on GPU nodes (fake API server, real controller and master): online GPU pods serving
models by day, batch GPU pods harvesting the GPUs they leave by night."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from ebb.client.sdk import EbbClient
from ebb.controller.policy.tidal import TidalConfig
from tests.helpers import wait_until
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.fake_store import NODES as NODE_TYPE
from tests.k8s.fake_store import PODS, Change
from tests.k8s.harness import offline, submit, tidal_state
from tests.k8s.test_kube_backend import displaced_pods, running

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


async def test_the_tide_lends_idle_gpus_and_takes_them_back_for_online_gpu_pods(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0", cpu="4")  # CPU only: the GPU job's workers cannot go there
    gpu_nodes(kube)
    night = [f"serve-{n}" for n in range(2)]
    serving(kube, night)
    job = await submit(ebb, tmp_path / "job", workers=16, cpu=2, gpu=1)
    tide = TidalConfig(sample_s=0.05, lead_s=0.5, headroom=0.25, window=3, min_online=0)
    h = harness_factory(tidal=tide)
    hours_before = metric("ebb_tidal_harvested_node_hours_total")
    # Night: 2 of 16 GPUs serve; a quarter (4) kept free; the GPU budget (10) is batch work's,
    # though the online pods use only 4 of 64 cores: the budget is the GPUs'.
    await h.converge(
        lambda: batch_gpus(h, job) == 10 and running(kube, night),
        what="10 batch GPU pods on the lent GPU nodes",
    )
    assert all(tidal_state(kube, n) == "offline" for n in NODES)
    assert metric("ebb_tidal_budget") == 10
    assert metric("ebb_tidal_budget", "cpu") == 64 - 4 - 16
    await wait_until(
        lambda: metric("ebb_tidal_harvested_node_hours_total") > hours_before,
        what="GPU node-hours harvested",
    )
    displaced = displaced_pods(kube)
    # Morning: 8 more servers at once, 10 GPUs online; 10 + 10 > 16, and no forecast saw it:
    # the scheduler preempts batch pods for them, and they run at once.
    morning = [f"serve-{n}" for n in range(2, 10)]
    serving(kube, morning)
    await h.converge(lambda: running(kube, night + morning), what="the servers running")
    assert displaced["preempted"] >= 1
    # The tide follows: no more batch GPUs than the forecast leaves (16 - 10).
    await h.converge(lambda: batch_gpus(h, job) <= 6, what="batch GPUs within the forecast")
    # Noon: every GPU serves. Batch pods give them all back, and each server runs.
    noon = [f"serve-{n}" for n in range(10, 16)]
    serving(kube, noon)
    await h.converge(
        lambda: running(kube, night + morning + noon) and batch_gpus(h, job) == 0,
        what="every GPU serving",
    )
    assert metric("ebb_tidal_budget") == 0


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
