"""Anthropic's Message Batches, with the official `anthropic` client as its users install it:
a batch of Messages requests created inline, polled to `ended`, its results (a Message each,
`errored` for what the engine does not do), the same text the OpenAI chat route gives for the
same messages; listing, cancelling, deleting; the API's error shapes and headers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import anthropic
import pytest

from ebb.client.stack import LocalStack

from .conftest import KEYS, chat_line, client, jsonl, lines_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SYSTEM = "Answer in one short line."
QUESTIONS = ["Where do rivers go?", "What is a stone made of?"]


def anthropic_client(stack: LocalStack, owner: str = "alice") -> anthropic.Anthropic:
    assert stack.gateway_url is not None
    return anthropic.Anthropic(
        base_url=stack.gateway_url.removesuffix("/v1"), api_key=KEYS[owner], max_retries=0
    )


def params(content: Any, **more: Any) -> Any:
    """A Messages request's params (Any: the client's TypedDicts are not what is tested)."""
    return {
        "model": "tiny-chat",
        "max_tokens": 24,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        **more,
    }


async def ended(ac: anthropic.Anthropic, batch_id: str, timeout_s: float = 240) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await asyncio.to_thread(ac.messages.batches.retrieve, batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.monotonic() < deadline, f"{batch_id} still {batch.processing_status}"
        await asyncio.sleep(0.2)


async def test_a_message_batch_answers_each_request_as_the_chat_route_would(
    gateway_stack: LocalStack,
) -> None:
    ac = anthropic_client(gateway_stack)
    requests = [
        {"custom_id": "q-0", "params": params(QUESTIONS[0], system=SYSTEM)},
        {
            "custom_id": "q-1",
            "params": params(
                [{"type": "text", "text": QUESTIONS[1]}],
                system=[{"type": "text", "text": SYSTEM}],
            ),
        },
        {"custom_id": "cut", "params": params(QUESTIONS[0], max_tokens=2)},
        {"custom_id": "no-budget", "params": {**params("hi"), "max_tokens": None}},
        {"custom_id": "tools", "params": params("hi", tools=[{"name": "t", "input_schema": {}}])},
        {
            "custom_id": "image",
            "params": params([{"type": "image", "source": {"type": "url", "url": "x"}}]),
        },
    ]
    created = await asyncio.to_thread(ac.messages.batches.create, requests=requests)  # type: ignore[arg-type]
    assert created.type == "message_batch" and created.id.startswith("msgbatch_")
    assert created.processing_status == "in_progress" and created.results_url is None
    done = await ended(ac, created.id)
    counts = done.request_counts
    assert (counts.succeeded, counts.errored, counts.canceled, counts.expired) == (3, 3, 0, 0)
    assert counts.processing == 0 and done.ended_at is not None
    assert done.results_url is not None
    results = {
        r.custom_id: r.result
        for r in await asyncio.to_thread(lambda: list(ac.messages.batches.results(created.id)))
    }
    assert set(results) == {r["custom_id"] for r in requests}
    kinds = {k: r.type for k, r in results.items()}
    assert kinds == {
        "q-0": "succeeded",
        "q-1": "succeeded",
        "cut": "succeeded",
        "no-budget": "errored",
        "tools": "errored",
        "image": "errored",
    }
    for custom_id in ("no-budget", "tools", "image"):
        error = results[custom_id].error.error  # type: ignore[union-attr]
        assert error.type == "invalid_request_error", error
    cut = results["cut"].message  # type: ignore[union-attr]
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2

    # The OpenAI chat route, the same messages: the same text, token for token.
    oa = client(gateway_stack)
    chats = [
        chat_line(
            f"chat-{i}",
            "",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            max_tokens=24,
            temperature=0,
        )
        for i, q in enumerate(QUESTIONS)
    ]
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("requests.jsonl", jsonl(chats)), purpose="batch"
    )
    batch = await asyncio.to_thread(
        oa.batches.create,
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    answered = await wait_for(oa, batch.id)
    chat = {a["custom_id"]: a["response"]["body"] for a in lines_of(oa, answered.output_file_id)}
    for i in range(2):
        message = results[f"q-{i}"].message  # type: ignore[union-attr]
        body = chat[f"chat-{i}"]
        assert message.content[0].text == body["choices"][0]["message"]["content"]  # type: ignore[union-attr]
        assert message.usage.input_tokens == body["usage"]["prompt_tokens"]
        assert message.role == "assistant" and message.model == "tiny-chat"

    # Listed, newest first, paged as Anthropic pages; an OpenAI batch is not among them.
    second = await asyncio.to_thread(
        ac.messages.batches.create, requests=[{"custom_id": "a", "params": params("hi")}]
    )
    page = await asyncio.to_thread(ac.messages.batches.list, limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    older = await asyncio.to_thread(ac.messages.batches.list, limit=5, after_id=second.id)
    assert [b.id for b in older.data] == [created.id] and not older.has_more
    newer = await asyncio.to_thread(ac.messages.batches.list, limit=5, before_id=created.id)
    assert [b.id for b in newer.data] == [second.id] and not newer.has_more

    # Another owner sees none of it; deleted once ended (before: tested below).
    with pytest.raises(anthropic.NotFoundError):
        await asyncio.to_thread(
            anthropic_client(gateway_stack, "bob").messages.batches.retrieve, created.id
        )
    deleted = await asyncio.to_thread(ac.messages.batches.delete, created.id)
    assert deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        await asyncio.to_thread(ac.messages.batches.retrieve, created.id)


async def test_a_cancelled_message_batch_ends_with_each_request_answered_or_canceled(
    gateway_stack: LocalStack,
) -> None:
    ac = anthropic_client(gateway_stack)
    requests: list[dict[str, Any]] = [
        {"custom_id": f"r-{i}", "params": params(f"Tell me about stone {i}", max_tokens=64)}
        for i in range(40)
    ]
    created = await asyncio.to_thread(ac.messages.batches.create, requests=requests)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError, match="still processing"):
        await asyncio.to_thread(ac.messages.batches.delete, created.id)
    cancelled = await asyncio.to_thread(ac.messages.batches.cancel, created.id)
    assert cancelled.processing_status in ("canceling", "ended")
    assert cancelled.cancel_initiated_at is not None
    done = await ended(ac, created.id)
    counts = done.request_counts
    assert counts.succeeded + counts.canceled == 40 and counts.errored == counts.expired == 0
    results = await asyncio.to_thread(lambda: list(ac.messages.batches.results(created.id)))
    assert sorted(r.custom_id for r in results) == sorted(r["custom_id"] for r in requests)
    kinds = [r.result.type for r in results]
    assert (
        kinds.count("canceled") == counts.canceled and kinds.count("succeeded") == counts.succeeded
    )


async def test_the_api_s_errors_have_its_shapes(gateway_stack: LocalStack) -> None:
    with pytest.raises(anthropic.AuthenticationError):
        await asyncio.to_thread(
            anthropic.Anthropic(
                base_url=gateway_stack.gateway_url.removesuffix("/v1"),  # type: ignore[union-attr]
                api_key="sk-wrong",
                max_retries=0,
            ).messages.batches.list
        )
    ac = anthropic_client(gateway_stack)
    with pytest.raises(anthropic.BadRequestError, match="used twice"):
        await asyncio.to_thread(
            ac.messages.batches.create,
            requests=[{"custom_id": "a", "params": params("x")}] * 2,
        )
    with pytest.raises(anthropic.NotFoundError):
        await asyncio.to_thread(ac.messages.batches.retrieve, "msgbatch_nope")
    url = f"{gateway_stack.gateway_url}/messages/batches"
    async with (
        aiohttp.ClientSession() as http,
        http.get(url, headers={"x-api-key": KEYS["alice"]}) as answer,
    ):
        assert answer.status == 400
        assert await answer.json() == {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "anthropic-version: header is required.",
            },
        }
