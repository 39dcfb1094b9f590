"""k8s/ and the controller's Kubernetes backend against a control plane built from
Kubernetes' own code (tests/controlplane: etcd, kube-apiserver with RBAC, the controller
manager, the scheduler; nodes simulated): what `kubectl` and the API server accept, what the
ReplicaSet, StatefulSet and DaemonSet controllers and the scheduler make of it, and what the
controller may do with exactly the rights k8s/ grants it, with a real ServiceAccount token.

One deployment of k8s/base per module, as the docs say to make it (docs/deployment.md): the
namespace, the NATS Secrets from k8s/make-secrets.sh, then `kubectl apply -k k8s/base`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from ebb.common.messaging.messages import JobStatus
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.backend import LaunchRefused
from ebb.controller.kube.backend import REMOVED, KubeConfig, KubernetesBackend, pod_name
from tests.controlplane import ControlPlane, prepare_install, rolled_out
from tests.controlplane.nodes import NodesThread
from tests.helpers import wait_until
from tests.k8s.harness import NS
from tests.k8s.manifests import find

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
CONTROLLER = "ebb-controller"


def _rollout(plane: ControlPlane, kind: str, name: str, namespace: str = NS) -> None:
    done = plane.kubectl(
        "-n", namespace, "rollout", "status", f"{kind}/{name}", "--timeout=120s", check=False
    )
    assert done.returncode == 0, f"{kind}/{name} did not roll out: {done.stdout}{done.stderr}"


def _applied(plane: ControlPlane, *args: str) -> str:
    done = plane.kubectl("apply", *args, check=False)
    assert done.returncode == 0, f"kubectl apply {' '.join(args)}: {done.stderr}"
    return done.stdout


NODES = {
    "offline-0": {"ebb.io/pool": "offline"},
    "offline-1": {"ebb.io/pool": "offline"},
    "online-0": {"ebb.io/pool": "online"},
}
"""Simulated nodes: two of the offline pool (worker pods and the model cache go there), one
online."""


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    with NodesThread(control_plane, NODES):
        yield control_plane


@pytest.fixture(scope="module")
def deployed(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> ControlPlane:
    """k8s/base applied to the control plane as docs/deployment.md says, NATS's volume
    provided as an operator of a cluster without a provisioner would (a PersistentVolume)."""
    plane = cluster
    prepare_install(plane, tmp_path_factory.mktemp("install"))
    _applied(plane, "-k", str(REPO / "k8s" / "base"))
    return plane


def test_k8s_base_applies_and_every_workload_comes_up(deployed: ControlPlane) -> None:
    """The Deployments' ReplicaSets, NATS's StatefulSet (its claim bound) and the model
    cache's DaemonSet make their pods; the scheduler places them on nodes their affinity
    allows; they become ready."""
    plane = deployed
    rolled_out(plane)
    pods = json.loads(plane.kubectl("-n", NS, "get", "pods", "-o", "json").stdout)["items"]
    placed = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods}
    assert all(placed.values()), placed
    cache = [n for p, n in placed.items() if p.startswith("ebb-model-cache-")]
    # The DaemonSet's affinity: the offline and mixed pools, not the online node.
    assert sorted(cache) == ["offline-0", "offline-1"]


def test_the_prod_overlay_passes_the_api_servers_validation(deployed: ControlPlane) -> None:
    """Every object of k8s/overlays/prod, PodMonitors included once the Prometheus Operator's
    CRDs are installed, is accepted by the API server (validation and admission, nothing
    stored). Over the running base install, as its kustomization warns, NATS's StatefulSet
    cannot change in place until it is deleted with `--cascade=orphan` (its pod and volume
    kept)."""
    plane = deployed
    overlay = str(REPO / "k8s" / "overlays" / "prod")
    crd = plane.crds / "monitoring.coreos.com_podmonitors.yaml"
    refused = plane.kubectl("apply", "--dry-run=server", "-k", overlay, check=False)
    assert refused.returncode != 0
    assert 'no matches for kind "PodMonitor"' in refused.stderr, refused.stderr
    _applied(plane, "--server-side", "-f", str(crd))
    plane.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/podmonitors.monitoring.coreos.com",
    )  # fmt: skip
    refused = plane.kubectl("apply", "--dry-run=server", "-k", overlay, check=False)
    assert 'StatefulSet "ebb-nats" is invalid' in refused.stderr, refused.stderr
    assert "spec.serviceName" in refused.stderr and "field is immutable" in refused.stderr
    plane.kubectl("-n", NS, "delete", "statefulset", "ebb-nats", "--cascade=orphan")
    try:
        out = _applied(plane, "--dry-run=server", "-k", overlay)
        assert "podmonitor.monitoring.coreos.com/ebb created (server dry run)" in out, out
        assert "statefulset.apps/ebb-nats created (server dry run)" in out, out
    finally:
        _applied(plane, "-k", str(REPO / "k8s" / "base"))  # the base install as it was
        _rollout(plane, "statefulset", "ebb-nats")


def _token(plane: ControlPlane, account: str, namespace: str = NS) -> str:
    """A token of the ServiceAccount from the TokenRequest API, as a projected volume gets."""
    return plane.kubectl("-n", namespace, "create", "token", account).stdout.strip()


def _backend_config(namespace: str = NS) -> KubeConfig:
    return KubeConfig(
        namespace=namespace,
        image="ebb:0.1.0",
        nats=NatsConfig(url="nats://127.0.0.1:1"),
        nats_secret=None,
        service_account=None,
        tidal=None,
        priority_class="ebb-batch",
        grace_s=5,
    )


@contextlib.asynccontextmanager
async def _controller(plane: ControlPlane) -> AsyncIterator[tuple[KubernetesBackend, CoreV1Api]]:
    """The controller's backend as the ebb-controller ServiceAccount (a token the API server
    signed), its informers running and the nodes listed; and the admin's client."""
    async with (
        plane.api_client(_token(plane, CONTROLLER)) as api,
        plane.api_client() as admin,
    ):
        backend = KubernetesBackend(_backend_config(), api)
        agents = [asyncio.create_task(a) for a in backend.agents().values()]
        try:
            await wait_until(lambda: len(backend.nodes.items) == 3, timeout=60, what="nodes")
            yield backend, CoreV1Api(admin)
        finally:
            for agent in agents:
                agent.cancel()
            await asyncio.gather(*agents, return_exceptions=True)


async def test_the_controller_with_k8s_rbac_launches_sees_and_drains_a_worker(
    deployed: ControlPlane,
) -> None:
    """As the ebb-controller ServiceAccount, with a token the API server signed: the backend's
    informers list and watch nodes and pods, it creates a worker pod, the scheduler places it
    on an offline node, the backend sees it run and deletes it."""
    plane = deployed
    worker = f"w-{uuid.uuid4().hex[:6]}"
    name = pod_name(worker)
    async with _controller(plane) as (backend, admin):
        job = JobStatus(id=f"t{uuid.uuid4().hex[:8]}", name="plane", state="RUNNING")
        await backend.launch(job, worker)

        async def running() -> bool:
            return any(w.id == name and w.phase == "running" for w in await backend.observe())

        await wait_until(running, timeout=60, what="the worker pod running")
        pod = await admin.read_namespaced_pod(name, NS)
        assert pod.spec.node_name in ("offline-0", "offline-1")
        assert pod.spec.priority_class_name == "ebb-batch"
        assert pod.metadata.labels["ebb.io/job"] == job.id
        await backend.terminate(name, grace_s=5)

        async def gone() -> bool:
            try:
                await admin.read_namespaced_pod(name, NS)
            except ApiException as e:
                return e.status == 404
            return False

        await wait_until(gone, timeout=60, what="the worker pod deleted")
        await wait_until(
            lambda: not any(p["metadata"]["name"] == name for p in backend.workers.values()),
            timeout=30,
            what="the informer told of the deletion",
        )


async def test_a_worker_pod_deleted_by_force_is_reported_lost_once_and_one_forgotten_is_not(
    deployed: ControlPlane,
) -> None:
    """`kubectl delete pod --grace-period=0 --force` removes a running worker's pod from the
    API at once, with no terminal status: the backend reports the worker failed for want of
    capacity (nobody's fault: the master frees its shards now, not when their leases run
    out), once. A pod the controller deleted itself (`forget`, after it ended) is not news."""
    plane = deployed
    job = JobStatus(id=f"t{uuid.uuid4().hex[:8]}", name="plane", state="RUNNING")
    forced, forgotten = f"w-{uuid.uuid4().hex[:6]}", f"w-{uuid.uuid4().hex[:6]}"
    async with _controller(plane) as (backend, admin):
        for worker in (forced, forgotten):
            await backend.launch(job, worker)

        async def phases() -> dict[str, str]:
            return {w.id: w.phase for w in await backend.observe() if w.job == job.id}

        async def both_running() -> bool:
            found = await phases()
            return found.get(pod_name(forced)) == found.get(pod_name(forgotten)) == "running"

        await wait_until(both_running, timeout=60, what="both workers running")
        await admin.delete_namespaced_pod(pod_name(forced), NS, grace_period_seconds=0)
        await backend.forget(forgotten)

        reports: list[tuple[str, str, str | None, str]] = []

        async def both_gone() -> bool:
            reports.extend(
                (w.id, w.phase, w.failure, w.reason)
                for w in await backend.observe()
                if w.job == job.id
            )
            names = {p["metadata"]["name"] for p in backend.workers.values()}
            return not names & {pod_name(forced), pod_name(forgotten)}

        await wait_until(both_gone, timeout=60, what="both pods gone from the informer")
        reports.extend((w.id, w.phase, w.failure, w.reason) for w in await backend.observe())
        lost = [r for r in reports if r[1] == "failed"]
        assert lost == [(pod_name(forced), "failed", "capacity", REMOVED)]


@pytest.fixture
def narrowed(deployed: ControlPlane, tmp_path: Path) -> Iterator[str]:
    """A namespace where the controller's ServiceAccount has k8s/'s Role less one verb:
    `create` on pods."""
    plane = deployed
    namespace = f"narrow-{uuid.uuid4().hex[:6]}"
    plane.kubectl("create", "namespace", namespace)
    role = copy.deepcopy(find("Role", CONTROLLER))
    for rule in role["rules"]:
        if rule["resources"] == ["pods"]:
            rule["verbs"].remove("create")
    binding = copy.deepcopy(find("RoleBinding", CONTROLLER))
    binding["subjects"][0]["namespace"] = namespace
    account: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": CONTROLLER},
    }
    path = tmp_path / "narrow.yaml"
    for obj in (account, role, binding):
        obj["metadata"]["namespace"] = namespace
    path.write_text(yaml.safe_dump_all([account, role, binding]))
    _applied(plane, "-n", namespace, "-f", str(path))
    yield namespace
    plane.kubectl("delete", "namespace", namespace, "--wait=false")


async def test_a_verb_missing_from_the_role_fails_with_an_error_that_names_it(
    deployed: ControlPlane, narrowed: str
) -> None:
    plane = deployed
    async with plane.api_client(_token(plane, CONTROLLER, narrowed)) as api:
        backend = KubernetesBackend(_backend_config(narrowed), api)
        job = JobStatus(id="tnarrow", name="plane", state="RUNNING")
        with pytest.raises(LaunchRefused) as refused:
            await backend.launch(job, "w-narrow")
    reason = refused.value.reason  # what the job's status then says (test_rbac_on_control_plane)
    assert f"system:serviceaccount:{narrowed}:{CONTROLLER}" in reason, reason
    assert 'cannot create resource "pods"' in reason, reason


def test_simulated_nodes_stay_ready(cluster: ControlPlane) -> None:
    """The node lifecycle controller sees each simulated node's lease renewed: Ready, and no
    not-ready or unreachable taint."""
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    ready = {
        n["metadata"]["name"]
        for n in nodes
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
        and not n["spec"].get("taints")
    }
    assert ready == {"offline-0", "offline-1", "online-0"}
