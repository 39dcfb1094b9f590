"""RBAC as a real API server enforces it: the controller runs on the token of its own
ServiceAccount (the TokenRequest API), bound by k8s/base/rbac.yaml as `kubectl apply -k`
makes it, on a control plane built from Kubernetes' own code with simulated nodes. Through its
whole life every request it makes is allowed and every grant is one it uses (the API server's
audit log says which requests it made and what it answered); a verb taken from its Role is
refused by the server, and the job says which until it is granted again. (The fake API
server authorizes nothing: the tests on it check each request against k8s/ read as data, the
`controllers_rbac` fixture.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import CoordinationV1Api, CoreV1Api

from ebb.client.sdk import EbbClient
from ebb.common.messaging import identity
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.election import LeaderElector
from ebb.controller.kube.backend import JOB_LABEL, KubeConfig, KubernetesBackend, from_cluster
from ebb.controller.kube.podspec import credentials_secret_name
from ebb.controller.policy.tidal import LABEL as TIDAL
from ebb.controller.policy.tidal import TidalConfig
from ebb.controller.service import Controller, ControllerConfig
from tests.controlplane import ControlPlane
from tests.controlplane.nodes import NodesThread
from tests.helpers import wait_until
from tests.k8s.harness import NS, Harness, submit
from tests.k8s.manifests import Access, Obj, find, granted, objects, used_grants

pytestmark = pytest.mark.timeout(240)

SERVICE_ACCOUNT = "ebb-controller"
USER = f"system:serviceaccount:{NS}:{SERVICE_ACCOUNT}"
ALLOCATABLE = {"cpu": "8", "memory": "32Gi", "pods": "110"}
NODES = {
    "off-0": {"ebb.io/pool": "offline"},
    "mix-0": {"ebb.io/pool": "mixed"},
    "mix-1": {"ebb.io/pool": "mixed"},
}
KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")


@pytest.fixture(scope="module")
def plane(workers_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> ControlPlane:
    """The module's control plane with k8s/'s RBAC objects applied as kustomize renders
    them, and simulated nodes."""
    folder = tmp_path_factory.mktemp("rbac")
    _apply(workers_plane, folder, [o for o in objects() if o["kind"] in KINDS])
    return workers_plane


@pytest.fixture(scope="module")
def nodes(plane: ControlPlane) -> Iterator[NodesThread]:
    with NodesThread.simulated(plane, NODES, allocatable=ALLOCATABLE) as thread:
        yield thread


def _apply(plane: ControlPlane, folder: Path, items: list[Obj], *verb: str) -> None:
    path = folder / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    plane.kubectl(*(verb or ("apply",)), "-f", str(path))


def _token(plane: ControlPlane) -> str:
    """A token of the controller's ServiceAccount, from the TokenRequest API."""
    done = plane.kubectl("create", "token", SERVICE_ACCOUNT, "-n", NS, "--duration", "1h")
    return done.stdout.strip()


def _requests(plane: ControlPlane) -> list[tuple[Access, int]]:
    """Each resource request the controller made, as the authorizer saw it, and the status
    the server answered."""
    out = []
    for event in plane.audited(USER):
        ref = event.get("objectRef")
        if not ref:
            continue  # discovery and other non-resource paths
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        access = Access(
            event["verb"], ref.get("apiGroup", ""), resource, ref.get("namespace"), ref.get("name")
        )
        out.append((access, int(event.get("responseStatus", {}).get("code", 0))))
    return out


async def test_the_controller_on_its_own_token_is_refused_nothing_and_uses_every_grant(
    plane: ControlPlane,
    nodes: NodesThread,
    ebb: EbbClient,
    nats_config: NatsConfig,
    tmp_path: Path,
) -> None:
    """From reading its own pod and Deployment, leading through its Lease, lending a mixed
    node, to starting a job's workers, each with its NATS credentials Secret, and removing
    them: the API server refuses none of its requests, and every grant of k8s/ is used."""
    labels = {"app.kubernetes.io/name": "ebb-controller"}
    container = {"name": "controller", "image": "ebb:0.1.0"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "ebb-controller", "namespace": NS, "labels": labels},
        "spec": {
            "replicas": 0,  # the pod below stands for its replica
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }
    me = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "ebb-controller-0", "namespace": NS, "labels": labels},
        "spec": {"serviceAccountName": SERVICE_ACCOUNT, "containers": [container]},
    }
    _apply(plane, tmp_path, [deployment, me])
    job = await submit(ebb, tmp_path / "job", workers=4, cpu=4)
    async with plane.api_client(_token(plane)) as api, plane.api_client() as admin:
        core: Any = CoreV1Api(admin)  # plain JSON maps: the stubs know only models
        settings = KubeConfig(
            namespace=NS,
            nats=nats_config,
            priority_class="ebb-batch",
            owner_deployment="ebb-controller",
            tidal=TidalConfig(sample_s=0.05, lead_s=0.5, window=3),
        )
        config = await from_cluster(settings, api, pod_name="ebb-controller-0")
        assert config.owner is not None and config.image
        elector = LeaderElector(
            api, namespace=NS, name="ebb-controller", identity="c0", lease_s=2, renew_s=0.2
        )
        controller = Controller(
            ControllerConfig(nats=nats_config, resync_s=0.1),
            KubernetesBackend(config, api, signer=identity.Trust.new("ebb").worker_signer()),
            elector=elector,
        )
        run = asyncio.create_task(controller.run())

        leases: Any = CoordinationV1Api(admin)

        async def raw(response: Any) -> Any:
            """The object a raw read answered (None for a 404: it raises nothing)."""
            if response.status == 404:
                return None
            assert response.status == 200, await response.text()
            return await response.json()

        async def workers() -> list[Obj]:
            found = await raw(
                await core.list_namespaced_pod(
                    NS, label_selector=f"{JOB_LABEL}={job}", _preload_content=False
                )
            )
            return [p for p in found["items"] if not p["metadata"].get("deletionTimestamp")]

        async def with_credentials() -> bool:
            pods = await workers()
            for pod in pods:
                name = credentials_secret_name(pod["metadata"]["name"])
                if await raw(await core.read_namespaced_secret(name, NS, _preload_content=False)):
                    continue
                return False
            return len(pods) >= 2

        async def lent() -> bool:
            for name in ("mix-0", "mix-1"):
                node = await raw(await core.read_node(name, _preload_content=False))
                if (node["metadata"].get("labels") or {}).get(TIDAL) == "offline":
                    return True
            return False

        async def lease_version() -> str:
            lease = await raw(
                await leases.read_namespaced_lease("ebb-controller", NS, _preload_content=False)
            )
            return str(lease["metadata"]["resourceVersion"]) if lease else ""

        try:
            await wait_until(with_credentials, timeout=60, what="workers with their credentials")
            await wait_until(lent, timeout=60, what="a mixed node lent")
            renewed = await wait_until(lease_version, timeout=30, what="the controller's lease")

            async def renewed_since() -> bool:
                return await lease_version() not in ("", renewed)

            await wait_until(renewed_since, timeout=30, what="the lease renewed")
            await ebb.cancel(job)

            async def none_left() -> bool:
                return not await workers()

            await wait_until(none_left, timeout=60, what="the workers removed")
        finally:
            controller.request_stop()
            await asyncio.gather(run, return_exceptions=True)

    requests = _requests(plane)
    assert requests, "the audit log has none of the controller's requests"
    refused = sorted({f"{a} ({code})" for a, code in requests if code in (401, 403)})
    assert not refused, f"the API server refused the controller: {refused}"
    grants = granted(SERVICE_ACCOUNT, NS)
    used = set().union(*(used_grants(a, grants, NS) for a, _ in requests))
    unused = sorted(str(g) for g in grants - used)
    assert not unused, f"k8s/base/rbac.yaml grants what the controller never uses: {unused}"


async def test_a_verb_taken_from_the_role_is_refused_and_the_job_says_which(
    plane: ControlPlane,
    nodes: NodesThread,
    ebb: EbbClient,
    nats_config: NatsConfig,
    tmp_path: Path,
) -> None:
    """The Role without `create` on pods: the API server refuses each worker pod, and the
    job, running with none, says so in the server's words (the verb, the resource, the
    ServiceAccount); the Role mended, its workers start and the job no longer waits."""
    role = find("Role", "ebb-controller")
    crippled = json.loads(json.dumps(role))
    for rule in crippled["rules"]:
        if "pods" in rule["resources"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
    _apply(plane, tmp_path, [crippled], "replace")
    job = await submit(ebb, tmp_path / "job", workers=2, cpu=2)
    async with plane.api_client(_token(plane)) as api:
        h = Harness(api, nats_config, ebb.nc, tidal=None)
        try:

            async def waiting() -> str:
                return (await ebb.job(job)).waiting

            reason = await h.converge(waiting, what="the job to say why it has no workers")
            assert "may not create worker pods" in reason, reason
            assert 'cannot create resource "pods"' in reason and USER in reason, reason
            status = await ebb.job(job)
            assert status.state == "RUNNING" and not h.pods(job)
            _apply(plane, tmp_path, [role], "replace")

            async def started() -> bool:
                return len(h.pods(job)) == 2 and not await waiting()

            await h.converge(started, what="its workers once the Role is mended", timeout=60)
        finally:
            await h.close()
            await ebb.cancel(job)
