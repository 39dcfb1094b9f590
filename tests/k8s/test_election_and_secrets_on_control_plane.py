"""Two of the controller's Kubernetes semantics on a control plane built from Kubernetes' own
code: leader election on real Lease objects (two replicas racing to create one: the API
server's conflict decides; a leader that dies without a word loses it when it runs out; a
standby that leads carries on with the workers there), and each worker's NATS credential Secret
owned by its pod, so that kube-controller-manager's garbage collector deletes it with the pod
(the controller deletes no Secret itself)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import CoreV1Api
from nats.aio.client import Client as NATS

from ebb.client.sdk import EbbClient
from ebb.common.messaging import identity
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.election import LeaderElector
from ebb.controller.kube.backend import JOB_LABEL, KubeConfig, KubernetesBackend
from ebb.controller.kube.podspec import CREDENTIALS_KEY, mounted_credentials
from ebb.controller.service import Controller, ControllerConfig
from tests.controlplane import ControlPlane
from tests.controlplane.nodes import NodesThread
from tests.helpers import wait_until
from tests.k8s.harness import NS, Harness, submit
from tests.k8s.test_placement import running, spec_of
from tests.scripted_master import ScriptedMaster


async def test_one_of_two_racing_replicas_leads_and_a_dead_leaders_lease_is_taken_over(
    workers_plane: ControlPlane,
) -> None:
    async with workers_plane.api_client() as a, workers_plane.api_client() as b:
        first = LeaderElector(a, namespace=NS, name="lead", identity="a", lease_s=1, renew_s=0.1)
        second = LeaderElector(b, namespace=NS, name="lead", identity="b", lease_s=1, renew_s=0.1)
        # Both find no Lease and create it at once: the API server takes one create.
        won = await asyncio.gather(first.try_acquire(), second.try_acquire())
        assert sorted(won) == [False, True]
        leader, standby = (first, second) if won[0] else (second, first)
        assert not await standby.try_acquire()
        # The leader dies without a word: no renewals. Its lease runs out; the standby leads.
        assert await wait_until(standby.try_acquire, timeout=20, interval=0.1, what="a takeover")
        lease: Any = await _lease(workers_plane, "lead")
        assert lease["spec"]["holderIdentity"] == standby.identity != leader.identity
        assert lease["spec"]["leaseTransitions"] == 1


async def test_one_controller_leads_and_the_standby_carries_on_with_its_workers(
    workers_plane: ControlPlane, ebb: EbbClient, nats_config: NatsConfig, tmp_path: Path
) -> None:
    """Two controllers, one Lease: the first leads and starts a job's workers, the second
    waits; the first stops, the second leads and adopts them (its first pass makes none)."""
    job = await submit(ebb, tmp_path / "job", workers=2, cpu=1)
    node = {"off-0": {"ebb.io/pool": "offline"}}
    allocatable = {"cpu": "2", "memory": "8Gi", "pods": "110"}  # room for the two alone
    with NodesThread.simulated(workers_plane, node, allocatable=allocatable):
        async with (
            workers_plane.api_client() as a,
            workers_plane.api_client() as b,
            workers_plane.api_client() as admin,
        ):
            core: Any = CoreV1Api(admin)  # plain JSON maps: the stubs know only models
            controllers = [
                Controller(
                    ControllerConfig(nats=nats_config, resync_s=0.2),
                    KubernetesBackend(KubeConfig(namespace=NS, nats=nats_config, tidal=None), api),
                    elector=LeaderElector(
                        api, namespace=NS, name="standby", identity=f"c{n}", lease_s=1, renew_s=0.2
                    ),
                )
                for n, api in enumerate((a, b))
            ]

            async def alive() -> list[Any]:
                response = await core.list_namespaced_pod(
                    NS, label_selector=f"{JOB_LABEL}={job}", _preload_content=False
                )
                pods = (await response.json())["items"]
                return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

            async def two() -> bool:
                return len(await alive()) == 2

            runs = [asyncio.create_task(controllers[0].run())]
            try:
                await wait_until(controllers[0].leading.is_set, what="the first to lead")
                runs.append(asyncio.create_task(controllers[1].run()))
                await wait_until(two, timeout=60, what="2 workers")
                before = {p["metadata"]["uid"] for p in await alive()}
                assert not controllers[1].leading.is_set()
                lease: Any = await _lease(workers_plane, "standby")
                assert lease["spec"]["holderIdentity"] == "c0"
                controllers[0].request_stop()
                await runs[0]
                await wait_until(controllers[1].leading.is_set, timeout=30, what="the standby")

                def reconciled() -> bool:
                    return (r := controllers[1].reconciler) is not None and r.last_plan is not None

                await wait_until(reconciled, timeout=30, what="the standby's first pass")
                assert {p["metadata"]["uid"] for p in await alive()} == before
            finally:
                for c in controllers:
                    c.request_stop()
                await asyncio.gather(*runs, return_exceptions=True)
                await ebb.cancel(job)


async def _lease(plane: ControlPlane, name: str) -> Any:
    from kubernetes_asyncio.client import CoordinationV1Api

    async with plane.api_client() as api:
        leases: Any = CoordinationV1Api(api)  # plain JSON maps: the stubs know only models
        response = await leases.read_namespaced_lease(name, NS, _preload_content=False)
        return await response.json()


async def test_a_worker_pods_credential_secret_goes_with_the_pod_by_the_garbage_collector(
    workers_plane: ControlPlane,
    scripted: ScriptedMaster,
    nc: NATS,
    nats_config: NatsConfig,
    tmp_path: Path,
) -> None:
    job = "credentials"
    status = running(spec_of(tmp_path / "job", workers=2), todo=40, job=job)
    scripted.set(status)
    node = {"off-0": {"ebb.io/pool": "offline"}}
    with NodesThread.simulated(workers_plane, node):
        async with workers_plane.api_client() as api:
            core: Any = CoreV1Api(api)  # plain JSON maps: the stubs know only models
            signer = identity.Trust.new("ebb").worker_signer()
            h = Harness(api, nats_config, nc, tidal=None, signer=signer)
            try:
                await h.converge(lambda: len(h.pods(job)) == 2, what="2 worker pods", timeout=60)
                pods = h.pods(job)
                names = [mounted_credentials(p) for p in pods]
                assert all(names) and len(set(names)) == 2  # one credential each

                async def secrets() -> list[Any]:
                    """Those of the pods' Secrets that exist (raw: a 404 raises nothing)."""
                    found = []
                    for name in names:
                        response = await core.read_namespaced_secret(
                            name, NS, _preload_content=False
                        )
                        if response.status != 404:
                            assert response.status == 200, await response.text()
                            found.append(await response.json())
                    return found

                made = await wait_until(
                    lambda: _all_of(secrets(), 2), what="their Secrets", timeout=60
                )
                for secret, pod in zip(
                    sorted(made, key=lambda s: s["metadata"]["name"]),
                    sorted(pods, key=mounted_credentials),  # type: ignore[arg-type]
                    strict=True,
                ):
                    (owner,) = secret["metadata"]["ownerReferences"]
                    assert (owner["kind"], owner["uid"]) == ("Pod", pod["metadata"]["uid"])
                    assert base64.b64decode(secret["data"][CREDENTIALS_KEY])
                # The job ends: the controller deletes its pods, and no Secret.
                scripted.set(dataclasses.replace(status, state="CANCELLED", shards={}))
                await h.converge(
                    lambda: not h.pods(job, alive=False), what="the pods deleted", timeout=60
                )
                await wait_until(
                    lambda: _all_of(secrets(), 0),
                    what="the Secrets deleted by the garbage collector",
                    timeout=60,
                )
            finally:
                await h.close()


async def _all_of(found: Any, count: int) -> Any:
    """`found` (awaited) if it has `count` items (True for none), else None."""
    items = await found
    if len(items) != count:
        return None
    return items or True
