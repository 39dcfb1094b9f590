"""Leader election between controller replicas, through a coordination.k8s.io Lease.

The leader holds the Lease and renews it every `renew_s`; every write is a replace with the
resourceVersion read (compare-and-set), so two replicas can never both believe they won. A
standby takes the Lease over once its renewTime is older than leaseDurationSeconds. As with
every Kubernetes lease, expiry is judged on wall clocks: keep the nodes' clocks in sync.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

from kubernetes_asyncio.client import ApiClient, CoordinationV1Api
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)


class LostLeadership(Exception):
    """Another replica holds the Lease now, or we could not renew it in time."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _stamp(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        api: ApiClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_s: int = 15,
        renew_s: float = 5.0,
    ) -> None:
        self.api: Any = CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_s = lease_s
        self.renew_s = renew_s
        self._version = ""

    def _body(self, *, acquire: bool, transitions: int) -> dict[str, Any]:
        now = _stamp(_now())
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_s,
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        if acquire:
            spec["acquireTime"] = now
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "resourceVersion": self._version,
            },
            "spec": spec,
        }

    async def try_acquire(self) -> bool:
        """One attempt. True if we hold the Lease now."""
        try:
            current = await self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            return await self._create()
        spec = current.spec
        holder = spec.holder_identity or ""
        renewed = spec.renew_time
        duration = spec.lease_duration_seconds or self.lease_s
        expired = renewed is None or (_now() - renewed).total_seconds() > duration
        if holder not in ("", self.identity) and not expired:
            return False
        self._version = current.metadata.resource_version
        taking_over = holder != self.identity
        body = self._body(
            acquire=taking_over, transitions=(spec.lease_transitions or 0) + int(taking_over)
        )
        try:
            replaced = await self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as e:
            if e.status == 409:
                return False  # another replica wrote it between our read and our write
            raise
        self._version = replaced.metadata.resource_version
        if taking_over:
            log.info("leading as %s (took over from %s)", self.identity, holder or "nobody")
        return True

    async def _create(self) -> bool:
        body = self._body(acquire=True, transitions=0)
        del body["metadata"]["resourceVersion"]
        try:
            created = await self.api.create_namespaced_lease(self.namespace, body)
        except ApiException as e:
            if e.status == 409:
                return False  # another replica created it first
            raise
        self._version = created.metadata.resource_version
        log.info("leading as %s (new lease)", self.identity)
        return True

    async def acquire(self) -> None:
        """Wait until we lead."""
        announced = False
        while True:
            try:
                if await self.try_acquire():
                    return
            except ApiException as e:
                log.warning("leader election: API error %s", e.status)
            if not announced:
                log.info("standing by: another controller leads")
                announced = True
            await asyncio.sleep(self.renew_s)

    async def keep(self) -> None:
        """Renew for as long as we lead (an agent). Raises LostLeadership when we do not."""
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                body = self._body(acquire=False, transitions=0)
                current = await self.api.read_namespaced_lease(self.name, self.namespace)
                if current.spec.holder_identity != self.identity:
                    raise LostLeadership(f"{current.spec.holder_identity} holds the lease")
                body["spec"]["leaseTransitions"] = current.spec.lease_transitions or 0
                acquired = current.spec.acquire_time
                body["spec"]["acquireTime"] = _stamp(acquired) if acquired else None
                body["metadata"]["resourceVersion"] = current.metadata.resource_version
                replaced = await self.api.replace_namespaced_lease(self.name, self.namespace, body)
                self._version = replaced.metadata.resource_version
                last_ok = loop.time()
            except ApiException as e:
                if e.status == 409:
                    raise LostLeadership("the lease changed under us") from e
                if loop.time() - last_ok > self.lease_s:
                    raise LostLeadership(f"could not renew for {self.lease_s}s") from e
                log.warning("leader election: renewal failed (%s); retrying", e.status)

    async def release(self) -> None:
        """On a clean stop, let a standby lead at once instead of after the lease expires."""
        try:
            current = await self.api.read_namespaced_lease(self.name, self.namespace)
            if current.spec.holder_identity != self.identity:
                return
            body = self._body(acquire=False, transitions=current.spec.lease_transitions or 0)
            body["spec"]["holderIdentity"] = ""
            body["spec"]["renewTime"] = None
            body["metadata"]["resourceVersion"] = current.metadata.resource_version
            await self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as e:
            log.debug("could not release the lease: %s", e.status)
