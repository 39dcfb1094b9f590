"""A batch whatever happens to it midway: cancelled by its owner, its worker SIGKILLed and
the gateway itself SIGKILLed and restarted. Its counts stay true, and every request is in
the output or the error file exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import psutil
import pytest

from ebb.client.stack import LocalStack

from ..llm_model import corpus
from .conftest import chat_line, client, create, jsonl, lines_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(500)]


def requests(n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        chat_line(f"r-{i:04d}", prompt, max_tokens=max_tokens)
        for i, prompt in enumerate(corpus(n, seed=11))
    ]


async def submitted(stack: LocalStack, lines: list[dict[str, Any]], window: str = "24h") -> Any:
    oa = client(stack)
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("in.jsonl", jsonl(lines)), purpose="batch"
    )
    return await asyncio.to_thread(create, oa, uploaded.id, window=window)


async def until_some_done(stack: LocalStack, batch_id: str) -> Any:
    """The batch in progress with some requests answered (a shard committed)."""
    oa = client(stack)
    while True:
        batch = await wait_for(oa, batch_id, ("in_progress", "completed"))
        assert batch.status == "in_progress", "the batch ended before anything could happen"
        assert batch.request_counts is not None
        if batch.request_counts.completed > 0:
            return batch
        await asyncio.sleep(0.2)


def every_request_once(
    oa: Any, batch: Any, lines: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    output, errors = lines_of(oa, batch.output_file_id), lines_of(oa, batch.error_file_id)
    ids = sorted(line["custom_id"] for line in output + errors)
    assert ids == sorted(line["custom_id"] for line in lines)
    assert batch.request_counts.total == len(lines)
    assert batch.request_counts.completed == len(output)
    assert batch.request_counts.failed == len(errors)
    return output, errors


def check_answers(
    output: list[dict[str, Any]], lines: list[dict[str, Any]], reference: Any
) -> None:
    asked = {line["custom_id"]: line["body"] for line in lines}
    for line in output:
        body = asked[line["custom_id"]]
        text, _ = reference(body["messages"][0]["content"], body["max_tokens"])
        assert line["response"]["body"]["choices"][0]["message"]["content"] == text


async def test_a_batch_cancelled_midway_keeps_what_it_answered(
    gateway_stack: LocalStack, reference: Any
) -> None:
    oa = client(gateway_stack)
    lines = requests(300, max_tokens=64)
    batch = await submitted(gateway_stack, lines)
    running = await until_some_done(gateway_stack, batch.id)
    cancelling = await asyncio.to_thread(oa.batches.cancel, batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    # Asking again is no error: it is being cancelled.
    assert (await asyncio.to_thread(oa.batches.cancel, batch.id)).status in (
        "cancelling",
        "cancelled",
    )
    seen: list[str] = []
    ended = await wait_for(oa, batch.id, seen=seen)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    # As the API goes: cancelling, then cancelled (its results are written meanwhile).
    assert set(seen) <= {"cancelling", "cancelled"} and ended.finalizing_at is None, seen
    output, errors = every_request_once(oa, ended, lines)
    assert len(output) >= running.request_counts.completed
    unrun = [e for e in errors if e["error"] is not None]
    assert unrun, "the batch finished before the cancel took: nothing was cut short"
    assert {e["error"]["code"] for e in unrun} == {"batch_cancelled"}
    assert all(e["response"] is None for e in unrun)
    check_answers(output, lines, reference)


async def test_a_batch_cancelled_as_it_is_created_counts_and_lists_every_request(
    gateway_stack: LocalStack,
) -> None:
    oa = client(gateway_stack)
    lines = requests(400, max_tokens=4)
    batch = await submitted(gateway_stack, lines)
    cancelling = await asyncio.to_thread(oa.batches.cancel, batch.id)
    assert cancelling.status == "cancelling"
    ended = await wait_for(oa, batch.id)
    assert ended.status == "cancelled", ended
    # Cancelled while its file was read or just after: either way every request is counted
    # and is in one of the files, those never run as cancelled.
    _, errors = every_request_once(oa, ended, lines)
    assert ended.request_counts.total == len(lines)
    assert {e["error"]["code"] for e in errors if e["error"]} <= {"batch_cancelled"}


def worker_pids() -> list[int]:
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "ebb.worker" in cmdline:
            pids.append(int(proc.pid))
    return pids


async def test_a_batch_outlives_a_killed_worker_and_a_killed_gateway(
    gateway_stack: LocalStack, reference: Any
) -> None:
    oa = client(gateway_stack)
    lines = requests(400, max_tokens=64)
    batch = await submitted(gateway_stack, lines)
    await until_some_done(gateway_stack, batch.id)
    await gateway_stack.kill("gateway")
    (victim, *_) = worker_pids()
    os.kill(victim, signal.SIGKILL)
    await gateway_stack.restart("gateway")
    await gateway_stack.wait_for_gateway()
    ended = await wait_for(oa, batch.id)
    assert ended.status == "completed", ended
    output, errors = every_request_once(oa, ended, lines)
    assert errors == [] and len(output) == len(lines)
    check_answers(output, lines, reference)


async def test_a_batch_past_its_window_expires_with_what_it_answered(
    gateway_stack: LocalStack, reference: Any
) -> None:
    oa = client(gateway_stack)
    lines = requests(40, max_tokens=16)
    batch = await submitted(gateway_stack, lines, window="1s")
    assert batch.expires_at == batch.created_at + 1
    ended = await wait_for(oa, batch.id)
    assert ended.status == "expired" and ended.expired_at is not None, ended
    assert ended.expired_at >= ended.expires_at
    output, errors = every_request_once(oa, ended, lines)
    assert errors and {e["error"]["code"] for e in errors} == {"batch_expired"}
    check_answers(output, lines, reference)
    # Its job (if it got as far as one) was stopped, not left to run on.
    from ebb.client.sdk import EbbClient

    async with await EbbClient.connect(gateway_stack.nats_config) as ebb:
        jobs = {job.id: job.state for job in (await ebb.status()).jobs}
    assert jobs.get(batch.id, "CANCELLED") == "CANCELLED"
