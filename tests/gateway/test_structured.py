"""Structured output per request through the Batch API, with the official `openai` client:
each chat request's `response_format` (a JSON Schema, or text) enforced for its row alone by
the engine (the tiny model's random weights write no JSON unguided), a schema the model's
tokens cannot write the error line of that request only, a format the API does not define
refused as it is read."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ebb.client.stack import LocalStack

from .conftest import chat_line, client, create, jsonl, lines_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

LABELS = {
    "type": "object",
    "properties": {"label": {"enum": ["spam", "ham"]}, "urgent": {"type": "boolean"}},
    "required": ["label", "urgent"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}},
    "required": ["city"],
}


def schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def shaped(custom_id: str, content: str, fmt: dict[str, Any]) -> dict[str, Any]:
    return chat_line(custom_id, content, response_format=fmt, max_tokens=48, temperature=0)


async def test_each_request_s_json_schema_shapes_its_own_answer(
    gateway_stack: LocalStack,
) -> None:
    oa = client(gateway_stack)
    lines = [
        shaped("label-0", "Win a free cruise now", schema_format("l", LABELS)),
        shaped("city", "Where is it cold?", schema_format("c", CITY)),
        chat_line("free", "Tell me about stones", response_format={"type": "text"}, max_tokens=6),
        shaped("label-1", "Lunch at noon?", schema_format("l", LABELS)),
        chat_line(
            "unwritable",  # the guide's dialect has no lookahead: no token may start it
            "hello",
            response_format=schema_format("u", {"type": "string", "pattern": "(?=a)a"}),
        ),
        chat_line("xml", "hello", response_format={"type": "xml"}),
        chat_line("nameless", "hello", response_format={"type": "json_schema", "json_schema": {}}),
    ]
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("requests.jsonl", jsonl(lines)), purpose="batch"
    )
    batch = await asyncio.to_thread(create, oa, uploaded.id)
    done = await wait_for(oa, batch.id)
    assert done.status == "completed", done
    answers = {a["custom_id"]: a["response"] for a in lines_of(oa, done.output_file_id)}
    errors = {e["custom_id"]: e["response"] for e in lines_of(oa, done.error_file_id)}
    assert set(answers) == {"label-0", "city", "free", "label-1"}, errors
    assert set(errors) == {"unwritable", "xml", "nameless"}

    def content(custom_id: str) -> str:
        choice = answers[custom_id]["body"]["choices"][0]
        text: str = choice["message"]["content"]
        return text

    for custom_id in ("label-0", "label-1", "city"):  # the schema's end: the guide's stop
        assert answers[custom_id]["body"]["choices"][0]["finish_reason"] == "stop"

    for custom_id in ("label-0", "label-1"):
        value = json.loads(content(custom_id))
        assert set(value) == {"label", "urgent"} and value["label"] in ("spam", "ham"), value
    assert json.loads(content("city"))["city"] in ("Oslo", "Lima")
    assert not content("free").lstrip().startswith("{")  # text: the model's own, unshaped
    for custom_id, (status, param, code) in {
        "unwritable": (400, "response_format", "invalid_value"),
        "xml": (400, "response_format.type", "invalid_value"),
        "nameless": (400, "response_format.json_schema.name", "invalid_value"),
    }.items():
        error = errors[custom_id]["body"]["error"]
        assert (errors[custom_id]["status_code"], error["param"], error["code"]) == (
            status,
            param,
            code,
        ), error
