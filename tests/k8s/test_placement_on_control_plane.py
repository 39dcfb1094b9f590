"""Placement as kube-scheduler itself does it: the pods the controller makes for each job, on a
control plane built from Kubernetes' own code with simulated nodes. Where test_placement.py
checks what the controller writes into a pod (on the fake API server, whose own scheduler
is a sketch), these check where the real scheduler then puts it: preferred node affinity
(the pool a job goes to first), required node affinity (the pools it may use), nodeSelector
(its GPU type, the controller's and the job's labels), taints and tolerations, and the
extended resource GPUs are counted in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.policy.tidal import LABEL as TIDAL
from tests.controlplane import ControlPlane
from tests.controlplane.nodes import NodesThread
from tests.k8s.harness import NS, Harness
from tests.k8s.test_placement import A100, running, spec_of
from tests.scripted_master import ScriptedMaster

pytestmark = pytest.mark.timeout(180)

ALLOCATABLE = {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "4", "pods": "110"}


def _nodes(plane: ControlPlane, labels: dict[str, dict[str, str]]) -> NodesThread:
    """Simulated nodes for one test (deleted when it ends), each with ALLOCATABLE."""
    return NodesThread.simulated(plane, labels, allocatable=ALLOCATABLE)


async def _placed(h: Harness, job: str, count: int) -> list[dict[str, Any]]:
    """Reconcile until `count` pods of `job` are bound to nodes by the scheduler."""

    def bound() -> list[dict[str, Any]] | None:
        pods = h.pods(job)
        return pods if len(pods) == count and all(p["spec"].get("nodeName") for p in pods) else None

    found: list[dict[str, Any]] = await h.converge(bound, what=f"{count} pods placed", timeout=90)
    return found


@pytest.mark.parametrize(
    ("pool", "lands_on"),
    [("offline", "off-0"), ("any", "off-0"), ("mixed", "mix-0"), ("online", "off-0")],
)
async def test_kube_scheduler_puts_a_jobs_pods_on_the_pool_it_asks_for_first(
    plane: ControlPlane,
    scripted: ScriptedMaster,
    nc: NATS,
    nats_config: NatsConfig,
    tmp_path: Path,
    pool: str,
    lands_on: str,
) -> None:
    """An offline node and a mixed one the tide lent, both with room for every pod: the
    scheduler follows the pool the job asks for (its pods' preferred node affinity), and
    never puts an offline-only job on the mixed node (required)."""
    job = f"placed-{pool}"
    scripted.set(running(spec_of(tmp_path / "job", pool=pool), todo=40, job=job))
    with _nodes(
        plane,
        {"off-0": {"ebb.io/pool": "offline"}, "mix-0": {"ebb.io/pool": "mixed", TIDAL: "offline"}},
    ):
        async with plane.api_client() as api:
            h = Harness(api, nats_config, nc, tidal=None)
            try:
                pods = await _placed(h, job, 2)
            finally:
                await h.close()
    assert {p["spec"]["nodeName"] for p in pods} == {lands_on}


async def test_kube_scheduler_puts_gpu_pods_on_their_gpu_type_past_a_taint_they_tolerate(
    plane: ControlPlane,
    scripted: ScriptedMaster,
    nc: NATS,
    nats_config: NatsConfig,
    tmp_path: Path,
) -> None:
    """Two GPU nodes alike but for their GPU type; the job's type tainted `dedicated`, which
    the job tolerates: its pods go there (nodeSelector: the controller's labels, the job's,
    its GPU type), each counted against the node's `nvidia.com/gpu`. Two of two GPUs fill its
    four: the controller makes no third, as the scheduler would find no room for it."""
    label = "example.io/gpu-model"  # the controller's setting, not the default
    common = {"ebb.io/pool": "offline", "zone": "a", "disk": "ssd", "team": "search"}
    job = "placed-gpu"
    spec = spec_of(tmp_path / "job", workers=3, gpu=2, gpu_type=A100)
    spec["node_selector"] = {"zone": "a", "team": "search"}
    spec["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    scripted.set(running(spec, todo=40, job=job))
    with _nodes(plane, {"t4-0": {**common, label: "Tesla-T4"}, "a100-0": {**common, label: A100}}):
        plane.kubectl("taint", "node", "a100-0", "dedicated=inference:NoSchedule")
        async with plane.api_client() as api:
            h = Harness(
                api,
                nats_config,
                nc,
                tidal=None,
                node_selector={"disk": "ssd"},
                gpu_type_label=label,
            )
            try:
                pods = await _placed(h, job, 2)
                # The capacity the controller counts agrees with the scheduler's: no third pod
                # is made for a node with no GPU left.
                await h.reconciler.reconcile_once()
                assert len(h.pods(job)) == 2
            finally:
                await h.close()
    for pod in pods:
        assert pod["spec"]["nodeName"] == "a100-0"
        assert pod["spec"]["nodeSelector"] == {
            "zone": "a",
            "disk": "ssd",
            "team": "search",
            label: A100,
        }
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"


@pytest.fixture
def plane(workers_plane: ControlPlane) -> ControlPlane:
    return workers_plane


@pytest.fixture(autouse=True)
def _no_worker_pods_left(plane: ControlPlane) -> Iterator[None]:
    """Each test's worker pods removed after it (their nodes are gone with it)."""
    yield
    plane.kubectl(
        "-n", NS, "delete", "pods", "-l", "app.kubernetes.io/name=ebb-worker",
        "--grace-period=0", "--force", check=False,
    )  # fmt: skip
