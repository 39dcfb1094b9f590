"""`/v1/responses` through the Batch API, with the official `openai` client: each request's
answer a Response object the client's own model reads (`output_text`, `usage`, `status`), the
same text the chat endpoint gives for the same messages, `text.format` shaping its answer,
`max_output_tokens` ending it `incomplete`, and what the engine does not do refused line by
line."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.responses import Response

from ebb.client.stack import LocalStack

from .conftest import chat_line, client, jsonl, lines_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

LABELS = {
    "type": "object",
    "properties": {"label": {"enum": ["spam", "ham"]}},
    "required": ["label"],
    "additionalProperties": False,
}
INSTRUCTIONS = "Answer in one short line."
QUESTIONS = ["Where do rivers go?", "What is a stone made of?"]


def response_line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": "tiny-chat", "temperature": 0, **body},
    }


async def _run(oa: Any, lines: list[dict[str, Any]], endpoint: str) -> tuple[dict, dict]:  # type: ignore[type-arg]
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("requests.jsonl", jsonl(lines)), purpose="batch"
    )
    batch = await asyncio.to_thread(
        oa.batches.create,
        input_file_id=uploaded.id,
        endpoint=endpoint,
        completion_window="24h",
    )
    done = await wait_for(oa, batch.id)
    assert done.status == "completed", done
    answers = {a["custom_id"]: a["response"] for a in lines_of(oa, done.output_file_id)}
    errors = {e["custom_id"]: e["response"] for e in lines_of(oa, done.error_file_id)}
    return answers, errors


async def test_a_responses_batch_answers_with_response_objects_as_chat_would(
    gateway_stack: LocalStack,
) -> None:
    oa = client(gateway_stack)
    lines = [
        response_line(
            "plain-0", input=QUESTIONS[0], instructions=INSTRUCTIONS, max_output_tokens=24
        ),
        response_line(
            "items-1",
            instructions=INSTRUCTIONS,
            input=[
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": QUESTIONS[1]}],
                }
            ],
            max_output_tokens=24,
            metadata={"team": "search"},
        ),
        response_line(
            "shaped",
            input="Win a free cruise now",
            max_output_tokens=48,
            text={"format": {"type": "json_schema", "name": "label", "schema": LABELS}},
        ),
        response_line("cut", input=QUESTIONS[0], max_output_tokens=2),
        response_line("tools", input="hi", tools=[{"type": "web_search"}]),
        response_line(
            "image",
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        ),
        response_line("chained", input="hi", previous_response_id="resp_1"),
    ]
    answers, errors = await _run(oa, lines, "/v1/responses")
    assert set(answers) == {"plain-0", "items-1", "shaped", "cut"}, errors
    assert {k: v["body"]["error"]["code"] for k, v in errors.items()} == {
        "tools": "unsupported_parameter",
        "image": "unsupported_value",
        "chained": "unsupported_parameter",
    }
    read = {k: Response.model_validate(v["body"]) for k, v in answers.items()}
    for response in read.values():
        assert response.object == "response" and response.model == "tiny-chat"
        assert response.usage is not None
        assert response.usage.total_tokens == (
            response.usage.input_tokens + response.usage.output_tokens
        )
    assert read["cut"].status == "incomplete" and read["cut"].usage is not None
    assert read["cut"].incomplete_details is not None
    assert read["cut"].incomplete_details.reason == "max_output_tokens"
    assert read["cut"].usage.output_tokens == 2
    assert json.loads(read["shaped"].output_text)["label"] in ("spam", "ham")
    assert read["shaped"].status == "completed"
    assert read["items-1"].metadata == {"team": "search"}
    assert read["plain-0"].instructions == INSTRUCTIONS
    assert read["plain-0"].max_output_tokens == 24 and read["plain-0"].temperature == 0

    # The chat endpoint, the same messages: the same text, token for token.
    chats = [
        chat_line(
            f"chat-{i}",
            "",
            messages=[
                {"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": question},
            ],
            max_tokens=24,
            temperature=0,
        )
        for i, question in enumerate(QUESTIONS)
    ]
    chat_answers, _ = await _run(oa, chats, "/v1/chat/completions")
    for i, custom_id in enumerate(("plain-0", "items-1")):
        chat = chat_answers[f"chat-{i}"]["body"]
        assert read[custom_id].output_text == chat["choices"][0]["message"]["content"]
        assert read[custom_id].usage.input_tokens == chat["usage"]["prompt_tokens"]  # type: ignore[union-attr]
