"""k8s/base/rbac.yaml grants the controller exactly what it uses: the real controller (the
kubernetes-asyncio client against the fake API server) goes through its whole life, from
reading its own pod and Deployment, leading through its Lease, lending a mixed node, to
starting and removing a job's workers, each with its NATS credentials Secret; every request
it makes is granted, and every
permission granted is one it used."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ebb.client.sdk import EbbClient
from ebb.common.messaging import identity
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.election import LeaderElector
from ebb.controller.kube.backend import JOB_LABEL, KubeConfig, KubernetesBackend, from_cluster
from ebb.controller.kube.podspec import credentials_secret_name
from ebb.controller.policy.tidal import TidalConfig
from ebb.controller.service import Controller, ControllerConfig
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.harness import NS, offline, submit, tidal_state
from tests.k8s.manifests import Access, Obj, access, allowed, find, objects

pytestmark = pytest.mark.timeout(120)

SERVICE_ACCOUNT = "ebb-controller"


def granted() -> set[tuple[str, str, str, str | None, bool]]:
    """Every (group, resource, verb, resource name, namespaced) the controller's roles grant."""
    out: set[tuple[str, str, str, str | None, bool]] = set()
    subject = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NS}
    for binding in objects():
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if subject not in binding["subjects"]:
            continue
        role: Obj = find(binding["roleRef"]["kind"], binding["roleRef"]["name"])
        namespaced = binding["kind"] == "RoleBinding"
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or [None]:
                            out.add((group, resource, verb, name, namespaced))
    return out


def used_permission(
    a: Access, grants: set[tuple[str, str, str, str | None, bool]]
) -> set[tuple[str, str, str, str | None, bool]]:
    """The grants that let request `a` through: a namespaced one for a request in our own
    namespace if there is one (a Role is what it is meant to use), else the cluster's."""
    matching = {
        g
        for g in grants
        if g[:3] == (a.group, a.resource, a.verb)
        and (g[3] is None or g[3] == a.name)
        and (a.namespace == NS if g[4] else True)
    }
    namespaced = {g for g in matching if g[4]}
    return namespaced or matching


async def test_the_controller_uses_every_permission_it_has_and_no_other(
    kube: FakeKubeAPI, ebb: EbbClient, nats_config: NatsConfig, tmp_path: Path
) -> None:
    kube.add_namespace(NS)
    kube.add("priorityclasses", find("PriorityClass", "ebb-batch"))
    labels = {"app.kubernetes.io/name": "ebb-controller"}
    kube.add(
        "deployments",
        {
            "metadata": {"name": "ebb-controller", "labels": labels},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "controller", "image": "ebb:0.1.0"}]},
                },
            },
        },
        NS,
    )
    me = kube.add_pod(
        {
            "metadata": {"name": "ebb-controller-0", "labels": labels},
            "spec": {"containers": [{"name": "controller", "image": "ebb:0.1.0"}]},
        },
        NS,
    )
    offline(kube, "off-0", cpu="4")
    for n in range(2):
        kube.add_node(
            f"mix-{n}",
            labels={"ebb.io/pool": "mixed"},
            allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"},
        )
    job = await submit(ebb, tmp_path / "job", workers=4, cpu=2)

    async with kube.api_client() as api:
        settings = KubeConfig(
            namespace=NS,
            nats=nats_config,
            priority_class="ebb-batch",
            owner_deployment="ebb-controller",
            tidal=TidalConfig(sample_s=0.05, lead_s=0.5, window=3),
        )
        config = await from_cluster(settings, api, pod_name=me["metadata"]["name"])
        assert config.owner is not None and config.image
        elector = LeaderElector(
            api, namespace=NS, name="ebb-controller", identity="c0", lease_s=1, renew_s=0.2
        )
        controller = Controller(
            ControllerConfig(nats=nats_config, resync_s=0.1),
            KubernetesBackend(config, api, signer=identity.Trust.new("ebb").worker_signer()),
            elector=elector,
        )
        run = asyncio.create_task(controller.run())
        try:

            def workers() -> list[Obj]:
                return [
                    p
                    for p in kube.list_pods(NS, label_selector=f"{JOB_LABEL}={job}")
                    if not p["metadata"].get("deletionTimestamp")
                ]

            await kube.wait_for(lambda: len(workers()) >= 2, timeout=30, what="workers")
            await kube.wait_for(
                lambda: all(
                    kube.get("secrets", credentials_secret_name(p["metadata"]["name"]), NS)
                    for p in workers()
                ),
                timeout=30,
                what="their credentials",
            )
            await kube.wait_for(
                lambda: any(tidal_state(kube, f"mix-{n}") == "offline" for n in range(2)),
                timeout=30,
                what="a mixed node lent",
            )
            renewed = kube.get("leases", "ebb-controller", NS)
            assert renewed is not None
            await kube.wait_for(
                lambda: (
                    (kube.get("leases", "ebb-controller", NS) or {})["metadata"]["resourceVersion"]
                    != renewed["metadata"]["resourceVersion"]
                ),
                timeout=10,
                what="the lease renewed",
            )
            await ebb.cancel(job)
            await kube.wait_for(lambda: not workers(), timeout=30, what="the workers removed")
        finally:
            controller.request_stop()
            await asyncio.gather(run, return_exceptions=True)

    requests = [a for r in kube.requests if (a := access(r.method, r.path, r.query))]
    denied = sorted({str(a) for a in requests if not allowed(SERVICE_ACCOUNT, NS, a)})
    assert not denied, f"k8s/base/rbac.yaml does not let the controller do: {denied}"
    grants = granted()
    used = set().union(*(used_permission(a, grants) for a in requests))
    unused = sorted(str(g) for g in grants - used)
    assert not unused, f"k8s/base/rbac.yaml grants what the controller never uses: {unused}"
