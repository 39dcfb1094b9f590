"""The controller's Kubernetes backend against the fake API server: the real
kubernetes-asyncio client, a real shard master on a real nats-server, fake nodes and kubelet."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import REGISTRY

from ebb.client.sdk import EbbClient
from ebb.common import envvars
from ebb.common.job import parse_job
from ebb.common.messaging import identity
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.__main__ import worker_signer
from ebb.controller.kube.backend import (
    JOB_LABEL,
    KubeConfig,
    from_cluster,
    repository,
    running_image,
)
from ebb.controller.kube.podspec import CREDENTIALS_DIR, CREDENTIALS_KEY, mounted_credentials
from ebb.controller.policy.tidal import TidalConfig
from tests.helpers import job_spec, wait_until, write_dataset, write_model
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.fake_kubelet import Evicted, Exit, ImagePullError, OOMKilled
from tests.k8s.fake_store import PODS, Change, Obj
from tests.k8s.harness import NS, Harness, offline, submit, tidal_state

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("controllers_rbac")]


async def test_scales_out_to_the_capacity_of_the_offline_pool(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    for n in range(3):
        offline(kube, f"off-{n}")
    kube.add_node("on-0", labels={"ebb.io/pool": "online"})
    job = await submit(ebb, tmp_path / "job", workers=20, cpu=2)
    h = harness_factory(tidal=None)
    # 3 nodes x 8 cores, 2 cores a worker: 12 fit (the online node is not ours to use).
    await h.converge(lambda: len(h.pods(job)) == 12, what="12 worker pods")
    await kube.wait_for(
        lambda: all(p["status"].get("phase") == "Running" for p in h.pods(job)), what="running"
    )
    pods = h.pods(job)
    assert {p["spec"]["nodeName"] for p in pods} == {"off-0", "off-1", "off-2"}
    pod = pods[0]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["EBB_JOB"]["value"] == job
    assert env["EBB_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "ebb-nats-worker"
    assert container["resources"]["requests"]["cpu"] == "2"
    assert pod["spec"]["priorityClassName"] == "ebb-batch"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["envFrom"] == [{"secretRef": {"name": "ebb-storage-worker", "optional": True}}]
    # Prometheus finds each worker's /metrics through the pod's annotations.
    assert env["EBB_METRICS_PORT"]["value"] == "9400"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    # Another node appears: the next pass uses it.
    offline(kube, "off-3", cpu="4")
    await h.converge(lambda: len(h.pods(job)) == 14, what="14 worker pods")


async def test_worker_pods_run_the_controllers_image_and_belong_to_its_deployment(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    kube.add_namespace(NS)
    labels = {"app.kubernetes.io/name": "ebb-controller"}
    async with kube.api_client() as api:
        # Not there (yet): a warning, and pods without an owner; not a crash.
        unknown = await from_cluster(
            KubeConfig(namespace=NS, owner_deployment="ebb-controller"), api
        )
    deployment = kube.add(
        "deployments",
        {
            "metadata": {"name": "ebb-controller", "labels": labels},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "controller", "image": "ebb:latest"}]},
                },
            },
        },
        NS,
    )
    controller_pod = kube.add_pod(
        {
            "metadata": {"name": "ebb-controller-0", "labels": labels},
            "spec": {"containers": [{"name": "controller", "image": "registry.example/ebb:1.2"}]},
        },
        NS,
    )
    async with kube.api_client() as api:
        found = await from_cluster(
            KubeConfig(namespace=NS, owner_deployment="ebb-controller"),
            api,
            pod_name=controller_pod["metadata"]["name"],
        )
    assert unknown.owner is None
    assert found.image == "registry.example/ebb:1.2"  # workers run what the controller runs
    assert found.owner == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "ebb-controller",
        "uid": deployment["metadata"]["uid"],
    }
    offline(kube, "off-0")
    job = await submit(ebb, tmp_path / "job", workers=1)
    h = harness_factory(tidal=None, owner=found.owner, image=found.image)
    await h.converge(lambda: len(h.pods(job)) == 1, what="a worker pod")
    (worker,) = h.pods(job)
    assert worker["spec"]["containers"][0]["image"] == "registry.example/ebb:1.2"
    # Its stages' model runtime is imported once, before they start (the job's model is ONNX).
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env[envvars.STAGE_PRELOAD] == "onnxruntime"
    (ref,) = worker["metadata"]["ownerReferences"]
    assert ref["uid"] == deployment["metadata"]["uid"] and ref["controller"] is True


async def test_worker_pods_run_the_very_build_the_controller_runs_by_digest(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    kube.add_namespace(NS)
    offline(kube, "off-0")
    me = kube.add_pod(
        {
            "metadata": {"name": "ebb-controller-0"},
            "spec": {
                "containers": [{"name": "controller", "image": "registry.example:5000/ebb:1.2"}]
            },
        },
        NS,
    )

    def image_id() -> str | None:
        pod = kube.get_pod(me["metadata"]["name"], NS) or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        return next((s["imageID"] for s in statuses if s.get("imageID")), None)

    running = await kube.wait_for(image_id, timeout=20, what="the controller's pod running")
    repo, digest = running.split("@")
    assert repo == "registry.example:5000/ebb" and digest.startswith("sha256:")
    async with kube.api_client() as api:
        found = await from_cluster(KubeConfig(namespace=NS), api, pod_name="ebb-controller-0")
        # An image the configuration names is used as it is; the pod is not even read.
        named = await from_cluster(
            KubeConfig(namespace=NS, image="registry.example/other:3"), api, pod_name="nope"
        )
    assert found.image == f"registry.example:5000/ebb@{digest}"
    assert named.image == "registry.example/other:3"
    job = await submit(ebb, tmp_path / "job", workers=1)
    h = harness_factory(tidal=None, image=found.image)
    await h.converge(lambda: len(h.pods(job)) == 1, what="a worker pod")
    (worker,) = h.pods(job)
    assert worker["spec"]["containers"][0]["image"] == found.image


def test_an_image_by_digest_is_told_from_its_tag_and_registry_port() -> None:
    digest = "sha256:" + "ab" * 32
    assert repository("registry.example:5000/team/ebb:1.2") == "registry.example:5000/team/ebb"
    assert repository(f"ebb@{digest}") == "ebb"
    assert repository("localhost:5000/ebb") == "localhost:5000/ebb"
    assert running_image("ebb:0.1.0", f"docker-pullable://docker.io/library/ebb@{digest}") == (
        f"ebb@{digest}"
    )
    # No digest reported (an image built on the node): the reference as given.
    assert running_image("ebb:0.1.0", "sha256:" + "cd" * 32) == "ebb:0.1.0"
    assert running_image("ebb:0.1.0", "") == "ebb:0.1.0"


async def test_jobs_share_capacity_by_priority_then_equally(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0", cpu="12")
    first = await submit(ebb, tmp_path / "a", workers=10, cpu=2)
    second = await submit(ebb, tmp_path / "b", workers=10, cpu=2)
    h = harness_factory(tidal=None)
    await h.converge(
        lambda: (len(h.pods(first)), len(h.pods(second))) == (3, 3), what="an equal split"
    )


async def test_the_mixed_pool_is_lent_at_night_and_given_back_when_online_load_returns(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0", cpu="4")
    for n in range(3):
        kube.add_node(
            f"mix-{n}",
            labels={"ebb.io/pool": "mixed"},
            allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"},
        )
    job = await submit(ebb, tmp_path / "job", workers=20, cpu=2)
    tide = TidalConfig(
        policy="threshold",
        sample_s=0.05,
        window=3,
        cooldown_s=60.0,
        lend_below=0.45,
        reclaim_above=0.7,
    )
    h = harness_factory(tidal=tide)
    # Quiet online load: two mixed nodes lent (one always stays online), workers move in.
    await h.converge(
        lambda: (
            len(h.pods(job)) == 2 + 4 + 4 and all(p["spec"].get("nodeName") for p in h.pods(job))
        ),
        what="workers on the offline pool and 2 lent nodes",
    )
    lent = {n for n in ("mix-0", "mix-1", "mix-2") if tidal_state(kube, n) == "offline"}
    assert len(lent) == 2
    on_lent = {p["metadata"]["name"] for p in h.pods(job) if p["spec"]["nodeName"] in lent}
    assert len(on_lent) == 8
    evicted_before = REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0
    # Morning: online pods that need the mixed pool's room arrive, and cannot be scheduled.
    for n in range(3):
        kube.add_pod(
            {
                "metadata": {"name": f"web-{n}", "labels": {"ebb.io/workload": "online"}},
                "spec": {
                    "nodeSelector": {"ebb.io/pool": "mixed"},
                    "containers": [
                        {"name": "web", "image": "web", "resources": {"requests": {"cpu": "6"}}}
                    ],
                },
            },
            "default",
        )
    # The scheduler preempts batch pods for them at once (lower priority); the tide reclaims
    # both nodes (Pending online pods) and drains what preemption left; cool-down keeps the
    # nodes online.
    displaced = displaced_pods(kube)
    await h.converge(
        lambda: all(
            (kube.get_pod(f"web-{n}", "default") or {}).get("status", {}).get("phase") == "Running"
            for n in range(3)
        ),
        what="the online pods running",
    )
    # Both lent nodes came back in one sample: the pending pods needed them both.
    assert all(tidal_state(kube, n) in ("online", "offline2online") for n in lent)
    await h.converge(
        lambda: {p["spec"].get("nodeName") for p in h.pods(job)} <= {"off-0", None},
        what="batch work back on the offline pool only",
    )
    # Each of the 8 batch pods on the lent nodes went, once: preempted, drained by the tide,
    # or (the tide's relabelling and its drains being apart) drained by the reconciler as
    # surplus once the nodes no longer counted. (Read once the drain is over: the
    # controller's cache may see a pod bound a sample late.)
    drained = (REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0) - evicted_before
    assert {name: displaced["deleted"].get(name) for name in on_lent} == dict.fromkeys(on_lent, 1)
    assert displaced["preempted"] >= 1
    assert displaced["preempted"] + drained <= 8
    # Each drained pod counts against its job (placer.py): reclaimed that often, a job
    # that leaves its pool to the controller goes to the offline pool first.
    assert h.backend.harvester is not None
    assert h.backend.harvester.reclaimed[job] == drained


def displaced_pods(kube: FakeKubeAPI) -> dict[str, Any]:
    """From now on (live): worker pods preempted by the scheduler, counted once each; and,
    by pod, how often each was marked for deletion (by anyone)."""
    counts: dict[str, Any] = {"preempted": 0, "deleted": Counter()}

    def seen(change: Change) -> None:
        if change.rt is not PODS or change.obj["metadata"].get("namespace") != NS:
            return

        def preempted(pod: Obj | None) -> bool:
            conditions = ((pod or {}).get("status") or {}).get("conditions") or []
            return any(c.get("reason") == "PreemptionByScheduler" for c in conditions)

        if preempted(change.obj) and not preempted(change.prev):
            counts["preempted"] += 1
        was_marked = bool(((change.prev or {}).get("metadata") or {}).get("deletionTimestamp"))
        marked = change.type == "DELETED" or bool(change.obj["metadata"].get("deletionTimestamp"))
        if marked and not was_marked:
            counts["deleted"][change.obj["metadata"]["name"]] += 1

    kube.store.subscribe(seen)
    return counts


def online_pod(kube: FakeKubeAPI, name: str, cpu: str, **spec: Any) -> None:
    """An online pod for the mixed pool asking for `cpu` cores; `spec`: more of its spec (a
    node selector of its own, scheduling gates)."""
    kube.add_pod(
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
        "default",
    )


def running(kube: FakeKubeAPI, names: list[str]) -> bool:
    return all(
        (kube.get_pod(n, "default") or {}).get("status", {}).get("phase") == "Running"
        for n in names
    )


async def test_the_forecast_tide_drains_ahead_of_a_rise_and_preemption_takes_a_surge(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0", cpu="4")
    for n in range(3):
        kube.add_node(
            f"mix-{n}",
            labels={"ebb.io/pool": "mixed"},
            allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"},
        )
    job = await submit(ebb, tmp_path / "job", workers=20, cpu=2)
    tide = TidalConfig(sample_s=0.05, lead_s=0.5, headroom=0.25, window=3)
    h = harness_factory(tidal=tide)
    # Quiet: every mixed node but one lent; a quarter of the pool (6 cores) kept free, which
    # the node kept online holds; batch pods fill the lent nodes and the offline pool.
    await h.converge(
        lambda: len(h.pods(job)) == 2 + 8 and all(p["spec"].get("nodeName") for p in h.pods(job)),
        what="workers on the offline pool and 2 lent nodes",
    )
    assert sorted(n for n in ("mix-0", "mix-1", "mix-2") if tidal_state(kube, n) == "offline")
    evicted_before = REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0
    displaced = displaced_pods(kube)

    def drained() -> float:
        return (REGISTRY.get_sample_value("ebb_batch_evictions_total") or 0) - evicted_before

    # A rise the online node still has room for: the trend sees where it goes, and the tide
    # drains batch pods ahead of it; nothing needed preempting.
    web = [f"web-{n}" for n in range(4)]
    for name in web:
        online_pod(kube, name, "2")
    await h.converge(lambda: running(kube, web) and drained() >= 1, what="a drain ahead")
    assert displaced["preempted"] == 0

    # Once the level holds, the budget (24 cores - 8 online - 6 free) brings batch pods back.
    def on_lent_nodes() -> tuple[int, int]:
        """Batch pods running on the mixed nodes, and those going from them."""
        mixed = [p for p in h.pods(job) if p["spec"].get("nodeName", "").startswith("mix")]
        going = sum(1 for p in mixed if p["metadata"].get("deletionTimestamp"))
        live = sum(
            1
            for p in mixed
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"
        )
        return live, going

    await h.converge(
        lambda: on_lent_nodes()[0] >= 4 and on_lent_nodes()[1] == 0,
        what="batch pods back on the lent nodes, none going",
    )
    # A surge no forecast sees: two online pods of 6 cores, for which the scheduler preempts
    # batch pods at once; they run without waiting for the tide. 8 cores or less are free
    # (24 - 8 online - 8 or more batch), less than the surge's 12: one of them at least can
    # only run by preemption (a pod still terminating would have let it wait instead).
    surge = ["surge-0", "surge-1"]
    for name in surge:
        online_pod(kube, name, "6")
    await h.converge(lambda: running(kube, web + surge), what="the online pods running")
    assert displaced["preempted"] >= 1


async def test_an_oom_killed_worker_comes_back_with_more_memory(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0")
    job = await submit(ebb, tmp_path / "job", workers=1, memory_gb=1)
    kube.add_pod_policy(OOMKilled(after=0.05), labels={JOB_LABEL: job}, count=1)
    h = harness_factory(tidal=None)
    first = await h.converge(lambda: h.pods(job), what="a first worker")
    oom_killed = first[0]["metadata"]["name"]

    def relaunched() -> Any:
        return next((p for p in h.pods(job) if p["metadata"]["name"] != oom_killed), None)

    pod = await h.converge(relaunched, what="a second worker")
    assert h.kube.get_pod(oom_killed, NS) is None  # accounted for, then removed
    memory = int(pod["spec"]["containers"][0]["resources"]["requests"]["memory"])
    assert memory == int(1.5 * 2**30)


async def test_an_evicted_worker_is_replaced_at_once_without_penalty(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0")
    job = await submit(ebb, tmp_path / "job", workers=1)
    kube.add_pod_policy(Evicted(after=0.05), labels={JOB_LABEL: job}, count=1)
    h = harness_factory(tidal=None)
    first: list[str] = []

    def replaced() -> bool:
        names = [p["metadata"]["name"] for p in h.pods(job)]
        if names and not first:
            first.extend(names)
        return bool(names) and names != first

    await h.converge(replaced, what="a replacement")
    assert h.reconciler.failures[job] == 0  # eviction is not the job's fault


@pytest.mark.parametrize(
    ("policy", "reason"),
    [
        (ImagePullError(), "ImagePullBackOff"),
        (Exit(code=3, after=0.02, message="stage 'model' failed: no such file"), "no such file"),
        # A pipeline that cannot start on any worker, on the cluster's one node.
        (Exit(code=4, after=0.02, message="stage 'model': no such file"), "could not start"),
    ],
)
async def test_a_worker_that_cannot_run_fails_the_job_with_the_reason(
    kube: FakeKubeAPI,
    ebb: EbbClient,
    harness_factory: Any,
    tmp_path: Path,
    policy: Any,
    reason: str,
) -> None:
    offline(kube, "off-0")
    job = await submit(ebb, tmp_path / "job", workers=2)
    kube.add_pod_policy(policy, labels={JOB_LABEL: job})
    h = harness_factory(tidal=None)

    async def failed() -> Any:
        status = await ebb.job(job)
        return status if status.state == "FAILED" else None

    final = await wait_until(lambda: _pass_then(h, failed), timeout=30, what="the job to fail")
    assert reason.lower() in final.reason.lower() or "ErrImagePull" in final.reason
    await h.converge(lambda: not h.pods(job), what="its pods gone")


async def _pass_then(h: Harness, probe: Any) -> Any:
    with contextlib.suppress(Exception):
        await h.reconciler.reconcile_once()
    return await probe()


async def test_workers_that_keep_crashing_fail_the_job(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0")
    job = await submit(ebb, tmp_path / "job", workers=1)
    kube.add_pod_policy(Exit(code=1, after=0.02), labels={JOB_LABEL: job})
    h = harness_factory(tidal=None)

    async def failed() -> Any:
        status = await ebb.job(job)
        return status if status.state == "FAILED" else None

    final = await wait_until(lambda: _pass_then(h, failed), timeout=30, what="the job to fail")
    assert "3 workers crashed in a row" in final.reason and "exit code 1" in final.reason


async def test_a_node_where_workers_keep_failing_is_avoided(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "bad-node")
    job = await submit(ebb, tmp_path / "job", workers=1)
    kube.add_pod_policy(Exit(code=1, after=0.02), labels={JOB_LABEL: job}, count=2)
    h = harness_factory(tidal=None, avoid_after=2)
    await h.converge(
        lambda: "bad-node" in h.backend.avoidance.avoided(asyncio.get_running_loop().time()),
        what="the node avoided",
    )
    offline(kube, "good-node")
    pod = await h.converge(
        lambda: next((p for p in h.pods(job) if p["spec"].get("nodeName")), None),
        what="a worker placed",
    )
    assert pod["spec"]["nodeName"] == "good-node"
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"][0]["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": ["bad-node"]}
    ]


async def test_informers_survive_cut_watches_expired_history_and_api_errors(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0", cpu="4")
    job = await submit(ebb, tmp_path / "job", workers=10, cpu=1)
    h = harness_factory(tidal=None)
    await h.converge(lambda: len(h.pods(job)) == 4, what="4 workers")
    kube.cut_watches()
    offline(kube, "off-1", cpu="2")  # a change made while the watches are down
    await h.converge(lambda: len(h.pods(job)) == 6, what="6 workers after the cut")
    relists = h.backend.workers.relists
    kube.cut_watches()
    kube.add_pod(
        {"metadata": {"name": "noise"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    )
    kube.compact()  # the history the informers would resume from is gone: 410, then a list
    await wait_until(lambda: h.backend.workers.relists > relists, what="a fresh list after 410")
    kube.fail_next(4, status=500, method="POST")
    kube.fail_next(2, status=429, method="GET", path="/nodes")
    offline(kube, "off-2", cpu="2")
    await h.converge(lambda: len(h.pods(job)) == 8, what="8 workers despite 500s and 429s")
    # ...and the cache agrees with the server, object for object.
    await wait_until(
        lambda: (
            set(h.backend.workers.items)
            == {f"{NS}/{p['metadata']['name']}" for p in h.pods(job, alive=False)}
        ),
        what="the informer's cache to match the server",
    )


# -- one NATS credential per worker ----------------------------------------------------------


def _secret_of(kube: FakeKubeAPI, pod: Obj) -> Obj | None:
    name = mounted_credentials(pod)
    return kube.get("secrets", name, NS) if name else None


def _creds_in(secret: Obj) -> str:
    return base64.b64decode(secret["data"][CREDENTIALS_KEY]).decode()


async def test_each_worker_pod_mounts_a_credential_of_its_own_and_none_is_in_its_spec(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0")
    job = await submit(ebb, tmp_path / "job", workers=3, cpu=2)
    signer = identity.Trust.new("ebb").worker_signer()
    h = harness_factory(tidal=None, signer=signer)
    await h.converge(lambda: len(h.pods(job)) == 3, what="3 worker pods")
    # The kubelet starts a container only once the Secret it mounts exists.
    await kube.wait_for(
        lambda: all(p["status"].get("phase") == "Running" for p in h.pods(job)), what="running"
    )
    seeds = set()
    for pod in h.pods(job):
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        secret = _secret_of(kube, pod)
        assert secret is not None, name
        creds = _creds_in(secret)
        # The credential names this worker (its id is the pod's name), and no other.
        assert identity.credentials_name(creds) == name
        seeds.add(creds.split("BEGIN USER NKEY SEED-----\n")[1].split("\n")[0])
        assert secret["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}
        ]
        assert secret["immutable"] is True
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == CREDENTIALS_DIR)
        assert mount["readOnly"] is True
        assert env[envvars.NATS_CREDS]["value"] == f"{CREDENTIALS_DIR}/{CREDENTIALS_KEY}"
        # Nothing secret in the pod: no password, token or credential text, no shared Secret.
        for var in (envvars.NATS_USER, envvars.NATS_PASSWORD, envvars.NATS_TOKEN):
            assert var not in env
        assert envvars.NATS_CREDENTIALS not in env
        assert "NKEY SEED" not in json.dumps(pod) and "ebb-nats-worker" not in json.dumps(pod)
    assert len(seeds) == 3
    # A pass that finds every pod with its Secret makes no request for one.
    posts = _secret_posts(kube)
    await h.reconciler.reconcile_once()
    await h.reconciler.reconcile_once()
    assert _secret_posts(kube) == posts == 3


def _secret_posts(kube: FakeKubeAPI) -> int:
    return sum(1 for r in kube.requests if r.method == "POST" and r.path.endswith("/secrets"))


async def test_a_controller_lost_between_a_pod_and_its_secret_is_repaired_by_the_next(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0")
    job = await submit(ebb, tmp_path / "job", workers=1)
    signer = identity.Trust.new("ebb").worker_signer()
    # The first controller creates the pod, then fails to create its Secret (and dies).
    lost = kube.fail_next(status=503, method="POST", path=r"/secrets$")
    first = harness_factory(tidal=None, signer=signer)
    with pytest.raises(ApiException):
        await first.reconciler.reconcile_once()
    assert lost.hits
    (pod,) = h_pods = first.pods(job)
    await first.close()
    # Without its credential the pod waits, and is not counted as failed.
    await kube.wait_for(
        lambda: (
            (kube.get_pod(pod["metadata"]["name"], NS) or {})
            .get("status", {})
            .get("containerStatuses", [{}])[0]
            .get("state", {})
            .get("waiting", {})
            .get("reason")
            == "ContainerCreating"
        ),
        what="the pod waiting for its Secret",
    )
    assert _secret_of(kube, pod) is None and len(h_pods) == 1
    # The next controller finds a pending pod of ours without its Secret, and makes it.
    second = harness_factory(tidal=None, signer=signer)
    await second.converge(lambda: _secret_of(kube, pod) is not None, what="the Secret made")
    await kube.wait_for_pod(pod["metadata"]["name"], NS, phase="Running")
    assert [p["metadata"]["uid"] for p in second.pods(job)] == [pod["metadata"]["uid"]]
    secret = _secret_of(kube, pod)
    assert secret is not None
    assert identity.credentials_name(_creds_in(secret)) == pod["metadata"]["name"]
    # A repeated launch of the same worker (its pod there: 409) makes nothing twice.
    status = await ebb.job(job)
    await second.backend.launch(status, pod["metadata"]["name"])
    await second.reconciler.reconcile_once()
    assert _secret_posts(kube) == 2  # the one refused, the one made


async def test_without_a_signer_workers_share_the_configured_secret(
    kube: FakeKubeAPI, ebb: EbbClient, harness_factory: Any, tmp_path: Path
) -> None:
    offline(kube, "off-0")
    job = await submit(ebb, tmp_path / "job", workers=1)
    h = harness_factory(tidal=None)
    (pod,) = await h.converge(lambda: h.pods(job), what="a worker pod")
    assert mounted_credentials(pod) is None
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env[envvars.NATS_USER]["valueFrom"]["secretKeyRef"]["name"] == "ebb-nats-worker"
    assert envvars.NATS_CREDS not in env
    await kube.wait_for_pod(pod["metadata"]["name"], NS, phase="Running")
    assert _secret_posts(kube) == 0


def test_the_controller_takes_its_signing_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trust = identity.Trust.new("ebb")
    monkeypatch.delenv(envvars.WORKER_NATS_SIGNING_KEY, raising=False)
    assert worker_signer() is None  # workers then share `nats_secret`
    monkeypatch.setenv(envvars.WORKER_NATS_SIGNING_KEY, trust.worker_signing_key.seed)
    monkeypatch.delenv(envvars.WORKER_NATS_ACCOUNT, raising=False)
    with pytest.raises(SystemExit, match=envvars.WORKER_NATS_ACCOUNT):
        worker_signer()
    monkeypatch.setenv(envvars.WORKER_NATS_ACCOUNT, trust.account.public)
    assert worker_signer() == trust.worker_signer()
    monkeypatch.setenv(envvars.WORKER_NATS_SIGNING_KEY, "not a seed")
    with pytest.raises(SystemExit, match="not an nkey seed"):
        worker_signer()


async def test_workers_preempted_and_nodes_lost_under_one_shard_never_quarantine_it(
    kube: FakeKubeAPI,
    ebb: EbbClient,
    harness_factory: Any,
    tmp_path: Path,
    nats_config: NatsConfig,
) -> None:
    """The job's one shard, held each time by the worker of a pod that the cluster takes away
    (preempted; its node lost), far more often than max_attempts: each loss is forgiven."""
    for n in range(4):
        offline(kube, f"off-{n}")
    folder = tmp_path / "job"
    write_dataset(folder / "data", rows=100, row_group_size=100)
    write_model(folder / "model.onnx")
    job = await ebb.submit(parse_job(job_spec(folder, rows_per_shard=100, workers=(1, 1))))
    h = harness_factory(tidal=None)
    master = MasterClient(ebb.nc, nats_config)

    def running_pod() -> Any:
        pods = [p for p in h.pods(job) if p["status"].get("phase") == "Running"]
        return pods[0] if pods else None

    losses = 8
    for n in range(losses):
        pod = await h.converge(running_pod, what="a running worker pod")
        name = pod["metadata"]["name"]
        held = await master.lease(job, name)  # its worker takes the shard
        assert held.status == "granted" and held.attempt == n + 1
        if n % 2:
            kube.preempt(name, NS, by="kubelet")
        else:
            kube.remove_node(pod["spec"]["nodeName"], pods="fail")
            offline(kube, f"new-{n}")  # the node pool replaces it

        async def given_back() -> bool:
            return (await ebb.job(job)).shards.get("DOING", 1) == 0

        await wait_until(lambda: _pass_then(h, given_back), timeout=30, what="the shard back")
    status = await ebb.job(job)
    assert status.state == "RUNNING" and status.shards["QUARANTINED"] == 0
    assert (status.attempts_forgiven, status.workers_lost) == (losses, {"capacity": losses})
