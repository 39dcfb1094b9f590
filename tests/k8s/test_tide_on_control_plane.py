"""The tide's signals as kube-scheduler itself gives them, on a control plane built from
Kubernetes' own code with simulated nodes (test_tide_signals.py has the same on the fake API
server, whose scheduler is a sketch). An online pod calls a lent node back only if the
scheduler found no room for it that a mixed node could give: not one held by a scheduling
gate (SchedulingGated), nor one whose nodeSelector no mixed node meets, nor one waiting for
its volume's claim to bind (Unschedulable all the same, told apart by the scheduler's own
message), and one the mixed pool's room would place does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY

from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.backend import WorkerInfo
from ebb.controller.policy.failures import preempted
from ebb.controller.policy.tidal import LABEL as TIDAL
from ebb.controller.policy.tidal import TidalConfig
from tests.controlplane import ControlPlane
from tests.controlplane.nodes import NodesThread
from tests.helpers import wait_until
from tests.k8s.harness import NS, Harness
from tests.k8s.test_placement import running as running_job
from tests.k8s.test_placement import spec_of
from tests.k8s.test_tide_signals import harvester, samples, threshold_tide
from tests.scripted_master import ScriptedMaster

pytestmark = pytest.mark.timeout(240)

MIXED = ("mix-0", "mix-1", "mix-2")
ONLINE_NS = "default"


def _allocatable(cpu: str) -> dict[str, str]:
    return {"cpu": cpu, "memory": "32Gi", "pods": "110"}


@pytest.fixture(autouse=True)
def _nothing_left(workers_plane: ControlPlane) -> Iterator[None]:
    """Each test's worker pods, online pods and claims removed after it."""
    yield
    workers_plane.kubectl(
        "-n", NS, "delete", "pods", "-l", "app.kubernetes.io/name=ebb-worker",
        "--grace-period=0", "--force", "--wait=false", check=False,
    )  # fmt: skip
    workers_plane.kubectl(
        "-n", ONLINE_NS, "delete", "pods,pvc", "--all", "--grace-period=0", "--force",
        "--wait=false", check=False,
    )  # fmt: skip


@pytest.fixture
def nodes(workers_plane: ControlPlane) -> Iterator[None]:
    """An offline node of 4 cores and three mixed ones of 8, as test_tide_signals.py's."""
    offline = {"off-0": {"ebb.io/pool": "offline"}}
    mixed = {n: {"ebb.io/pool": "mixed"} for n in MIXED}
    with (
        NodesThread.simulated(workers_plane, offline, allocatable=_allocatable("4")),
        NodesThread.simulated(workers_plane, mixed, allocatable=_allocatable("8")),
    ):
        yield


@pytest.fixture
async def api(workers_plane: ControlPlane) -> AsyncIterator[ApiClient]:
    async with workers_plane.api_client() as client:
        yield client


def lent(h: Harness) -> set[str]:
    """The mixed nodes lent to batch work, as the controller's informer sees them."""
    return {
        node["metadata"]["name"]
        for node in h.backend.nodes.items.values()
        if (node["metadata"].get("labels") or {}).get(TIDAL) == "offline"
    }


async def online_pod(core: Any, name: str, cpu: str, **spec: Any) -> None:
    """An online pod for the mixed pool asking for `cpu` cores; `spec`: more of its spec."""
    await core.create_namespaced_pod(
        ONLINE_NS,
        {
            "metadata": {"name": name, "labels": {"ebb.io/workload": "online"}},
            "spec": {
                "nodeSelector": {"ebb.io/pool": "mixed"},
                "containers": [
                    {"name": "web", "image": "web", "resources": {"requests": {"cpu": cpu}}}
                ],
                **spec,
            },
        },
    )


async def scheduled(core: Any, name: str) -> tuple[str, str, str]:
    """The pod's PodScheduled condition: status, reason and message, as the scheduler set
    them ("" while it has none)."""
    pod = await core.read_namespaced_pod(name, ONLINE_NS)
    for c in pod.status.conditions or []:
        if c.type == "PodScheduled":
            return c.status or "", c.reason or "", c.message or ""
    return "", "", ""


async def wait_scheduled(core: Any, name: str, reason: str) -> str:
    """Until the scheduler has said `reason` (False) of the pod; its message."""
    said: tuple[str, str, str] = ("", "", "")

    async def check() -> bool:
        nonlocal said
        said = await scheduled(core, name)
        return said[:2] == ("False", reason)

    await wait_until(check, what=f"the scheduler's {reason} for {name}", timeout=60)
    return said[2]


@pytest.mark.usefixtures("nodes")
async def test_only_online_pods_the_mixed_pools_room_would_place_call_a_lent_node_back(
    api: ApiClient,
    scripted: ScriptedMaster,
    nc: NATS,
    nats_config: NatsConfig,
    tmp_path: Path,
) -> None:
    core: Any = CoreV1Api(api)  # plain JSON maps: the stubs know only models
    job = "tide-signals"
    scripted.set(running_job(spec_of(tmp_path / "job", workers=20), todo=40, job=job))
    h = Harness(api, nats_config, nc, tidal=threshold_tide())
    try:
        await h.converge(lambda: len(lent(h)) == 2, what="two mixed nodes lent", timeout=90)
        before = lent(h)
        evictions = REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0.0
        reclaimed = harvester(h).reclaimed[job]

        # Held by a scheduling gate; pinned to a pool with no node; waiting for a claim that
        # no StorageClass will ever bind. The scheduler tries none of them in vain for lack
        # of room: no mixed node's room would place them.
        await online_pod(core, "gated", "6", schedulingGates=[{"name": "example.com/quota"}])
        await online_pod(core, "pinned", "6", nodeSelector={"ebb.io/pool": "online"})
        await core.create_namespaced_persistent_volume_claim(
            ONLINE_NS,
            {
                "metadata": {"name": "data"},
                "spec": {
                    "storageClassName": "none-such",
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        )
        await online_pod(
            core,
            "claiming",
            "6",
            volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        )
        await wait_scheduled(core, "gated", "SchedulingGated")
        await wait_scheduled(core, "pinned", "Unschedulable")
        message = await wait_scheduled(core, "claiming", "Unschedulable")
        assert "persistentvolumeclaim" in message.lower()  # what tells it apart
        await samples(h, 10)
        await h.converge(lambda: True, what="a reconcile pass")
        assert lent(h) == before
        assert (REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0.0) == evictions
        assert harvester(h).reclaimed[job] == reclaimed

        # One the mixed pool's room would place: that one calls a lent node back.
        await online_pod(core, "room", "6")
        await h.converge(
            lambda: bool(before - lent(h)),
            what="a lent node reclaimed for the pod that needs room",
            timeout=90,
        )
    finally:
        await h.close()


async def test_batch_pods_the_scheduler_preempts_for_an_online_pod_are_nobodys_fault(
    workers_plane: ControlPlane,
    api: ApiClient,
    scripted: ScriptedMaster,
    nc: NATS,
    nats_config: NatsConfig,
    tmp_path: Path,
) -> None:
    """A mixed node lent to batch work, full of a job's workers; an online pod (priority 0)
    that finds no other room: kube-scheduler preempts two batch pods (the `ebb-batch`
    PriorityClass of k8s/, -20), marks them `DisruptionTarget: PreemptionByScheduler`, deletes
    them with their grace period, and binds the online pod once they are gone. One drains and
    exits 0: a drain. The other is deleted by force while it drains (its node gone, or an
    operator in a hurry), leaving no end: lost to the cluster with the scheduler's reason,
    nobody's fault. Both count against the job's use of the mixed pool (its next pods go to
    the offline pool first)."""
    core: Any = CoreV1Api(api)
    job = "preempted"
    scripted.set(running_job(spec_of(tmp_path / "job", workers=4, pool="any"), todo=40, job=job))
    lent_node = {"mix-0": {"ebb.io/pool": "mixed", TIDAL: "offline"}}
    with NodesThread.simulated(
        workers_plane, lent_node, allocatable=_allocatable("8"), terminate_delay=5.0
    ):
        h = Harness(api, nats_config, nc, tidal=None)
        try:

            def four_placed() -> bool:
                pods = h.pods(job)
                return len(pods) == 4 and all(p["spec"].get("nodeName") for p in pods)

            await h.converge(four_placed, what="four workers on the lent node", timeout=90)
            await online_pod(core, "surge", "4")

            def victims() -> list[str]:
                return sorted(
                    p["metadata"]["name"] for p in h.pods(job, alive=False) if preempted(p)
                )

            found = await wait_until(
                lambda: len(victims()) == 2 and victims(), what="two batch pods preempted"
            )
            forced, drained = found
            await core.delete_namespaced_pod(forced, NS, grace_period_seconds=0)
            reports: dict[str, WorkerInfo] = {}

            async def both_reported() -> bool:
                for w in await h.backend.observe():
                    if w.id in found and not w.alive and w.phase != "terminating":
                        reports[w.id] = w
                return len(reports) == 2

            await wait_until(both_reported, what="both preempted workers reported", timeout=60)

            async def bound() -> bool:
                pod = await core.read_namespaced_pod("surge", ONLINE_NS)
                return bool(pod.spec.node_name == "mix-0")

            await wait_until(bound, what="the online pod bound after preemption", timeout=90)
        finally:
            await h.close()
    lost = reports[forced]
    assert (lost.phase, lost.failure) == ("failed", "capacity")
    assert lost.reason.startswith("PreemptionByScheduler")
    assert (reports[drained].phase, reports[drained].drained) == ("succeeded", True)
    assert h.backend.placer.preempted[job] == 2


GPU = "nvidia.com/gpu"
GPU_NODES = ("gpu-0", "gpu-1")


async def serve(core: Any, names: list[str]) -> None:
    """Online model servers: 2 cores and a GPU each (the request defaults to the limit)."""
    for name in names:
        await core.create_namespaced_pod(
            ONLINE_NS,
            {
                "metadata": {"name": name, "labels": {"ebb.io/workload": "online"}},
                "spec": {
                    "nodeSelector": {"ebb.io/pool": "mixed"},
                    "containers": [
                        {
                            "name": "serve",
                            "image": "serve",
                            "resources": {"requests": {"cpu": "2"}, "limits": {GPU: "1"}},
                        }
                    ],
                },
            },
        )


def batch_gpus(h: Harness, job: str) -> int:
    """GPUs the job's live pods hold on the GPU nodes."""
    return sum(
        int(c["resources"]["limits"].get(GPU, 0))
        for p in h.pods(job)
        if p["spec"].get("nodeName") in GPU_NODES and not p["metadata"].get("deletionTimestamp")
        for c in p["spec"]["containers"]
    )


async def test_the_tide_lends_idle_gpus_and_the_scheduler_takes_them_back_for_servers(
    workers_plane: ControlPlane,
    api: ApiClient,
    scripted: ScriptedMaster,
    nc: NATS,
    nats_config: NatsConfig,
    tmp_path: Path,
) -> None:
    """test_gpu_tide.py's day on kube-scheduler: two mixed nodes of 8 GPUs serve models by
    day; by night the tide lends what they leave (a quarter kept free), and batch GPU pods
    take it. At a surge no forecast saw, the scheduler preempts batch pods for the servers,
    which run at once; the tide follows, and at noon every GPU serves."""
    core: Any = CoreV1Api(api)

    async def running(names: list[str]) -> bool:
        for name in names:
            pod = await core.read_namespaced_pod(name, ONLINE_NS)
            if pod.status.phase != "Running":
                return False
        return True

    job = "gpu-tide"
    scripted.set(running_job(spec_of(tmp_path / "job", workers=16, gpu=1), todo=40, job=job))
    offline = {"off-0": {"ebb.io/pool": "offline"}}  # CPU only: no GPU worker goes there
    gpus = {n: {"ebb.io/pool": "mixed"} for n in GPU_NODES}
    with (
        NodesThread.simulated(workers_plane, offline, allocatable=_allocatable("4")),
        NodesThread.simulated(
            workers_plane,
            gpus,
            allocatable={"cpu": "32", "memory": "128Gi", GPU: "8", "pods": "110"},
        ),
    ):
        night = [f"serve-{n}" for n in range(2)]
        await serve(core, night)
        tide = TidalConfig(sample_s=0.05, lead_s=0.5, headroom=0.25, window=3, min_online=0)
        h = Harness(api, nats_config, nc, tidal=tide)
        try:
            # Night: 2 of 16 GPUs serve, a quarter (4) kept free: 10 are batch work's.
            await h.converge(
                lambda: batch_gpus(h, job) == 10,
                what="10 batch GPU pods on the lent GPU nodes",
                timeout=90,
            )
            assert await running(night)
            assert lent(h) == set(GPU_NODES)
            # Morning: 8 more servers at once, 10 GPUs online: 10 + 10 > 16.
            morning = [f"serve-{n}" for n in range(2, 10)]
            await serve(core, morning)
            await h.converge(
                lambda: running(night + morning), what="the servers running", timeout=90
            )
            assert h.backend.placer.preempted[job] >= 1
            await h.converge(
                lambda: batch_gpus(h, job) <= 6, what="batch GPUs within the forecast", timeout=90
            )
            # Noon: every GPU serves.
            noon = [f"serve-{n}" for n in range(10, 16)]
            await serve(core, noon)

            async def all_serving() -> bool:
                return batch_gpus(h, job) == 0 and await running(night + morning + noon)

            await h.converge(all_serving, what="every GPU serving", timeout=120)
        finally:
            await h.close()
