"""A batch file's lines judged one by one: the job's rows, the error lines, the file's own
problems (ebb.gateway.requests, pure)."""

from __future__ import annotations

import json
from typing import Any

from ebb.gateway.requests import MAX_REPORTED, Validation, validate
from ebb.gateway.store import split_lines

CHAT = "/v1/chat/completions"
MODELS = {"m": object(), "other": object()}


def judged(
    lines: list[Any], *, endpoint: str = CHAT, max_requests: int = 100, max_line_bytes: int = 4096
) -> tuple[Validation, list[dict[str, Any]], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    raw = b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )
    # As the store reads a file: in pieces (small here, so that lines cross them).
    pieces = [raw[i : i + 1000] for i in range(0, len(raw), 1000)]
    found = validate(
        split_lines(pieces, max_bytes=max_line_bytes),
        batch_id="batch_1",
        endpoint=endpoint,
        models=MODELS,
        max_requests=max_requests,
        max_line_bytes=max_line_bytes,
        accept=lambda row, model: rows.append({**row, "model": model}),
        reject=errors.append,
    )
    return found, rows, errors


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def test_a_request_becomes_a_row_with_its_sampling() -> None:
    found, rows, errors = judged(
        [
            line("a", max_tokens=5, temperature=0, top_p=0.5, seed=7, stop="\n"),
            line(
                "b",
                max_completion_tokens=3,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
                    }
                ],
            ),
        ]
    )
    assert (found.total, found.accepted, found.rejected, found.problem_count) == (2, 2, 0, 0)
    assert errors == [] and found.model == "m"
    assert rows[0] == {
        "custom_id": "a",
        "line": 1,
        "prompt": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0.0,
        "top_p": 0.5,
        "seed": 7,
        "stop": ["\n"],
        "structured": None,
        "model": "m",
    }
    assert rows[1]["prompt"] == [{"role": "user", "content": "xy"}] and rows[1]["max_tokens"] == 3
    assert rows[1]["temperature"] is None and rows[1]["stop"] is None


def test_a_response_format_becomes_its_row_s_structured_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _, rows, errors = judged(
        [
            line("text", response_format={"type": "text"}),
            line("object", response_format={"type": "json_object"}),
            line(
                "schema",
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": schema},
                },
            ),
            line("any", response_format={"type": "json_schema", "json_schema": {"name": "any"}}),
            line(
                "bad-schema",
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1]},
                },
            ),
            line("not-a-format", response_format="json"),
        ]
    )
    shapes = {r["custom_id"]: r["structured"] for r in rows}
    assert shapes == {
        "text": None,
        "object": json.dumps({"json": {"type": "object"}}),
        "schema": json.dumps({"json": schema}, separators=(",", ":"), sort_keys=True),
        "any": '{"json":{"type":"object"}}',
    }
    params = {e["custom_id"]: e["response"]["body"]["error"]["param"] for e in errors}
    assert params == {
        "bad-schema": "response_format.json_schema.schema",
        "not-a-format": "response_format.type",
    }


def test_a_request_the_gateway_will_not_run_is_an_error_line_and_the_rest_run() -> None:
    found, rows, errors = judged(
        [
            line("ok"),
            line("model", model="gpt-9"),
            line("mixed", model="other"),
            line("temp", temperature=3),
            line("tools", tools=[{"type": "function"}]),
            line("image", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            line("penalty-zero", presence_penalty=0),
        ]
    )
    assert [r["custom_id"] for r in rows] == ["ok", "penalty-zero"]
    codes = {
        e["custom_id"]: (e["response"]["status_code"], e["response"]["body"]["error"]["code"])
        for e in errors
    }
    assert codes == {
        "model": (404, "model_not_found"),
        "mixed": (400, "mismatched_model"),
        "temp": (400, "invalid_value"),
        "tools": (400, "unsupported_parameter"),
        "image": (400, "unsupported_value"),
    }
    assert all(e["error"] is None and e["id"].startswith("batch_req_") for e in errors)
    assert found.rejected == 5 and found.problem_count == 0


def test_the_file_s_own_problems_name_every_line_and_stop_the_rows() -> None:
    found, _, _ = judged(
        [
            line("a"),
            b"{not json",
            b"[1, 2]",
            {**line("b"), "method": "GET"},
            {**line("c"), "url": "/v1/completions"},
            line("a"),
            {"custom_id": "d", "method": "POST", "url": CHAT},
            {**line("e"), "custom_id": 5},
            {**line("f"), "body": "text"},
        ]
    )
    assert [(p.line, p.code) for p in found.problems] == [
        (2, "invalid_json_line"),
        (3, "invalid_json_line"),
        (4, "invalid_value"),
        (5, "invalid_url"),
        (6, "duplicate_custom_id"),
        (7, "missing_required_parameter"),
        (8, "invalid_type"),
        (9, "invalid_type"),
    ]
    assert "first on line 1" in found.problems[4].message


def test_too_many_lines_and_problems_are_counted_and_the_first_listed() -> None:
    found, _, _ = judged([line(f"q{i}") for i in range(12)], max_requests=10)
    assert [(p.line, p.code) for p in found.problems] == [(11, "too_many_requests")]
    found, _, _ = judged([b"nope"] * (MAX_REPORTED + 5), max_requests=1000)
    assert found.problem_count == MAX_REPORTED + 5 and len(found.problems) == MAX_REPORTED
    found, _, _ = judged([b"", b"  "])
    assert [p.code for p in found.problems] == ["empty_file"]


def test_a_completion_request_is_its_prompt_text() -> None:
    request = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": ["once upon"], "max_tokens": 4},
    }
    _, rows, errors = judged([request], endpoint="/v1/completions")
    assert errors == [] and rows[0]["prompt"] == "once upon"
    _, rows, errors = judged(
        [{**request, "body": {"model": "m", "prompt": ["a", "b"]}}], endpoint="/v1/completions"
    )
    assert rows == [] and errors[0]["response"]["body"]["error"]["param"] == "prompt"


class _Encoder:
    """A catalogue model as the checks see it: what it serves, whether it takes dimensions."""

    endpoints = ("/v1/embeddings",)

    def __init__(self, dimensions: bool) -> None:
        self.dimensions = dimensions


def test_an_embeddings_request_is_its_inputs_as_texts_or_token_ids() -> None:
    embeddings = "/v1/embeddings"

    def request(custom_id: str, model: str = "enc", **body: Any) -> dict[str, Any]:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": embeddings,
            "body": {"model": model, **body},
        }

    chat_only = type("Chat", (), {"endpoints": ("/v1/chat/completions",)})()
    models: dict[str, object] = {"enc": _Encoder(dimensions=False), "chat": chat_only}
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    lines = [
        request("text", input="hello"),
        request("texts", input=["a", "b"], encoding_format="base64"),
        request("ids", input=[1, 2, 3]),
        request("many-ids", input=[[1, 2], [3]]),
        request("empty-list", input=[]),
        request("empty-text", input=["a", " "]),
        request("mixed", input=["a", 1]),
        request("too-many", input=["x"] * 2049),
        request("format", input="a", encoding_format="float16"),
        request("dimensions", input="a", dimensions=64),
        request("chat-model", model="chat", input="a"),
    ]
    raw = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    found = validate(
        split_lines([raw], max_bytes=1 << 20),
        batch_id="batch_1",
        endpoint=embeddings,
        models=models,
        max_requests=100,
        max_line_bytes=1 << 20,
        accept=lambda row, model: rows.append(row),
        reject=errors.append,
    )
    assert (found.accepted, found.rejected) == (4, 7)
    assert rows[0] == {
        "custom_id": "text",
        "line": 1,
        "input": ["hello"],
        "input_ids": None,
        "dimensions": None,
        "encoding_format": "float",
    }
    assert rows[1]["input"] == ["a", "b"] and rows[1]["encoding_format"] == "base64"
    assert rows[2]["input"] is None and rows[2]["input_ids"] == [[1, 2, 3]]
    assert rows[3]["input_ids"] == [[1, 2], [3]]
    codes = {
        e["custom_id"]: (
            e["response"]["body"]["error"]["param"],
            e["response"]["body"]["error"]["code"],
        )
        for e in errors
    }
    assert codes == {
        "empty-list": ("input", "invalid_type"),
        "empty-text": ("input", "invalid_value"),
        "mixed": ("input", "invalid_type"),
        "too-many": ("input", "invalid_value"),
        "format": ("encoding_format", "invalid_value"),
        "dimensions": ("dimensions", "unsupported_parameter"),
        "chat-model": ("model", "unsupported_model"),
    }


def test_a_responses_request_is_its_instructions_and_input_as_a_chat() -> None:
    def responses_line(custom_id: str, **body: Any) -> dict[str, Any]:
        body = {"model": "m", **body}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}

    found, rows, errors = judged(
        [
            responses_line("text", input="hi", instructions="be brief", max_output_tokens=9),
            responses_line(
                "items",
                input=[
                    {"role": "developer", "content": "rules"},
                    {
                        "type": "message",
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_text", "text": "b"},
                        ],
                    },
                ],
                text={"format": {"type": "json_object"}},
            ),
            responses_line("truncated", input="hi", truncation="auto"),
            responses_line("reasoning", input="hi", reasoning={"effort": "high"}),
            responses_line("no-input"),
            responses_line("call", input=[{"type": "function_call_output", "output": "x"}]),
        ],
        endpoint="/v1/responses",
    )
    by_id = {r["custom_id"]: r for r in rows}
    assert by_id["text"]["prompt"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert by_id["text"]["max_tokens"] == 9 and by_id["text"]["structured"] is None
    assert json.loads(by_id["text"]["echo"])["instructions"] == "be brief"
    assert by_id["items"]["prompt"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
    ]
    assert json.loads(by_id["items"]["structured"]) == {"json": {"type": "object"}}
    codes = {e["custom_id"]: e["response"]["body"]["error"]["code"] for e in errors}
    assert codes == {
        "truncated": "unsupported_value",
        "reasoning": "unsupported_parameter",
        "no-input": "missing_required_parameter",
        "call": "unsupported_value",
    }
    assert found.accepted == 2
