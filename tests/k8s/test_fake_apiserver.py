"""The fake API server, driven by the real kubernetes_asyncio client over loopback HTTP.

Each test states a behaviour of the real API server (or kubelet) that the controller will rely
on, and checks the fake shows it to the unmodified client.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client import ApiClient, ApiException
from kubernetes_asyncio.leaderelection.electionconfig import Config as ElectionConfig
from kubernetes_asyncio.leaderelection.leaderelection import LeaderElection
from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock
from kubernetes_asyncio.watch import Watch

from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.fake_kubelet import CrashLoop, Evicted, Exit, ImagePullError, OOMKilled, Preempted

NS = "default"
quiet = pytest.mark.kube(run_kubelet=False)  # no kubelet writes between the test's own
# How the controller must ask for a JSON merge patch (a dict body is otherwise sent as a
# strategic merge patch). The client takes `_content_type` but its stubs do not declare it.
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}


def pod_body(
    name: str | None = None,
    *,
    generate_name: str | None = None,
    labels: dict[str, str] | None = None,
    requests: dict[str, str] | None = None,
    node_selector: dict[str, str] | None = None,
    affinity: k8s.V1Affinity | None = None,
    tolerations: list[k8s.V1Toleration] | None = None,
    restart_policy: str | None = None,
    finalizers: list[str] | None = None,
) -> k8s.V1Pod:
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name=name, generate_name=generate_name, labels=labels, finalizers=finalizers
        ),
        spec=k8s.V1PodSpec(
            containers=[
                k8s.V1Container(
                    name="worker",
                    image="ebb/worker:1.0",
                    resources=k8s.V1ResourceRequirements(requests=requests),
                )
            ],
            node_selector=node_selector,
            affinity=affinity,
            tolerations=tolerations,
            restart_policy=restart_policy,
        ),
    )


def status_body(e: ApiException) -> Any:
    assert e.body is not None
    body = json.loads(e.body)
    assert body["kind"] == "Status" and body["status"] == "Failure"
    assert body["code"] == e.status
    return body


async def refused(call: Awaitable[Any], status: int) -> pytest.ExceptionInfo[ApiException]:
    """`call` fails with an API error of HTTP `status`."""
    with pytest.raises(ApiException) as exc:
        await call
    assert exc.value.status == status
    return exc


async def next_event(stream: Any, timeout: float = 5.0) -> Any:
    async with asyncio.timeout(timeout):
        return await stream.__anext__()


async def events_until(stream: Any, stop: Any, timeout: float = 5.0) -> list[Any]:
    """Collect watch events until `stop(event)` is true (that event included)."""
    events: list[Any] = []
    async with asyncio.timeout(timeout):
        async for event in stream:
            events.append(event)
            if stop(event):
                return events
    raise AssertionError(f"the watch ended before the expected event; got {events}")


async def pod_events_until(core: Any, stop: Any, **query: Any) -> list[Any]:
    """Watch the namespace's pods (with these list parameters) until `stop(event)`."""
    async with Watch() as watch:
        stream = watch.stream(core.list_namespaced_pod, NS, timeout_seconds=10, **query)
        return await events_until(stream, stop)


def container(pod: Any) -> Any:
    """The first container's status in a stored pod, or {} before the kubelet reports one."""
    return (pod["status"].get("containerStatuses") or [{}])[0]


def summary(events: list[Any]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"].metadata.name) for e in events]


# ---- create / get / list ---------------------------------------------------------------------


@quiet
async def test_create_with_generate_name_fills_server_fields(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    first = await core.create_namespaced_pod(NS, pod_body(generate_name="worker-"))
    # A plain dict body works too (the stubs say V1Pod; the client takes either).
    as_dict: Any = {
        "metadata": {"generateName": "worker-"},
        "spec": {"containers": [{"name": "w", "image": "busybox"}]},
    }
    second = await core.create_namespaced_pod(NS, as_dict)
    for pod in (first, second):
        assert isinstance(pod, k8s.V1Pod)
        assert pod.kind == "Pod" and pod.api_version == "v1"
        assert pod.metadata.name.startswith("worker-") and len(pod.metadata.name) == 12
        assert pod.metadata.namespace == NS
        assert pod.metadata.uid and isinstance(pod.metadata.creation_timestamp, datetime)
        assert pod.status.phase == "Pending"
    assert first.metadata.name != second.metadata.name
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    # Defaulting the real server does, which the controller may read back.
    assert second.spec.restart_policy == "Always"
    assert second.spec.termination_grace_period_seconds == 30
    assert second.spec.containers[0].image_pull_policy == "Always"  # untagged image
    assert first.spec.containers[0].image_pull_policy == "IfNotPresent"


@quiet
async def test_create_conflicts_and_validation(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    await core.create_namespaced_pod(NS, pod_body("w-0"))
    exc = await refused(core.create_namespaced_pod(NS, pod_body("w-0")), 409)
    body = status_body(exc.value)
    assert body["reason"] == "AlreadyExists"
    assert body["message"] == 'pods "w-0" already exists'
    assert body["details"] == {"name": "w-0", "kind": "pods"}

    exc = await refused(core.create_namespaced_pod(NS, pod_body("Not_A_Name")), 422)
    body = status_body(exc.value)
    assert body["reason"] == "Invalid"
    assert body["details"]["causes"][0]["field"] == "metadata.name"

    no_image: Any = {"metadata": {"name": "w-1"}, "spec": {"containers": [{"name": "c"}]}}
    exc = await refused(core.create_namespaced_pod(NS, no_image), 422)
    assert status_body(exc.value)["details"]["causes"] == [
        {
            "reason": "FieldValueRequired",
            "message": "Required value",
            "field": "spec.containers[0].image",
        }
    ]

    exc = await refused(core.create_namespaced_pod("no-such-namespace", pod_body("w-2")), 404)
    assert status_body(exc.value)["message"] == 'namespaces "no-such-namespace" not found'


@quiet
async def test_get_missing_object_is_404_with_status(kube: FakeKubeAPI, client: ApiClient) -> None:
    exc = await refused(k8s.CoreV1Api(client).read_namespaced_pod("nope", NS), 404)
    assert status_body(exc.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'pods "nope" not found',
        "reason": "NotFound",
        "details": {"name": "nope", "kind": "pods"},
        "code": 404,
    }
    with pytest.raises(ApiException) as exc:
        await k8s.CoordinationV1Api(client).read_namespaced_lease("nope", NS)
    assert status_body(exc.value)["message"] == 'leases.coordination.k8s.io "nope" not found'


@quiet
async def test_list_with_label_selectors(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    for name, labels in [
        ("a1", {"app": "a", "tier": "gpu"}),
        ("a2", {"app": "a"}),
        ("b1", {"app": "b", "tier": "cpu"}),
        ("n1", {}),
    ]:
        await core.create_namespaced_pod(NS, pod_body(name, labels=labels))

    async def names(selector: str) -> list[str]:
        result = await core.list_namespaced_pod(NS, label_selector=selector)
        assert isinstance(result, k8s.V1PodList)
        return [p.metadata.name for p in result.items]

    assert await names("") == ["a1", "a2", "b1", "n1"]
    assert await names("app=a") == ["a1", "a2"]
    assert await names("app==a") == ["a1", "a2"]
    assert await names("app!=a") == ["b1", "n1"]  # != also selects objects without the key
    assert await names("app in (a, b)") == ["a1", "a2", "b1"]
    assert await names("app notin (a)") == ["b1", "n1"]
    assert await names("tier") == ["a1", "b1"]
    assert await names("!tier") == ["a2", "n1"]
    assert await names("app=a,!tier") == ["a2"]
    assert await names("app in (a),tier in (gpu,cpu)") == ["a1"]
    await refused(names("app in ()"), 400)


async def test_list_with_field_selectors(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1", allocatable={"cpu": "1", "memory": "1Gi"})
    kube.add_namespace("other")
    await core.create_namespaced_pod(NS, pod_body("fits", requests={"cpu": "1"}))
    await kube.wait_for_pod("fits", phase="Running")
    await core.create_namespaced_pod(NS, pod_body("waits", requests={"cpu": "1"}))
    await core.create_namespaced_pod("other", pod_body("elsewhere", requests={"cpu": "1"}))
    await kube.wait_for(
        lambda: all(
            p["status"].get("conditions") for p in kube.list_pods(field_selector="spec.nodeName=")
        ),
        what="the scheduler to give up on the pods that do not fit",
    )

    async def names(selector: str, namespace: str | None = NS) -> list[str]:
        if namespace is None:
            result = await core.list_pod_for_all_namespaces(field_selector=selector)
        else:
            result = await core.list_namespaced_pod(namespace, field_selector=selector)
        return [p.metadata.name for p in result.items]

    assert await names("spec.nodeName=n1") == ["fits"]
    assert await names("spec.nodeName=") == ["waits"]
    assert await names("status.phase=Running") == ["fits"]
    assert await names("status.phase!=Running", None) == ["waits", "elsewhere"]
    assert await names("metadata.name=waits") == ["waits"]
    assert await names("metadata.namespace=other", None) == ["elsewhere"]
    assert await names("metadata.namespace=default,status.phase=Pending", None) == ["waits"]
    exc = await refused(names("spec.schedulerName==default-scheduler,metadata.labels=x"), 400)
    assert '"metadata.labels" is not a known field selector' in status_body(exc.value)["message"]


@quiet
async def test_list_carries_resource_version_and_pages(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    for i in range(5):
        await core.create_namespaced_pod(NS, pod_body(f"w-{i}"))
    listed = await core.list_namespaced_pod(NS)
    assert listed.kind == "PodList" and listed.api_version == "v1"
    assert listed.metadata.resource_version == str(kube.resource_version)
    # As from a real server, list items carry no kind/apiVersion (kubernetes#3030).
    assert listed.items[0].to_dict()["kind"] is None

    first = await core.list_namespaced_pod(NS, limit=2)
    assert [p.metadata.name for p in first.items] == ["w-0", "w-1"]
    assert first.metadata.remaining_item_count == 3
    await core.create_namespaced_pod(NS, pod_body("w-5"))  # pages stay at the first's version
    second = await core.list_namespaced_pod(NS, limit=2, _continue=first.metadata._continue)
    third = await core.list_namespaced_pod(NS, limit=2, _continue=second.metadata._continue)
    assert [p.metadata.name for p in second.items + third.items] == ["w-2", "w-3", "w-4"]
    assert not third.metadata._continue  # the last page
    assert third.metadata.resource_version == first.metadata.resource_version


# ---- update: patch, replace, status ----------------------------------------------------------


@quiet
async def test_patch_content_types_sent_by_the_client(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    await core.create_namespaced_pod(NS, pod_body("w", labels={"app": "a", "keep": "1"}))

    # A dict body: the client sends a strategic merge patch; null deletes a key.
    patched = await core.patch_namespaced_pod(
        "w", NS, {"metadata": {"labels": {"app": None, "job": "j1"}}}
    )
    assert patched.metadata.labels == {"keep": "1", "job": "j1"}
    # Forced to a JSON merge patch.
    patched = await core.patch_namespaced_pod(
        "w", NS, {"metadata": {"annotations": {"ebb/shard": "7"}}}, **MERGE_PATCH
    )
    assert patched.metadata.annotations == {"ebb/shard": "7"}
    # A list body: a JSON patch; a failing `test` operation is 422 and changes nothing.
    patched = await core.patch_namespaced_pod(
        "w", NS, [{"op": "replace", "path": "/metadata/labels/job", "value": "j2"}]
    )
    assert patched.metadata.labels["job"] == "j2"
    with pytest.raises(ApiException) as exc:
        await core.patch_namespaced_pod(
            "w", NS, [{"op": "test", "path": "/metadata/labels/job", "value": "j1"}]
        )
    assert exc.value.status == 422

    patches = [r.content_type for r in kube.requests if r.method == "PATCH"]
    assert patches == [
        "application/strategic-merge-patch+json",
        "application/merge-patch+json",
        "application/json-patch+json",
        "application/json-patch+json",
    ]
    # A resourceVersion in a patch is a precondition.
    stale = patched.metadata.resource_version
    await core.patch_namespaced_pod("w", NS, {"metadata": {"labels": {"x": "1"}}})
    with pytest.raises(ApiException) as exc:
        await core.patch_namespaced_pod(
            "w", NS, {"metadata": {"resourceVersion": stale, "labels": {"x": "2"}}}
        )
    assert exc.value.status == 409
    assert status_body(exc.value)["reason"] == "Conflict"
    exc = await refused(
        core.patch_namespaced_pod("missing", NS, {"metadata": {"labels": {"x": "1"}}}), 404
    )


@quiet
async def test_status_is_a_subresource_and_pod_spec_is_immutable(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    await core.create_namespaced_pod(NS, pod_body("w"))
    # Through the main resource the status is ignored, as by a real server...
    ignored = await core.patch_namespaced_pod("w", NS, {"status": {"phase": "Running"}})
    assert ignored.status.phase == "Pending"
    # ...and through /status it is taken.
    taken = await core.patch_namespaced_pod_status("w", NS, {"status": {"phase": "Running"}})
    assert taken.status.phase == "Running"
    exc = await refused(
        core.patch_namespaced_pod("w", NS, {"spec": {"restartPolicy": "Never"}}), 422
    )
    assert "pod updates may not change fields" in status_body(exc.value)["message"]


@quiet
async def test_replace_with_stale_resource_version_conflicts(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    await core.create_namespaced_pod(NS, pod_body("w"))
    read = await core.read_namespaced_pod("w", NS)
    read.metadata.labels = {"gen": "1"}
    replaced = await core.replace_namespaced_pod("w", NS, read)
    assert replaced.metadata.labels == {"gen": "1"}
    assert int(replaced.metadata.resource_version) > int(read.metadata.resource_version)

    read.metadata.labels = {"gen": "2"}  # still carries the old resourceVersion
    exc = await refused(core.replace_namespaced_pod("w", NS, read), 409)
    assert status_body(exc.value)["message"] == (
        'Operation cannot be fulfilled on pods "w": the object has been modified; please apply '
        "your changes to the latest version and try again"
    )
    stored = kube.get_pod("w")
    assert stored is not None and stored["metadata"]["labels"] == {"gen": "1"}

    # Writing back what is stored changes nothing: no new resourceVersion, no watch event.
    rv = kube.resource_version
    same = await core.replace_namespaced_pod("w", NS, replaced)
    assert same.metadata.resource_version == replaced.metadata.resource_version
    assert kube.resource_version == rv


# ---- delete --------------------------------------------------------------------------------


async def test_delete_with_grace_period_goes_through_terminating(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1")
    await core.create_namespaced_pod(NS, pod_body("w"))
    running = await kube.wait_for_pod("w", phase="Running")

    async with Watch() as watch:
        stream = watch.stream(
            core.list_namespaced_pod,
            NS,
            resource_version=running["metadata"]["resourceVersion"],
            timeout_seconds=10,
        )
        deleted = await core.delete_namespaced_pod("w", NS, grace_period_seconds=30)
        assert isinstance(deleted, k8s.V1Pod)
        assert deleted.metadata.deletion_timestamp is not None
        assert deleted.metadata.deletion_grace_period_seconds == 30
        events = await events_until(stream, lambda e: e["type"] == "DELETED")

    terminating, stopped, gone = events
    assert terminating["type"] == "MODIFIED"
    assert terminating["object"].metadata.deletion_timestamp is not None
    assert terminating["object"].status.phase == "Running"
    # The kubelet reports the containers stopped (SIGTERM) before the pod goes.
    assert stopped["type"] == "MODIFIED" and stopped["object"].status.phase == "Failed"
    assert stopped["object"].status.container_statuses[0].state.terminated.exit_code == 143
    assert gone["type"] == "DELETED"
    await refused(core.read_namespaced_pod("w", NS), 404)


async def test_delete_with_zero_grace_or_unscheduled_is_immediate(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1")
    await core.create_namespaced_pod(NS, pod_body("running"))
    await kube.wait_for_pod("running", phase="Running")
    await core.delete_namespaced_pod(
        "running", NS, body=k8s.V1DeleteOptions(grace_period_seconds=0)
    )
    assert kube.get_pod("running") is None

    # No kubelet runs a pod that is not on a node, so there is nothing to wait for.
    await core.create_namespaced_pod(NS, pod_body("pending", node_selector={"no": "such-node"}))
    await core.delete_namespaced_pod("pending", NS, grace_period_seconds=30)
    assert kube.get_pod("pending") is None


async def test_finalizers_hold_a_deleted_pod(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1")
    await core.create_namespaced_pod(NS, pod_body("w", finalizers=["ebb.dev/exit-status"]))
    await kube.wait_for_pod("w", phase="Running")
    await core.delete_namespaced_pod("w", NS)
    held = await kube.wait_for_pod(
        "w", where=lambda p: p["metadata"].get("deletionGracePeriodSeconds") == 0
    )
    assert held["status"]["phase"] == "Failed"  # stopped, but still there for the controller
    await core.patch_namespaced_pod("w", NS, {"metadata": {"finalizers": None}}, **MERGE_PATCH)
    assert kube.get_pod("w") is None


# ---- watch ---------------------------------------------------------------------------------


@quiet
async def test_watch_from_resource_version_sees_changes_in_order(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    start = (await core.list_namespaced_pod(NS)).metadata.resource_version
    await core.create_namespaced_pod(NS, pod_body("w", labels={"app": "ebb"}))
    await core.patch_namespaced_pod("w", NS, {"metadata": {"labels": {"step": "2"}}})
    await core.create_namespaced_pod(NS, pod_body("other"))
    await core.delete_namespaced_pod("w", NS)

    events = await pod_events_until(
        core, lambda e: e["type"] == "DELETED", label_selector="app=ebb", resource_version=start
    )
    assert summary(events) == [("ADDED", "w"), ("MODIFIED", "w"), ("DELETED", "w")]
    versions = [int(e["object"].metadata.resource_version) for e in events]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert events[1]["object"].metadata.labels == {"app": "ebb", "step": "2"}
    assert events[0]["raw_object"]["kind"] == "Pod"


@quiet
async def test_watch_reports_objects_entering_and_leaving_the_selector(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    await core.create_namespaced_pod(NS, pod_body("w", labels={"job": "j1"}))
    start = str(kube.resource_version)
    await core.patch_namespaced_pod("w", NS, {"metadata": {"labels": {"job": "j2"}}})
    await core.patch_namespaced_pod("w", NS, {"metadata": {"labels": {"job": "j1"}}})
    events = await pod_events_until(
        core, lambda e: e["type"] == "ADDED", label_selector="job=j1", resource_version=start
    )
    assert summary(events) == [("DELETED", "w"), ("ADDED", "w")]


@quiet
async def test_watch_without_resource_version_starts_with_current_objects(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    await core.create_namespaced_pod(NS, pod_body("before"))
    async with Watch() as watch:
        stream = watch.stream(core.list_namespaced_pod, NS, timeout_seconds=10)
        assert summary([await next_event(stream)]) == [("ADDED", "before")]
        await core.create_namespaced_pod(NS, pod_body("after"))
        assert summary([await next_event(stream)]) == [("ADDED", "after")]


@quiet
async def test_watch_resumes_from_last_resource_version_after_abrupt_cut(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    start = str(kube.resource_version)
    async with Watch() as watch:
        stream = watch.stream(core.list_namespaced_pod, NS, resource_version=start)
        await core.create_namespaced_pod(NS, pod_body("a"))
        assert summary([await next_event(stream)]) == [("ADDED", "a")]
        assert kube.cut_watches() == 1
        # Queued behind the cut: this stream never sends it.
        await core.create_namespaced_pod(NS, pod_body("b"))
        with pytest.raises(aiohttp.ClientPayloadError):
            await next_event(stream)
        resume_from = watch.resource_version
    await kube.wait_for(lambda: kube.open_watches == 0)
    await core.create_namespaced_pod(NS, pod_body("c"))

    events = await pod_events_until(
        core, lambda e: e["object"].metadata.name == "c", resource_version=resume_from
    )
    assert summary(events) == [("ADDED", "b"), ("ADDED", "c")]  # nothing lost, nothing twice


@quiet
async def test_client_watch_reconnects_by_itself_after_the_server_ends_the_stream(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    start = str(kube.resource_version)
    async with Watch() as watch:
        # No timeout_seconds: the client's Watch re-lists from its last resourceVersion when the
        # server closes the stream, as the server does every so often.
        stream = watch.stream(core.list_namespaced_pod, NS, resource_version=start)
        await core.create_namespaced_pod(NS, pod_body("a"))
        a = await next_event(stream)
        kube.cut_watches(graceful=True)
        await core.create_namespaced_pod(NS, pod_body("b"))
        b = await next_event(stream)
    assert summary([a, b]) == [("ADDED", "a"), ("ADDED", "b")]
    watches = [r.query for r in kube.requests if r.query.get("watch")]
    assert [q["resourceVersion"] for q in watches] == [start, a["object"].metadata.resource_version]


@pytest.mark.kube(run_kubelet=False, bookmark_interval=0.05)
async def test_watch_bookmarks_carry_the_current_resource_version(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    await core.create_namespaced_pod(NS, pod_body("w"))
    async with Watch() as watch:
        stream = watch.stream(
            core.list_namespaced_pod,
            NS,
            resource_version=str(kube.resource_version),
            allow_watch_bookmarks=True,
            timeout_seconds=10,
        )
        event = await next_event(stream)
        assert event["type"] == "BOOKMARK"
        assert event["raw_object"]["metadata"]["resourceVersion"] == str(kube.resource_version)
        assert watch.resource_version == str(kube.resource_version)


@quiet
async def test_compaction_expires_old_resource_versions(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    old = str(kube.resource_version)
    await core.create_namespaced_pod(NS, pod_body("w"))
    # Before compaction, an exact list shows the past.
    past = await core.list_namespaced_pod(NS, resource_version=old, resource_version_match="Exact")
    assert past.items == [] and past.metadata.resource_version == old
    kube.compact()

    # On the wire: HTTP 200, then one ERROR event with a 410 Status, then the end.
    url = f"{kube.url}/api/v1/namespaces/{NS}/pods"
    async with (
        asyncio.timeout(5),
        aiohttp.ClientSession() as session,
        session.get(url, params={"watch": "1", "resourceVersion": old}) as raw,
    ):
        assert raw.status == 200
        lines = (await raw.read()).decode().splitlines()
    event = json.loads(lines[0])
    assert len(lines) == 1 and event["type"] == "ERROR"
    assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"

    async with Watch() as watch:
        with pytest.raises(ApiException) as exc:
            await next_event(
                watch.stream(core.list_namespaced_pod, NS, resource_version=old, timeout_seconds=10)
            )
    assert exc.value.status == 410 and str(exc.value.reason).startswith("Expired")

    exc = await refused(
        core.list_namespaced_pod(NS, resource_version=old, resource_version_match="Exact"), 410
    )
    assert status_body(exc.value)["reason"] == "Expired"
    # Without "Exact" the server serves its latest state, which is newer than asked: fine.
    assert len((await core.list_namespaced_pod(NS, resource_version=old)).items) == 1


@pytest.mark.kube(run_kubelet=False, history_limit=3)
async def test_history_overflow_expires_old_resource_versions(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    old = str(kube.resource_version)
    for i in range(3):
        await core.create_namespaced_pod(NS, pod_body(f"w-{i}"))
    async with Watch() as watch:
        events = await events_until(
            watch.stream(core.list_namespaced_pod, NS, resource_version=old, timeout_seconds=10),
            lambda e: e["object"].metadata.name == "w-2",
        )
    assert len(events) == 3  # exactly what the history still holds
    await core.create_namespaced_pod(NS, pod_body("w-3"))
    async with Watch() as watch:
        with pytest.raises(ApiException) as exc:
            await next_event(
                watch.stream(core.list_namespaced_pod, NS, resource_version=old, timeout_seconds=10)
            )
    assert exc.value.status == 410


# ---- fault injection -----------------------------------------------------------------------


@quiet
async def test_injected_500_and_429_reach_the_client(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    fault = kube.fail_next(status=500)
    exc = await refused(core.list_namespaced_pod(NS), 500)
    assert status_body(exc.value)["reason"] == "InternalError"
    assert fault.remaining == 0 and [h.method for h in fault.hits] == ["GET"]
    await core.list_namespaced_pod(NS)  # spent: the next request goes through

    throttle = kube.fail_next(2, status=429, retry_after=7, method="POST", path=r"/pods$")
    for _ in range(2):
        exc = await refused(core.create_namespaced_pod(NS, pod_body("w")), 429)
        assert exc.value.headers is not None and exc.value.headers["Retry-After"] == "7"
        assert status_body(exc.value)["details"] == {"retryAfterSeconds": 7}
        await core.list_namespaced_pod(NS)  # not a POST: unaffected
    await core.create_namespaced_pod(NS, pod_body("w"))
    assert len(throttle.hits) == 2

    # A watch that fails to open: the client turns the Status line into an ApiException.
    kube.fail_next(status=500, when=lambda r: "watch" in r.query)
    async with Watch() as watch:
        with pytest.raises(ApiException) as exc:
            await next_event(watch.stream(core.list_namespaced_pod, NS, timeout_seconds=10))
    assert exc.value.status == 500


@pytest.mark.kube(run_kubelet=False, token="s3cret")
async def test_bearer_token_is_required_when_set(kube: FakeKubeAPI, client: ApiClient) -> None:
    await k8s.CoreV1Api(client).list_namespaced_pod(NS)
    async with k8s.ApiClient(k8s.Configuration(host=kube.url)) as anonymous:
        with pytest.raises(ApiException) as exc:
            await k8s.CoreV1Api(anonymous).list_namespaced_pod(NS)
    assert exc.value.status == 401


@quiet
async def test_discovery_and_version(kube: FakeKubeAPI, client: ApiClient) -> None:
    assert (await k8s.CoreApi(client).get_api_versions()).versions == ["v1"]
    groups = await k8s.ApisApi(client).get_api_versions()
    assert [g.name for g in groups.groups] == ["apps", "coordination.k8s.io", "scheduling.k8s.io"]
    resources = await k8s.CoordinationV1Api(client).get_api_resources()
    assert [r.name for r in resources.resources] == ["leases"]
    assert (await k8s.VersionApi(client).get_code()).major == "1"


# ---- the fake kubelet: scheduling ----------------------------------------------------------


def pod_scheduled(pod: Any) -> Any:
    return next(c for c in pod.status.conditions if c.type == "PodScheduled")


async def test_scheduler_honours_node_selector_affinity_and_capacity(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("cpu-1", allocatable={"cpu": "4", "memory": "16Gi"})
    kube.add_node(
        "gpu-1",
        labels={"gpu": "a100", "zone": "a"},
        allocatable={"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "2"},
    )
    kube.add_node(
        "gpu-2",
        labels={"gpu": "t4", "zone": "b"},
        allocatable={"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"},
    )
    a100 = {"gpu": "a100"}
    one_gpu = {"nvidia.com/gpu": "1"}
    zone_b = k8s.V1Affinity(
        node_affinity=k8s.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(
                node_selector_terms=[
                    k8s.V1NodeSelectorTerm(
                        match_expressions=[
                            k8s.V1NodeSelectorRequirement(key="zone", operator="In", values=["b"]),
                            k8s.V1NodeSelectorRequirement(key="gpu", operator="Exists"),
                            k8s.V1NodeSelectorRequirement(
                                key="gpu", operator="NotIn", values=["a100"]
                            ),
                        ]
                    )
                ]
            )
        )
    )
    await core.create_namespaced_pod(NS, pod_body("g1", node_selector=a100, requests=one_gpu))
    await core.create_namespaced_pod(NS, pod_body("g2", affinity=zone_b, requests=one_gpu))
    await core.create_namespaced_pod(NS, pod_body("g3", node_selector=a100, requests=one_gpu))
    for name, node in [("g1", "gpu-1"), ("g2", "gpu-2"), ("g3", "gpu-1")]:
        await kube.wait_for_pod(name, phase="Running")
        assert (await core.read_namespaced_pod(name, NS)).spec.node_name == node

    # gpu-1's two GPUs are taken: a third A100 pod waits, and the scheduler says why.
    await core.create_namespaced_pod(NS, pod_body("g4", node_selector=a100, requests=one_gpu))
    await kube.wait_for_pod("g4", where=lambda p: bool(p["status"].get("conditions")))
    waiting = await core.read_namespaced_pod("g4", NS)
    assert waiting.status.phase == "Pending" and not waiting.spec.node_name
    condition = pod_scheduled(waiting)
    assert (condition.status, condition.reason) == ("False", "Unschedulable")
    assert condition.message == (
        "0/3 nodes are available: 1 Insufficient nvidia.com/gpu, "
        "2 node(s) didn't match Pod's node affinity/selector."
    )

    # Freeing a GPU lets it in, without any prodding.
    await core.delete_namespaced_pod("g1", NS, grace_period_seconds=0)
    await kube.wait_for_pod("g4", phase="Running")
    placed = await core.read_namespaced_pod("g4", NS)
    assert placed.spec.node_name == "gpu-1" and pod_scheduled(placed).status == "True"

    # CPU: requests count against allocatable, terminated pods do not.
    await core.create_namespaced_pod(NS, pod_body("big", requests={"cpu": "6"}))
    big = await kube.wait_for_pod("big", phase="Running")
    assert big["spec"]["nodeName"] != "cpu-1"


async def test_taints_readiness_and_cordons_keep_pods_off_nodes(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node(
        "tainted", taints=[{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]
    )
    kube.add_node("down", ready=False)
    kube.add_node("cordoned")
    await k8s.CoreV1Api(client).patch_node("cordoned", {"spec": {"unschedulable": True}})
    await core.create_namespaced_pod(NS, pod_body("plain"))
    pending = await kube.wait_for_pod("plain", where=lambda p: bool(p["status"].get("conditions")))
    assert pending["status"]["conditions"][0]["message"] == (
        "0/3 nodes are available: 1 node(s) had untolerated taint "
        "{node.kubernetes.io/not-ready: }, 1 node(s) had untolerated taint "
        "{nvidia.com/gpu: true}, 1 node(s) were unschedulable."
    )
    toleration = k8s.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
    await core.create_namespaced_pod(NS, pod_body("tolerant", tolerations=[toleration]))
    assert (await kube.wait_for_pod("tolerant", phase="Running"))["spec"]["nodeName"] == "tainted"
    kube.set_node_ready("down", True)
    assert (await kube.wait_for_pod("plain", phase="Running"))["spec"]["nodeName"] == "down"


async def test_node_labels_changes_reach_the_scheduler(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1")
    await core.create_namespaced_pod(NS, pod_body("w", node_selector={"pool": "ebb"}))
    pending = await kube.wait_for_pod("w", where=lambda p: bool(p["status"].get("conditions")))
    assert "nodeName" not in pending["spec"]
    kube.set_node_labels("n1", {"kubernetes.io/hostname": "n1", "pool": "ebb"})
    await kube.wait_for_pod("w", phase="Running")
    node = await core.read_node("n1")
    assert node.metadata.labels["pool"] == "ebb"
    assert node.status.allocatable == {
        "cpu": "8",
        "memory": "32Gi",
        "nvidia.com/gpu": "0",
        "pods": "110",
    }


# ---- the fake kubelet: what pods go through --------------------------------------------------


async def started_pod(
    kube: FakeKubeAPI, core: k8s.CoreV1Api, name: str, restart_policy: str = "Never"
) -> None:
    if kube.get_node("n1") is None:
        kube.add_node("n1")
    await core.create_namespaced_pod(NS, pod_body(name, restart_policy=restart_policy))


async def test_running_pod_status(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    await started_pod(kube, core, "w")
    await kube.wait_for_pod("w", phase="Running")
    pod = await core.read_namespaced_pod("w", NS)
    status = pod.status.container_statuses[0]
    assert status.ready and status.started and status.restart_count == 0
    assert status.state.running.started_at is not None and status.container_id
    assert pod.status.pod_ip and pod.status.host_ip and pod.status.start_time
    conditions = {c.type: c.status for c in pod.status.conditions}
    assert conditions["Ready"] == conditions["ContainersReady"] == "True"
    assert pod.status.qos_class == "BestEffort"


async def test_exit_policies_end_a_never_restarting_pod(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_pod_policy(Exit(code=0), name_prefix="ok")
    kube.add_pod_policy(Exit(code=3, message="shard 7 failed"), name_prefix="bad")
    await started_pod(kube, core, "ok-1")
    await started_pod(kube, core, "bad-1")
    await kube.wait_for_pod("ok-1", phase="Succeeded")
    await kube.wait_for_pod("bad-1", phase="Failed")

    ok = (await core.read_namespaced_pod("ok-1", NS)).status.container_statuses[0]
    assert (ok.state.terminated.exit_code, ok.state.terminated.reason) == (0, "Completed")
    bad = (await core.read_namespaced_pod("bad-1", NS)).status
    terminated = bad.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason, terminated.message) == (
        3,
        "Error",
        "shard 7 failed",
    )
    assert terminated.finished_at >= terminated.started_at
    assert bad.reason is None  # a failed container is not a pod-level reason


async def test_a_pod_exits_on_demand_even_in_its_grace_period(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    await started_pod(kube, core, "done-1")
    await started_pod(kube, core, "draining-1")
    await kube.wait_for_pod("done-1", phase="Running")
    await kube.wait_for_pod("draining-1", phase="Running")
    kube.exit_pod("done-1", NS)
    await kube.wait_for_pod("done-1", phase="Succeeded")
    terminated = (await core.read_namespaced_pod("done-1", NS)).status.container_statuses[0]
    assert terminated.state.terminated.exit_code == 0
    # A worker that ends its drain before its grace is over: Succeeded, then gone.
    await core.delete_namespaced_pod("draining-1", NS, grace_period_seconds=30)
    ended = kube.exit_pod("draining-1", NS)
    assert ended["status"]["phase"] == "Succeeded"
    await kube.wait_for(lambda: kube.get_pod("draining-1", NS) is None, what="the pod gone")


async def test_oom_killed_fails_or_crash_loops_by_restart_policy(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_pod_policy(OOMKilled())
    await started_pod(kube, core, "never", restart_policy="Never")
    await started_pod(kube, core, "always", restart_policy="Always")
    await kube.wait_for_pod("never", phase="Failed")
    never = (await core.read_namespaced_pod("never", NS)).status.container_statuses[0]
    assert never.state.terminated.reason == "OOMKilled"
    assert never.state.terminated.exit_code == 137

    await kube.wait_for_pod("always", where=lambda p: container(p).get("restartCount", 0) >= 1)
    always = await core.read_namespaced_pod("always", NS)
    assert always.status.phase == "Running"
    last = always.status.container_statuses[0].last_state.terminated
    assert (last.reason, last.exit_code) == ("OOMKilled", 137)


async def test_crash_loop_back_off_with_growing_restart_count(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_pod_policy(CrashLoop())
    await started_pod(kube, core, "w", restart_policy="Always")

    def backing_off(p: Any) -> bool:
        status = container(p)
        waiting = status.get("state", {}).get("waiting") or {}
        return waiting.get("reason") == "CrashLoopBackOff" and status["restartCount"] >= 3

    await kube.wait_for_pod("w", where=backing_off)
    pod = await core.read_namespaced_pod("w", NS)
    status = pod.status.container_statuses[0]
    assert pod.status.phase == "Running" and not status.ready
    assert status.state.waiting.message.startswith("back-off ")
    assert status.last_state.terminated.exit_code == 1
    assert {c.type: c.reason for c in pod.status.conditions}["Ready"] == "ContainersNotReady"


async def test_eviction_by_policy_and_on_demand(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_pod_policy(Evicted(after=0.05), name_prefix="pressured")
    await started_pod(kube, core, "pressured")
    await started_pod(kube, core, "victim")
    await kube.wait_for_pod("victim", phase="Running")
    kube.evict("victim", message="The node was low on resource: ephemeral-storage. ")

    for name in ("pressured", "victim"):
        await kube.wait_for_pod(name, phase="Failed")
        status = (await core.read_namespaced_pod(name, NS)).status
        assert status.reason == "Evicted"
        assert status.message.startswith("The node was low on resource: ")
        disruption = next(c for c in status.conditions if c.type == "DisruptionTarget")
        assert (disruption.status, disruption.reason) == ("True", "TerminationByKubelet")
        assert status.container_statuses[0].state.terminated.exit_code == 137


async def test_preemption_by_scheduler_and_by_kubelet(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_pod_policy(Preempted(after=0.05), name_prefix="sched")
    kube.add_pod_policy(Preempted(after=0.05, by="kubelet"), name_prefix="kube")
    await started_pod(kube, core, "sched-1", restart_policy="Always")
    await started_pod(kube, core, "kube-1", restart_policy="Always")
    events = await pod_events_until(
        core, lambda e: e["type"] == "DELETED", field_selector="metadata.name=sched-1"
    )
    marked = next(
        e["object"] for e in events if e["object"].metadata.deletion_timestamp is not None
    )
    disruption = next(c for c in marked.status.conditions if c.type == "DisruptionTarget")
    assert disruption.reason == "PreemptionByScheduler"
    assert disruption.message == (
        "default-scheduler: preempting to accommodate a higher priority pod"
    )

    await kube.wait_for_pod("kube-1", phase="Failed")
    status = (await core.read_namespaced_pod("kube-1", NS)).status
    assert (status.reason, status.message) == (
        "Preempting",
        "Preempted in order to admit critical pod",
    )
    assert any(c.type == "DisruptionTarget" for c in status.conditions)


# ---- priority: admission and preemption ------------------------------------------------------


def prioritised(
    name: str, priority_class: str | None, *, cpu: str = "2", node_selector: Any = None
) -> k8s.V1Pod:
    body = pod_body(name, requests={"cpu": cpu}, node_selector=node_selector)
    spec: Any = body.spec  # its stubs type the field as str; the API takes it unset
    spec.priority_class_name = priority_class
    return body


async def add_priority_class(
    client: ApiClient, name: str, value: int, *, never: bool = False, default: bool = False
) -> Any:
    return await k8s.SchedulingV1Api(client).create_priority_class(
        k8s.V1PriorityClass(
            metadata=k8s.V1ObjectMeta(name=name),
            value=value,
            preemption_policy="Never" if never else None,
            global_default=default or None,
        )
    )


async def test_priority_class_admission(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    scheduling = k8s.SchedulingV1Api(client)
    names = {c.metadata.name for c in (await scheduling.list_priority_class()).items}
    assert {"system-cluster-critical", "system-node-critical"} <= names
    created = await add_priority_class(client, "batch", -10, never=True)
    assert created.preemption_policy == "Never"
    await add_priority_class(client, "web", 1000)

    # The class is resolved to spec.priority and spec.preemptionPolicy at admission.
    await core.create_namespaced_pod(NS, prioritised("b", "batch"))
    await core.create_namespaced_pod(NS, prioritised("w", "web"))
    await core.create_namespaced_pod(NS, prioritised("plain", None))
    b, w, plain = [(await core.read_namespaced_pod(n, NS)).to_dict() for n in ("b", "w", "plain")]
    assert (b["spec"]["priority"], b["spec"]["preemption_policy"]) == (-10, "Never")
    assert (w["spec"]["priority"], w["spec"]["preemption_policy"]) == (1000, "PreemptLowerPriority")
    assert (plain["spec"]["priority"], plain["spec"]["priority_class_name"]) == (0, None)

    # A class that does not exist is refused, and so is a priority the pod sets itself.
    exc = await refused(core.create_namespaced_pod(NS, prioritised("x", "missing")), 403)
    assert status_body(exc.value)["message"] == (
        'pods "x" is forbidden: no PriorityClass with name missing was found'
    )
    forged = prioritised("y", "batch")
    forged.spec.priority = 5
    exc = await refused(core.create_namespaced_pod(NS, forged), 403)
    assert (
        "the integer value of priority (5) must not be provided in pod spec"
        in (status_body(exc.value)["message"])
    )
    assert kube.get_pod("x") is None and kube.get_pod("y") is None

    # A global default class applies to pods that name none; a class's value is immutable.
    await add_priority_class(client, "fallback", 7, default=True)
    await core.create_namespaced_pod(NS, prioritised("later", None))
    later = await core.read_namespaced_pod("later", NS)
    assert (later.spec.priority, later.spec.priority_class_name) == (7, "fallback")
    await refused(scheduling.patch_priority_class("web", {"value": 1}), 422)


async def test_scheduler_preempts_the_lowest_priority_pods_gracefully(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1", allocatable={"cpu": "8", "memory": "32Gi"})
    await add_priority_class(client, "batch", -10, never=True)
    await add_priority_class(client, "web", 1000)
    await core.create_namespaced_pod(NS, prioritised("low-a", "batch"))
    await core.create_namespaced_pod(NS, prioritised("low-b", "batch"))
    await core.create_namespaced_pod(NS, prioritised("mid", None, cpu="4"))
    for name in ("low-a", "low-b", "mid"):
        await kube.wait_for_pod(name, phase="Running")

    # The node is full. A web pod needing 4 cores: removing every lower-priority pod makes room;
    # giving back the most important first keeps `mid`; the two batch pods are the victims.
    since = (await core.list_namespaced_pod(NS)).metadata.resource_version
    await core.create_namespaced_pod(NS, prioritised("web-1", "web", cpu="4"))
    events = await pod_events_until(
        core,
        lambda e: e["object"].metadata.name == "web-1" and e["object"].status.phase == "Running",
        resource_version=since,
    )
    marked: dict[str, Any] = {}
    for e in events:
        if e["object"].metadata.deletion_timestamp is not None:
            marked.setdefault(e["object"].metadata.name, e["object"])  # the first: the preemption
    assert set(marked) == {"low-a", "low-b"}
    for victim in marked.values():
        assert victim.metadata.deletion_grace_period_seconds == 30  # graceful, the pod's own
        disruption = next(c for c in victim.status.conditions if c.type == "DisruptionTarget")
        assert disruption.reason == "PreemptionByScheduler"
    nominated = [
        e["object"].status.nominated_node_name
        for e in events
        if e["object"].metadata.name == "web-1" and not e["object"].spec.node_name
    ]
    assert "n1" in nominated  # nominated while its victims terminate
    order = [e["object"].metadata.name for e in events if e["type"] == "DELETED"]
    assert set(order) == {"low-a", "low-b"}  # gone before web-1 runs
    web = (await core.read_namespaced_pod("web-1", NS)).to_dict()
    assert web["spec"]["node_name"] == "n1" and web["status"]["nominated_node_name"] is None
    assert (await core.read_namespaced_pod("mid", NS)).status.phase == "Running"


async def test_preemption_picks_the_node_with_the_least_important_victims(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    for node in ("n1", "n2"):
        kube.add_node(node, allocatable={"cpu": "4", "memory": "32Gi"})
    await add_priority_class(client, "batch", -10, never=True)
    await add_priority_class(client, "web", 1000)
    await core.create_namespaced_pod(NS, prioritised("mid", None, cpu="4"))
    placed = await kube.wait_for_pod("mid", phase="Running")
    other = "n2" if placed["spec"]["nodeName"] == "n1" else "n1"
    await core.create_namespaced_pod(NS, prioritised("low", "batch", cpu="4"))
    assert (await kube.wait_for_pod("low", phase="Running"))["spec"]["nodeName"] == other
    await core.create_namespaced_pod(NS, prioritised("web-1", "web", cpu="4"))
    assert (await kube.wait_for_pod("web-1", phase="Running"))["spec"]["nodeName"] == other
    assert kube.get_pod("low") is None
    assert kube.get_pod("mid")["status"]["phase"] == "Running"  # type: ignore[index]


async def test_a_pod_that_never_preempts_waits(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1", allocatable={"cpu": "2", "memory": "32Gi"})
    await add_priority_class(client, "scavenger", -100)
    await add_priority_class(client, "batch", -10, never=True)
    await core.create_namespaced_pod(NS, prioritised("scavenger", "scavenger"))
    await kube.wait_for_pod("scavenger", phase="Running")
    await core.create_namespaced_pod(NS, prioritised("b", "batch"))
    pending = await kube.wait_for_pod("b", where=lambda p: bool(p["status"].get("conditions")))
    assert "nominatedNodeName" not in pending["status"]
    # A default-priority pod does preempt the scavenger, and takes the room before `b`.
    await core.create_namespaced_pod(NS, prioritised("plain", None))
    await kube.wait_for_pod("plain", phase="Running")
    assert kube.get_pod("scavenger") is None
    assert kube.get_pod("b")["status"]["phase"] == "Pending"  # type: ignore[index]


async def test_image_pull_failure_stays_pending(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_pod_policy(ImagePullError())
    await started_pod(kube, core, "w")

    def waiting_reason(reason: str) -> Any:
        def probe(p: Any) -> bool:
            return bool(
                (container(p).get("state", {}).get("waiting") or {}).get("reason") == reason
            )

        return probe

    await kube.wait_for_pod("w", where=waiting_reason("ErrImagePull"))
    await kube.wait_for_pod("w", where=waiting_reason("ImagePullBackOff"))
    pod = await core.read_namespaced_pod("w", NS)
    assert pod.status.phase == "Pending" and pod.spec.node_name == "n1"
    assert pod.status.container_statuses[0].state.waiting.message.startswith("Back-off pulling")


async def test_policy_goes_to_the_next_matching_pods_only(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1")
    rule = kube.add_pod_policy(OOMKilled(), labels={"ebb/job": "j1"}, count=1)
    for name, job in [("j2-a", "j2"), ("j1-a", "j1"), ("j1-b", "j1")]:
        body = pod_body(name, labels={"ebb/job": job}, restart_policy="Never")
        await core.create_namespaced_pod(NS, body)
    await kube.wait_for_pod("j1-a", phase="Failed")
    await kube.wait_for_pod("j1-b", phase="Running")
    await kube.wait_for_pod("j2-a", phase="Running")
    assert rule.pods == ["j1-a"] and rule.remaining == 0


async def test_lost_node_fails_or_deletes_its_pods(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1")
    kube.add_node("n2")
    await core.create_namespaced_pod(
        NS, pod_body("on-1", node_selector={"kubernetes.io/hostname": "n1"})
    )
    await core.create_namespaced_pod(
        NS, pod_body("on-2", node_selector={"kubernetes.io/hostname": "n2"})
    )
    await kube.wait_for_pod("on-1", phase="Running")
    await kube.wait_for_pod("on-2", phase="Running")

    kube.remove_node("n1")
    lost = (await core.read_namespaced_pod("on-1", NS)).status
    assert (lost.phase, lost.reason) == ("Failed", "NodeLost")
    assert lost.message == "Node n1 which was running pod on-1 is unresponsive"
    assert any(c.type == "DisruptionTarget" for c in lost.conditions)
    with pytest.raises(ApiException):
        await core.read_node("n1")

    kube.remove_node("n2", pods="delete")
    assert kube.get_pod("on-2") is None


async def test_eviction_api_deletes_gracefully(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    await started_pod(kube, core, "w")
    await kube.wait_for_pod("w", phase="Running")
    eviction = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name="w", namespace=NS))
    await core.create_namespaced_pod_eviction("w", NS, eviction)
    pod = await core.read_namespaced_pod("w", NS)
    assert pod.metadata.deletion_timestamp is not None
    assert any(c.reason == "EvictionByEvictionAPI" for c in pod.status.conditions)
    await kube.wait_for(lambda: kube.get_pod("w") is None)


# ---- coordination.k8s.io leases --------------------------------------------------------------


@quiet
async def test_lease_create_get_replace_with_conflicts(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    coordination = k8s.CoordinationV1Api(client)
    now = datetime.now(UTC)
    lease = k8s.V1Lease(
        metadata=k8s.V1ObjectMeta(name="ebb-controller"),
        spec=k8s.V1LeaseSpec(
            holder_identity="a",
            lease_duration_seconds=15,
            acquire_time=now,
            renew_time=now,
            lease_transitions=0,
        ),
    )
    created = await coordination.create_namespaced_lease(NS, lease)
    assert created.spec.holder_identity == "a" and created.spec.renew_time == now
    stored = kube.get("leases", "ebb-controller", NS)
    # The server re-renders MicroTime in its own form, whatever RFC 3339 form the client sent.
    assert stored is not None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", stored["spec"]["renewTime"])
    with pytest.raises(ApiException) as exc:
        await coordination.create_namespaced_lease(NS, lease)
    assert exc.value.status == 409 and status_body(exc.value)["reason"] == "AlreadyExists"

    # Two candidates read the same version; the first write wins, the second conflicts.
    seen_by_a = await coordination.read_namespaced_lease("ebb-controller", NS)
    seen_by_b = await coordination.read_namespaced_lease("ebb-controller", NS)
    seen_by_a.spec.renew_time = datetime.now(UTC)
    renewed = await coordination.replace_namespaced_lease("ebb-controller", NS, seen_by_a)
    assert int(renewed.metadata.resource_version) > int(seen_by_b.metadata.resource_version)
    seen_by_b.spec.holder_identity = "b"
    seen_by_b.spec.lease_transitions = 1
    with pytest.raises(ApiException) as exc:
        await coordination.replace_namespaced_lease("ebb-controller", NS, seen_by_b)
    assert exc.value.status == 409 and status_body(exc.value)["reason"] == "Conflict"
    assert (
        await coordination.read_namespaced_lease("ebb-controller", NS)
    ).spec.holder_identity == "a"

    lease.metadata.name = "bad"
    lease.spec.lease_duration_seconds = 0
    exc = await refused(coordination.create_namespaced_lease(NS, lease), 422)


@quiet
async def test_library_leader_election_elects_exactly_one(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    leaders: list[str] = []
    elected = asyncio.Event()

    def candidate(identity: str) -> LeaderElection:
        async def lead() -> None:
            leaders.append(identity)
            elected.set()

        async def stop() -> None:
            pass

        lock = LeaseLock("ebb-controller", NS, identity, client)
        return LeaderElection(ElectionConfig(lock, 15, 10, 1, lead, stop))

    tasks = [asyncio.create_task(candidate(i).run()) for i in ("a", "b")]
    try:
        async with asyncio.timeout(5):
            await elected.wait()
        # Both have made their first attempt once the loser has read the lease back.
        await kube.wait_for(
            lambda: sum(r.method == "GET" and "leases/" in r.path for r in kube.requests) >= 2
        )
        await asyncio.sleep(0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    lease = kube.get("leases", "ebb-controller", NS)
    assert lease is not None
    assert leaders == [lease["spec"]["holderIdentity"]]


# ---- the fixture itself --------------------------------------------------------------------


async def test_stop_ends_open_watches_cleanly() -> None:
    kube = FakeKubeAPI(run_kubelet=False)
    await kube.start()
    try:
        async with kube.api_client() as api, Watch() as watch:
            stream = watch.stream(k8s.CoreV1Api(api).list_namespaced_pod, NS, timeout_seconds=30)
            drained = asyncio.create_task(_drain(stream))
            await kube.wait_for(lambda: kube.open_watches == 1)
            await kube.stop()
            async with asyncio.timeout(5):
                assert await drained == []
    finally:
        await kube.stop()  # idempotent


async def _drain(stream: AsyncIterator[Any]) -> list[Any]:
    return [event async for event in stream]


# ---- the other resources, and the less common verbs ------------------------------------------


@quiet
async def test_cluster_scoped_nodes_and_namespaces(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    kube.add_node("n1", labels={"pool": "ebb"})
    kube.add_node("n2")
    nodes = await core.list_node(label_selector="pool=ebb")
    assert [n.metadata.name for n in nodes.items] == ["n1"]
    assert not nodes.items[0].metadata.namespace  # cluster-scoped
    by_name = await core.list_node(field_selector="metadata.name=n2")
    assert [n.metadata.name for n in by_name.items] == ["n2"]
    await refused(core.list_node(field_selector="metadata.namespace=default"), 400)

    await core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name="ebb")))
    assert (await core.read_namespace("ebb")).status.phase == "Active"
    await core.create_namespaced_pod("ebb", pod_body("w"))
    await core.delete_namespace("ebb")
    assert kube.get_pod("w", "ebb") is None  # the contents go with it
    await refused(core.create_namespaced_pod("ebb", pod_body("w")), 404)


@quiet
async def test_events_dry_run_and_delete_collection(kube: FakeKubeAPI, client: ApiClient) -> None:
    core = k8s.CoreV1Api(client)
    event = k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(generate_name="w."),
        involved_object=k8s.V1ObjectReference(kind="Pod", name="w", namespace=NS),
        reason="Scaled",
        type="Normal",
        message="ebb scaled the job",
    )
    created = await core.create_namespaced_event(NS, event)
    listed = await core.list_namespaced_event(NS, field_selector="involvedObject.name=w")
    assert [e.metadata.name for e in listed.items] == [created.metadata.name]

    dry = await core.create_namespaced_pod(NS, pod_body("dry"), dry_run="All")
    assert dry.metadata.uid and kube.get_pod("dry") is None

    for name, app in [("a1", "a"), ("a2", "a"), ("b1", "b")]:
        await core.create_namespaced_pod(NS, pod_body(name, labels={"app": app}))
    status = await core.delete_collection_namespaced_pod(NS, label_selector="app=a")
    assert status.status == "Success"
    assert [p["metadata"]["name"] for p in kube.list_pods(NS)] == ["b1"]


# -- Secrets and the garbage collector ------------------------------------------------------


def secret_body(name: str, *, owner: k8s.V1Pod | None = None, **fields: Any) -> k8s.V1Secret:
    refs = None
    if owner is not None:
        refs = [
            k8s.V1OwnerReference(
                api_version="v1", kind="Pod", name=owner.metadata.name, uid=owner.metadata.uid
            )
        ]
    return k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=name, owner_references=refs), **fields)


@quiet
async def test_secret_string_data_is_stored_as_base64_data_and_immutable_means_it(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    v1 = k8s.CoreV1Api(client)
    made = await v1.create_namespaced_secret(
        NS,
        secret_body("s", string_data={"creds": "text"}, data={"other": "eA=="}, immutable=True),
    )
    assert made.data == {"creds": "dGV4dA==", "other": "eA=="}
    assert made.to_dict()["string_data"] is None  # write-only: folded into data
    assert made.type == "Opaque"
    read = await v1.read_namespaced_secret("s", NS)
    assert read.data == made.data
    exc = await refused(
        v1.patch_namespaced_secret("s", NS, {"stringData": {"creds": "other"}}, **MERGE_PATCH),
        422,
    )
    assert "immutable" in status_body(exc.value)["message"]
    await refused(v1.create_namespaced_secret(NS, secret_body("s")), 409)
    await refused(v1.create_namespaced_secret(NS, secret_body("t", data={"k": "not base64!"})), 422)


@quiet
async def test_the_garbage_collector_deletes_what_only_gone_owners_owned(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    v1 = k8s.CoreV1Api(client)
    owner = await v1.create_namespaced_pod(NS, pod_body("owner"))
    await v1.create_namespaced_secret(NS, secret_body("owned", owner=owner))
    await v1.create_namespaced_secret(NS, secret_body("free"))
    before = kube.resource_version
    await v1.delete_namespaced_pod("owner", NS)
    await kube.wait_for(lambda: kube.get("secrets", "owned", NS) is None, what="owned collected")
    # As the real one, a moment after: the owner's deletion comes first in every watch.
    deletions = [
        (c.obj["kind"], c.obj["metadata"]["name"])
        for c in kube.store.changes_since(before)
        if c.type == "DELETED"
    ]
    assert deletions == [("Pod", "owner"), ("Secret", "owned")]
    assert kube.get("secrets", "free", NS) is not None
    # An owner gone before its dependent was made (or a namesake with another uid): collected.
    await v1.create_namespaced_pod(NS, pod_body("owner"))
    await v1.create_namespaced_secret(NS, secret_body("late", owner=owner))
    await kube.wait_for(lambda: kube.get("secrets", "late", NS) is None, what="late collected")
    assert kube.garbage_collector.collected == [
        ("Secret", NS, "owned"),
        ("Secret", NS, "late"),
    ]


async def test_a_container_waits_for_the_secret_its_pod_mounts(
    kube: FakeKubeAPI, client: ApiClient
) -> None:
    v1 = k8s.CoreV1Api(client)
    kube.add_node("n1")
    body = pod_body("w")
    body.spec.volumes = [
        k8s.V1Volume(name="creds", secret=k8s.V1SecretVolumeSource(secret_name="w-creds")),
        k8s.V1Volume(
            name="extra", secret=k8s.V1SecretVolumeSource(secret_name="absent", optional=True)
        ),
    ]
    await v1.create_namespaced_pod(NS, body)

    def waiting() -> str:
        pod = kube.get_pod("w", NS) or {"status": {}}
        state = container(pod).get("state") or {}
        return str((state.get("waiting") or {}).get("message", ""))

    message = await kube.wait_for(waiting, what="the container waiting for its Secret")
    assert 'secret "w-creds" not found' in message
    assert (kube.get_pod("w", NS) or {})["status"]["phase"] == "Pending"
    # Made: the kubelet mounts it and starts the container (an optional one may stay absent).
    await v1.create_namespaced_secret(NS, secret_body("w-creds", string_data={"creds": "x"}))
    await kube.wait_for_pod("w", NS, phase="Running")
