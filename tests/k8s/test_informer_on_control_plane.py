"""The controller's informers against a real API server's watch semantics: a kube-apiserver
that crashes and comes back has a watch cache that starts afresh, so a watch resuming from
before the crash is told 410 Gone (an ERROR event in the stream, as the real server sends it),
and the informer lists again. What was deleted while no watch ran is told as a deletion all
the same: the controller learns of a worker pod removed in the gap (test_kube_backend.py has
the 410 at a chosen moment, on the fake API server)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import CoreV1Api

from ebb.controller.kube.informer import Informer, Obj
from tests.controlplane import ControlPlane
from tests.helpers import wait_until

NS = "default"


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    """A control plane of the test's own: its API server is crashed and started again, a
    process of the test's that ends with it."""
    if shutil.which("go") is None:
        pytest.skip("go not found: the control plane cannot be built on this machine")
    plane = ControlPlane(tmp_path / "plane")
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


def _config_map(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "data": {"k": name}}


async def test_an_informer_lists_again_after_a_crashed_api_server_lost_its_history(
    plane: ControlPlane,
) -> None:
    deleted: list[str] = []
    watching = asyncio.Event()
    """Cleared: the informer's next watch waits (a gap with no watch, held open by the test)."""
    watching.set()
    async with plane.api_client() as api:
        core: Any = CoreV1Api(api)  # plain JSON maps: the stubs know only models
        for name in ("kept", "gone"):
            await core.create_namespaced_config_map(NS, _config_map(name))

        async def list_config_maps(**kwargs: Any) -> Any:
            if kwargs.get("watch"):
                await watching.wait()
            return await core.list_namespaced_config_map(NS, **kwargs)

        def on_delete(obj: Obj) -> None:
            deleted.append(obj["metadata"]["name"])

        informer = Informer("config-maps", list_config_maps, on_delete=on_delete)
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), timeout=30)
            assert {f"{NS}/kept", f"{NS}/gone"} <= informer.items.keys()
            relists = informer.relists
            watching.clear()
            # The store's revision moves past the informer's last: the restarted server's
            # watch cache starts there, after it.
            await core.create_namespaced_secret(NS, {"metadata": {"name": "moved-on"}})
            await asyncio.to_thread(plane.crash_apiserver)
            async with plane.api_client() as fresh:
                admin: Any = CoreV1Api(fresh)
                await admin.delete_namespaced_config_map("gone", NS)
                await admin.create_namespaced_config_map(NS, _config_map("new"))
            watching.set()
            await wait_until(
                lambda: (
                    {f"{NS}/kept", f"{NS}/new"} <= informer.items.keys()
                    and f"{NS}/gone" not in informer.items
                ),
                what="the informer's cache as the server has it",
                timeout=60,
            )
            assert informer.relists == relists + 1  # the 410: a list, not a resumed watch
            assert deleted == ["gone"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
