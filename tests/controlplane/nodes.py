"""Simulated nodes for the control plane (the idea of kwok, in the suite): Node objects that
the scheduler places pods on and the node lifecycle controller keeps Ready, because they
renew their Leases in `kube-node-lease` as a kubelet does; and a stand-in kubelet for them
that reports each pod bound to one of them as Running (its containers started, Ready) and,
once the pod is deleted, removes it as a kubelet does when its containers have stopped.
Nothing is run: nodes whose pods really run are kubelet.py's.

Everything goes through the API server with the admin's client: the status subresources, the
Leases and the deletion are the requests a kubelet makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Self, TypeVar

from kubernetes_asyncio.client import ApiClient, CoordinationV1Api, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.watch import Watch

if TYPE_CHECKING:
    from tests.controlplane import ControlPlane

log = logging.getLogger(__name__)
T = TypeVar("T")

LEASE_S = 40
"""A kubelet's node lease duration; it renews at a quarter of it."""
NOT_READY = "node.kubernetes.io/not-ready"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _stamp() -> str:
    return _now().strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeAgent:
    """What every node of the suite does as a kubelet would, whatever runs its pods: the
    Node registered Ready with its capacity, its Lease renewed, and every change of a pod
    bound to it handed to `on_pod` (ADDED, MODIFIED or DELETED, the pod as the API's JSON).
    `async with Agent(api, {"node-a": {labels}}):` until the block ends (then the nodes are
    deleted)."""

    node_type = "simulated"

    def __init__(
        self,
        api: ApiClient,
        nodes: dict[str, dict[str, Any]],
        *,
        allocatable: dict[str, str] | None = None,
    ) -> None:
        """`nodes`: name -> labels. `allocatable`: every node's (cpu 8, 32Gi, 110 pods)."""
        self.api = api
        self.core: Any = CoreV1Api(api)
        self.leases: Any = CoordinationV1Api(api)
        self.labels = nodes
        self.allocatable = allocatable or {"cpu": "8", "memory": "32Gi", "pods": "110"}
        self._tasks: list[asyncio.Task[None]] = []
        self.started: set[tuple[str, str]] = set()
        """(namespace, name) of every pod reported Running."""

    async def __aenter__(self) -> Self:
        for name, labels in self.labels.items():
            await self.core.create_node(
                {
                    "metadata": {"name": name, "labels": {**labels, "type": self.node_type}},
                    "spec": {},
                }
            )
            await self._ready(name)
        for name in self.labels:
            await self._schedulable(name)
        self._tasks = [
            asyncio.create_task(self._heartbeats(), name="node-leases"),
            asyncio.create_task(self._pods(), name="node-pods"),
        ]
        return self

    async def __aexit__(self, *_: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._watching_stopped()
        for name in self.labels:
            with contextlib.suppress(ApiException):
                await self.core.delete_node(name)

    async def _watching_stopped(self) -> None:
        """Called on exit once no pod event can come: the place to end work they began."""

    async def _ready(self, name: str) -> None:
        """The node's status as a kubelet posts it: capacity and a Ready condition."""
        now = _stamp()
        await self.core.patch_node_status(
            name,
            {
                "status": {
                    "capacity": self.allocatable,
                    "allocatable": self.allocatable,
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": self.node_type,
                            "lastHeartbeatTime": now,
                            "lastTransitionTime": now,
                        }
                    ],
                    "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                    "nodeInfo": _NODE_INFO,
                }
            },
        )

    async def _schedulable(self, name: str, timeout_s: float = 60) -> None:
        """Wait until the node lifecycle controller has lifted the `not-ready` taint that
        admission puts on every new node: until then the scheduler places nothing there, and
        a test's pods would all go to whichever node it freed first."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            node = await self.core.read_node(name)
            taints = node.spec.taints or []
            if not any(t.key == NOT_READY for t in taints):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"node {name} still tainted {NOT_READY} after {timeout_s:g}s")
            await asyncio.sleep(0.1)

    async def _heartbeats(self) -> None:
        while True:
            for name in self.labels:
                try:
                    await self._renew(name)
                except ApiException as e:
                    log.warning("node %s: lease not renewed: %s", name, e.reason)
            await asyncio.sleep(LEASE_S / 4)

    async def _renew(self, name: str) -> None:
        now = _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_S, "renewTime": now},
        }
        try:
            await self.leases.patch_namespaced_lease(name, "kube-node-lease", body)
        except ApiException as e:
            if e.status != 404:
                raise
            await self.leases.create_namespaced_lease("kube-node-lease", body)

    async def _pods(self) -> None:
        """Watch every pod; hand those bound to our nodes to `on_pod`. A watch that ends (a
        timeout, a 410 after compaction) is started again from a fresh list."""
        while True:
            try:
                listed = await self.core.list_pod_for_all_namespaces()
                for pod in listed.items:
                    await self._dispatch("ADDED", pod)
                async with Watch() as watch:
                    async for event in watch.stream(
                        self.core.list_pod_for_all_namespaces,
                        resource_version=listed.metadata.resource_version,
                        timeout_seconds=60,
                    ):
                        await self._dispatch(event["type"], event["object"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the API server restarting, a 410: list again
                log.info("pods watch ended: %r", e)
                await asyncio.sleep(0.2)

    async def _dispatch(self, kind: str, pod: Any) -> None:
        if kind not in ("ADDED", "MODIFIED", "DELETED") or pod.spec.node_name not in self.labels:
            return
        await self.on_pod(kind, self.api.sanitize_for_serialization(pod))

    async def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        raise NotImplementedError


class SimulatedNodes(NodeAgent):
    """Nodes that run nothing: a pod bound to one is reported Running (its containers
    started, Ready) and, once deleted, ended (exit 0, as a drained worker ends) and removed.

    `start_delay`: how long a pod takes to start; `terminate_delay`: how long a deleted pod
    takes to end (at most its grace period), as a worker's drain does. Both 0 by default: at
    once."""

    def __init__(
        self,
        api: ApiClient,
        nodes: dict[str, dict[str, Any]],
        *,
        allocatable: dict[str, str] | None = None,
        start_delay: float = 0.0,
        terminate_delay: float = 0.0,
    ) -> None:
        super().__init__(api, nodes, allocatable=allocatable)
        self.start_delay = start_delay
        self.terminate_delay = terminate_delay
        self._pending: dict[tuple[str, str], asyncio.Task[None]] = {}
        """Pods starting or stopping, by (namespace, name)."""
        self._unfinished: set[asyncio.Task[None]] = set()
        """Every task not yet done, those cancelled and replaced in `_pending` too: each is
        awaited on exit, so none is left for the garbage collector once the loop has gone."""

    async def _watching_stopped(self) -> None:
        for task in self._unfinished:
            task.cancel()
        await asyncio.gather(*self._unfinished, return_exceptions=True)

    async def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        if kind == "DELETED":
            self.started.discard(key)
            if (task := self._pending.pop(key, None)) is not None:
                task.cancel()
        elif meta.get("deletionTimestamp"):
            starting = self._pending.get(key)
            if starting is not None and starting.get_name() == "start":
                starting.cancel()
                del self._pending[key]
            if key not in self._pending:
                self._later(key, "stop", lambda: self._stop(pod), self._stop_delay(pod))
        elif (
            pod["status"].get("phase") == "Pending"
            and key not in self.started
            and key not in self._pending
        ):
            self._later(key, "start", lambda: self._start(pod), self.start_delay)

    def _stop_delay(self, pod: dict[str, Any]) -> float:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        return min(self.terminate_delay, float(grace)) if grace is not None else 0.0

    def _later(
        self,
        key: tuple[str, str],
        what: str,
        work: Callable[[], Coroutine[Any, Any, None]],
        delay: float,
    ) -> None:
        """`work()` after `delay` (0: as soon as the loop comes to it)."""

        async def run() -> None:
            if delay > 0:
                await asyncio.sleep(delay)
            await work()

        def done(task: asyncio.Task[None]) -> None:
            # A callback, not a `finally` in run(): that would call into the loop even when
            # the coroutine is closed by the garbage collector, after the loop has gone.
            self._unfinished.discard(task)
            if self._pending.get(key) is task:
                del self._pending[key]

        task = asyncio.create_task(run(), name=what)
        task.add_done_callback(done)
        self._pending[key] = task
        self._unfinished.add(task)

    async def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        now = _stamp()
        statuses = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod["spec"]["containers"]
        ]
        conditions = [
            {"type": kind, "status": "True", "lastTransitionTime": now}
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ]
        try:
            await self.core.patch_namespaced_pod_status(
                meta["name"],
                meta["namespace"],
                {
                    "status": {
                        "phase": "Running",
                        "conditions": conditions,
                        "containerStatuses": statuses,
                        "hostIP": "127.0.0.1",
                        "podIP": "127.0.0.1",
                        "startTime": now,
                    }
                },
            )
        except ApiException as e:
            if e.status != 404:
                raise
            return
        self.started.add((meta["namespace"], meta["name"]))

    async def _stop(self, pod: dict[str, Any]) -> None:
        """A deleted pod's containers have stopped: its end posted (exit 0, Succeeded), then
        the pod removed, as a kubelet does."""
        meta = pod["metadata"]
        self.started.discard((meta["namespace"], meta["name"]))
        now = _stamp()
        statuses = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": 0,
                        "reason": "Completed",
                        "startedAt": now,
                        "finishedAt": now,
                    }
                },
            }
            for c in pod["spec"]["containers"]
        ]
        with contextlib.suppress(ApiException):
            await self.core.patch_namespaced_pod_status(
                meta["name"],
                meta["namespace"],
                {"status": {"phase": "Succeeded", "containerStatuses": statuses}},
            )
        await delete_now(self.core, pod)


async def delete_now(core: Any, pod: dict[str, Any]) -> None:
    """A kubelet's final delete of a pod whose containers have stopped: grace 0, its uid named
    so that a pod of the same name made since is not the one removed."""
    meta = pod["metadata"]
    with contextlib.suppress(ApiException):
        await core.delete_namespaced_pod(
            meta["name"],
            meta["namespace"],
            grace_period_seconds=0,
            body={"preconditions": {"uid": meta["uid"]}, "gracePeriodSeconds": 0},
        )


_NODE_INFO = {
    "architecture": "amd64",
    "bootID": "",
    "containerRuntimeVersion": "simulated://1",
    "kernelVersion": "",
    "kubeProxyVersion": "",
    "kubeletVersion": "v1.37.2",
    "machineID": "",
    "operatingSystem": "linux",
    "osImage": "simulated",
    "systemUUID": "",
}


class NodesThread:
    """Node agents on an event loop of their own, in a thread: for a module's control plane,
    which outlives every test's loop. `with NodesThread(plane, NODES):` simulated nodes;
    `make` builds another agent from the admin's client."""

    def __init__(
        self,
        plane: ControlPlane,
        nodes: dict[str, dict[str, Any]] | None = None,
        *,
        make: Callable[[ApiClient], NodeAgent] | None = None,
    ) -> None:
        self.plane = plane
        self.make = make or (lambda api: SimulatedNodes(api, nodes or {}))
        self.agent: NodeAgent | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stop: asyncio.Event | None = None
        self._running: asyncio.Future[None] | None = None

    async def _run(self, ready: asyncio.Future[None]) -> None:
        self._stop = asyncio.Event()
        try:
            async with self.plane.api_client() as api:
                self.agent = self.make(api)
                async with self.agent:
                    ready.set_result(None)
                    await self._stop.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            raise

    def call(self, work: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run `work` on the agents' loop (their objects belong to it)."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=timeout)

    def __enter__(self) -> NodesThread:
        self._thread.start()

        async def start() -> None:
            ready: asyncio.Future[None] = self._loop.create_future()
            self._running = asyncio.ensure_future(self._run(ready))
            await ready

        try:
            self.call(start(), timeout=120)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            raise
        return self

    @classmethod
    def simulated(
        cls, plane: ControlPlane, labels: dict[str, dict[str, Any]], **options: Any
    ) -> NodesThread:
        """Simulated nodes named and labelled by `labels`; `options`: SimulatedNodes' own
        (allocatable, start and terminate delays)."""
        return cls(plane, make=lambda api: SimulatedNodes(api, labels, **options))

    def __exit__(self, *_: object) -> None:
        assert self._stop is not None and self._running is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self.call(_wait(self._running), timeout=120)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


async def _wait(task: asyncio.Future[None]) -> None:
    with contextlib.suppress(Exception):
        await task
