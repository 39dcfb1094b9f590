"""A request's body as its job's row: its prompt and its sampling, each checked as the API
defines it, or the reason it is refused (`RequestRefused`: a line of the error file, the
other requests run). Pure.

One concept past 400 lines: every endpoint's body (chat, completions, responses, Anthropic's
messages, embeddings) becomes the same row through the same checks of a value (`_number`,
`_float`, `_content`, `structured_of`), and reads best beside them."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

UNSUPPORTED = {
    "tools": "tool calls",
    "functions": "function calls",
    "tool_choice": "tool calls",
    "function_call": "function calls",
    "logprobs": "log probabilities",
    "top_logprobs": "log probabilities",
    "logit_bias": "logit bias",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "suffix": "suffixes",
    "echo": "echoing the prompt",
    "best_of": "best_of",
}
"""Body parameters that would change the answer in a way the llm stage does not do: a
request that sets one (to anything but its neutral value) is refused, never answered as if
it had not."""

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "tool_choice": (None, "none"),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
}


class RequestRefused(Exception):
    """A request the gateway will not run: its error line says why."""

    def __init__(
        self, message: str, *, param: str | None, code: str | None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


SEED_LIMIT = 2**63
"""Seeds are 64-bit signed integers in the job's columns: 0 up to this, exclusive."""


EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
"""Anthropic's Messages API, the endpoint of a Message Batch's requests."""
MAX_INPUTS = 2048
"""Inputs one embeddings request may hold, as the API allows."""


def model_of(
    body: dict[str, Any],
    models: Mapping[str, object],
    batch_model: str | None,
    endpoint: str | None = None,
) -> str:
    model = body.get("model")
    if model is None:
        raise RequestRefused(
            "Model parameter is required.", param="model", code="missing_required_parameter"
        )
    if not isinstance(model, str) or model not in models:
        served = ", ".join(repr(m) for m in sorted(models))
        raise RequestRefused(
            f"The model {model!r} does not exist or is not served here; this gateway serves "
            f"{served}.",
            param="model",
            code="model_not_found",
            status=404,
        )
    endpoints: tuple[str, ...] | None = getattr(models[model], "endpoints", None)
    if endpoint is not None and endpoints is not None and endpoint not in endpoints:
        raise RequestRefused(
            f"The model {model!r} serves {', '.join(endpoints)}, not {endpoint}.",
            param="model",
            code="unsupported_model",
        )
    if batch_model is not None and model != batch_model:
        raise RequestRefused(
            f"A batch runs one model: this request names {model!r}, the batch's first "
            f"{batch_model!r}.",
            param="model",
            code="mismatched_model",
        )
    return model


def row_of(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The job's columns for one request: its prompt and its sampling (null: the
    catalogue model's), or, an embeddings request, its inputs."""
    if endpoint == EMBEDDINGS:
        return embedding_row(body)
    if endpoint == RESPONSES:
        return response_row(body)
    if endpoint == MESSAGES:
        return message_row(body)
    if body.get("stream"):
        raise RequestRefused(
            "Streaming is not supported in the Batch API.",
            param="stream",
            code="streaming_unsupported",
        )
    n = body.get("n")
    if n not in (None, 1):
        raise RequestRefused(
            f"Only one choice per request is supported here (n={n!r}).",
            param="n",
            code="unsupported_value",
        )
    for name in (*UNSUPPORTED, "frequency_penalty", "presence_penalty"):
        if name in body and body[name] not in NEUTRAL.get(name, (None,)):
            what = UNSUPPORTED.get(name, "penalties")
            raise RequestRefused(
                f"{name!r} ({what}) is not supported by this gateway.",
                param=name,
                code="unsupported_parameter",
            )
    prompt = _messages(body) if endpoint == CHAT else _prompt(body)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return {
        "prompt": prompt,
        "max_tokens": _number(max_tokens, "max_tokens", low=1, high=SEED_LIMIT - 1),
        "temperature": _float(body.get("temperature"), "temperature", low=0.0, high=2.0),
        "top_p": _float(body.get("top_p"), "top_p", low=0.0, high=1.0, open_low=True),
        "seed": _number(body.get("seed"), "seed", low=0, high=SEED_LIMIT - 1),
        "stop": _stop(body.get("stop")),
        "structured": structured_of(body.get("response_format"), "response_format"),
    }


JSON_OBJECT = {"type": "object"}
"""`json_object`'s shape: any JSON object."""


def structured_of(fmt: object, param: str) -> str | None:
    """A request's `response_format` (chat) or `text.format` (responses) as its row's
    `structured` column (the llm stage's `per_row.structured`: a JSON text of `{json:
    schema}`); None for text, the catalogue model's own shape. The schema's enforceability
    is the engine's to judge: one it cannot enforce is the request's error line."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"json": JSON_OBJECT})
    if kind != "json_schema":
        raise RequestRefused(
            f"'{param}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
            param=f"{param}.type",
            code="invalid_value",
        )
    assert isinstance(fmt, dict)
    # Chat nests the schema under `json_schema`; the Responses API puts it beside `type`.
    holder = fmt.get("json_schema") if param == "response_format" else fmt
    if param == "output_format" and "name" not in fmt:  # Anthropic's has no name
        holder = {**fmt, "name": "output"}
    if not isinstance(holder, dict):
        raise RequestRefused(
            f"'{param}.json_schema' must be an object with a 'name' and a 'schema'.",
            param=f"{param}.json_schema",
            code="invalid_type",
        )
    where = f"{param}.json_schema" if param == "response_format" else param
    name = holder.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise RequestRefused(
            f"'{where}.name' must be 1-64 letters, digits, _ and -, got {name!r}.",
            param=f"{where}.name",
            code="invalid_value",
        )
    schema = holder.get("schema", JSON_OBJECT)
    if not isinstance(schema, dict):
        raise RequestRefused(
            f"'{where}.schema' must be a JSON Schema object.",
            param=f"{where}.schema",
            code="invalid_type",
        )
    return json.dumps({"json": schema or JSON_OBJECT}, separators=(",", ":"), sort_keys=True)


NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


RESPONSES_UNSUPPORTED = {
    "tools": "tool calls",
    "tool_choice": "tool calls",
    "previous_response_id": "stored conversations",
    "conversation": "stored conversations",
    "prompt": "stored prompts",
    "reasoning": "reasoning",
    "include": "included extras",
    "background": "background responses",
    "top_logprobs": "log probabilities",
    "max_tool_calls": "tool calls",
}
"""Responses API parameters that would change the answer in a way the llm stage does not
do: refused unless at their neutral value (null, empty, `none`/`auto` without tools)."""
RESPONSES_NEUTRAL: tuple[Any, ...] = (None, [], {}, False, 0, "none", "auto")


def _refuse_any_set(body: dict[str, Any], unsupported: Mapping[str, str]) -> None:
    """Refuse a request that sets one of `unsupported` (name: what it does) to anything but
    a neutral value."""
    for name, what in unsupported.items():
        if name in body and body[name] not in RESPONSES_NEUTRAL:
            raise RequestRefused(
                f"{name!r} ({what}) is not supported by this gateway.",
                param=name,
                code="unsupported_parameter",
            )


def response_row(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API request's columns: `instructions` then `input` (a string, or message
    items) as a chat, its sampling, its `text.format` as the row's structured output, and
    what its Response echoes (`echo`: a JSON text)."""
    if body.get("stream"):
        raise RequestRefused(
            "Streaming is not supported in the Batch API.",
            param="stream",
            code="streaming_unsupported",
        )
    _refuse_any_set(body, RESPONSES_UNSUPPORTED)
    if body.get("truncation") not in (None, "disabled"):
        raise RequestRefused(
            "'truncation' other than 'disabled' is not supported here: a prompt over the "
            "model's context is refused.",
            param="truncation",
            code="unsupported_value",
        )
    chat = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestRefused(
                "'instructions' must be a string.", param="instructions", code="invalid_type"
            )
        chat.append({"role": "system", "content": instructions})
    chat += _input_items(body.get("input"))
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise RequestRefused("'text' must be an object.", param="text", code="invalid_type")
    fmt = (text or {}).get("format")
    row = {
        "prompt": chat,
        "max_tokens": _number(
            body.get("max_output_tokens"), "max_output_tokens", low=1, high=SEED_LIMIT - 1
        ),
        "temperature": _float(body.get("temperature"), "temperature", low=0.0, high=2.0),
        "top_p": _float(body.get("top_p"), "top_p", low=0.0, high=1.0, open_low=True),
        "seed": None,
        "stop": None,
        "structured": structured_of(fmt, "text.format"),
    }
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= 16
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise RequestRefused(
            "'metadata' must map at most 16 keys to strings.", param="metadata", code="invalid_type"
        )
    echo = {
        "instructions": instructions,
        "max_output_tokens": row["max_tokens"],
        "temperature": row["temperature"],
        "top_p": row["top_p"],
        "text": {"format": fmt if fmt is not None else {"type": "text"}},
        "metadata": metadata or {},
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
    }
    return {**row, "echo": json.dumps(echo, separators=(",", ":"))}


MESSAGES_UNSUPPORTED = {
    "tools": "tool use",
    "tool_choice": "tool use",
    "mcp_servers": "MCP servers",
    "container": "code execution",
    "context_management": "context management",
}
"""Messages API parameters the llm stage does not do: refused unless neutral."""


def message_row(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request's columns: `system` then `messages` as a chat,
    `max_tokens` (required, as the API has it), `temperature` (0 to 1), `top_p`, `top_k`,
    `stop_sequences`."""
    if body.get("stream"):
        raise RequestRefused(
            "Streaming is not supported in Message Batches.", param="stream", code="invalid_value"
        )
    _refuse_any_set(body, MESSAGES_UNSUPPORTED)
    thinking = body.get("thinking")
    if thinking is not None and not (
        isinstance(thinking, dict) and thinking.get("type") == "disabled"
    ):
        raise RequestRefused(
            "thinking: extended thinking is not supported by this gateway.",
            param="thinking",
            code="unsupported_parameter",
        )
    if body.get("max_tokens") is None:
        raise RequestRefused(
            "max_tokens: Field required", param="max_tokens", code="missing_required_parameter"
        )
    chat = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _blocks(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestRefused(
            "messages: must be a non-empty list of messages.",
            param="messages",
            code="invalid_type",
        )
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise RequestRefused(
                f"{where}.role: must be 'user' or 'assistant', got {role!r}.",
                param=f"{where}.role",
                code="invalid_value",
            )
        chat.append({"role": role, "content": _blocks(message.get("content"), where)})
    stop = body.get("stop_sequences")
    if stop is not None and not (
        isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    ):
        raise RequestRefused(
            "stop_sequences: must be a list of non-empty strings.",
            param="stop_sequences",
            code="invalid_type",
        )
    return {
        "prompt": chat,
        "max_tokens": _number(body["max_tokens"], "max_tokens", low=1, high=SEED_LIMIT - 1),
        "temperature": _float(body.get("temperature"), "temperature", low=0.0, high=1.0),
        "top_p": _float(body.get("top_p"), "top_p", low=0.0, high=1.0, open_low=True),
        "top_k": _number(body.get("top_k"), "top_k", low=0, high=2**31 - 1),
        "seed": None,
        "stop": list(stop) if stop else None,
        "structured": structured_of(body.get("output_format"), "output_format"),
    }


def _blocks(content: object, where: str) -> str:
    """A Messages content: a string, or text blocks (anything else refused)."""
    if isinstance(content, list):
        for i, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise RequestRefused(
                    f"{where}.content.{i}: only text blocks are supported here, got {kind!r}.",
                    param=f"{where}.content.{i}",
                    code="unsupported_value",
                )
    return _content(content, where)


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
"""A Responses input item's role as the chat template knows it (`developer` is the system's)."""
_TEXT_PARTS = ("input_text", "output_text", "text")


def _input_items(value: object) -> list[dict[str, str]]:
    if value is None:
        raise RequestRefused(
            "Input parameter is required.", param="input", code="missing_required_parameter"
        )
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestRefused(
            "'input' must be a string or a non-empty array of message items.",
            param="input",
            code="invalid_type",
        )
    chat = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise RequestRefused(
                f"{where}: only message items are supported here.",
                param=where,
                code="unsupported_value",
            )
        role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise RequestRefused(
                f"{where}.role must be one of {sorted(_ROLES)}, got {item.get('role')!r}.",
                param=f"{where}.role",
                code="invalid_value",
            )
        content = item.get("content")
        if isinstance(content, list):
            content = [
                {**part, "type": "text"}
                if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
                else part
                for part in content
            ]
        chat.append({"role": role, "content": _content(content, where)})
    return chat


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise RequestRefused(
            "Messages parameter is required.", param="messages", code="missing_required_parameter"
        )
    if not isinstance(messages, list) or not messages:
        raise RequestRefused(
            "'messages' must be a non-empty array.", param="messages", code="invalid_type"
        )
    chat = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestRefused(
                f"{where} must be an object with a 'role'.", param=where, code="invalid_type"
            )
        chat.append({"role": message["role"], "content": _content(message.get("content"), where)})
    return chat


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestRefused(
                    f"{where}.content: only text parts are supported here.",
                    param=f"{where}.content",
                    code="unsupported_value",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestRefused(
                    f"{where}.content: a text part needs its 'text'.",
                    param=f"{where}.content",
                    code="invalid_type",
                )
            texts.append(text)
        return "".join(texts)
    raise RequestRefused(
        f"{where}.content must be a string or an array of text parts.",
        param=f"{where}.content",
        code="invalid_type",
    )


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise RequestRefused(
            "Prompt parameter is required.", param="prompt", code="missing_required_parameter"
        )
    if not isinstance(prompt, str):
        raise RequestRefused(
            "'prompt' must be one string here (one completion per request).",
            param="prompt",
            code="invalid_type",
        )
    return prompt


def _number(value: object, name: str, *, low: int, high: int) -> int | None:
    """A whole number in [low, high] (a JSON number too big for a float reads as inf, one
    too big for the job's int64 columns is out of range: both refused, never raised)."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))
    ):
        raise RequestRefused(
            f"{name!r} must be a whole number, got {value!r}.", param=name, code="invalid_type"
        )
    if not low <= value <= high:
        raise RequestRefused(
            f"{name!r} must lie in [{low}, {high}], got {value!r}.",
            param=name,
            code="invalid_value",
        )
    return int(value)


def _float(
    value: object, name: str, *, low: float, high: float, open_low: bool = False
) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestRefused(
            f"{name!r} must be a number, got {value!r}.", param=name, code="invalid_type"
        )
    if value < low or value > high or (open_low and value == low):
        bounds = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
        raise RequestRefused(
            f"{name!r} must lie in {bounds}, got {value!r}.", param=name, code="invalid_value"
        )
    return float(value)


def _stop(value: object) -> list[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or not 1 <= len(items) <= 4
        or not all(isinstance(s, str) and s for s in items)
    ):
        raise RequestRefused(
            "'stop' must be a non-empty string or an array of 1 to 4 of them.",
            param="stop",
            code="invalid_value",
        )
    return list(items)


def embedding_row(body: dict[str, Any]) -> dict[str, Any]:
    """An embeddings request's columns: its inputs (texts, or token ids: one of the two
    columns, the other null), its `dimensions` (null: the model's) and how its vectors are
    written (`encoding_format`)."""
    value = body.get("input")
    if value is None:
        raise RequestRefused(
            "Input parameter is required.", param="input", code="missing_required_parameter"
        )
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        texts = list(value)
    elif isinstance(value, list) and value and all(_token(v) for v in value):
        ids = [[int(v) for v in value]]
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(v, list) and v and all(_token(t) for t in v) for v in value)
    ):
        ids = [[int(t) for t in v] for v in value]
    else:
        raise RequestRefused(
            "'input' must be a string, an array of strings, an array of token ids or an "
            "array of arrays of token ids, none of them empty.",
            param="input",
            code="invalid_type",
        )
    count = len(texts if texts is not None else ids or [])
    if count > MAX_INPUTS:
        raise RequestRefused(
            f"'input' holds {count} inputs; the most one request may have is {MAX_INPUTS}.",
            param="input",
            code="invalid_value",
        )
    if texts is not None and not all(t.strip() for t in texts):
        raise RequestRefused(
            "'input' cannot hold an empty string.", param="input", code="invalid_value"
        )
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise RequestRefused(
            f"'encoding_format' must be 'float' or 'base64', got {fmt!r}.",
            param="encoding_format",
            code="invalid_value",
        )
    return {
        "input": texts,
        "input_ids": ids,
        "dimensions": _number(body.get("dimensions"), "dimensions", low=1, high=65536),
        "encoding_format": fmt,
    }


def _token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
