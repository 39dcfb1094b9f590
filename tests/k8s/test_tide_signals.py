"""What the tide reads as online demand and as capacity (fake API server, real controller and
master): only online pods the scheduler found no room for, that a mixed node could take,
call a lent node back; a cordoned or NotReady node is neither lent nor counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from ebb.client.sdk import EbbClient
from ebb.controller.kube.harvest import TidalHarvester
from ebb.controller.kube.views import PodView
from ebb.controller.policy.tidal import TidalConfig
from tests.helpers import wait_until
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.harness import Harness, offline, submit, tidal_state

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("controllers_rbac")]

MIXED = ("mix-0", "mix-1", "mix-2")
SAMPLE_S = 0.05


def mixed_nodes(kube: FakeKubeAPI) -> None:
    for name in MIXED:
        kube.add_node(
            name,
            labels={"ebb.io/pool": "mixed"},
            allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"},
        )


def threshold_tide() -> TidalConfig:
    return TidalConfig(
        policy="threshold",
        sample_s=SAMPLE_S,
        window=3,
        cooldown_s=60.0,
        lend_below=0.45,
        reclaim_above=0.7,
    )


def harvester(h: Harness) -> TidalHarvester:
    assert h.backend.harvester is not None
    return h.backend.harvester


async def samples(h: Harness, n: int) -> None:
    """Until the tide has taken `n` more samples."""
    tide = harvester(h)
    start = tide.last_sample or 0.0
    await wait_until(
        lambda: (tide.last_sample or 0.0) >= start + n * SAMPLE_S,
        what=f"{n} samples of the tide",
    )


def condition(kube: FakeKubeAPI, pod: str) -> tuple[str, str]:
    found = kube.get_pod(pod, "default") or {}
    for c in (found.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled":
            return c.get("status", ""), c.get("reason", "")
    return "", ""


async def test_cordoned_and_not_ready_mixed_nodes_are_neither_lent_nor_counted(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0", cpu="4")
    mixed_nodes(kube)
    kube.add_node(
        "mix-cordoned",
        labels={"ebb.io/pool": "mixed"},
        allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"},
        unschedulable=True,
    )
    kube.add_node(
        "mix-down",
        labels={"ebb.io/pool": "mixed"},
        allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"},
        ready=False,
    )
    await submit(ebb, tmp_path / "job", workers=20, cpu=2)
    h = harness_factory(tidal=threshold_tide())
    await h.converge(
        lambda: sum(tidal_state(kube, n) == "offline" for n in MIXED) == 2,
        what="two mixed nodes lent",
    )
    await samples(h, 10)
    assert tidal_state(kube, "mix-cordoned") in (None, "online")
    assert tidal_state(kube, "mix-down") in (None, "online")
    # What is lent is what the two lent nodes have: nothing of the others.
    assert REGISTRY.get_sample_value("ebb_tidal_lent", {"resource": "cpu"}) == 16.0
    pool = harvester(h).mixed_pool()
    assert pool.capacity()["cpu"] == 24.0


async def test_a_pod_drained_twice_on_a_lagging_cache_counts_once(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    """A sample whose cache has not seen the deletion yet drains the pod again: it is deleted
    and counted against its job (reclaims_to_offline) once."""
    offline(kube, "off-0", cpu="4")
    job = await submit(ebb, tmp_path / "job", workers=2, cpu=2)
    h = harness_factory(tidal=threshold_tide())
    await h.converge(lambda: len(h.pods(job)) == 2, what="two workers")
    pod = PodView(h.pods(job)[0])  # as the cache saw it before the deletion
    tide = harvester(h)
    evictions = REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0.0
    await tide._drain(pod)
    await tide._drain(pod)
    assert tide.reclaimed[job] == 1
    assert (REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0.0) == evictions + 1
