"""Fixtures: a control plane built from Kubernetes' own code (one per module that asks:
`control_plane`); a started fake API server, and a real client pointed at it; a real
shard master, a client of it, and controller harnesses on the fake server.

`@pytest.mark.kube(run_kubelet=False, history_limit=5, ...)` passes options to FakeKubeAPI.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient
from nats.aio.client import Client as NATS

from ebb.client.sdk import EbbClient
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.shard_master.service import MasterConfig
from tests.controlplane import ControlPlane
from tests.helpers import ASSETS
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.harness import NS, Harness
from tests.k8s.manifests import access, allowed, find
from tests.scripted_master import ScriptedMaster
from tests.shard_master.test_master import Master


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kube(**options): options for the FakeKubeAPI fixture")


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler of one release, built
    once per machine (tests/controlplane/build.sh, `make test`), with no nodes: one for each
    module that asks (started in seconds), so that no module sees another's objects."""
    if shutil.which("go") is None:
        pytest.skip("go not found: the control plane cannot be built on this machine")
    plane = ControlPlane(tmp_path_factory.mktemp("controlplane"))
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def workers_plane(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> ControlPlane:
    """The module's control plane with what worker pods need, as k8s/ makes it: the
    namespace, the batch PriorityClass and the workers' ServiceAccount (admission refuses a pod
    that names a class or an account that does not exist)."""
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        find("PriorityClass", "ebb-batch"),
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "ebb-worker", "namespace": NS},
        },
    ]
    path = tmp_path_factory.mktemp("workers") / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    control_plane.kubectl("apply", "-f", str(path))
    return control_plane


@pytest.fixture
async def kube(request: pytest.FixtureRequest) -> AsyncIterator[FakeKubeAPI]:
    marker = request.node.get_closest_marker("kube")
    async with FakeKubeAPI(**(marker.kwargs if marker else {})) as api:
        yield api


@pytest.fixture
async def client(kube: FakeKubeAPI) -> AsyncIterator[ApiClient]:
    async with kube.api_client() as api_client:
        yield api_client


@pytest.fixture
async def master(nats_config: NatsConfig, tmp_path: Path) -> AsyncIterator[Master]:
    config = MasterConfig(nats=nats_config, id="m", data_roots=[str(tmp_path), str(ASSETS)])
    async with Master(config) as m:
        yield m


@pytest.fixture
async def ebb(nats_config: NatsConfig, master: Master) -> AsyncIterator[EbbClient]:
    async with await EbbClient.connect(nats_config) as client:
        yield client


@pytest.fixture
async def harness_factory(
    kube: FakeKubeAPI, nats_config: NatsConfig, ebb: EbbClient
) -> AsyncIterator[Any]:
    made: list[Harness] = []

    def make(**config: Any) -> Harness:
        h = Harness(kube, nats_config, ebb.nc, **config)
        made.append(h)
        return h

    yield make
    for h in made:
        await h.close()


@pytest.fixture
async def controllers_rbac(kube: FakeKubeAPI) -> AsyncIterator[None]:
    """Every request the controller made in a test, k8s/base/rbac.yaml lets it make
    (`pytest.mark.usefixtures("controllers_rbac")`)."""
    yield
    denied = sorted(
        {
            str(a)
            for r in kube.requests
            if (a := access(r.method, r.path, r.query)) and not allowed("ebb-controller", NS, a)
        }
    )
    assert not denied, f"k8s/base/rbac.yaml does not let the controller do: {denied}"


@pytest.fixture
async def scripted(nc: NATS, nats_config: NatsConfig) -> AsyncIterator[ScriptedMaster]:
    """A master whose answers the test scripts (tests/scripted_master.py), over a real
    nats-server."""
    master = ScriptedMaster(nc, nats_config)
    await master.start()
    yield master
    await master.close()
