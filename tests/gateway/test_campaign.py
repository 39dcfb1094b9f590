"""A hostile client against two gateway replicas (the suite's slice of bench section
`hostile`): fuzzed batch files and raw HTTP requests, a cancel as a batch is created, one
replica SIGKILLed and started again midway. No replica exits of itself; every request of a
batch that ran is answered exactly once; no probe gets a 5xx, and every refusal has the
API's error shape."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psutil
import pytest

from ebb.client.stack import LocalStack

from .conftest import KEYS, gateway_config, lines_of, started, wait_for
from .hostile import FuzzFile, assert_error_shape, batch_file, check_batch, http_probes, send

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_LINE_BYTES = 256 * 1024
RSS_BOUND = 512 * 1024**2
"""A replica's resident memory at most, whatever it is sent (the bench states it measured)."""


@pytest.fixture
async def two_gateways(
    tmp_path: Path, tiny_chat_model: Path, prefix: str
) -> AsyncIterator[LocalStack]:
    config = gateway_config(
        tmp_path,
        tiny_chat_model,
        max_file_bytes=8 * 1024 * 1024,
        max_line_bytes=MAX_LINE_BYTES,
    )
    async with started(tmp_path, tiny_chat_model, prefix, config, replicas=2) as stack:
        yield stack


def urls(stack: LocalStack) -> list[str]:
    return [f"http://127.0.0.1:{port}/v1" for port in stack.gateway_ports.values()]


async def test_a_hostile_client_takes_no_replica_down_and_loses_no_request(
    two_gateways: LocalStack,
) -> None:
    stack = two_gateways
    rng = random.Random(46)
    clients = [
        {owner: openai.OpenAI(base_url=url, api_key=key) for owner, key in KEYS.items()}
        for url in urls(stack)
    ]
    peak = {"rss": 0}
    watching = asyncio.create_task(_watch_rss(stack, peak))
    runs: asyncio.Task[list[Any]] | None = None
    try:
        # Another owner's file and batch, for the probes to ask for with alice's key.
        bob = clients[0]["bob"]
        theirs = await asyncio.to_thread(
            bob.files.create, file=("b.jsonl", b'{"x": 1}\n'), purpose="batch"
        )
        their_batch = await asyncio.to_thread(
            bob.batches.create,
            input_file_id=theirs.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        fuzzed = [
            batch_file(rng, n=40, tag=f"f{k}", fails=k % 3 == 2, max_line_bytes=MAX_LINE_BYTES)
            for k in range(6)
        ]
        probes = http_probes(rng, others={"file": theirs.id, "batch": their_batch.id}, n=150)
        runs = asyncio.create_task(_run_batches(clients, fuzzed))
        answers = await _probe(stack, probes)
        # A replica dies as a node would, mid-campaign, and comes back.
        await stack.kill("gateway-2")
        await stack.restart("gateway-2")
        await stack.wait_for_gateway("gateway-2")
        answers += await _probe(stack, probes[:50])
        ended = await runs
    finally:
        for task in (watching, runs):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for by_owner in clients:
            for oa in by_owner.values():
                oa.close()

    for (status, body), probe in zip(answers, probes + probes[:50], strict=True):
        assert status < 500, (probe, status, body)
        assert probe.expect in (None, status), (probe, status, body)
        if status >= 400 and probe.api_shape:
            assert_error_shape(body)
    oa = openai.OpenAI(base_url=urls(stack)[0], api_key=KEYS["alice"])
    with oa:
        for batch, fuzz in zip(ended, fuzzed, strict=True):
            output, errors = lines_of(oa, batch.output_file_id), lines_of(oa, batch.error_file_id)
            check_batch(batch, fuzz, output, errors)
    assert {b.status for b in ended} >= {"failed", "completed"}
    # Neither replica exited of itself (gateway-2's one exit was the SIGKILL above).
    assert all(stack.processes[name].returncode is None for name in stack.gateway_ports)
    assert stack.restarts.get("gateway", 0) == 0
    assert peak["rss"] < RSS_BOUND, peak


async def _probe(stack: LocalStack, probes: list[Any]) -> list[tuple[int, Any]]:
    bases = urls(stack)
    async with aiohttp.ClientSession() as http:
        return [await send(http, bases[i % 2], p, KEYS) for i, p in enumerate(probes)]


async def _run_batches(
    clients: list[dict[str, openai.OpenAI]], fuzzed: list[FuzzFile]
) -> list[Any]:
    """Each file uploaded and its batch created through either replica; the second batch is
    cancelled as it is created; all waited for."""
    made: list[Any] = []
    for k, fuzz in enumerate(fuzzed):
        oa = clients[k % 2]["alice"]
        uploaded = await asyncio.to_thread(
            oa.files.create, file=(f"{k}.jsonl", fuzz.payload), purpose="batch"
        )
        while True:
            try:
                batch = await asyncio.to_thread(
                    oa.batches.create,
                    input_file_id=uploaded.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
                break
            except openai.RateLimitError:  # alice's 4 at once: wait for one to end
                for earlier in made:
                    await wait_for(clients[0]["alice"], earlier.id, timeout_s=400)
        if k == 1:
            await asyncio.to_thread(oa.batches.cancel, batch.id)
        made.append(batch)
    return [await wait_for(clients[0]["alice"], b.id, timeout_s=400) for b in made]


async def _watch_rss(stack: LocalStack, peak: dict[str, int]) -> None:
    while True:
        for name in stack.gateway_ports:
            process = stack.processes.get(name)
            if process is not None and process.returncode is None:
                try:
                    rss = psutil.Process(process.pid).memory_info().rss
                except psutil.NoSuchProcess:
                    continue
                peak["rss"] = max(peak["rss"], rss)
        await asyncio.sleep(0.05)
