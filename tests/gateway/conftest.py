"""A gateway on the embedded stack, reached with the official `openai` client as its users
reach it: a tiny model built here, two keys (two owners), a small upload limit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from ebb.client.stack import LocalStack, StackConfig

from ..llm_model import build_tiny_llm

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
MAX_FILE_BYTES = 256 * 1024
BOB_STORES = 64 * 1024
ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "model")


def gateway_config(tmp: Path, model: Path, **limits: Any) -> Path:
    config = {
        "root": str(tmp / "gateway"),
        "models": {
            "tiny-chat": {
                "stage": {
                    "llm": {
                        "model": str(model),
                        "max_in_flight": 8,
                        # Greedy, so that answers can be compared with the model's own.
                        "sampling": {"max_tokens": 8, "temperature": 0.0},
                    },
                    "batch_size": 16,
                },
                "resources": {"max_workers": 2},
                "rows_per_shard": 10,
            }
        },
        "keys": [
            {"owner": "alice", "key": KEYS["alice"], "max_active_batches": 4},
            {
                "owner": "bob",
                "sha256": _sha256(KEYS["bob"]),
                "max_active_batches": 1,
                "max_stored_bytes": BOB_STORES,
            },
        ],
        "max_file_bytes": MAX_FILE_BYTES,
        # A window no batch can finish in: its workers take longer to start.
        "windows": {"24h": {"seconds": 86400}, "1s": {"seconds": 1, "priority": -1}},
        **limits,
    }
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _sha256(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


@contextlib.asynccontextmanager
async def started(
    tmp: Path, model: Path, prefix: str, config: Path, *, replicas: int = 1
) -> AsyncIterator[LocalStack]:
    """The embedded stack with `replicas` gateways serving `config`; stopped after, its
    NATS having refused nothing."""
    stack = LocalStack(
        StackConfig(
            state_dir=tmp / "state",
            data_roots=[str(tmp), str(model.parent)],
            max_workers=2,
            worker_grace_s=10,
            prefix=prefix,
            gateway=config,
            gateway_replicas=replicas,
        )
    )
    await stack.start()
    try:
        yield stack
    finally:
        close_clients(stack)
        await stack.stop()
    assert stack.nats.violations == []


@pytest.fixture
async def gateway_stack(
    tmp_path: Path, tiny_chat_model: Path, prefix: str
) -> AsyncIterator[LocalStack]:
    config = gateway_config(tmp_path, tiny_chat_model)
    async with started(tmp_path, tiny_chat_model, prefix, config) as stack:
        yield stack


_CLIENTS: dict[tuple[int, str], openai.OpenAI] = {}
"""One client per stack and owner, closed with its stack: an unclosed client's sockets
would be closed by the collector, a warning at a moment no test controls."""


def client(stack: LocalStack, owner: str = "alice") -> openai.OpenAI:
    assert stack.gateway_url is not None
    key = (id(stack), owner)
    if key not in _CLIENTS:
        _CLIENTS[key] = openai.OpenAI(base_url=stack.gateway_url, api_key=KEYS[owner])
    return _CLIENTS[key]


def close_clients(stack: LocalStack) -> None:
    for key in [k for k in _CLIENTS if k[0] == id(stack)]:
        _CLIENTS.pop(key).close()


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": content}], **body},
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def wait_for(
    oa: openai.OpenAI,
    batch_id: str,
    statuses: tuple[str, ...] = ENDED,
    *,
    timeout_s: float = 240,
    seen: list[str] | None = None,
) -> Any:
    """Poll the batch (as a user does) until its status is one of `statuses`; `seen` gets
    each status polled."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await asyncio.to_thread(oa.batches.retrieve, batch_id)
        if seen is not None:
            seen.append(batch.status)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        await asyncio.sleep(0.2)


def lines_of(oa: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in oa.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="session")
def reference(tiny_chat_model: Path) -> Iterator[Any]:
    """What the model makes of a chat alone, greedily: the answers to compare with."""
    from ebb.worker.llm.hf import TransformersEngine

    from ..worker.test_llm import _greedy

    engine = TransformersEngine(str(tiny_chat_model))

    def answer(content: str, max_tokens: int) -> tuple[str, int]:
        ids = _greedy(engine, engine.encode([{"role": "user", "content": content}]), max_tokens)
        return engine.tokenizer.decode(ids, skip_special_tokens=True), len(ids)

    yield answer


def create(oa: openai.OpenAI, file_id: str, *, window: str = "24h") -> Any:
    """A chat batch of the file, as a user creates one."""
    return oa.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window=window,  # type: ignore[arg-type]
    )
