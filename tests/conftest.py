"""Fixtures: a real nats-server per test (free port, temp store), and leak checks.

Every test must leave no child process and no asyncio task behind: a service that forgets
one in a test forgets it in production too.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
from nats.aio.client import Client as NATS

from ebb.common.messaging import bus
from ebb.common.messaging.embedded import EmbeddedNats
from ebb.common.messaging.natsconfig import NatsConfig

from .vllm_server import VLLMServer

ASSETS = Path(__file__).parent / "assets"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and asyncio.iscoroutinefunction(item.obj):
            item.fixturenames.insert(0, "_no_leftover_tasks")


def _lives_with_this_process(p: psutil.Process) -> bool:
    """multiprocessing's resource tracker, and the fork server stage processes come from,
    live as long as this process, by design (the stage processes they start do not). And the
    processes of pods on the suite's nodes (tests/controlplane/kubelet.py), each pod in a
    network namespace of its own: their node ends them with its module."""
    try:
        command = " ".join(p.cmdline())
        if os.readlink(f"/proc/{p.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
            return True
    except (psutil.Error, OSError):
        return False
    return "multiprocessing.resource_tracker" in command or "multiprocessing.forkserver" in command


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    new = [
        p
        for p in me.children(recursive=True)
        if p.pid not in before and not _lives_with_this_process(p)
    ]
    _, alive = psutil.wait_procs(new, timeout=5)
    leftover = [f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in alive if p.is_running()]
    for p in alive:
        p.kill()
    assert not leftover, f"test left child processes behind: {leftover}"


@pytest.fixture
async def _no_leftover_tasks() -> AsyncIterator[None]:
    yield
    current = asyncio.current_task()
    # Give tasks that are finishing (cancelled callbacks, closing transports) one turn.
    for _ in range(3):
        await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    # nats-py keeps internal tasks only while a connection is open; ours must all be closed.
    assert not leftover, f"test left asyncio tasks behind: {[t.get_name() for t in leftover]}"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(state_dir=tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prefix() -> str:
    """A subject prefix of this test's own: with it no stray client from another test (or
    another run) that reconnects to a reused port can answer or take our messages."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def nats_config(nats_server: EmbeddedNats, prefix: str) -> NatsConfig:
    return NatsConfig(url=nats_server.url, prefix=prefix, request_timeout_s=2.0)


@pytest.fixture
async def nc(nats_config: NatsConfig) -> AsyncIterator[NATS]:
    client = await bus.connect(nats_config, name="test")
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture(scope="session")
def bos_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model in a shape vLLM's CPU build runs (heads of 32), whose tokenizer and
    chat template both write the BOS, as Llama 3's do."""
    from .llm_model import build_tiny_llm

    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "bos", hidden=128, bos=True)


@pytest.fixture(scope="module")
def vllm_server(bos_llm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """vLLM serving `bos_llm`, started once for a module as a user starts one (and stopped
    after it: its gigabytes are not held through the rest of the suite)."""
    from .helpers import free_port

    server = VLLMServer(bos_llm, free_port(), tmp_path_factory.mktemp("vllm") / "vllm.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
