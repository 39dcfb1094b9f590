"""`kubectl apply -k k8s/overlays/dev` on a control plane built from Kubernetes' own code,
with a node whose pods really run (tests/controlplane/kubelet.py): NATS, the shard master,
the controller, the gateway and the node's model cache start from the manifests as they are
(their commands, environment, Secrets, ConfigMaps, probes and the controller's ServiceAccount
token), become ready, and answer a client that reaches NATS through its Service with the
credentials k8s/make-secrets.sh made."""

from __future__ import annotations

import base64
import json
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ebb.client.sdk import EbbClient
from ebb.common.job import parse_job
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.submission import SubmitError
from tests.controlplane import ControlPlane, prepare_install, rolled_out
from tests.controlplane.kubelet import ProcessNodes
from tests.controlplane.nodes import NodesThread
from tests.helpers import job_spec
from tests.k8s.harness import NS

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="pods run in namespaces of their own: needs root and iproute2",
    ),
]

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-ebb-test"
OVERLAY = REPO / "k8s" / "overlays" / "dev"


def _kubectl_ok(plane: ControlPlane, *args: str) -> str:
    done = plane.kubectl(*args, check=False)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The dev overlay installed as docs/deployment.md says, on one node of the offline pool
    (everything goes there), NATS's claim bound to a hostPath PersistentVolume."""
    plane = control_plane
    root = Path("/var/lib/ebb-test-kubelet") / uuid.uuid4().hex[:8]
    try:
        with NodesThread(
            plane,
            make=lambda api: ProcessNodes(
                api, {"node-a": {"ebb.io/pool": "offline"}}, root=root, apiserver_port=plane.port
            ),
        ):
            try:
                prepare_install(plane, root / "install", gateway_key=KEY)
                _kubectl_ok(plane, "apply", "-k", str(OVERLAY))
                yield plane
            finally:
                # Deleted while the node still runs them: each pod stopped in its grace period.
                plane.kubectl("delete", "namespace", NS, "--timeout=120s", check=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def client(installed: ControlPlane) -> AsyncIterator[EbbClient]:
    """A client from this host, through the ebb-nats Service's ClusterIP, with the client
    credentials the install made."""
    plane = installed
    service = json.loads(_kubectl_ok(plane, "-n", NS, "get", "service", "ebb-nats", "-o", "json"))
    secret = json.loads(
        _kubectl_ok(plane, "-n", NS, "get", "secret", "ebb-nats-client", "-o", "json")
    )
    config = NatsConfig(
        url=f"nats://{service['spec']['clusterIP']}:4222",
        prefix="ebb",
        creds=base64.b64decode(secret["data"]["creds"]).decode(),
        first_connect_timeout_s=60,
    )
    async with await EbbClient.connect(config) as c:
        yield c


def test_every_service_of_the_dev_overlay_starts_and_becomes_ready(installed: ControlPlane) -> None:
    rolled_out(installed, timeout_s=240)


async def test_the_installed_master_answers_a_client_through_the_nats_service(
    installed: ControlPlane, client: EbbClient, tmp_path: Path
) -> None:
    """The master answers over NATS, and refuses a job whose input is outside the data roots
    the manifests give it (s3://ebb-data/), saying so."""
    reply = await client.status()
    assert reply.ok and reply.jobs == []
    spec = parse_job(job_spec(tmp_path, input_uri="/srv/elsewhere/data"))
    with pytest.raises(SubmitError) as refused:
        await client.submit(spec, accept_timeout_s=60)
    assert "s3://ebb-data/" in str(refused.value), str(refused.value)
