"""Nodes whose pods really run, as local processes: a kubelet for the suite, without images.

Each pod bound to one of these nodes gets what a pod gets from a kubelet and its runtime:

- **its own network**: a network namespace with an address of its own on a bridge of this
  host (10.N.0.0/16, N of POD_OCTETS), so that two pods may listen on the same port, as the
  manifests have them (every Ebb service serves metrics on 9400);
- **Services**: a userspace proxy (what kube-proxy's userspace mode did) listens on every
  Service's ClusterIP and port, on the host, and forwards each connection to a ready endpoint
  of its EndpointSlices; `kubernetes.default` goes to the API server. Names resolve through
  the pod's own /etc/hosts (`svc`, `svc.ns`, `svc.ns.svc`, `svc.ns.svc.cluster.local`, the
  headless Services' pods by their hostnames), rewritten as Services change;
- **its volumes** at their mount paths, in a mount namespace of the container's own:
  Secrets, ConfigMaps (their `items`), projected volumes (the ServiceAccount token from the
  TokenRequest API, bound to the pod; `kube-root-ca.crt`; the downward API's namespace),
  emptyDir, hostPath, and claims bound to hostPath PersistentVolumes;
- **its environment**: `env` (values, fieldRefs, Secret and ConfigMap keys), `envFrom`, and
  the `KUBERNETES_SERVICE_*` variables;
- **probes** (startup, readiness, liveness: httpGet and tcpSocket), **restarts** by the pod's
  restartPolicy with a kubelet's back-off, **exit codes** as container statuses;
- **deletion** with its grace period: SIGTERM, then SIGKILL when it is spent; a pod removed
  by force (`--grace-period=0 --force`) loses its processes too.

One concept, a pod's life on such a node (its parts read in the order a pod starts: network,
volumes, environment, containers, probes, deletion), with the Services it reaches in
services.py.

The image is not pulled: the container's command runs on this host's files, from IMAGES
(what an image's entrypoint would be), with the project's interpreter first on PATH, as an
image with Ebb installed has it. The paths the "image" needs (the interpreter's environment
and the source tree) stay visible even where a volume covers a parent (an emptyDir on /tmp).
Mount points a pod names are made on the host as empty folders if missing (/etc/ebb, /cache),
as a runtime makes them in an image's root, and removed when the node stops. Runs as root
(namespaces, mounts, links); user and group ids of a securityContext are not applied.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import logging
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from tests.controlplane.nodes import NodeAgent, _stamp, delete_now
from tests.controlplane.services import ServiceProxy, ip

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
POD_OCTETS = (128, 191)
"""Pods get 10.N.0.0/16 for an N drawn from these (and the bridge is named for it), so that
two suites on one machine do not share a network."""
BACKOFF_S = (10.0, 300.0)
"""A kubelet's restart back-off: 10 s, doubling, at most 5 minutes."""


def _image_paths() -> list[Path]:
    """What the containers' "image" is made of here: the interpreter's environment (the
    venv, and the Python it was made from) and the source tree (an editable install)."""
    paths = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), REPO}
    return sorted(paths)


def entrypoint(image: str) -> list[str]:
    """The entrypoint of an image the manifests name, on this host."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    binaries = Path(sys.executable).parent
    found = {
        "nats": [str(binaries / "nats-server")],
        "ebb": [],
    }.get(name)
    if found is None:
        raise ValueError(f"no entrypoint known for image {image!r}")
    return found


# --------------------------------------------------------------------------------------------
# Pods
# --------------------------------------------------------------------------------------------


class _Missing(LookupError):
    """A Secret or ConfigMap a pod needs does not exist (yet)."""


@dataclass
class _Container:
    spec: dict[str, Any]
    process: asyncio.subprocess.Process | None = None
    started_at: str = ""
    launched: float = 0.0
    """When this run began (monotonic), for a probe's initialDelaySeconds."""
    restarts: int = 0
    last: dict[str, Any] | None = None
    """lastState.terminated of the run before this one."""
    terminated: dict[str, Any] | None = None
    waiting: str = ""
    started: bool = False
    """Its startup probe passed (or it has none)."""
    ready: bool = False
    failures: dict[str, int] = field(default_factory=dict)
    """Consecutive failures by probe kind."""
    next_probe: dict[str, float] = field(default_factory=dict)
    """When each probe is next due (monotonic)."""

    def end(self) -> None:
        """Its process has exited: its terminated state, as a kubelet reports it (a signal's
        death as 128 + the signal)."""
        assert self.process is not None
        code = self.process.returncode or 0
        self.terminated = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": self.started_at,
            "finishedAt": _stamp(),
        }


class PodRun:
    """One pod on this node: its network, volumes and containers, from start to removal."""

    def __init__(self, node: ProcessNodes, pod: dict[str, Any], address: str) -> None:
        self.node = node
        self.pod = pod
        self.meta = pod["metadata"]
        self.address = address
        self.key = (self.meta["namespace"], self.meta["name"])
        short = hashlib.sha256(self.meta["uid"].encode()).hexdigest()[:8]
        self.netns = f"ebbp-{short}"
        self.veth = f"ebbv{short}"
        self.root = node.root / "pods" / f"{self.meta['namespace']}_{self.meta['name']}_{short}"
        self.containers = {c["name"]: _Container(c) for c in pod["spec"]["containers"]}
        self.deleting = False
        self.gone = False
        self.task: asyncio.Task[None] | None = None

    # ---- set-up ----------------------------------------------------------------------------

    def _network(self) -> None:
        ip("netns", "add", self.netns)
        ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        ip("link", "set", self.veth, "master", self.node.bridge, "up")
        inside = ("netns", "exec", self.netns, "ip")
        ip(*inside, "link", "set", "lo", "up")
        ip(*inside, "addr", "add", f"{self.address}/16", "dev", "eth0")
        ip(*inside, "link", "set", "eth0", "up")
        ip(*inside, "route", "add", "default", "via", self.node.host_ip)

    async def _volumes(self) -> dict[str, Path]:
        """Each volume's folder on the host (a hostPath's own path)."""
        out: dict[str, Path] = {}
        for volume in self.pod["spec"].get("volumes") or []:
            name = volume["name"]
            folder = self.root / "volumes" / name
            if "hostPath" in volume:
                out[name] = Path(volume["hostPath"]["path"])
                out[name].mkdir(parents=True, exist_ok=True)
                continue
            if "persistentVolumeClaim" in volume:
                out[name] = await self._claimed(volume["persistentVolumeClaim"]["claimName"])
                continue
            folder.mkdir(parents=True, exist_ok=True)
            out[name] = folder
            if "emptyDir" in volume:
                continue
            if "secret" in volume:
                await self._secret(folder, volume["secret"])
            elif "configMap" in volume:
                await self._config_map(folder, volume["configMap"])
            elif "projected" in volume:
                for source in volume["projected"]["sources"]:
                    await self._projected(folder, source)
            else:
                raise ValueError(f"volume {name}: kind not supported here: {sorted(volume)}")
        return out

    async def _claimed(self, claim: str) -> Path:
        found = await self.node.core.read_namespaced_persistent_volume_claim(
            claim, self.meta["namespace"]
        )
        volume = await self.node.core.read_persistent_volume(found.spec.volume_name)
        path = Path(volume.spec.host_path.path)
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def _data(self, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
        try:
            if kind == "secret":
                found = await self.node.core.read_namespaced_secret(name, self.meta["namespace"])
                return {k: base64.b64decode(v) for k, v in (found.data or {}).items()}
            found = await self.node.core.read_namespaced_config_map(name, self.meta["namespace"])
            data = {k: v.encode() for k, v in (found.data or {}).items()}
            data |= {k: base64.b64decode(v) for k, v in (found.binary_data or {}).items()}
            return data
        except ApiException as e:
            if e.status != 404:
                raise
            if optional:
                return None
            raise _Missing(f"{kind} {self.meta['namespace']}/{name} not found") from None

    @staticmethod
    def _write_items(
        folder: Path, data: dict[str, bytes], items: list[dict[str, Any]] | None
    ) -> None:
        chosen = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        for key, path in chosen:
            target = folder / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[key])

    async def _secret(self, folder: Path, source: dict[str, Any]) -> None:
        data = await self._data("secret", source["secretName"], bool(source.get("optional")))
        if data is not None:
            self._write_items(folder, data, source.get("items"))

    async def _config_map(self, folder: Path, source: dict[str, Any]) -> None:
        data = await self._data("configmap", source["name"], bool(source.get("optional")))
        if data is not None:
            self._write_items(folder, data, source.get("items"))

    async def _projected(self, folder: Path, source: dict[str, Any]) -> None:
        if "secret" in source:
            s = source["secret"]
            data = await self._data("secret", s["name"], bool(s.get("optional")))
            if data is not None:
                self._write_items(folder, data, s.get("items"))
        elif "configMap" in source:
            c = source["configMap"]
            data = await self._data("configmap", c["name"], bool(c.get("optional")))
            if data is not None:
                self._write_items(folder, data, c.get("items"))
        elif "serviceAccountToken" in source:
            t = source["serviceAccountToken"]
            body = {
                "spec": {
                    "audiences": [t["audience"]] if t.get("audience") else None,
                    "expirationSeconds": int(t.get("expirationSeconds") or 3607),
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": self.meta["name"],
                        "uid": self.meta["uid"],
                    },
                }
            }
            token = await self.node.core.create_namespaced_service_account_token(
                self.pod["spec"].get("serviceAccountName") or "default",
                self.meta["namespace"],
                body,
            )
            (folder / t["path"]).write_text(token.status.token)
        elif "downwardAPI" in source:
            for item in source["downwardAPI"]["items"]:
                value = self._field(item["fieldRef"]["fieldPath"])
                (folder / item["path"]).write_text(value)
        else:
            raise ValueError(f"projected source not supported here: {sorted(source)}")

    def _field(self, path: str) -> str:
        values: dict[str, str] = {
            "metadata.name": self.meta["name"],
            "metadata.namespace": self.meta["namespace"],
            "metadata.uid": self.meta["uid"],
            "spec.nodeName": self.pod["spec"]["nodeName"],
            "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName") or "default",
            "status.podIP": self.address,
            "status.hostIP": self.node.host_ip,
        }
        if path in values:
            return values[path]
        if path.startswith("metadata.labels['"):
            return str((self.meta.get("labels") or {}).get(path[17:-2], ""))
        raise ValueError(f"fieldRef {path} not supported here")

    async def _environment(self, container: dict[str, Any]) -> dict[str, str]:
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/root",
            "HOSTNAME": self.meta["name"],
            "KUBERNETES_SERVICE_HOST": self.node.kubernetes_ip,
            "KUBERNETES_SERVICE_PORT": "443",
            "KUBERNETES_SERVICE_PORT_HTTPS": "443",
            "PYTHONUNBUFFERED": "1",
        }
        for source in container.get("envFrom") or []:
            kind = "secret" if "secretRef" in source else "configmap"
            ref = source.get("secretRef") or source["configMapRef"]
            data = await self._data(kind, ref["name"], bool(ref.get("optional")))
            for k, v in (data or {}).items():
                env[source.get("prefix", "") + k] = v.decode()
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = _expand(str(item["value"]), env)
                continue
            ref = item.get("valueFrom") or {}
            if "fieldRef" in ref:
                env[item["name"]] = self._field(ref["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in ref or "configMapKeyRef" in ref:
                kind = "secret" if "secretKeyRef" in ref else "configmap"
                key_ref = ref.get("secretKeyRef") or ref["configMapKeyRef"]
                data = await self._data(kind, key_ref["name"], bool(key_ref.get("optional")))
                if data is not None and key_ref["key"] in data:
                    env[item["name"]] = data[key_ref["key"]].decode()
            else:
                raise ValueError(f"env {item['name']}: source not supported here: {sorted(ref)}")
        return env

    # ---- containers ------------------------------------------------------------------------

    def _script(
        self, container: dict[str, Any], volumes: dict[str, Path], env: dict[str, str]
    ) -> Path:
        """The container's start, as a shell script run in the pod's network namespace and a
        mount namespace of its own: volumes bound at their paths, the "image" paths bound
        back over any volume that covered them, /etc/hosts, the hostname, then exec."""
        stage = self.root / "image"
        lines = ["set -e"]
        images = _image_paths()
        for i, path in enumerate(images):
            lines.append(
                f"mkdir -p {stage}/{i} && mount --bind {shlex.quote(str(path))} {stage}/{i}"
            )
        for mount in container.get("volumeMounts") or []:
            source = volumes[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
            self.node.mount_point(Path(mount["mountPath"]), directory=source.is_dir())
            target = shlex.quote(mount["mountPath"])
            lines.append(f"mount --bind {shlex.quote(str(source))} {target}")
            if mount.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {target}")
        for i, path in enumerate(images):
            back = shlex.quote(str(path))
            lines.append(f"mkdir -p {back} && mount --bind {stage}/{i} {back}")
        lines.append(f"mount --bind {self.root / 'hosts'} /etc/hosts")
        lines.append(f"hostname {shlex.quote(self.meta['name'])}")
        lines.append(f"cd {shlex.quote(container.get('workingDir') or '/')}")
        command = container.get("command") or entrypoint(container["image"])
        argv = [_expand(a, env) for a in [*command, *(container.get("args") or [])]]
        assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        lines.append(f"exec env -i {assignments} {' '.join(shlex.quote(a) for a in argv)}")
        path = self.root / f"{container['name']}.sh"
        path.write_text("\n".join(lines) + "\n")
        return path

    async def _prepare(self) -> dict[str, Path]:
        """Volumes and environment, then each container's start script. A Secret or ConfigMap
        the pod needs (not `optional`) that does not exist yet keeps the pod waiting, tried
        again each second, as a kubelet does (ContainerCreating, a FailedMount event): Ebb's
        controller creates a worker's credential Secret only once the pod exists."""
        waiting = False
        while True:
            try:
                volumes = await self._volumes()
                return {
                    name: self._script(c.spec, volumes, await self._environment(c.spec))
                    for name, c in self.containers.items()
                }
            except _Missing as e:
                if not waiting:
                    waiting = True
                    for c in self.containers.values():
                        c.waiting = "ContainerCreating"
                    log.info("pod %s/%s waits: %s", *self.key, e)
                    await self._status(phase="Pending")
                await asyncio.sleep(1.0)

    async def _launch(self, c: _Container, script: Path) -> None:
        logfile = (self.root / f"{c.spec['name']}.log").open("ab")
        try:
            c.process = await asyncio.create_subprocess_exec(
                "ip", "netns", "exec", self.netns,
                "unshare", "--mount", "--uts", "--propagation", "private", "sh", str(script),
                stdout=logfile,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        finally:
            logfile.close()
        c.started_at = _stamp()
        c.launched = time.monotonic()
        c.terminated = None
        c.waiting = ""
        c.started = not c.spec.get("startupProbe")
        c.ready = False
        c.failures = {}
        c.next_probe = {}

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("pod %s/%s could not run", *self.key)
            await self._status(phase="Failed", reason="KubeletError", message=str(e)[:500])

    async def _run(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "hosts").write_text(self.node.proxy.hosts(self.meta["namespace"]))
        self._network()
        scripts = await self._prepare()
        for name, c in self.containers.items():
            await self._launch(c, scripts[name])
        await self._status()
        policy = self.pod["spec"].get("restartPolicy", "Always")
        loop = asyncio.get_running_loop()
        restart_at: dict[str, float] = {}
        while not self.deleting:
            changed = False
            for name, c in self.containers.items():
                if (
                    c.process is not None
                    and c.process.returncode is not None
                    and c.terminated is None
                ):
                    c.end()
                    c.ready = False
                    changed = True
                    again = policy == "Always" or (
                        policy == "OnFailure" and c.process.returncode != 0
                    )
                    if again:
                        delay = min(BACKOFF_S[0] * 2**c.restarts, BACKOFF_S[1])
                        restart_at[name] = loop.time() + delay
                        c.waiting = "CrashLoopBackOff" if c.restarts else ""
                if name in restart_at and loop.time() >= restart_at[name]:
                    del restart_at[name]
                    c.last, c.restarts = c.terminated, c.restarts + 1
                    await self._launch(c, scripts[name])
                    changed = True
                if c.terminated is None:
                    changed |= await self._probe(c)
            if changed:
                await self._status()
            if (
                policy != "Always"
                and all(c.terminated for c in self.containers.values())
                and not restart_at
            ):
                return
            await asyncio.sleep(0.2)

    async def _probe(self, c: _Container) -> bool:
        """Run the probes that are due, each on its own period (the startup probe alone until
        it passes); True when the container's state changed."""
        now = time.monotonic()
        kinds = ["startupProbe"] if not c.started else ["readinessProbe", "livenessProbe"]
        changed = False
        for kind in kinds:
            probe = c.spec.get(kind)
            if not probe:
                if kind == "readinessProbe" and not c.ready:
                    c.ready, changed = True, True
                continue
            due = c.next_probe.get(kind, c.launched + float(probe.get("initialDelaySeconds", 0)))
            if now < due:
                continue
            c.next_probe[kind] = now + float(probe.get("periodSeconds", 10))
            if await self._check(c.spec, probe):
                c.failures[kind] = 0
                if kind == "startupProbe":
                    c.started, changed = True, True
                elif kind == "readinessProbe" and not c.ready:
                    c.ready, changed = True, True
                continue
            c.failures[kind] = c.failures.get(kind, 0) + 1
            if kind == "readinessProbe" and c.ready:
                c.ready, changed = False, True
            if kind != "readinessProbe" and c.failures[kind] >= int(
                probe.get("failureThreshold", 3)
            ):
                log.info("pod %s/%s: %s of %s failed: killed", *self.key, kind, c.spec["name"])
                await self._kill(
                    c, grace=float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
                )
        return changed

    async def _check(self, container: dict[str, Any], probe: dict[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = _port(container, get["port"])
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.address, port), timeout
                )
                writer.write(
                    f"GET {get.get('path', '/')} HTTP/1.1\r\nHost: {self.address}\r\n"
                    "Connection: close\r\n\r\n".encode()
                )
                line = await asyncio.wait_for(reader.readline(), timeout)
                writer.close()
                status = int(line.split()[1]) if line.startswith(b"HTTP/") else 0
                return 200 <= status < 400
            except (OSError, TimeoutError, ValueError, IndexError):
                return False
        if "tcpSocket" in probe:
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        self.address, _port(container, probe["tcpSocket"]["port"])
                    ),
                    timeout,
                )
                writer.close()
                return True
            except (OSError, TimeoutError):
                return False
        raise ValueError(f"probe not supported here: {sorted(probe)}")

    async def _kill(self, c: _Container, *, grace: float) -> None:
        """SIGTERM to the container's processes, SIGKILL once `grace` is spent."""
        process = c.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    async def stop(self, grace: float) -> None:
        """The pod deleted: its containers stopped within `grace`, then removed from the API
        (unless it is gone already), its network and files with it."""
        self.deleting = True
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        await asyncio.gather(*(self._kill(c, grace=grace) for c in self.containers.values()))
        for c in self.containers.values():
            if c.process is not None and c.terminated is None:
                c.end()
        if not self.gone:
            with contextlib.suppress(ApiException):
                await self._status()
            await delete_now(self.node.core, self.pod)
        self.cleanup()

    def cleanup(self) -> None:
        ip("link", "del", self.veth, check=False)
        ip("netns", "del", self.netns, check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    async def _status(
        self, *, phase: str | None = None, reason: str = "", message: str = ""
    ) -> None:
        statuses = []
        for name, c in self.containers.items():
            if c.waiting:
                state: dict[str, Any] = {"waiting": {"reason": c.waiting}}
            elif c.terminated is not None:
                state = {"terminated": c.terminated}
            else:
                state = {"running": {"startedAt": c.started_at}}
            status: dict[str, Any] = {
                "name": name,
                "image": c.spec["image"],
                "imageID": "",
                "ready": c.ready,
                "started": c.started and "running" in state,
                "restartCount": c.restarts,
                "state": state,
            }
            if c.last is not None:
                status["lastState"] = {"terminated": c.last}
            statuses.append(status)
        if phase is None:
            ended = [c.terminated for c in self.containers.values()]
            policy = self.pod["spec"].get("restartPolicy", "Always")
            if policy != "Always" and all(ended):
                phase = "Succeeded" if all(e and e["exitCode"] == 0 for e in ended) else "Failed"
            else:
                phase = "Running"
        ready = all(c.ready for c in self.containers.values())
        now = _stamp()
        conditions = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": now},
            {"type": "Ready", "status": str(ready), "lastTransitionTime": now},
        ]
        body: dict[str, Any] = {
            "status": {
                "phase": phase,
                "conditions": conditions,
                "containerStatuses": statuses,
                "hostIP": self.node.host_ip,
                "podIP": self.address,
                "podIPs": [{"ip": self.address}],
                "startTime": self.meta.get("creationTimestamp") or now,
            }
        }
        if reason:
            body["status"] |= {"reason": reason, "message": message}
        try:
            await self.node.core.patch_namespaced_pod_status(
                self.meta["name"], self.meta["namespace"], body
            )
        except ApiException as e:
            if e.status != 404:
                raise


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {container['name']} has no port named {port}")


def _expand(value: str, env: dict[str, str]) -> str:
    """$(VAR) references, as Kubernetes expands them in env values, commands and args."""
    for k, v in env.items():
        value = value.replace(f"$({k})", v)
    return value


class ProcessNodes(NodeAgent):
    """Nodes whose pods run as processes of this host (see the module's docstring)."""

    node_type = "process"

    def __init__(
        self,
        api: ApiClient,
        nodes: dict[str, dict[str, Any]],
        *,
        root: Path,
        apiserver_port: int,
        allocatable: dict[str, str] | None = None,
    ) -> None:
        super().__init__(api, nodes, allocatable=allocatable)
        self.root = root
        octet = random.randint(*POD_OCTETS)
        self.bridge = f"ebbk{octet}"
        self.host_ip = f"10.{octet}.0.1"
        self.proxy = ServiceProxy(api, apiserver_port, self.bridge)
        self.runs: dict[str, PodRun] = {}
        """By pod uid."""
        self._addresses = (f"10.{octet}.{i // 250 + 1}.{i % 250 + 2}" for i in itertools.count())
        self.kubernetes_ip = ""
        self._stopping: set[asyncio.Task[None]] = set()
        self.made: set[Path] = set()
        """Mount points made on this host (their highest folder made)."""

    async def __aenter__(self) -> ProcessNodes:
        if os.geteuid() != 0:
            raise RuntimeError("process nodes need root (network namespaces, mounts)")
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.host_ip}/16", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        self.root.mkdir(parents=True, exist_ok=True)
        self.kubernetes_ip = await self._kubernetes_service()
        self._proxy_task = asyncio.create_task(self.proxy.run(), name="service-proxy")
        self._hosts_task = asyncio.create_task(self._rewrite_hosts(), name="pod-hosts")
        return await super().__aenter__()

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(run.stop(grace=2) for run in list(self.runs.values())))
        self.runs.clear()
        await asyncio.gather(*self._stopping, return_exceptions=True)
        for task in (self._proxy_task, self._hosts_task):
            task.cancel()
        await asyncio.gather(self._proxy_task, self._hosts_task, return_exceptions=True)
        await self.proxy.close()
        await super().__aexit__(*exc)
        ip("link", "del", self.bridge, check=False)
        self._remove_mount_points()

    def mount_point(self, target: Path, *, directory: bool) -> None:
        """A mount point a pod names, made on this host if missing (as a runtime makes one in
        an image's root); the highest folder made is removed again when the node stops."""
        folder = target if directory else target.parent
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        if missing:
            self.made.add(missing[-1])
        if not directory and not target.exists():
            target.touch()
            self.made.add(target)

    def _remove_mount_points(self) -> None:
        """What mount_point made, where nothing has been left in it."""
        for top in sorted(self.made, key=lambda p: len(p.parts), reverse=True):
            if top.is_file() and top.stat().st_size == 0:
                top.unlink()
                continue
            for folder, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # only if empty
        self.made.clear()

    async def _kubernetes_service(self) -> str:
        """The `kubernetes` Service's ClusterIP: the API server makes it a moment after it
        starts."""
        for _ in range(300):
            try:
                found = await self.core.read_namespaced_service("kubernetes", "default")
                return str(found.spec.cluster_ip)
            except ApiException as e:
                if e.status != 404:
                    raise
            await asyncio.sleep(0.2)
        raise RuntimeError("the API server made no `kubernetes` Service in 60 s")

    async def _rewrite_hosts(self) -> None:
        """Each pod's /etc/hosts as Services and endpoints change (in place: the pod sees it
        through its bind mount)."""
        while True:
            await self.proxy.changed.wait()
            self.proxy.changed.clear()
            for run in list(self.runs.values()):
                hosts = run.root / "hosts"
                if hosts.exists():
                    with hosts.open("r+") as f:
                        f.truncate(0)
                        f.write(self.proxy.hosts(run.meta["namespace"]))
            await asyncio.sleep(0.2)

    async def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        run = self.runs.get(meta["uid"])
        if kind == "DELETED":
            if run is not None:
                run.gone = True
                del self.runs[meta["uid"]]
                if not run.deleting:
                    # Removed by force: its processes are killed now, as a kubelet does.
                    run.deleting = True
                    self._background(run.stop(grace=min(2.0, _grace(pod))))
            return
        if meta.get("deletionTimestamp"):
            if run is not None and not run.deleting:
                run.deleting = True
                self._background(self._finish(run, _grace(pod)))
            elif run is None:
                await delete_now(self.core, pod)
            return
        if run is None and pod["status"].get("phase") == "Pending":
            run = PodRun(self, pod, next(self._addresses))
            self.runs[meta["uid"]] = run
            run.task = asyncio.create_task(run.run(), name=f"pod-{meta['name']}")

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _finish(self, run: PodRun, grace: float) -> None:
        await run.stop(grace)
        self.runs.pop(run.meta["uid"], None)


def _grace(pod: dict[str, Any]) -> float:
    meta = pod["metadata"]
    found = meta.get("deletionGracePeriodSeconds")
    if found is None:
        found = pod["spec"].get("terminationGracePeriodSeconds", 30)
    return float(found)
