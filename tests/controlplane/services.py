"""Services for the suite's nodes whose pods run (kubelet.py): every Service's ClusterIP held
by the nodes' bridge on this host, each port served by a userspace proxy (what kube-proxy's
userspace mode did) to a ready endpoint of the Service's EndpointSlices, `kubernetes.default`
to the API server; and each pod's /etc/hosts: Services by their names, headless Services'
pods by theirs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import subprocess
from typing import Any

from kubernetes_asyncio.client import ApiClient, CoreV1Api, DiscoveryV1Api
from kubernetes_asyncio.watch import Watch

log = logging.getLogger(__name__)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class ServiceProxy:
    """Every Service's ClusterIP held by the bridge, each port served by a proxy to a ready
    endpoint; the names of Services and of headless Services' pods, for /etc/hosts."""

    def __init__(self, api: ApiClient, apiserver_port: int, bridge: str) -> None:
        self.bridge = bridge
        self.core: Any = CoreV1Api(api)
        self.discovery: Any = DiscoveryV1Api(api)
        self.api = api
        self.apiserver_port = apiserver_port
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}
        """EndpointSlices by (namespace, name)."""
        self._listeners: dict[tuple[str, int], asyncio.Server] = {}
        self._addresses: set[str] = set()
        self._next = itertools.count()
        self._open: set[asyncio.StreamWriter] = set()
        """Both ends of every connection it forwards, closed with it."""
        self.changed = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(
            self._watch(self.core.list_service_for_all_namespaces, self.services),
            self._watch(self.discovery.list_endpoint_slice_for_all_namespaces, self.slices),
        )

    async def _watch(self, lister: Any, into: dict[tuple[str, str], dict[str, Any]]) -> None:
        while True:
            try:
                listed = await lister()
                into.clear()
                for item in listed.items:
                    obj = self.api.sanitize_for_serialization(item)
                    into[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
                await self._sync()
                async with Watch() as watch:
                    async for event in watch.stream(
                        lister,
                        resource_version=listed.metadata.resource_version,
                        timeout_seconds=60,
                    ):
                        obj = self.api.sanitize_for_serialization(event["object"])
                        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                        if event["type"] == "DELETED":
                            into.pop(key, None)
                        elif event["type"] in ("ADDED", "MODIFIED"):
                            into[key] = obj
                        await self._sync()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.info("service watch ended: %r", e)
                await asyncio.sleep(0.2)

    async def _sync(self) -> None:
        wanted: set[tuple[str, int]] = set()
        for (namespace, name), service in self.services.items():
            cluster_ip = service["spec"].get("clusterIP")
            if not cluster_ip or cluster_ip == "None":
                continue
            if cluster_ip not in self._addresses:
                ip("addr", "add", f"{cluster_ip}/32", "dev", self.bridge, check=False)
                self._addresses.add(cluster_ip)
            for port in service["spec"].get("ports") or []:
                if port.get("protocol", "TCP") != "TCP":
                    continue
                key = (cluster_ip, int(port["port"]))
                wanted.add(key)
                if key not in self._listeners:
                    server = await asyncio.start_server(
                        functools.partial(self._forward, target=(namespace, name, port)),
                        cluster_ip,
                        int(port["port"]),
                    )
                    self._listeners[key] = server
        for key in list(self._listeners.keys() - wanted):
            self._listeners.pop(key).close()
        self.changed.set()

    def endpoints(
        self, namespace: str, service: str, port_name: str | None
    ) -> list[tuple[str, int]]:
        """Ready endpoints of a Service's port: (pod address, target port)."""
        out: list[tuple[str, int]] = []
        for (ns, _), found in self.slices.items():
            labels = found["metadata"].get("labels") or {}
            if ns != namespace or labels.get("kubernetes.io/service-name") != service:
                continue
            ports = [
                p
                for p in found.get("ports") or []
                if (p.get("name") or None) == (port_name or None)
            ]
            if not ports:
                continue
            for endpoint in found.get("endpoints") or []:
                if (endpoint.get("conditions") or {}).get("ready") is False:
                    continue
                for address in endpoint.get("addresses") or []:
                    out.append((address, int(ports[0]["port"])))
        return out

    async def _forward(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        target: tuple[str, str, dict[str, Any]],
    ) -> None:
        namespace, service, port = target
        if (namespace, service) == ("default", "kubernetes"):
            targets = [("127.0.0.1", self.apiserver_port)]
        else:
            targets = self.endpoints(namespace, service, port.get("name"))
        if not targets:
            writer.close()
            return
        host, target_port = targets[next(self._next) % len(targets)]
        try:
            up_reader, up_writer = await asyncio.open_connection(host, target_port)
        except OSError:
            writer.close()
            return
        self._open |= {writer, up_writer}
        try:
            await asyncio.gather(
                _pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True
            )
        finally:
            self._open -= {writer, up_writer}

    def hosts(self, namespace: str) -> str:
        """/etc/hosts for a pod of `namespace`: every Service by its names, headless ones by
        their ready pods (and each pod by hostname.subdomain)."""
        lines = ["127.0.0.1 localhost"]
        for (ns, name), service in sorted(self.services.items()):
            names = [f"{name}.{ns}.svc.cluster.local", f"{name}.{ns}.svc", f"{name}.{ns}"]
            if ns == namespace:
                names.append(name)
            cluster_ip = service["spec"].get("clusterIP")
            if cluster_ip and cluster_ip != "None":
                lines.append(f"{cluster_ip} {' '.join(names)}")
                continue
            for (slice_ns, _), found in self.slices.items():
                labels = found["metadata"].get("labels") or {}
                if slice_ns != ns or labels.get("kubernetes.io/service-name") != name:
                    continue
                for endpoint in found.get("endpoints") or []:
                    for address in endpoint.get("addresses") or []:
                        own = []
                        if endpoint.get("hostname"):
                            own = [f"{endpoint['hostname']}.{n}" for n in names]
                        lines.append(f"{address} {' '.join(own + names)}")
        return "\n".join(lines) + "\n"

    async def close(self) -> None:
        for listener in self._listeners.values():
            listener.close()
        for writer in list(self._open):
            writer.close()
        for listener in self._listeners.values():
            await listener.wait_closed()
        self._listeners.clear()
        await asyncio.sleep(0.1)  # the pipes see their ends closed and end
        for address in self._addresses:
            ip("addr", "del", f"{address}/32", "dev", self.bridge, check=False)
        self._addresses.clear()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        with contextlib.suppress(Exception):
            writer.close()
