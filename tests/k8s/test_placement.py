"""Each job placed by its own `resources` and by its kind, on the fake API server through the
real kubernetes-asyncio client: its pool in its pods' node affinity, its GPU type and node
selector in their nodeSelector, the WPAI policy (a short job's pods prefer the mixed pool; once
its workers were reclaimed often, the offline pool), and a job asking for what no node has
waiting, with the reason in its status, until such a node appears.

The policy's inputs (a job's median shard time) are the test's to set, through the scripted
master of tests/scripted_master.py; what a job that cannot be placed says is read through a
real master over a real nats-server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
from nats.aio.client import Client as NATS

from ebb.client.sdk import EbbClient
from ebb.common.job import parse_job
from ebb.common.messaging.messages import JobStatus, TierStatus
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.kube.backend import KubeConfig
from ebb.controller.kube.podspec import TIER_LABEL, pod_placement
from ebb.controller.policy.pools import PoolPolicy
from ebb.controller.policy.tidal import LABEL as TIDAL
from tests.helpers import job_spec, wait_until, write_dataset, write_model
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.harness import NS, Harness, offline
from tests.scripted_master import ScriptedMaster

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("controllers_rbac")]

GPU_LABEL = "nvidia.com/gpu.product"
A100 = "NVIDIA-A100-SXM4-80GB"
JOB = "placed"


def lent(kube: FakeKubeAPI, name: str, cpu: str = "8", gpus: str = "0") -> None:
    """A mixed node the tide has lent to batch work."""
    kube.add_node(
        name,
        labels={"ebb.io/pool": "mixed", TIDAL: "offline"},
        allocatable={"cpu": cpu, "memory": "32Gi", "nvidia.com/gpu": gpus, "pods": "110"},
    )


def gpu_node(
    kube: FakeKubeAPI,
    name: str,
    product: str,
    gpus: str = "4",
    *,
    label: str = GPU_LABEL,
    labels: dict[str, str] | None = None,
) -> None:
    kube.add_node(
        name,
        labels={"ebb.io/pool": "offline", label: product, **(labels or {})},
        allocatable={"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": gpus, "pods": "110"},
    )


def spec_of(folder: Path, *, workers: int = 2, **resources: Any) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    write_dataset(folder / "data", rows=40 * 100, row_group_size=100)
    write_model(folder / "model.onnx")
    spec = job_spec(folder, rows_per_shard=100, workers=(1, workers))
    spec["resources"].update(cpu=2, memory_gb=1, **resources)
    return spec


def running(spec: dict[str, Any], *, todo: int, shard_s: float = 0.0, job: str = JOB) -> JobStatus:
    """The job as the scripted master tells it: `todo` shards left, its median shard time."""
    return JobStatus(
        id=job,
        name=job,
        state="RUNNING",
        shards={"TODO": todo},
        min_workers=spec["resources"]["min_workers"],
        max_workers=spec["resources"]["max_workers"],
        spec={**spec, "id": job},
        shard_s=shard_s,
    )


def affinity(pod: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = pod["spec"]["affinity"]["nodeAffinity"]
    return found


def required_pools(pod: dict[str, Any]) -> list[list[str]]:
    """Each required term's pools (the values of its pool expression)."""
    terms = affinity(pod)["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return [
        [v for e in t["matchExpressions"] if e["key"] == "ebb.io/pool" for v in e["values"]]
        for t in terms
    ]


def preferred_pool(pod: dict[str, Any]) -> str | None:
    terms = affinity(pod).get("preferredDuringSchedulingIgnoredDuringExecution") or []
    if not terms:
        return None
    assert len(terms) == 1 and terms[0]["weight"] == 100
    (expression,) = terms[0]["preference"]["matchExpressions"]
    assert expression["key"] == "ebb.io/pool"
    value: str = expression["values"][0]
    return value


@pytest.mark.parametrize(
    ("pool", "required", "preferred", "lands_on"),
    [
        ("offline", [["offline"]], None, "off-0"),
        ("any", [["offline"], ["mixed"]], "offline", "off-0"),
        ("mixed", [["offline"], ["mixed"]], "mixed", "mix-0"),
        ("online", [["offline"], ["mixed"]], "offline", "off-0"),  # read as `any`
    ],
)
async def test_pods_carry_the_pool_their_job_asks_for(
    kube: FakeKubeAPI,
    scripted: ScriptedMaster,
    nc: NATS,
    nats_config: NatsConfig,
    tmp_path: Path,
    pool: str,
    required: list[list[str]],
    preferred: str | None,
    lands_on: str,
) -> None:
    offline(kube, "off-0", cpu="16")
    lent(kube, "mix-0", cpu="16")
    scripted.set(running(spec_of(tmp_path / "job", pool=pool), todo=40))
    h = Harness(kube, nats_config, nc, tidal=None)
    try:
        await h.converge(lambda: len(h.pods(JOB)) == 2, what="2 pods")
        await kube.wait_for(
            lambda: all(p["spec"].get("nodeName") for p in h.pods(JOB)), what="scheduled"
        )
        for pod in h.pods(JOB):
            assert required_pools(pod) == required
            assert preferred_pool(pod) == preferred
            assert pod["spec"]["nodeName"] == lands_on
    finally:
        await h.close()


async def test_pods_select_their_gpu_type_and_placement_goes_controller_job_tier(
    kube: FakeKubeAPI, scripted: ScriptedMaster, nc: NATS, nats_config: NatsConfig, tmp_path: Path
) -> None:
    label = "example.io/gpu-model"  # the controller's setting, not the default
    labels = {"zone": "a", "disk": "ssd", "team": "search"}
    gpu_node(kube, "t4-0", "Tesla-T4", label=label, labels=labels)
    gpu_node(kube, "a100-0", A100, label=label, labels=labels)
    spec = spec_of(tmp_path / "job", gpu=1, gpu_type=A100)
    spec["node_selector"] = {"zone": "a", "team": "search"}
    spec["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    scripted.set(running(spec, todo=40))
    ours = {"zone": "b", "disk": "ssd"}
    h = Harness(kube, nats_config, nc, tidal=None, node_selector=ours, gpu_type_label=label)
    try:
        await h.converge(lambda: len(h.pods(JOB)) == 2, what="2 GPU pods")
        await kube.wait_for(
            lambda: all(p["spec"].get("nodeName") for p in h.pods(JOB)), what="scheduled"
        )
        for pod in h.pods(JOB):
            # The controller's `disk` stays; the job's `zone` wins over the controller's.
            assert pod["spec"]["nodeSelector"] == {
                "zone": "a",
                "disk": "ssd",
                "team": "search",
                label: A100,
            }
            assert {"key": "dedicated", "operator": "Exists"} in pod["spec"]["tolerations"]
            assert pod["spec"]["nodeName"] == "a100-0"
    finally:
        await h.close()
    # A tier's placement goes over the job's, and its GPU type over all: controller < job <
    # tier < gpu_type.
    tier = {
        "name": "gpu",
        "stages": ["preprocess", "model", "postprocess"],
        "resources": {"gpu": 1, "gpu_type": "NVIDIA-L4"},
        "node_selector": {"team": "ads", label: "Tesla-T4"},
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
    }
    config = KubeConfig(tidal=None, node_selector=ours, gpu_type_label=label)
    placement = pod_placement(config, parse_job({**spec, "tiers": [tier]}), "gpu")
    assert placement.node_selector == {
        "zone": "a",
        "disk": "ssd",
        "team": "ads",
        label: "NVIDIA-L4",
    }
    assert placement.tolerations == [
        {"key": "dedicated", "operator": "Exists"},
        {"key": "gpu", "operator": "Exists"},
    ]


@pytest.mark.kube(terminate_delay=5.0)  # a preempted worker drains: the controller sees it
async def test_a_short_job_prefers_the_mixed_pool_until_its_workers_are_reclaimed(
    kube: FakeKubeAPI, scripted: ScriptedMaster, nc: NATS, nats_config: NatsConfig, tmp_path: Path
) -> None:
    offline(kube, "off-0", cpu="16")
    lent(kube, "mix-0", cpu="16")
    spec = spec_of(tmp_path / "job")  # pool: auto
    # 40 shards of a minute each on 2 workers: 20 minutes, within the half hour of a short job.
    scripted.set(running(spec, todo=40, shard_s=60.0))
    policy = PoolPolicy(short_job_s=1800.0, reclaims_to_offline=3)
    h = Harness(kube, nats_config, nc, tidal=None, pools=policy)
    try:
        await h.converge(lambda: len(h.pods(JOB)) == 2, what="2 pods of a short job")
        await kube.wait_for(
            lambda: all(p["spec"].get("nodeName") for p in h.pods(JOB)), what="scheduled"
        )
        assert {preferred_pool(p) for p in h.pods(JOB)} == {"mixed"}
        assert {p["spec"]["nodeName"] for p in h.pods(JOB)} == {"mix-0"}
        # Its shards take longer now: 40 of 2 hours each is a long job, offline first.
        scripted.set(running(spec, todo=40, shard_s=7200.0))
        assert h.backend.placer.pool_mode(scripted.jobs[JOB]) == "any"
        scripted.set(running(spec, todo=40, shard_s=60.0))

        # Its workers on the mixed node are preempted for online pods, three times: twice by
        # the scheduler (the pod drains, its worker exits 0), once by the kubelet (Failed).
        reclaimed: set[str] = set()
        preempters: tuple[Literal["scheduler", "kubelet"], ...] = ("scheduler",) * 2 + ("kubelet",)
        for by in preempters:
            pod = await h.converge(
                lambda: next(
                    (
                        p
                        for p in h.pods(JOB)
                        if p["spec"].get("nodeName") == "mix-0"
                        and p["status"].get("phase") == "Running"
                        and p["metadata"]["name"] not in reclaimed
                    ),
                    None,
                ),
                what="a running worker on the mixed node",
            )
            assert preferred_pool(pod) == "mixed"
            reclaimed.add(pod["metadata"]["name"])
            kube.preempt(pod["metadata"]["name"], NS, by=by)
            await h.converge(
                lambda: h.backend.placer.reclaims(JOB) == len(reclaimed),
                what=f"{len(reclaimed)} reclaims counted",
            )
        # From now on, however short: the offline pool first, for the pods that replace them.
        await h.converge(
            lambda: (
                len(h.pods(JOB)) == 2 and any(preferred_pool(p) == "offline" for p in h.pods(JOB))
            ),
            what="a replacement that prefers the offline pool",
        )
        assert h.backend.placer.pool_mode(scripted.jobs[JOB]) == "any"
        # Lost to the cluster, each: not the job's fault.
        assert {e.kind for e in scripted.ended} == {"capacity"}
        assert not scripted.failed
    finally:
        await h.close()


async def test_a_job_asking_for_a_pool_no_node_is_in_waits_and_says_why(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    lent(kube, "mix-0")
    lent(kube, "mix-1")
    job = await ebb.submit(parse_job(spec_of(tmp_path / "job", pool="offline")))
    h = harness_factory(tidal=None)

    async def waiting() -> str:
        await h.reconciler.reconcile_once()
        return (await ebb.job(job)).waiting

    reason = await wait_until(waiting, timeout=30, what="the job's status to say why it waits")
    assert reason.startswith("pool offline: no node of the cluster is in the offline pool")
    status = await ebb.job(job)
    assert status.state == "RUNNING" and not h.pods(job)  # waiting, not failed
    offline(kube, "off-0")
    await h.converge(lambda: len(h.pods(job)) == 2, what="pods on the new offline node")

    async def cleared() -> bool:
        await h.reconciler.reconcile_once()
        return (await ebb.job(job)).waiting == ""

    await wait_until(cleared, timeout=30, what="the reason cleared")
    assert {p["spec"].get("nodeName") for p in h.pods(job)} <= {"off-0", None}


async def test_nodes_without_a_pool_label_are_no_pool_and_the_job_says_to_label_them(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    # A cluster as it comes: no node labelled. Its pods' node affinity names the pools, so
    # room counted there would leave them Pending; the job waits, saying what to do.
    kube.add_node("plain-0", allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"})
    job = await ebb.submit(parse_job(spec_of(tmp_path / "job")))  # pool: auto
    h = harness_factory(tidal=None)

    async def waiting() -> str:
        await h.reconciler.reconcile_once()
        return (await ebb.job(job)).waiting

    reason = await wait_until(waiting, timeout=30, what="the job's status to say why it waits")
    assert "no node of the cluster is in the offline or mixed pool" in reason
    assert "kubectl label node NODE ebb.io/pool=offline" in reason
    assert not h.pods(job)
    node = kube.get_node("plain-0")
    assert node is not None
    kube.set_node_labels("plain-0", {**node["metadata"]["labels"], "ebb.io/pool": "offline"})
    await h.converge(lambda: len(h.pods(job)) == 2, what="pods once the node is labelled")
    await kube.wait_for(
        lambda: all(p["spec"].get("nodeName") == "plain-0" for p in h.pods(job)),
        what="the pods scheduled there",
    )


async def test_a_job_asking_for_a_gpu_type_no_node_has_waits_until_one_comes(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    gpu_node(kube, "t4-0", "Tesla-T4")
    kube.add_node(  # not ready: it may take pods later, so it counts
        "a100-old",
        labels={"ebb.io/pool": "offline", GPU_LABEL: "NVIDIA-A100-PCIE-40GB"},
        allocatable={"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1", "pods": "110"},
        ready=False,
    )
    job = await ebb.submit(parse_job(spec_of(tmp_path / "job", gpu=1, gpu_type=A100)))
    other = await ebb.submit(
        parse_job(spec_of(tmp_path / "other", gpu=1, gpu_type="NVIDIA-A100-PCIE-40GB"))
    )
    h = harness_factory(tidal=None)

    async def waiting() -> str:
        await h.reconciler.reconcile_once()
        return (await ebb.job(job)).waiting

    reason = await wait_until(waiting, timeout=30, what="the job's status to say why it waits")
    assert reason == f"gpu_type {A100}: no node of its pools has that GPU (label {GPU_LABEL})"
    # The job whose GPU's only node is not ready waits for room, not for a node: no reason.
    assert (await ebb.job(other)).waiting == ""
    assert not h.pods(job) and not h.pods(other)
    gpu_node(kube, "a100-0", A100, gpus="8")
    await h.converge(lambda: len(h.pods(job)) == 2, what="pods on the A100 node")

    async def cleared() -> bool:
        await h.reconciler.reconcile_once()
        return (await ebb.job(job)).waiting == ""

    await wait_until(cleared, timeout=30, what="the reason cleared")
    # More GPUs a worker than any A100 node has: waiting again, for that reason.
    more = await ebb.submit(parse_job(spec_of(tmp_path / "more", gpu=16, gpu_type=A100)))

    async def too_big() -> str:
        await h.reconciler.reconcile_once()
        return (await ebb.job(more)).waiting

    reason = await wait_until(too_big, timeout=30, what="the big job's reason")
    assert "16 GPUs (the most a node it may use has: 8 GPUs)" in reason


async def test_a_tier_no_node_could_take_waits_while_the_others_run(
    kube: FakeKubeAPI, scripted: ScriptedMaster, nc: NATS, nats_config: NatsConfig, tmp_path: Path
) -> None:
    offline(kube, "cpu-0")
    spec = spec_of(tmp_path / "job")
    spec["tiers"] = [
        {"name": "cpu", "stages": ["preprocess"], "resources": {"max_workers": 2, "cpu": 2}},
        {
            "name": "gpu",
            "stages": ["model", "postprocess"],
            "resources": {"max_workers": 1, "gpu": 1, "gpu_type": A100},
        },
    ]
    scripted.set(
        JobStatus(
            id=JOB,
            name=JOB,
            state="RUNNING",
            shards={"TODO": 40},
            min_workers=1,
            max_workers=2,
            spec={**spec, "id": JOB},
            tiers=[TierStatus(name="cpu", shards={"TODO": 40}), TierStatus(name="gpu")],
        )
    )
    h = Harness(kube, nats_config, nc, tidal=None)
    try:
        await h.converge(
            lambda: (
                len(h.pods(JOB)) == 2
                and any(r.tier == "gpu" and r.reason for r in scripted.placements)
            ),
            what="the CPU tier's pods, and word of the GPU tier",
        )
        assert {p["metadata"]["labels"][TIER_LABEL] for p in h.pods(JOB)} == {"cpu"}
        assert [(r.tier, r.reason.split(":")[0]) for r in scripted.placements] == [
            ("gpu", f"gpu_type {A100}")
        ]
        status = scripted.jobs[JOB]
        assert [t.waiting != "" for t in status.tiers] == [False, True]
        # Told once: the status says it now.
        await h.reconciler.reconcile_once()
        assert len(scripted.placements) == 1
        gpu_node(kube, "a100-0", A100)
        await h.converge(
            lambda: scripted.placements[-1].reason == "" and len(h.pods(JOB)) == 3,
            what="the GPU tier placed, and the word cleared",
        )
    finally:
        await h.close()
