"""Fixtures: a started fake API server, and a real client pointed at it.

`@pytest.mark.kube(run_kubelet=False, history_limit=5, ...)` passes options to FakeKubeAPI.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.k8s.fake_apiserver import FakeKubeAPI


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kube(**options): options for the FakeKubeAPI fixture")


@pytest.fixture
async def kube(request: pytest.FixtureRequest) -> AsyncIterator[FakeKubeAPI]:
    marker = request.node.get_closest_marker("kube")
    async with FakeKubeAPI(**(marker.kwargs if marker else {})) as api:
        yield api


@pytest.fixture
async def client(kube: FakeKubeAPI) -> AsyncIterator[ApiClient]:
    async with kube.api_client() as api_client:
        yield api_client
