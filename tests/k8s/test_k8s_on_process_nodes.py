"""`kubectl apply -k k8s/overlays/dev` on a control plane built from Kubernetes' own code,
with nodes whose pods really run (tests/controlplane/kubelet.py): NATS, the shard master,
the controller, the gateway and the nodes' model caches start from the manifests as they are
(their commands, environment, Secrets, ConfigMaps, probes and the controller's ServiceAccount
token), become ready, and answer a client that reaches NATS through its Service with the
credentials k8s/make-secrets.sh made; a job runs on worker pods the controller creates, with
its data and model in an object store (moto's S3 server, which the pods reach at their
bridge's address), through worker pods deleted by force and a node drained."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from ebb.client.sdk import EbbClient
from ebb.common.job import parse_job
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.submission import SubmitError
from tests.controlplane import ControlPlane, prepare_install, rolled_out
from tests.controlplane.kubelet import ProcessNodes
from tests.controlplane.nodes import NodesThread
from tests.helpers import ASSETS, job_spec, wait_until, write_dataset, write_model
from tests.k8s.harness import NS
from tests.objectstore import MotoS3, assert_exactly_once, create_bucket, s3, s3_environment, upload

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
SERVICES_NODE = "node-a"
"""In no pool: the services run here, never a worker."""
WORKER_NODES = ("node-b", "node-c")
"""The offline pool: workers and the model cache."""
BUCKET = "ebb-data"
"""The bucket of the manifests' data roots (s3://ebb-data/)."""


def _kubectl_ok(plane: ControlPlane, *args: str) -> str:
    done = plane.kubectl(*args, check=False)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


@dataclass
class Installed:
    plane: ControlPlane
    store_url: str
    """The object store, as the pods and this host reach it."""


def _overlay(folder: Path) -> Path:
    """The dev overlay as an operator adapts it, in an overlay of their own: the master's data
    roots also hold the suite's modelets (tests/assets, on every node's disk here, as in an
    image), which jobs name in pipeline.code_paths."""
    folder.mkdir(parents=True, exist_ok=True)
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "ebb-master"},
        "spec": {"template": {"spec": {"containers": [{
            "name": "master",
            "env": [{"name": "EBB_DATA_ROOTS", "value": f"s3://{BUCKET}/,{ASSETS}"}],
        }]}}},
    }  # fmt: skip
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes bases by relative path only.
        "resources": [os.path.relpath(OVERLAY, folder)],
        "patches": [{"patch": json.dumps(patch)}],
    }
    (folder / "kustomization.yaml").write_text(json.dumps(kustomization))
    return folder


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> Iterator[Installed]:
    """The dev overlay installed as docs/deployment.md says, the object-store Secrets
    included, on three nodes that run their pods: the services on node-a (the offline nodes
    cordoned while they are placed: the model cache's DaemonSet goes there all the same), the
    offline pool node-b and node-c; NATS's claim bound to a hostPath PersistentVolume."""
    plane = control_plane
    root = Path("/var/lib/ebb-test-kubelet") / uuid.uuid4().hex[:8]
    nodes = {SERVICES_NODE: {}, **{n: {"ebb.io/pool": "offline"} for n in WORKER_NODES}}
    try:
        with NodesThread(
            plane,
            make=lambda api: ProcessNodes(api, nodes, root=root, apiserver_port=plane.port),
        ) as agents:
            store = MotoS3(process=True, host=cast(ProcessNodes, agents.agent).host_ip).start()
            try:
                create_bucket(store.url, BUCKET)
                prepare_install(plane, root / "install", gateway_key=KEY)
                for role in ("master", "worker", "gateway"):
                    _kubectl_ok(
                        plane, "-n", NS, "create", "secret", "generic", f"ebb-storage-{role}",
                        *(f"--from-literal={k}={v}" for k, v in s3_environment(store.url).items()),
                    )  # fmt: skip
                for node in WORKER_NODES:
                    _kubectl_ok(plane, "cordon", node)
                _kubectl_ok(plane, "apply", "-k", str(_overlay(root / "overlay")))
                rolled_out(plane, timeout_s=240)
                for node in WORKER_NODES:
                    _kubectl_ok(plane, "uncordon", node)
                yield Installed(plane, store.url)
            finally:
                # Deleted while the nodes still run them: each pod stopped in its grace period.
                plane.kubectl("delete", "namespace", NS, "--timeout=120s", check=False)
                store.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def client(installed: Installed) -> AsyncIterator[EbbClient]:
    """A client from this host, through the ebb-nats Service's ClusterIP, with the client
    credentials the install made."""
    plane = installed.plane
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


def _pods(plane: ControlPlane, *selector: str) -> list[dict[str, Any]]:
    found = json.loads(_kubectl_ok(plane, "-n", NS, "get", "pods", *selector, "-o", "json"))
    return cast(list[dict[str, Any]], found["items"])


def test_every_service_of_the_dev_overlay_starts_and_becomes_ready(installed: Installed) -> None:
    """Each workload rolls out; the services where the nodes' labels and cordons put them,
    the model cache on each offline node (its DaemonSet's affinity)."""
    rolled_out(installed.plane, timeout_s=240)
    placed: dict[str, set[str]] = {}
    for pod in _pods(installed.plane):
        name = pod["metadata"]["labels"]["app.kubernetes.io/name"]
        placed.setdefault(name, set()).add(pod["spec"]["nodeName"])
    assert placed == {
        "ebb-nats": {SERVICES_NODE},
        "ebb-master": {SERVICES_NODE},
        "ebb-controller": {SERVICES_NODE},
        "ebb-gateway": {SERVICES_NODE},
        "ebb-model-cache": set(WORKER_NODES),
    }


async def test_the_installed_master_answers_a_client_through_the_nats_service(
    installed: Installed, client: EbbClient, tmp_path: Path
) -> None:
    """The master answers over NATS, and refuses a job whose input is outside the data roots
    the manifests give it (s3://ebb-data/), saying so."""
    reply = await client.status()
    assert reply.ok
    spec = parse_job(job_spec(tmp_path, input_uri="/srv/elsewhere/data"))
    with pytest.raises(SubmitError) as refused:
        await client.submit(spec, accept_timeout_s=60)
    assert f"s3://{BUCKET}/" in str(refused.value), str(refused.value)


async def test_a_job_on_worker_pods_loses_no_row_to_pods_deleted_by_force_or_a_drained_node(
    installed: Installed, client: EbbClient, tmp_path: Path
) -> None:
    """A job submitted over NATS runs on worker pods the controller creates on the offline
    nodes (their own NATS credentials, the workers' storage Secret, the model through the
    node's cache), with the default lease. Mid-job a worker pod is deleted with
    `--grace-period=0 --force` (its processes killed; the controller tells the master, which
    frees its shards at once), then the node of a running worker is drained (`kubectl drain`:
    its workers evicted, each stopping in its grace period). The controller launches others,
    on the offline node left; the job succeeds with every row once, and its workers end."""
    plane = installed.plane
    fs = s3(installed.store_url)
    rows = 24_000
    upload(fs, write_dataset(tmp_path / "data", rows=rows, files=2), f"{BUCKET}/in")
    fs.pipe_file(f"{BUCKET}/models/model.onnx", write_model(tmp_path / "model.onnx").read_bytes())
    out = f"{BUCKET}/out-{uuid.uuid4().hex[:8]}"
    spec = job_spec(
        tmp_path,
        rows_per_shard=1_000,
        workers=(2, 2),
        input_uri=f"s3://{BUCKET}/in",
        output_uri=f"s3://{out}",
    )
    del spec["fault"]  # the defaults, as users run
    # Half a second a batch: 12 shards (a row group each) of 16 batches keep two workers a
    # minute or so, long enough for what happens to them mid-job.
    spec["pipeline"]["stages"][0] = {
        "name": "preprocess",
        "modelet": "ebbtest_modelets:Slow",
        "params": {"seconds_per_batch": 0.5},
        "batch_size": 128,
    }
    spec["pipeline"]["stages"][1]["model"] = f"s3://{BUCKET}/models/model.onnx"
    job = await client.submit(parse_job(spec), accept_timeout_s=60)
    selector = f"-l=ebb.io/job={job}"
    seen: dict[str, str] = {}
    """Every worker pod of the job seen, by name: its node."""

    async def watch() -> None:
        while True:
            for p in await asyncio.to_thread(_pods, plane, selector):
                seen[p["metadata"]["name"]] = p["spec"].get("nodeName", "")
            await asyncio.sleep(0.5)

    def two_running(without: str = "") -> list[dict[str, Any]] | None:
        pods = [
            p
            for p in _pods(plane, selector)
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ]
        names = {p["metadata"]["name"] for p in pods}
        return pods if len(pods) == 2 and without not in names else None

    async def committed() -> bool:
        status = await client.job(job)
        assert status.state not in ("FAILED", "CANCELLED"), status.reason
        return status.rows_done > 0

    watcher = asyncio.create_task(watch())
    try:
        first = await wait_until(two_running, timeout=180, what="two workers")
        await wait_until(committed, timeout=120, what="a shard committed")

        # A worker pod removed by force: its processes die with it.
        victim = first[0]["metadata"]["name"]
        await asyncio.to_thread(
            _kubectl_ok, plane, "-n", NS, "delete", "pod", victim, "--grace-period=0", "--force"
        )
        replaced = await wait_until(
            lambda: two_running(without=victim), timeout=180, what="a worker in its place"
        )
        originals = {p["metadata"]["name"] for p in first}
        survivor = next(p for p in replaced if p["metadata"]["name"] in originals)
        newcomer = next(p["metadata"]["name"] for p in replaced if p is not survivor)

        async def leasing(worker: str) -> bool:
            return worker in (await client.job(job)).workers_busy

        # Both at work (the newcomer holds a lease: it runs its loop, and a SIGTERM now is a
        # drain, not the end of a process still importing its modules).
        await wait_until(lambda: leasing(newcomer), timeout=120, what="the newcomer at work")

        # A node drained as for an upgrade: its workers evicted, each stopped in its grace
        # period: the one that has run from the start is mid-shard. Each finishes or hands
        # back what it holds and exits.
        drained = survivor["spec"]["nodeName"]
        before = await client.job(job)
        assert before.state == "RUNNING" and before.rows_done < rows, "the drain comes mid-job"
        try:
            await asyncio.to_thread(
                _kubectl_ok, plane, "drain", drained,
                "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=180s",
            )  # fmt: skip
            final = await asyncio.wait_for(client.wait(job), timeout=400)
        finally:
            await asyncio.to_thread(_kubectl_ok, plane, "uncordon", drained)
        # The job's workers end with it.
        await wait_until(lambda: not _pods(plane, selector), timeout=120, what="workers gone")
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    assert final.state == "SUCCEEDED", final.reason
    assert (final.rows_done, final.error_rows) == (rows, 0)
    assert_exactly_once(fs, out, rows)
    # The forced one counted lost to the cluster (nobody's fault); the evicted ones ended as
    # drained workers do, none killed (counted drained unless the job ended first: one may
    # finish the job's last shard in its grace period).
    assert final.workers_lost == {"capacity": 1}, final.workers_lost
    # Each was replaced, and every worker ran in the offline pool.
    assert len(seen) >= 4, seen
    assert set(seen.values()) <= set(WORKER_NODES), seen
