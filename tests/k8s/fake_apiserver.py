"""An in-process fake Kubernetes API server that speaks the real HTTP/JSON protocol.

Tests drive the real `kubernetes_asyncio` client against it on loopback; nothing in the client
is patched. Where things live:

* `fake_store.py`     objects, the global resourceVersion, the change history, and each
                      resource's create/update/delete rules (validation, status, deletion);
* this module         `FakeKubeAPI`: the HTTP routing and verbs, the watch streams, fault
                      injection, and the helpers tests use to read and drive the cluster;
* `fake_kubelet.py`   the scheduler and kubelet that move pods through their lives;
* `GarbageCollector`  (here) deletes objects whose owners (ownerReferences) are all gone;
* `fake_selectors.py` label and field selectors;  `fake_patch.py`  merge and JSON patches.

    async with FakeKubeAPI() as kube, kube.api_client() as client:
        kube.add_node("gpu-1", labels={"gpu": "a100"})
        pod = await CoreV1Api(client).create_namespaced_pod("default", body)

What Kubernetes does is tested on a control plane built from Kubernetes' own code
(tests/controlplane, the `*_on_control_plane.py` and `test_control_plane.py` modules): RBAC as
k8s/ grants it (every request audited), leader election and the standby taking over, the
garbage collector removing a worker's Secret, kube-scheduler's placement and Unschedulable
pods, PriorityClass preemption, informers relisting after a crashed API server lost its
history, `kubectl apply -k` of the overlays, pods run as processes. This server stays for what
a real one cannot be made to do on demand, at a chosen moment, in one process:

* watches cut mid-stream, history compacted under a watcher, a 500 or 429 on the next call
  (`cut_watches`, `compact`, `fail_next`): the informers' recovery from each, one at a time;
* a cache lagging behind the server, so one pod is drained twice (test_tide_signals);
* a node turned NotReady or lost at once, and container ends a kubelet reports only after the
  fact: OOMKilled, Evicted, a crash loop, an image that cannot be pulled, exits on demand
  (the OOM, eviction, crash-loop and bad-node tests of test_kube_backend);
* preemption and node loss timed to the middle of one shard (the quarantine test);
* every request logged, so what the controller asked for in these faults is checked against
  k8s/'s RBAC too (the `controllers_rbac` fixture) and a test can count its calls.

Where a test here checks something the real server decides (validation, scheduling, RBAC), the
same claim is tested on the control plane as well."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from tests.k8s.fake_kubelet import FakeKubelet, Policy, PolicyRule, RunForever, set_condition
from tests.k8s.fake_patch import PatchError, json_patch, merge_patch
from tests.k8s.fake_selectors import Selector, SelectorError
from tests.k8s.fake_store import (
    NAMESPACES,
    NODES,
    PODS,
    PRIORITY_CLASSES,
    RESOURCES,
    SYSTEM_PRIORITY_CLASSES,
    ApiError,
    Change,
    Obj,
    ResourceType,
    Store,
    bad_request,
    expired,
    lookup,
    now_rfc3339,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
DEFAULT_ALLOCATABLE = {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "0", "pods": "110"}

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
_PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
)


class RequestRecord(NamedTuple):
    method: str
    path: str
    query: dict[str, str]
    content_type: str


@dataclass
class Fault:
    """Fail matching requests with `status` until `remaining` reaches 0."""

    status: int
    remaining: int
    method: str | None = None
    path: re.Pattern[str] | None = None
    when: Callable[[RequestRecord], bool] | None = None
    retry_after: int = 1
    message: str | None = None
    hits: list[RequestRecord] = field(default_factory=list)  # the requests it failed

    def matches(self, request: RequestRecord) -> bool:
        return (
            self.remaining > 0
            and (self.method is None or self.method.upper() == request.method)
            and (self.path is None or self.path.search(request.path) is not None)
            and (self.when is None or self.when(request))
        )

    def error(self) -> ApiError:
        reason = _REASONS.get(self.status, "InternalError")
        if self.status == 429:
            return ApiError(
                429,
                reason,
                self.message or "Too many requests, please try again later.",
                details={"retryAfterSeconds": self.retry_after},
                headers={"Retry-After": str(self.retry_after)},
            )
        return ApiError(self.status, reason, self.message or f"injected fault: {reason}")


# The watch stream's control messages, queued among the changes.
_CUT = "cut"  # drop the connection, mid-stream
_END = "end"  # end the response cleanly, as a server-side timeout does


@dataclass(frozen=True)
class _Target:
    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


def _truthy(value: str | None) -> bool:
    return value in ("true", "1", "True")


def _int_param(query: Any, name: str) -> int | None:
    value = query.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"invalid {name}: {value!r}") from None


def _resource_version(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise bad_request(f'invalid resource version "{value}"') from None


class FakeKubeAPI:
    """A fake API server on 127.0.0.1 (port chosen by the OS), with a fake kubelet.

    Every delay is in (small) seconds of wall time, so a test runs a pod's whole life in a
    fraction of a second. Use as `async with FakeKubeAPI() as kube:` or start()/stop().
    """

    def __init__(
        self,
        *,
        namespaces: Iterable[str] = DEFAULT_NAMESPACES,
        history_limit: int = 1000,
        start_delay: float = 0.05,
        terminate_delay: float = 0.05,
        backoff_delay: float = 0.05,
        default_policy: Policy | None = None,
        run_kubelet: bool = True,
        bookmark_interval: float = 0.5,
        max_watch_seconds: float | None = None,
        token: str | None = None,
    ) -> None:
        self.store = Store(history_limit=history_limit)
        for namespace in namespaces:
            self.add_namespace(namespace)
        for priority_class in SYSTEM_PRIORITY_CLASSES:
            self.store.create(PRIORITY_CLASSES, "", priority_class)
        self.kubelet = FakeKubelet(
            self.store,
            start_delay=start_delay,
            terminate_delay=terminate_delay,
            backoff_delay=backoff_delay,
            default_policy=default_policy or RunForever(),
        )
        self.run_kubelet = run_kubelet
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        self.token = token
        self.requests: list[RequestRecord] = []
        self.url = ""
        self._faults: list[Fault] = []
        # One queue per open watch stream: changes, and the control messages above.
        self._watches: set[asyncio.Queue[Change | str]] = set()
        self._runner: web.AppRunner | None = None
        self._changed = asyncio.Event()
        self._errors: list[BaseException] = []
        self._node_ips = 0
        self.store.subscribe(lambda _change: self._notify())
        self.garbage_collector = GarbageCollector(self.store)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_route("*", "/{path:.*}", self._dispatch)
        # access_log=None: the request log below is the one tests read.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        if self.run_kubelet:
            self.kubelet.start()

    async def stop(self) -> None:
        try:
            await self.kubelet.stop()
        finally:
            for watch in self._watches:
                watch.put_nowait(_END)
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
        errors, self._errors = self._errors, []
        if errors:
            raise RuntimeError("the fake API server failed while serving") from errors[0]

    async def __aenter__(self) -> FakeKubeAPI:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def configuration(self) -> Configuration:
        config = Configuration(host=self.url)
        if self.token is not None:
            config.api_key = {"BearerToken": self.token}
            config.api_key_prefix = {"BearerToken": "Bearer"}
        return config

    def api_client(self) -> ApiClient:
        """A real client for this server; the caller closes it (`async with`)."""
        return ApiClient(configuration=self.configuration())

    # ---- fault injection -------------------------------------------------------------------

    def fail_next(
        self,
        count: int = 1,
        *,
        status: int = 500,
        method: str | None = None,
        path: str | None = None,
        when: Callable[[RequestRecord], bool] | None = None,
        retry_after: int = 1,
        message: str | None = None,
    ) -> Fault:
        """Answer the next `count` requests that match (method, a regex searched in the path,
        a predicate) with `status` and a Status body; 429 comes with Retry-After."""
        fault = Fault(
            status, count, method, re.compile(path) if path else None, when, retry_after, message
        )
        self._faults.append(fault)
        return fault

    def cut_watches(self, *, graceful: bool = False) -> int:
        """Close every open watch stream now; returns how many. Abruptly by default: the
        connection drops in the middle of an event, and the events not yet sent are lost to it
        (the client must resume from the last resourceVersion it saw). `graceful` ends the
        responses cleanly instead, as the server does when a watch times out."""
        for watch in self._watches:
            watch.put_nowait(_END if graceful else _CUT)
        return len(self._watches)

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def compact(self) -> None:
        """Forget the change history: watches and exact lists from any earlier
        resourceVersion now get 410 Expired."""
        self.store.compact()

    @property
    def resource_version(self) -> int:
        return self.store.rv

    # ---- state helpers: read and drive the cluster without HTTP ----------------------------

    def add_namespace(self, name: str) -> Obj:
        return self.store.create(NAMESPACES, "", {"metadata": {"name": name}})

    def add_node(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        allocatable: dict[str, str] | None = None,
        capacity: dict[str, str] | None = None,
        taints: list[Obj] | None = None,
        ready: bool = True,
        unschedulable: bool = False,
    ) -> Obj:
        self._node_ips += 1
        ip = f"10.0.{self._node_ips // 250}.{self._node_ips % 250 + 1}"
        allocatable = {"pods": "110", **(allocatable or DEFAULT_ALLOCATABLE)}
        node = _new_node(name, ip, labels or {}, allocatable, capacity or allocatable, ready)
        node["spec"] = {"taints": taints or [], "unschedulable": unschedulable}
        return self.store.create(NODES, "", node)

    def set_node_labels(self, name: str, labels: dict[str, str]) -> Obj:
        """Replace the node's labels (a label tests rely on, like hostname, must be passed)."""
        return self._mutate_node(name, lambda n: n["metadata"].__setitem__("labels", dict(labels)))

    def set_node_ready(self, name: str, ready: bool | None) -> Obj:
        """Ready True/False, or None for Unknown (the node stopped reporting). A node that is
        not Ready takes no new pods; pods already on it keep running here."""

        def change(node: Obj) -> None:
            conditions = node["status"]["conditions"]
            conditions[:] = [c for c in conditions if c["type"] != "Ready"]
            conditions.append(_ready_condition(ready))

        return self._mutate_node(name, change)

    def remove_node(self, name: str, *, pods: Literal["fail", "delete", "keep"] = "fail") -> None:
        """The node is lost. Its pods become Failed with reason NodeLost and a DisruptionTarget
        condition ("fail"), are also deleted as the pod garbage collector does ("delete"), or
        are left as they are ("keep")."""
        if self.store.remove(NODES, "", name) is None:
            raise KeyError(f"no node {name}")
        self.kubelet.node_lost(name, pods)

    def get_node(self, name: str) -> Obj | None:
        return self.store.get(NODES, "", name)

    def add_pod(self, pod: Obj, namespace: str = "default") -> Obj:
        """Create a pod as the API would (defaults, validation), without a client."""
        return self.store.create(PODS, namespace, pod)

    def get_pod(self, name: str, namespace: str = "default") -> Obj | None:
        return self.store.get(PODS, namespace, name)

    def list_pods(
        self, namespace: str | None = None, *, label_selector: str = "", field_selector: str = ""
    ) -> list[Obj]:
        selector = Selector.parse(label_selector, field_selector, PODS.selectable_fields)
        return [pod for pod in self.store.objects(PODS, namespace) if selector.matches(pod)]

    def add(self, resource: str, obj: Obj, namespace: str = "") -> Obj:
        """Create any object by plural resource name, as the API would, without a client."""
        rt = next((r for r in RESOURCES if r.plural == resource), None)
        if rt is None:
            raise KeyError(f"unknown resource {resource}")
        return self.store.create(rt, namespace, obj)

    def get(self, resource: str, name: str, namespace: str = "") -> Obj | None:
        """Any stored object by plural resource name ("leases", "events", ...)."""
        rt = next((r for r in RESOURCES if r.plural == resource), None)
        if rt is None:
            raise KeyError(f"unknown resource {resource}")
        return self.store.get(rt, namespace, name)

    def add_pod_policy(
        self,
        policy: Policy,
        *,
        match: Callable[[Obj], bool] | None = None,
        labels: dict[str, str] | None = None,
        name_prefix: str | None = None,
        count: int | None = None,
    ) -> PolicyRule:
        """Pods created from now on that match (all given criteria) get `policy`; `count`
        limits it to that many pods. The newest matching rule wins over older ones."""

        def matches(pod: Obj) -> bool:
            meta = pod["metadata"]
            pod_labels = meta.get("labels") or {}
            return (
                (labels is None or all(pod_labels.get(k) == v for k, v in labels.items()))
                and (name_prefix is None or meta["name"].startswith(name_prefix))
                and (match is None or match(pod))
            )

        return self.kubelet.add_policy(policy, matches, count)

    def evict(
        self,
        name: str,
        namespace: str = "default",
        *,
        reason: str = "Evicted",
        message: str = "The node was low on resource: memory. ",
    ) -> Obj:
        """The kubelet evicts the pod now: phase Failed, status.reason `reason`, a
        DisruptionTarget condition, containers killed (137)."""
        return self.kubelet.evict(namespace, name, reason, message)

    def exit_pod(self, name: str, namespace: str = "default", *, code: int = 0) -> Obj:
        """The pod's containers exit now with `code`: a restartPolicy Never pod ends
        Succeeded (0) or Failed, as with the `Exit` policy."""
        return self.kubelet.exit(namespace, name, code)

    def preempt(
        self,
        name: str,
        namespace: str = "default",
        *,
        by: Literal["scheduler", "kubelet"] = "scheduler",
    ) -> Obj:
        """Preempt the pod now, as the `Preempted` policy does."""
        return self.kubelet.preempt(namespace, name, by)

    async def wait_for(
        self, predicate: Callable[[], T | None], *, timeout: float = 5.0, what: str = "condition"
    ) -> T:
        """Return `predicate()` once it is truthy, re-checking on every change to the cluster
        (and to the set of open watches); fail the test after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self.kubelet.check()
            result = predicate()
            if result:
                return result
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()

    async def wait_for_pod(
        self,
        name: str,
        namespace: str = "default",
        *,
        phase: str | None = None,
        where: Callable[[Obj], bool] | None = None,
        timeout: float = 5.0,
    ) -> Obj:
        def probe() -> Obj | None:
            pod = self.get_pod(name, namespace)
            if pod is None or (phase is not None and pod["status"].get("phase") != phase):
                return None
            return pod if where is None or where(pod) else None

        try:
            return await self.wait_for(probe, timeout=timeout)
        except AssertionError:
            pod = self.get_pod(name, namespace)
            seen = "no such pod" if pod is None else f"status {json.dumps(pod.get('status'))}"
            raise AssertionError(
                f"timed out after {timeout}s waiting for pod {namespace}/{name}; {seen}"
            ) from None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _mutate_node(self, name: str, change: Callable[[Obj], None]) -> Obj:
        node = self.store.mutate(NODES, "", name, change)
        if node is None:
            raise KeyError(f"no node {name}")
        return node

    # ---- HTTP: middleware and routing ------------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        record = RequestRecord(
            request.method, request.path, dict(request.query), request.content_type
        )
        self.requests.append(record)
        try:
            if self.token is not None and request.headers.get("Authorization") != (
                f"Bearer {self.token}"
            ):
                raise ApiError(401, "Unauthorized", "Unauthorized")
            for fault in self._faults:
                if fault.matches(record):
                    fault.remaining -= 1
                    fault.hits.append(record)
                    raise fault.error()
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.status(), status=e.code, headers=e.headers)
        except SelectorError as e:
            return web.json_response(bad_request(str(e)).status(), status=400)
        except Exception as e:
            # A bug in the fake, not in the code under test: answer 500 and fail the test at
            # stop() rather than let a client retry loop hide it.
            log.exception("fake API server failed on %s %s", request.method, request.path_qs)
            self._errors.append(e)
            error = ApiError(500, "InternalError", f"fake API server bug: {e!r}")
            return web.json_response(error.status(), status=500)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        target = self._route(request.path)
        if isinstance(target, web.StreamResponse):
            return target
        rt, namespace, name, sub = target.rt, target.namespace, target.name, target.subresource
        method = request.method
        if name is None:
            if method == "GET":
                if _truthy(request.query.get("watch")):
                    return await self._watch(request, rt, namespace)
                return self._list(request, rt, namespace)
            if method == "POST" and (namespace is not None or not rt.namespaced):
                return await self._create(request, rt, namespace or "")
            if method == "DELETE" and (namespace is not None or not rt.namespaced):
                return self._delete_collection(request, rt, namespace or "")
        elif sub is None or (sub == "status" and rt.status_subresource):
            ns = namespace or ""
            if method == "GET":
                obj = self.store.get(rt, ns, name)
                if obj is None:
                    raise rt.not_found(name)
                return web.json_response(obj)
            if method == "PUT":
                return await self._replace(request, rt, ns, name, sub)
            if method == "PATCH":
                return await self._patch(request, rt, ns, name, sub)
            if method == "DELETE" and sub is None:
                return await self._delete(request, rt, ns, name)
        elif sub == "eviction" and rt is PODS:
            if method == "POST":
                return await self._evict(request, namespace or "", name)
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        raise ApiError(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
            details={},
        )

    def _route(self, path: str) -> _Target | web.StreamResponse:
        """/api/v1[/namespaces/NS]/PLURAL[/NAME[/SUB]], and the same under /apis/GROUP/VERSION;
        the discovery documents above those."""
        parts = [p for p in path.split("/") if p]
        not_found = ApiError(404, "NotFound", "the server could not find the requested resource")
        if parts in (["healthz"], ["readyz"], ["livez"]):
            return web.Response(text="ok")
        if parts == ["version"]:
            return web.json_response(_VERSION)
        if parts[:1] == ["api"]:
            if len(parts) == 1:
                return web.json_response(self._api_versions())
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"]:
            if len(parts) == 1:
                return web.json_response(_group_list())
            if len(parts) == 2:
                groups = [g for g in _group_list()["groups"] if g["name"] == parts[1]]
                if not groups:
                    raise not_found
                return web.json_response({"kind": "APIGroup", "apiVersion": "v1", **groups[0]})
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise not_found
        if not rest:
            resources = _resource_list(group, version)
            if resources is None:
                raise not_found
            return web.json_response(resources)
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3 and lookup(group, version, rest[2]):
            namespace, rest = rest[1], rest[2:]
        rt = lookup(group, version, rest[0])
        if rt is None or len(rest) > 3:
            raise not_found
        name = rest[1] if len(rest) > 1 else None
        if (namespace is not None and not rt.namespaced) or (
            name is not None and rt.namespaced and namespace is None
        ):
            raise not_found
        return _Target(rt, namespace, name, rest[2] if len(rest) > 2 else None)

    def _api_versions(self) -> Obj:
        address = self.url.removeprefix("http://")
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
        }

    # ---- HTTP: the verbs -------------------------------------------------------------------

    async def _create(self, request: web.Request, rt: ResourceType, ns: str) -> web.Response:
        body = await _json_body(request)
        _check_body_namespace(body, ns)
        obj = self.store.create(rt, ns, body, dry_run=_dry_run(request))
        return web.json_response(obj, status=201)

    async def _replace(
        self, request: web.Request, rt: ResourceType, ns: str, name: str, sub: str | None
    ) -> web.Response:
        body = await _json_body(request)
        _check_body_namespace(body, ns)
        obj, created = self.store.update(
            rt, ns, name, body, subresource=sub, dry_run=_dry_run(request)
        )
        return web.json_response(obj, status=201 if created else 200)

    async def _patch(
        self, request: web.Request, rt: ResourceType, ns: str, name: str, sub: str | None
    ) -> web.Response:
        if request.content_type not in _PATCH_TYPES:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types "
                f"include: {', '.join(_PATCH_TYPES)}",
            )
        patch = await _json_body(request, allow_list=True)
        current = self.store.get(rt, ns, name)
        if current is None:
            raise rt.not_found(name)
        if request.content_type == "application/json-patch+json":
            if not isinstance(patch, list):
                raise bad_request("json patch must be a list of operations")
            try:
                patched = json_patch(current, patch)
            except PatchError as e:
                raise ApiError(422, "Invalid", str(e)) from None
        else:
            if not isinstance(patch, dict):
                raise bad_request("merge patch must be a JSON object")
            patched = merge_patch(current, patch)
        # A resourceVersion in the patch is a precondition, checked by the update.
        obj, _ = self.store.update(
            rt, ns, name, patched, subresource=sub, dry_run=_dry_run(request)
        )
        return web.json_response(obj)

    async def _delete(
        self, request: web.Request, rt: ResourceType, ns: str, name: str
    ) -> web.Response:
        options = await _json_body(request, optional=True)
        grace = _int_param(request.query, "gracePeriodSeconds")
        if grace is None and options.get("gracePeriodSeconds") is not None:
            grace = int(options["gracePeriodSeconds"])
        # Accepted and checked, but there is no garbage collector: dependents (by
        # ownerReferences) are not deleted, whatever the policy.
        propagation = request.query.get("propagationPolicy") or options.get("propagationPolicy")
        if propagation not in (None, "Orphan", "Background", "Foreground"):
            raise bad_request(f'propagationPolicy: Unsupported value: "{propagation}"')
        preconditions = options.get("preconditions") or {}
        obj, gone = self.store.delete(
            rt,
            ns,
            name,
            grace_period=grace,
            uid=preconditions.get("uid"),
            resource_version=preconditions.get("resourceVersion"),
            dry_run=_dry_run(request),
        )
        if rt.return_deleted_object or not gone:
            return web.json_response(obj)
        return web.json_response(_success(rt, obj))

    def _delete_collection(self, request: web.Request, rt: ResourceType, ns: str) -> web.Response:
        selector = _selector(request, rt)
        grace = _int_param(request.query, "gracePeriodSeconds")
        dry_run = _dry_run(request)
        for obj in self.store.objects(rt, ns if rt.namespaced else None):
            if selector.matches(obj):
                name = obj["metadata"]["name"]
                self.store.delete(rt, ns, name, grace_period=grace, dry_run=dry_run)
        return web.json_response(
            {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
        )

    async def _evict(self, request: web.Request, ns: str, name: str) -> web.Response:
        """The Eviction API (no PodDisruptionBudgets here): a graceful delete, marked."""
        body = await _json_body(request, optional=True)
        options = body.get("deleteOptions") or {}
        if self.store.get(PODS, ns, name) is None:
            raise PODS.not_found(name)
        self.store.mutate(
            PODS,
            ns,
            name,
            lambda p: set_condition(
                p, "DisruptionTarget", "True", "EvictionByEvictionAPI", "Eviction API: evicting"
            ),
        )
        grace = options.get("gracePeriodSeconds")
        self.store.delete(PODS, ns, name, grace_period=None if grace is None else int(grace))
        return web.json_response(
            {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"},
            status=201,
        )

    def _list(self, request: web.Request, rt: ResourceType, ns: str | None) -> web.Response:
        query = request.query
        selector = _selector(request, rt)
        rv_text = query.get("resourceVersion", "")
        match = query.get("resourceVersionMatch", "")
        token = query.get("continue", "")
        limit = _int_param(query, "limit") or 0
        start = ""
        if token:
            if rv_text:
                raise bad_request("specifying resource version is not allowed when using continue")
            at, start = _decode_continue(token)
            try:
                objs = self.store.objects_at(rt, at)
            except ApiError as e:
                if e.code != 410:
                    raise
                raise expired(
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter."
                ) from None
        elif match == "Exact":
            at = _resource_version(rv_text)
            objs = self.store.objects_at(rt, at)
        elif match in ("", "NotOlderThan"):
            # Served from the latest state, which is never older than what was asked: an old
            # resourceVersion is fine here (only Exact and continue need the history).
            if rv_text:
                self.store.require_reached(_resource_version(rv_text))
            at, objs = self.store.rv, self.store.objects(rt)
        else:
            raise bad_request(f'resourceVersionMatch: Unsupported value: "{match}"')
        items = [obj for obj in objs if _in(ns, obj) and selector.matches(obj)]
        items = [obj for obj in items if _list_key(obj) > start]
        meta: Obj = {"resourceVersion": str(at)}
        if limit and len(items) > limit:
            rest, items = len(items) - limit, items[:limit]
            meta["continue"] = _encode_continue(at, _list_key(items[-1]))
            if selector.empty:  # the real server cannot count selected items cheaply
                meta["remainingItemCount"] = rest
        for item in items:
            # The real server leaves kind and apiVersion off list items (kubernetes#3030);
            # code that reads them from a listed item must not pass here either.
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return web.json_response(
            {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version,
                "metadata": meta,
                "items": items,
            }
        )

    # ---- HTTP: watch -----------------------------------------------------------------------

    async def _watch(
        self, request: web.Request, rt: ResourceType, ns: str | None
    ) -> web.StreamResponse:
        """A chunked stream of {"type", "object"} lines, as the real server sends.

        The starting point, read and subscribed to without awaiting in between, so that no
        change falls between them: resourceVersion "" or "0" sends the current objects as ADDED
        first; any other value replays the history after it, or sends a 410 ERROR event when
        that history is gone.
        """
        query = request.query
        selector = _selector(request, rt)

        def visible(obj: Obj | None) -> bool:
            return obj is not None and _in(ns, obj) and selector.matches(obj)

        timeout = _int_param(query, "timeoutSeconds")
        limit_s: float | None = timeout if timeout else None
        if self.max_watch_seconds is not None:
            limit_s = min(limit_s or self.max_watch_seconds, self.max_watch_seconds)
        bookmarks = _truthy(query.get("allowWatchBookmarks"))
        send_initial = _truthy(query.get("sendInitialEvents"))
        rv_text = query.get("resourceVersion", "")
        start_rv = None if rv_text in ("", "0") or send_initial else _resource_version(rv_text)

        queue: asyncio.Queue[Change | str] = asyncio.Queue()
        initial: list[Obj] = []
        backlog: list[Change] = []
        error: ApiError | None = None
        if start_rv is None:
            initial = [obj for obj in self.store.objects(rt) if visible(obj)]
        else:
            try:
                backlog = self.store.changes_since(start_rv)
            except ApiError as e:
                error = e
        unsubscribe = self.store.subscribe(queue.put_nowait) if error is None else None
        self._watches.add(queue)
        self._notify()

        def event(change: Change) -> tuple[str, Obj] | None:
            """What this watcher sees of a change: an object that stops matching the selectors
            is DELETED for it, one that starts matching is ADDED."""
            if change.rt is not rt:
                return None
            now, before = visible(change.obj), visible(change.prev)
            if change.type == "MODIFIED" and now != before:
                return ("ADDED", change.obj) if now else ("DELETED", change.obj)
            return (change.type, change.obj) if now else None

        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)

            async def send(kind: str, obj: Obj) -> None:
                line = json.dumps({"type": kind, "object": obj}, separators=(",", ":"))
                await response.write(line.encode() + b"\n")

            if error is not None:
                await send("ERROR", error.status())
                return response
            for obj in initial:
                await send("ADDED", obj)
            if send_initial and bookmarks:
                await send("BOOKMARK", self._bookmark(rt, {"k8s.io/initial-events-end": "true"}))
            for change in backlog:
                if (ev := event(change)) is not None:
                    await send(*ev)
            loop = asyncio.get_running_loop()
            deadline = None if limit_s is None else loop.time() + limit_s
            next_bookmark = loop.time() + self.bookmark_interval if bookmarks else None
            while True:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    break
                if next_bookmark is not None and now >= next_bookmark and queue.empty():
                    # Only with nothing queued: a bookmark promises every change up to its
                    # resourceVersion has been sent.
                    await send("BOOKMARK", self._bookmark(rt))
                    next_bookmark = now + self.bookmark_interval
                if request.transport is None or request.transport.is_closing():
                    break  # the client went away
                # Wake up now and then to notice a client that hung up on an idle stream.
                wake = min(t for t in (deadline, next_bookmark, now + 0.25) if t is not None)
                try:
                    async with asyncio.timeout(max(wake - now, 0)):
                        item = await queue.get()
                except TimeoutError:
                    continue
                if item == _CUT:
                    # Torn in the middle of an event, as a dropped connection leaves it: the
                    # client must not take half a line for an event.
                    await response.write(b'{"type":"MODIFIED","object":{"kind":"')
                    if request.transport is not None:
                        request.transport.abort()
                    break
                if item == _END:
                    break
                if isinstance(item, Change) and (ev := event(item)) is not None:
                    await send(*ev)
        except ConnectionError:
            pass  # the client closed the stream
        finally:
            if unsubscribe is not None:
                unsubscribe()
            self._watches.discard(queue)
            self._notify()
        return response

    def _bookmark(self, rt: ResourceType, annotations: dict[str, str] | None = None) -> Obj:
        meta: Obj = {"resourceVersion": str(self.store.rv)}
        if annotations:
            meta["annotations"] = annotations
        return {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}


# --------------------------------------------------------------------------------------------
# The garbage collector
# --------------------------------------------------------------------------------------------


class GarbageCollector:
    """Kubernetes' garbage collector, background propagation: an object whose every
    ownerReference names an object that is gone (none of that kind and name, or one with
    another uid) is deleted, whether its owner went after it was made or was gone already.
    Owners of kinds this server does not serve are taken to exist.

    It acts after the write that made the garbage (scheduled on the event loop), as the real
    one does a moment later: a watch sees the owner's deletion before its dependents'."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.collected: list[tuple[str, str, str]] = []
        """(kind, namespace, name) of every object it deleted, in order."""
        self._scheduled = False
        store.subscribe(self._on_change)

    def _on_change(self, change: Change) -> None:
        relevant = change.type == "DELETED" or (
            change.type == "ADDED" and change.obj["metadata"].get("ownerReferences")
        )
        if not relevant or self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.collect()  # no loop, hence no watch whose order could suffer
            return
        self._scheduled = True
        loop.call_soon(self.collect)

    def _owner_exists(self, ref: Obj, namespace: str) -> bool:
        group, _, version = str(ref.get("apiVersion", "")).rpartition("/")
        rt = next(
            (
                r
                for r in RESOURCES
                if (r.group, r.version, r.kind) == (group, version, ref.get("kind"))
            ),
            None,
        )
        if rt is None:
            return True
        owner = self.store.get(rt, namespace if rt.namespaced else "", str(ref.get("name", "")))
        return owner is not None and owner["metadata"]["uid"] == ref.get("uid")

    def collect(self) -> None:
        self._scheduled = False
        for rt in RESOURCES:
            for obj in self.store.view(rt):
                meta = obj["metadata"]
                refs = meta.get("ownerReferences") or []
                if not refs or meta.get("deletionTimestamp"):
                    continue
                namespace = meta.get("namespace", "")
                if any(self._owner_exists(ref, namespace) for ref in refs):
                    continue
                with contextlib.suppress(ApiError):  # gone meanwhile
                    self.store.delete(rt, namespace, meta["name"])
                    self.collected.append((rt.kind, namespace, meta["name"]))


# --------------------------------------------------------------------------------------------
# Request and response helpers
# --------------------------------------------------------------------------------------------


async def _json_body(
    request: web.Request, *, optional: bool = False, allow_list: bool = False
) -> Any:
    raw = await request.read()
    if not raw.strip():
        if optional:
            return {}
        raise bad_request("the request body is empty")
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise bad_request(f"the body of the request is not valid JSON: {e}") from None
    if not isinstance(body, dict) and not (allow_list and isinstance(body, list)):
        raise bad_request("the body of the request must be a JSON object")
    return body


def _check_body_namespace(body: Obj, namespace: str) -> None:
    given = (body.get("metadata") or {}).get("namespace")
    if given and namespace and given != namespace:
        raise bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )


def _dry_run(request: web.Request) -> bool:
    values = request.query.getall("dryRun", [])
    if any(v != "All" for v in values):
        raise bad_request(f'dryRun: Unsupported value: "{values[0]}": supported values: "All"')
    return bool(values)


def _selector(request: web.Request, rt: ResourceType) -> Selector:
    query = request.query
    return Selector.parse(
        query.get("labelSelector", ""), query.get("fieldSelector", ""), rt.selectable_fields
    )


def _in(namespace: str | None, obj: Obj) -> bool:
    return namespace is None or obj["metadata"].get("namespace") == namespace


def _list_key(obj: Obj) -> str:
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]


def _encode_continue(rv: int, last_key: str) -> str:
    # The same shape as the real server's token; clients treat it as opaque.
    token = {"v": "meta.k8s.io/v1", "rv": rv, "start": last_key + "\x00"}
    return base64.urlsafe_b64encode(json.dumps(token).encode()).decode()


def _decode_continue(token: str) -> tuple[int, str]:
    try:
        decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(decoded["rv"]), str(decoded["start"])
    except (ValueError, KeyError, TypeError):
        raise bad_request(f"continue key is not valid: {token!r}") from None


def _success(rt: ResourceType, obj: Obj) -> Obj:
    details = rt.details(obj["metadata"]["name"])
    details["uid"] = obj["metadata"]["uid"]
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": details,
    }


def _new_node(
    name: str,
    ip: str,
    labels: dict[str, str],
    allocatable: dict[str, str],
    capacity: dict[str, str],
    ready: bool,
) -> Obj:
    """A node as a kubelet registers it."""
    return {
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **labels,
            },
        },
        "status": {
            "capacity": capacity,
            "allocatable": allocatable,
            "conditions": [
                _node_condition(kind, "False", f"KubeletHasNo{kind}", f"no {kind}")
                for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")
            ]
            + [_ready_condition(ready)],
            "addresses": [
                {"type": "InternalIP", "address": ip},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": name,
                "containerRuntimeVersion": "containerd://1.7.0",
                "kernelVersion": "6.1.0",
                "kubeProxyVersion": "v1.31.0",
                "kubeletVersion": "v1.31.0",
                "machineID": name,
                "operatingSystem": "linux",
                "osImage": "Fake Linux",
                "systemUUID": name,
            },
        },
    }


def _node_condition(kind: str, status: str, reason: str, message: str) -> Obj:
    now = now_rfc3339()
    return {
        "type": kind,
        "status": status,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
        "reason": reason,
        "message": message,
    }


def _ready_condition(ready: bool | None) -> Obj:
    if ready is None:
        return _node_condition(
            "Ready", "Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status."
        )
    if ready:
        return _node_condition("Ready", "True", "KubeletReady", "kubelet is posting ready status")
    return _node_condition("Ready", "False", "KubeletNotReady", "container runtime is down")


# --------------------------------------------------------------------------------------------
# Discovery documents (the client rarely asks; kubectl-like tools do)
# --------------------------------------------------------------------------------------------

_VERSION = {
    "major": "1",
    "minor": "31",
    "gitVersion": "v1.31.0-fake",
    "gitCommit": "0" * 40,
    "gitTreeState": "clean",
    "buildDate": "2024-08-13T00:00:00Z",
    "goVersion": "go1.22.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}

_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def _group_list() -> Obj:
    groups = sorted({rt.group for rt in RESOURCES if rt.group})
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [
            {
                "name": group,
                "versions": [{"groupVersion": f"{group}/v1", "version": "v1"}],
                "preferredVersion": {"groupVersion": f"{group}/v1", "version": "v1"},
            }
            for group in groups
        ],
    }


def _resource_list(group: str, version: str) -> Obj | None:
    types = [rt for rt in RESOURCES if (rt.group, rt.version) == (group, version)]
    if not types:
        return None
    resources: list[Obj] = []
    for rt in types:
        resources.append(
            {
                "name": rt.plural,
                "singularName": rt.kind.lower(),
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": _VERBS,
            }
        )
        if rt.status_subresource:
            resources.append(
                {
                    "name": f"{rt.plural}/status",
                    "singularName": "",
                    "namespaced": rt.namespaced,
                    "kind": rt.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    if group == "":
        resources.append(
            {
                "name": "pods/eviction",
                "singularName": "",
                "namespaced": True,
                "group": "policy",
                "version": "v1",
                "kind": "Eviction",
                "verbs": ["create"],
            }
        )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }
