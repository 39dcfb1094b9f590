"""Pods that really run, on nodes of the suite's kubelet (tests/controlplane/kubelet.py), under
the control plane built from Kubernetes' own code: what a pod is given (Secrets, ConfigMaps,
the downward API, a Service by its name, its ServiceAccount's token) and how it ends (exit
codes, probes, deletion with its grace period, removal by force)."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.controlplane import ControlPlane
from tests.controlplane.kubelet import ProcessNodes
from tests.controlplane.nodes import NodesThread
from tests.helpers import wait_until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="pods run in namespaces of their own: needs root and iproute2",
    ),
]

NODE = "proc-0"


@pytest.fixture(scope="module")
def nodes(control_plane: ControlPlane) -> Iterator[NodesThread]:
    root = Path("/var/lib/ebb-test-kubelet") / uuid.uuid4().hex[:8]
    try:
        with NodesThread(
            control_plane,
            make=lambda api: ProcessNodes(
                api,
                {NODE: {"ebb.io/pool": "offline"}},
                root=root,
                apiserver_port=control_plane.port,
            ),
        ) as thread:
            yield thread
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def namespace(control_plane: ControlPlane, nodes: NodesThread) -> Iterator[str]:
    name = f"p-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", name)
    # Its default ServiceAccount comes from the controller manager, a moment later: a pod
    # made before is refused.
    control_plane.kubectl(
        "-n", name, "wait", "--for=create", "serviceaccount/default", "--timeout=60s"
    )
    yield name
    control_plane.kubectl("delete", "namespace", name, "--timeout=60s")


def apply(plane: ControlPlane, namespace: str, *objects: dict[str, Any]) -> None:
    path = plane.root / f"apply-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    done = plane.kubectl("-n", namespace, "apply", "-f", str(path), check=False)
    assert done.returncode == 0, done.stderr


def pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    """A pod running `script` with the project's Python."""
    container = {
        "name": "main",
        "image": "ebb:0.1.0",
        "command": ["python", "-c", textwrap.dedent(script)],
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": spec.pop("labels", {"app": name})},
        "spec": {"containers": [container], "restartPolicy": "Never", **spec},
    }


def read(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    done = plane.kubectl("-n", namespace, "get", "pod", name, "-o", "json", check=False)
    return json.loads(done.stdout) if done.returncode == 0 else None


def ready(plane: ControlPlane, namespace: str, name: str) -> bool:
    found = read(plane, namespace, name) or {}
    conditions = found.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


async def ended(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        found = read(plane, namespace, name)
        if found and found["status"].get("phase") in ("Succeeded", "Failed"):
            return found
        return None

    result: dict[str, Any] = await wait_until(done, timeout=90, interval=0.3, what=f"{name} ended")
    return result


async def test_a_pod_gets_its_secret_config_map_downward_api_service_and_token(
    control_plane: ControlPlane, namespace: str
) -> None:
    plane = control_plane
    apply(
        plane,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s"},
            "stringData": {"token": "abc"},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c"},
            "data": {"greeting": "hi"},
        },
        pod(
            "web",
            """
            import http.server, socketserver
            class H(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200); self.end_headers(); self.wfile.write(b"pong")
            socketserver.TCPServer(("", 8080), H).serve_forever()
            """,
            container={
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
            },
            restartPolicy="Always",
        ),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    )
    await wait_until(
        lambda: ready(plane, namespace, "web"), timeout=60, interval=0.3, what="web ready"
    )
    apply(
        plane,
        namespace,
        pod(
            "client",
            """
            import os, sys, time, urllib.request
            token = open("/etc/s/token").read()
            sa = open("/var/run/secrets/kubernetes.io/serviceaccount/token").read()
            ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
            # A ready pod reaches the Service's EndpointSlice a moment later, in a real
            # cluster too: a client retries its first connection, as real ones do.
            deadline = time.monotonic() + 30
            while True:
                try:
                    body = urllib.request.urlopen("http://web/", timeout=10).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            wanted = ("abc", "hi", "client", os.environ["NS"], b"pong")
            got = (token, os.environ["GREETING"], os.environ["ME"], ns, body)
            sys.exit(0 if got == wanted and sa.count(".") == 2 else 3)
            """,
            container={
                "env": [
                    {
                        "name": "GREETING",
                        "valueFrom": {"configMapKeyRef": {"name": "c", "key": "greeting"}},
                    },
                    {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                ],
                "volumeMounts": [{"name": "s", "mountPath": "/etc/s", "readOnly": True}],
            },
            volumes=[{"name": "s", "secret": {"secretName": "s"}}],
        ),
    )
    found = await ended(plane, namespace, "client")
    terminated = found["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (found["status"]["phase"], terminated["exitCode"]) == ("Succeeded", 0)


async def test_exit_codes_become_container_statuses(
    control_plane: ControlPlane, namespace: str
) -> None:
    apply(control_plane, namespace, pod("fails", "import sys; sys.exit(7)"))
    found = await ended(control_plane, namespace, "fails")
    terminated = found["status"]["containerStatuses"][0]["state"]["terminated"]
    assert found["status"]["phase"] == "Failed"
    assert (terminated["exitCode"], terminated["reason"]) == (7, "Error")


async def test_deletion_sends_sigterm_then_sigkill_once_the_grace_period_is_spent(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """One pod stops on SIGTERM (and says it was asked); one ignores it and is killed when its
    grace period ends. Both are then removed from the API."""
    plane = control_plane
    marks = Path("/var/lib/ebb-test-kubelet") / f"marks-{uuid.uuid4().hex[:6]}"
    marks.mkdir(parents=True)
    script = """
        import os, signal, sys, time
        def stop(*_):
            open(os.path.join("{marks}", "{name}.term"), "w").write(str(time.time()))
            {after}
        signal.signal(signal.SIGTERM, stop)
        open(os.path.join("{marks}", "{name}.pid"), "w").write(str(os.getpid()))
        while True:
            time.sleep(0.1)
        """
    apply(
        plane,
        namespace,
        pod("polite", script.format(marks=marks, name="polite", after="sys.exit(0)"),
            terminationGracePeriodSeconds=30),
        pod("stubborn", script.format(marks=marks, name="stubborn", after="pass"),
            terminationGracePeriodSeconds=2),
    )  # fmt: skip
    try:
        for name in ("polite", "stubborn"):
            await wait_until((marks / f"{name}.pid").exists, timeout=60, what=name)
        pids = {n: int((marks / f"{n}.pid").read_text()) for n in ("polite", "stubborn")}
        plane.kubectl("-n", namespace, "delete", "pod", "polite", "stubborn", "--wait=false")
        await wait_until(
            lambda: all(read(plane, namespace, n) is None for n in pids),
            timeout=60,
            interval=0.3,
            what="both pods removed",
        )
        assert (marks / "polite.term").exists() and (marks / "stubborn.term").exists()
        for name, pid in pids.items():
            assert not _alive(pid), f"{name}'s process {pid} outlived its pod"
    finally:
        shutil.rmtree(marks, ignore_errors=True)


async def test_a_pod_removed_by_force_loses_its_processes(
    control_plane: ControlPlane, namespace: str
) -> None:
    plane = control_plane
    marks = Path("/var/lib/ebb-test-kubelet") / f"marks-{uuid.uuid4().hex[:6]}"
    marks.mkdir(parents=True)
    try:
        apply(
            plane,
            namespace,
            pod(
                "forced",
                f"""
                import os, time
                open("{marks}/pid", "w").write(str(os.getpid()))
                while True:
                    time.sleep(0.1)
                """,
            ),
        )
        await wait_until((marks / "pid").exists, timeout=60, what="the pod running")
        pid = int((marks / "pid").read_text())
        plane.kubectl("-n", namespace, "delete", "pod", "forced", "--grace-period=0", "--force")
        assert read(plane, namespace, "forced") is None
        await wait_until(lambda: not _alive(pid), timeout=30, what="its process killed")
    finally:
        shutil.rmtree(marks, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"
