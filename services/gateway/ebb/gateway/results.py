"""A batch's results: its job's committed rows as the API's output and error files.

Read from the job's commit records (each row in exactly one committed file, whatever was
retried, split or killed), a file at a time; written as JSONL, a line per request, to new
files that appear whole. The same job output gives the same files, byte for byte: a gateway
that dies while writing them writes them again, and nothing is doubled."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from ebb.common.data.layout import CommitRecord
from ebb.common.data.output import OutputStore

from .bodies import CHAT, EMBEDDINGS, MESSAGES, RESPONSES
from .requests import error_line, request_ids
from .store import FileStore, Writer

ENDED_SHORT = {
    "cancelled": (
        "batch_cancelled",
        "This request was not executed before the batch was cancelled.",
    ),
    "expired": (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    "failed": ("batch_failed", "This request was not executed: the batch's job failed ({reason})."),
    "": ("request_failed", "This request was not executed: {reason}."),
}

READ_COLUMNS = [
    "custom_id",
    "line",
    "text",
    "finish_reason",
    "prompt_tokens",
    "output_tokens",
    "_error",
]
EMBEDDING_COLUMNS = ["custom_id", "line", "embedding", "prompt_tokens", "encoding_format", "_error"]
COLUMNS_READ = {EMBEDDINGS: EMBEDDING_COLUMNS, RESPONSES: [*READ_COLUMNS, "echo"]}


_UNENFORCEABLE = re.compile(r"(^|: )structured( output)?: ")
"""A row's error that says its schema could not be enforced (ebb.worker.llm.stage)."""
_FORMAT_PARAM = {"/v1/responses": "text.format"}
"""Where a request sets its structured output, where not `response_format`."""
_PROMPT_PARAM = {
    "/v1/chat/completions": "messages",
    RESPONSES: "input",
    "/v1/completions": "prompt",
    EMBEDDINGS: "input",
}
_REFUSED_INPUT = re.compile(r"outside the model's vocabulary|^dimensions \d+: the model has")


@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    unrun: int = 0
    """Of the failed, those never run: the batch ended (cancelled, expired) before them."""
    input_tokens: int = 0
    output_tokens: int = 0


def write_results(
    *,
    batch_id: str,
    endpoint: str,
    model: str,
    job_output: str,
    requests: Iterator[tuple[str, int]],
    rejected: Iterator[bytes],
    ending: str,
    reason: str,
    output: Writer,
    errors: Writer,
) -> Tally:
    """Write the output file (the requests answered) and the error file (the rest: refused
    at validation, failed in the job, or never run because the batch ended short, as
    `ending` says). `requests`: every (custom_id, line) the job was given. Blocking."""
    tally = Tally()
    done = bytearray()
    emit = _jsonl if endpoint != MESSAGES else lambda line: _jsonl(anthropic_result(line))
    store = OutputStore(job_output)
    for record in store.commits():
        for path in _files(record):
            columns = COLUMNS_READ.get(endpoint, READ_COLUMNS)
            table = pq.read_table(store.full(path), columns=columns, filesystem=store.fs)
            for row in table.to_pylist():
                line = int(row["line"])
                if line >= len(done):
                    done.extend(bytes(line + 1 - len(done)))
                done[line] = 1
                if row["_error"] is None:
                    tally.completed += 1
                    tally.input_tokens += int(row["prompt_tokens"] or 0)
                    tally.output_tokens += int(row.get("output_tokens") or 0)
                    if endpoint == EMBEDDINGS:
                        body = _embeddings(batch_id, model, row)
                    else:
                        body = _answer(batch_id, endpoint, model, row, record)
                    output.write(emit(body))
                else:
                    tally.failed += 1
                    failed = _failed(batch_id, row["custom_id"], row["_error"], endpoint)
                    errors.write(emit(failed))
    for raw in rejected:
        if raw.strip():
            tally.failed += 1
            kept = emit(json.loads(raw)) if endpoint == MESSAGES else raw
            errors.write(kept if kept.endswith(b"\n") else kept + b"\n")
    code, message = ENDED_SHORT[ending]
    for custom_id, line in requests:
        if line < len(done) and done[line]:
            continue
        tally.failed += 1
        tally.unrun += 1
        line_id, _ = request_ids(batch_id, custom_id)
        missing = {
            "id": line_id,
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message.format(reason=reason or "no reason given")},
        }
        errors.write(emit(missing))
    return tally


def _files(record: CommitRecord) -> list[str]:
    return [f.path for f in record.files if f.rows]


def _jsonl(value: dict[str, Any]) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _answer(
    batch_id: str, endpoint: str, model: str, row: dict[str, Any], record: CommitRecord
) -> dict[str, Any]:
    line_id, request_id = request_ids(batch_id, row["custom_id"])
    digest = request_id.removeprefix("req_")
    prompt_tokens, output_tokens = int(row["prompt_tokens"]), int(row["output_tokens"])
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": output_tokens,
        "total_tokens": prompt_tokens + output_tokens,
    }
    created = int(record.committed_at)
    fingerprint = _fingerprint(record)
    body: dict[str, Any]
    if endpoint == RESPONSES:
        body = _response(digest, created, model, row)
    elif endpoint in (CHAT, MESSAGES):  # a Message Batch's, made a Message as it is written
        body = {
            "id": f"chatcmpl-{digest}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": row["text"], "refusal": None},
                    "logprobs": None,
                    "finish_reason": row["finish_reason"],
                }
            ],
            "usage": usage,
            "system_fingerprint": fingerprint,
        }
    else:
        body = {
            "id": f"cmpl-{digest}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "text": row["text"],
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": row["finish_reason"],
                }
            ],
            "usage": usage,
            "system_fingerprint": fingerprint,
        }
    return {
        "id": line_id,
        "custom_id": row["custom_id"],
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def _response(digest: str, created: int, model: str, row: dict[str, Any]) -> dict[str, Any]:
    """A Responses API request's answer: the Response object, its parameters echoed as the
    API echoes them (with their defaults where the request left them out)."""
    echo = json.loads(row["echo"])
    cut = row["finish_reason"] == "length"
    status = "incomplete" if cut else "completed"
    input_tokens, output_tokens = int(row["prompt_tokens"]), int(row["output_tokens"])
    return {
        "id": f"resp_{digest}",
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": echo["instructions"],
        "max_output_tokens": echo["max_output_tokens"],
        "max_tool_calls": None,
        "model": model,
        "output": [
            {
                "type": "message",
                "id": f"msg_{digest}",
                "status": status,
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": row["text"], "annotations": [], "logprobs": []}
                ],
            }
        ],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": False,
        "temperature": echo["temperature"] if echo["temperature"] is not None else 1.0,
        "text": echo["text"],
        "tool_choice": "auto",
        "tools": [],
        "top_logprobs": 0,
        "top_p": echo["top_p"] if echo["top_p"] is not None else 1.0,
        "truncation": "disabled",
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
        "user": echo["user"],
        "metadata": echo["metadata"],
    }


def _embeddings(batch_id: str, model: str, row: dict[str, Any]) -> dict[str, Any]:
    """An embeddings request's answer, as the API writes it: each input's vector as floats,
    or (`encoding_format: base64`) its float32 bytes, little-endian, in base64."""
    line_id, request_id = request_ids(batch_id, row["custom_id"])
    tokens = int(row["prompt_tokens"])
    as_base64 = row.get("encoding_format") == "base64"
    data = []
    for index, vector in enumerate(row["embedding"]):
        value: Any
        if as_base64:
            value = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        else:
            value = vector
        data.append({"object": "embedding", "index": index, "embedding": value})
    body = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return {
        "id": line_id,
        "custom_id": row["custom_id"],
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def _fingerprint(record: CommitRecord) -> str | None:
    """What generated the text, short: the model's digest (or store version) in the commit
    record, as `fp_…`."""
    for generation in record.generation.values():
        digest = generation.get("model_sha256") or generation.get("model_version")
        if digest:
            return f"fp_{str(digest)[:12]}"
    return None


def _failed(batch_id: str, custom_id: str, why: str, endpoint: str) -> dict[str, Any]:
    """A request the job ran and could not answer (its row's `_error`)."""
    fault = _request_fault(why, endpoint)
    if fault is not None:
        param, code = fault
        return error_line(batch_id, custom_id, status=400, message=why, param=param, code=code)
    # The request was valid (the gateway checked it): what failed was the model, its engine
    # or its worker, a server's fault as the API reports one.
    return error_line(
        batch_id,
        custom_id,
        status=500,
        message=why,
        param=None,
        code="server_error",
        kind="server_error",
    )


def _request_fault(why: str, endpoint: str) -> tuple[str | None, str] | None:
    """(param, code) where a row's error is its request's own, what the gateway could not
    check before the model saw it; None where it is the server's."""
    if "exceed the model's context" in why or "exceed kv_tokens" in why:
        return _PROMPT_PARAM.get(endpoint, "messages"), "context_length_exceeded"
    if endpoint == EMBEDDINGS and _REFUSED_INPUT.search(why):
        # An input the encoder refuses (an id outside the model's vocabulary, dimensions
        # beyond its width).
        return "input", "invalid_value"
    if _UNENFORCEABLE.search(why):
        # A schema the engine cannot enforce (its guide refused, or too slow to make).
        return _FORMAT_PARAM.get(endpoint, "response_format"), "invalid_value"
    if why.startswith("vLLM refused it: ") or ": vLLM refused it: " in why:
        # vLLM's own validation of the request (its structured output's grammar, mostly).
        return None, "invalid_value"
    return None


def job_rows(store: FileStore, relpath: str) -> Iterator[tuple[str, int]]:
    """(custom_id, line) of every row of the job's input, a row group at a time."""
    with store.fs.open(store.full(relpath), "rb") as f:
        parquet = pq.ParquetFile(f)
        for batch in parquet.iter_batches(columns=["custom_id", "line"], batch_size=4096):
            yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True)


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
"""Anthropic's error `type` for each status (any other: `api_error`)."""


def anthropic_result(line: dict[str, Any]) -> dict[str, Any]:
    """A result line of a Message Batch, from the line the OpenAI batch would have: a
    Message (`succeeded`), the request's error (`errored`), or `canceled`/`expired` for a
    request the batch ended before."""
    response = line.get("response")
    result: dict[str, Any]
    if response is None:
        code = (line.get("error") or {}).get("code")
        if code in ("batch_cancelled", "batch_expired"):
            result = {"type": "canceled" if code == "batch_cancelled" else "expired"}
        else:
            message = (line.get("error") or {}).get("message", "not run")
            result = _errored("api_error", message)
    elif response["status_code"] == 200:
        body = response["body"]
        choice = body["choices"][0]
        usage = body["usage"]
        result = {
            "type": "succeeded",
            "message": {
                "id": "msg_" + response["request_id"].removeprefix("req_"),
                "type": "message",
                "role": "assistant",
                "model": body["model"],
                "content": [{"type": "text", "text": choice["message"]["content"]}],
                "stop_reason": "max_tokens" if choice["finish_reason"] == "length" else "end_turn",
                "stop_sequence": None,
                "usage": {
                    "input_tokens": usage["prompt_tokens"],
                    "output_tokens": usage["completion_tokens"],
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                },
            },
        }
    else:
        error = response["body"]["error"]
        kind = ANTHROPIC_ERROR_TYPES.get(response["status_code"], "api_error")
        result = _errored(kind, error["message"])
    return {"custom_id": line["custom_id"], "result": result}


def _errored(kind: str, message: str) -> dict[str, Any]:
    return {
        "type": "errored",
        "error": {"type": "error", "error": {"type": kind, "message": message}},
    }
