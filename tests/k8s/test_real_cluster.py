"""The Kubernetes backend against a real cluster: the suite's control plane (built from
Kubernetes' own code, tests/controlplane), or with EBB_TEST_CLUSTER=1 the cluster of the
current kubeconfig context (or KUBECONFIG).

It works in a namespace of its own, deleted at the end. On a cluster of yours it needs rights
to create namespaces, pods and leases there, and to list nodes and pods. The worker pod runs
EBB_TEST_IMAGE (default ebb:latest) against no NATS: the test only needs it to exist, be seen,
and be drained.

    EBB_TEST_CLUSTER=1 EBB_TEST_IMAGE=registry.example/ebb:dev pytest tests/k8s/test_real_cluster.py
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from ebb.common.messaging.messages import JobStatus
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.election import LeaderElector
from ebb.controller.kube.backend import KubeConfig, KubernetesBackend, pod_name
from tests.controlplane import ControlPlane
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def plane(request: pytest.FixtureRequest) -> ControlPlane | None:
    """The suite's control plane, unless EBB_TEST_CLUSTER names the kubeconfig's cluster."""
    if os.environ.get("EBB_TEST_CLUSTER"):
        return None
    found: ControlPlane = request.getfixturevalue("control_plane")
    return found


@pytest.fixture
async def api(plane: ControlPlane | None) -> AsyncIterator[ApiClient]:
    if plane is None:
        await kube_config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        async with ApiClient() as client:
            yield client
        return
    async with plane.api_client() as client:
        yield client


@pytest.fixture
async def namespace(api: ApiClient) -> AsyncIterator[str]:
    name = f"ebb-test-{uuid.uuid4().hex[:8]}"
    core: Any = CoreV1Api(api)
    await core.create_namespace({"metadata": {"name": name}})

    async def has_default_account() -> bool:
        # Made by the controller manager a moment after the namespace: pods wait for it.
        try:
            await core.read_namespaced_service_account("default", name)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    await wait_until(has_default_account, timeout=60, what="the default ServiceAccount")
    try:
        yield name
    finally:
        await core.delete_namespace(name)


async def test_backend_sees_the_cluster_launches_and_drains_a_worker(
    api: ApiClient, namespace: str
) -> None:
    core: Any = CoreV1Api(api)
    nodes = (await core.list_node()).items
    config = KubeConfig(
        namespace=namespace,
        image=os.environ.get("EBB_TEST_IMAGE", "ebb:latest"),
        nats=NatsConfig(url="nats://127.0.0.1:1"),
        nats_secret=None,
        service_account=None,
        tidal=None,
        grace_s=5,
    )
    backend = KubernetesBackend(config, api)
    agents = [asyncio.create_task(a) for a in backend.agents().values()]
    try:
        # The informers list and watch real nodes and pods.
        await wait_until(lambda: len(backend.nodes.items) == len(nodes), timeout=60)
        job = JobStatus(id=f"t{uuid.uuid4().hex[:8]}", name="cluster-test", state="RUNNING")
        await backend.launch(job, "real-cluster-worker")
        pod = await core.read_namespaced_pod(pod_name("real-cluster-worker"), namespace)
        assert pod.metadata.labels["ebb.io/job"] == job.id

        async def seen() -> bool:
            return any(w.id == pod.metadata.name for w in await backend.observe())

        await wait_until(seen, timeout=60, what="the worker pod in the informer")
        await backend.terminate(pod.metadata.name, grace_s=5)

        async def gone() -> bool:
            try:
                await core.read_namespaced_pod(pod.metadata.name, namespace)
            except ApiException as e:
                return e.status == 404
            return False

        await wait_until(gone, timeout=120, what="the worker pod deleted")
    finally:
        for agent in agents:
            agent.cancel()
        await asyncio.gather(*agents, return_exceptions=True)


async def test_one_of_two_electors_leads(api: ApiClient, namespace: str) -> None:
    first = LeaderElector(api, namespace=namespace, name="lead", identity="a", lease_s=5)
    second = LeaderElector(api, namespace=namespace, name="lead", identity="b", lease_s=5)
    assert await first.try_acquire()
    assert not await second.try_acquire()
    await first.release()
    assert await wait_until(second.try_acquire, timeout=30, interval=0.5, what="a takeover")
