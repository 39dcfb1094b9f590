"""Two of the controller's Kubernetes semantics on a control plane built from Kubernetes' own
code (test_kube_backend.py has them on the fake API server): leader election on real Lease
objects (two replicas racing to create one: the API server's conflict decides; a leader that
dies without a word loses it when it runs out), and each worker's NATS credential Secret
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

from ebb.common.messaging import identity
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.election import LeaderElector
from ebb.controller.kube.podspec import CREDENTIALS_KEY, mounted_credentials
from tests.controlplane import ControlPlane
from tests.controlplane.nodes import NodesThread
from tests.helpers import wait_until
from tests.k8s.harness import NS, Harness
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
