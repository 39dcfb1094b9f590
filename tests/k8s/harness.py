"""A Kubernetes backend wired to an API server (the fake one, or a control plane built from
Kubernetes' own code) and a shard master (a real one, or one whose answers a test scripts)
over a real NATS server, for tests."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, cast

from kubernetes_asyncio.client import ApiClient
from nats.aio.client import Client as NATS

from ebb.client.sdk import EbbClient
from ebb.common.job import parse_job
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.identity import WorkerSigner
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.kube.backend import APP_LABEL, JOB_LABEL, KubeConfig, KubernetesBackend
from ebb.controller.policy.tidal import LABEL as TIDAL
from ebb.controller.reconcile import Reconciler, ReconcilerConfig
from tests.helpers import job_spec, wait_until, write_dataset, write_model
from tests.k8s.fake_apiserver import FakeKubeAPI
from tests.k8s.manifests import find

NS = "ebb"
"""The namespace k8s/ deploys into: the RBAC checks read its bindings."""


async def submit(
    ebb: EbbClient,
    folder: Path,
    *,
    workers: int,
    cpu: float = 2.0,
    memory_gb: float = 1.0,
    gpu: int = 0,
) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    write_dataset(folder / "data", rows=40 * 100, row_group_size=100)
    write_model(folder / "model.onnx")
    spec = job_spec(folder, rows_per_shard=100, workers=(1, workers))
    spec["resources"].update(cpu=cpu, memory_gb=memory_gb, gpu=gpu)
    return await ebb.submit(parse_job(spec))


class Harness:
    """A backend with its informers running, and a reconciler to drive by hand."""

    def __init__(
        self,
        kube: FakeKubeAPI | ApiClient,
        nats: NatsConfig,
        nc: NATS,
        *,
        signer: WorkerSigner | None = None,
        **config: Any,
    ) -> None:
        """`kube`: the fake API server, or a client of a real one (whose namespace, priority
        class and workers' ServiceAccount the caller made: `prepare_workers`)."""
        self.fake = kube if isinstance(kube, FakeKubeAPI) else None
        if self.fake is not None:
            if self.fake.get("namespaces", NS) is None:
                self.fake.add_namespace(NS)
            if self.fake.get("priorityclasses", "ebb-batch") is None:
                # The class k8s/ ships: worker pods name it, and admission refuses a missing one.
                self.fake.add("priorityclasses", find("PriorityClass", "ebb-batch"))
            self.client: ApiClient = self.fake.api_client()
        else:
            self.client = cast(ApiClient, kube)
        self.backend = KubernetesBackend(
            KubeConfig(namespace=NS, nats=nats, priority_class="ebb-batch", **config),
            self.client,
            signer=signer,
        )
        self.reconciler = Reconciler(
            master=MasterClient(nc, nats, backoff=Backoff(attempts=1)),
            backend=self.backend,
            config=ReconcilerConfig(
                relaunch_backoff=Backoff(first_s=0.01, max_s=0.02), max_crashes=3
            ),
        )
        self.tasks = [asyncio.create_task(a) for a in self.backend.agents().values()]
        self.errors: list[Exception] = []
        """Reconcile passes that failed (API errors in tests that inject them)."""

    async def converge(self, condition: Any, *, what: str, timeout: float = 30.0) -> Any:
        """Reconcile until `condition()` (a function or a coroutine function) holds (API errors
        included: the next pass retries)."""

        async def step() -> Any:
            try:
                await self.reconciler.reconcile_once()
            except Exception as e:
                self.errors.append(e)
            result = condition()
            return await result if asyncio.iscoroutine(result) else result

        return await wait_until(step, timeout=timeout, interval=0.05, what=what)

    @property
    def kube(self) -> FakeKubeAPI:
        assert self.fake is not None, "a real API server: read it through the client"
        return self.fake

    def pods(self, job: str | None = None, *, alive: bool = True) -> list[dict[str, Any]]:
        """Worker pods (of `job`): the fake's own, or as the backend's informer sees them."""
        if self.fake is not None:
            selector = f"{APP_LABEL}=ebb-worker" + (f",{JOB_LABEL}={job}" if job else "")
            pods = self.fake.list_pods(NS, label_selector=selector)
        else:
            pods = [
                p
                for p in self.backend.workers.values()
                if job is None or p["metadata"]["labels"].get(JOB_LABEL) == job
            ]
        if alive:
            pods = [
                p
                for p in pods
                if p["status"].get("phase") in ("Pending", "Running")
                and not p["metadata"].get("deletionTimestamp")
            ]
        return pods

    async def close(self) -> None:
        for e in self.errors[:3]:
            logging.getLogger(__name__).info("a reconcile pass failed: %r", e)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.fake is not None:
            await self.client.close()


def tidal_state(kube: FakeKubeAPI, node: str) -> str | None:
    found = kube.get_node(node)
    assert found is not None
    labels: dict[str, str] = found["metadata"].get("labels") or {}
    return labels.get(TIDAL)


def offline(
    kube: FakeKubeAPI, name: str, cpu: str = "8", labels: dict[str, str] | None = None
) -> None:
    kube.add_node(
        name,
        labels={"ebb.io/pool": "offline", **(labels or {})},
        allocatable={"cpu": cpu, "memory": "32Gi", "nvidia.com/gpu": "0", "pods": "110"},
    )
