"""Each worker pod's NATS credential, issued in a Secret of its own.

With a `WorkerSigner`, every worker pod mounts a Secret holding a credential minted for that
worker alone (ebb.common.messaging.identity). The pod is created first, then its Secret, owned by
the pod (the uid is only known once the pod exists), so that Kubernetes deletes it with the pod;
the kubelet keeps the container waiting until the Secret is there. A controller that dies
between the two steps, or a create that failed, is repaired on a later pass: a pending pod
of ours whose Secret we have not created gets one (a 409 means it exists). The controller
never reads Secrets.
"""

from __future__ import annotations

import logging
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from ebb.common.messaging.identity import WorkerSigner

from .informer import Obj
from .podspec import credentials_secret, mounted_credentials
from .views import PodView

log = logging.getLogger(__name__)


class CredentialIssuer:
    """Creates the credentials Secret of each worker pod the backend creates, and of any
    pending one a pass finds without."""

    def __init__(self, api: Any, signer: WorkerSigner) -> None:
        self.api = api
        """The Kubernetes client (CoreV1Api): Secrets are created as plain JSON maps."""
        self.signer = signer
        self._issued: set[str] = set()
        """Uids of worker pods whose credentials Secret exists (we created it, or found it
        there); pods gone are dropped on each pass."""

    async def issue(self, pod: Obj) -> None:
        """The credentials Secret of worker pod `pod` (created, with its uid), holding a
        credential for that worker alone: its id is the pod's name."""
        meta = pod["metadata"]
        secret = credentials_secret(pod, self.signer.credentials(meta["name"]))
        if secret["metadata"]["name"] != mounted_credentials(pod):
            return  # not a pod of this make: it reads no Secret of ours
        try:
            await self.api.create_namespaced_secret(meta["namespace"], secret)
            log.info("created the NATS credentials of pod %s", meta["name"])
        except ApiException as e:
            if e.status != 409:  # 409: there already (a repeated pass)
                raise
        self._issued.add(meta["uid"])

    async def repair(self, pods: list[PodView]) -> None:
        """Every pending worker pod of ours (`pods`: all there are) that mounts a credentials
        Secret has one; one that cannot be made now is tried again on the next pass."""
        self._issued &= {pod.meta.uid for pod in pods}
        for pod in pods:
            if (
                pod.phase == "Pending"
                and not pod.meta.deleting
                and pod.meta.uid
                and pod.meta.uid not in self._issued
                and mounted_credentials(pod.obj) is not None
            ):
                try:
                    await self.issue(pod.obj)
                except ApiException as e:
                    log.warning(
                        "no credentials for pod %s yet (%s %s): next pass",
                        pod.name,
                        e.status,
                        e.reason,
                    )
