"""A batch's input file, line by line: checked, and turned into the rows of its job.

Two kinds of trouble, as the API has them:
- the file's own (a line that is not a JSON object or not one a parser should take, a line
  past `max_line_bytes`, a missing `custom_id`, `method`, `url` or `body`, a `url` other
  than the batch's endpoint, a `custom_id` used twice, too many lines): the batch fails at
  validation, its `errors` naming every such line (1-based);
- a request's (its body, ebb.gateway.bodies: no such model in the catalogue, a parameter
  out of range or not supported): a line of the error file, the API's error in its
  `response.body`; the other requests run.

Streamed: a line is read, judged and written out before the next (the custom_ids are kept
as digests, to find one used twice). Pure: no NATS, no store; the sinks are the caller's."""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .bodies import SEED_LIMIT, RequestRefused, model_of, row_of
from .records import BatchError
from .store import Oversize

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
"""What a batch may ask for here: the generative endpoints an llm stage answers, and the
embeddings a SentenceEncoder stage computes."""

MAX_REPORTED = 100
"""Lines named in a failed batch's errors at most (the count says how many there were)."""


@dataclass
class Validation:
    """What one pass over the file found."""

    total: int = 0
    """Requests (non-blank lines)."""
    accepted: int = 0
    """Rows written for the job."""
    rejected: int = 0
    """Error lines written (refused requests)."""
    model: str | None = None
    """The catalogue model the batch runs (its first accepted request's)."""
    problems: list[BatchError] = field(default_factory=list)
    """The file's own problems, the first MAX_REPORTED."""
    problem_count: int = 0

    def problem(self, error: BatchError) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_REPORTED:
            self.problems.append(error)


def request_ids(batch_id: str, custom_id: str) -> tuple[str, str]:
    """The output line's `id` and its response's `request_id`: the same on every pass."""
    digest = hashlib.blake2b(f"{batch_id}\0{custom_id}".encode(), digest_size=12).hexdigest()
    return f"batch_req_{digest}", f"req_{digest}"


def default_seed(batch_id: str, custom_id: str) -> int:
    """The seed of a request that gives none: its own, from its batch and custom_id, so
    that N requests of one prompt sample N answers (pass@k, self-consistency) as the API's
    do, and a request retried, split or resumed samples the same one."""
    digest = hashlib.blake2b(f"{batch_id}\0{custom_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


def error_line(
    batch_id: str,
    custom_id: str,
    *,
    status: int,
    message: str,
    param: str | None,
    code: str | None,
    kind: str = "invalid_request_error",
) -> dict[str, Any]:
    """An error-file line for a request that was answered with an HTTP error, as the API
    writes it: the error envelope in `response.body`, `error` null. `kind`: the envelope's
    `type` (`server_error` with a 500: the fault was not the request's)."""
    line_id, request_id = request_ids(batch_id, custom_id)
    body = {
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code,
        }
    }
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def validate(
    lines: Iterable[bytes | Oversize],
    *,
    batch_id: str,
    endpoint: str,
    models: Mapping[str, object],
    max_requests: int,
    max_line_bytes: int,
    accept: Callable[[dict[str, Any], str], None],
    reject: Callable[[dict[str, Any]], None],
) -> Validation:
    """Judge every line: `accept` gets each job row (and the model it runs), `reject` each
    error line. The file's
    own problems are in the result (the batch fails if there are any: the caller then drops
    what the sinks got). `lines` are as `FileStore.read_bounded_lines` gives them: a line
    longer than `max_line_bytes` comes as its `Oversize`, never parsed."""
    v = Validation()
    ids = _CustomIds()
    for number, raw in enumerate(lines, start=1):
        if isinstance(raw, Oversize):
            v.total += 1
            v.problem(
                BatchError(
                    code="request_too_large",
                    message=f"This line is {raw.bytes} bytes; the most a request may have is "
                    f"{max_line_bytes}.",
                    line=number,
                )
            )
            continue
        if not raw.strip():
            continue
        v.total += 1
        if v.total == max_requests + 1:
            v.problem(
                BatchError(
                    code="too_many_requests",
                    message=f"The file holds more than the {max_requests} requests a batch "
                    "may have.",
                    line=number,
                )
            )
        item = _line(raw, number, endpoint, v)
        if item is None:
            continue
        custom_id, body = item
        ids.add(custom_id, number)
        if v.problem_count:
            continue  # the batch fails: only the file's own problems matter now
        try:
            if SURROGATE_ESCAPE.search(raw) and not _is_unicode(
                json.dumps(body, ensure_ascii=False)
            ):
                raise RequestRefused(  # noqa: TRY301 - an error line, as the body's refusals
                    "The request holds text that is not valid Unicode (a lone surrogate).",
                    param=None,
                    code="invalid_value",
                )
            model = model_of(body, models, v.model, endpoint)
            row = row_of(body, endpoint)
            if row.get("dimensions") is not None:
                allowed = getattr(models[model], "dimensions", False)
                if not allowed:
                    raise RequestRefused(  # noqa: TRY301 - an error line, as the body's refusals
                        f"The model {model!r} does not support 'dimensions'.",
                        param="dimensions",
                        code="unsupported_parameter",
                    )
            if "seed" in row and row["seed"] is None:
                row["seed"] = default_seed(batch_id, custom_id)
        except RequestRefused as e:
            reject(
                error_line(
                    batch_id,
                    custom_id,
                    status=e.status,
                    message=e.message,
                    param=e.param,
                    code=e.code,
                )
            )
            v.rejected += 1
            continue
        v.model = model
        accept({"custom_id": custom_id, "line": number, **row}, model)
        v.accepted += 1
    duplicated = [
        BatchError(
            code="duplicate_custom_id",
            message=f"This request's custom_id is used more than once (first on line "
            f"{first}); each request needs its own.",
            param="custom_id",
            line=line,
        )
        for line, first in ids.duplicates()
    ]
    v.problem_count += len(duplicated)
    v.problems = sorted([*v.problems, *duplicated], key=lambda p: p.line or 0)[:MAX_REPORTED]
    if v.total == 0:
        v.problem(BatchError(code="empty_file", message="The file holds no requests."))
    return v


class _CustomIds:
    """The custom_ids seen, as 16-byte digests with their lines in flat arrays (20 bytes a
    request, not a Python object each): a file of a million requests is checked in 20 MB.
    Duplicates are found at the end, by sorting (a file with any fails whole anyway)."""

    def __init__(self) -> None:
        self.high, self.low = array("Q"), array("Q")
        self.lines = array("L")

    def add(self, custom_id: str, line: int) -> None:
        digest = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()
        self.high.append(int.from_bytes(digest[:8], "little"))
        self.low.append(int.from_bytes(digest[8:], "little"))
        self.lines.append(line)

    def duplicates(self) -> list[tuple[int, int]]:
        """(line, the first line with its id, the id) of every request whose custom_id an
        earlier line used, by line."""
        if not self.lines:
            return []
        high = np.frombuffer(self.high, dtype=np.uint64)
        low = np.frombuffer(self.low, dtype=np.uint64)
        lines = np.frombuffer(
            self.lines, dtype=np.uint32 if self.lines.itemsize == 4 else np.uint64
        )
        order = np.lexsort((lines, low, high))
        same = (high[order][1:] == high[order][:-1]) & (low[order][1:] == low[order][:-1])
        found: list[tuple[int, int]] = []
        first = int(lines[order[0]])
        for k in range(1, len(order)):
            if same[k - 1]:
                found.append((int(lines[order[k]]), first))
            else:
                first = int(lines[order[k]])
        return sorted(found)


def _line(
    raw: bytes, number: int, endpoint: str, v: Validation
) -> tuple[str, dict[str, Any]] | None:
    """The line's custom_id and body, or None (its problem recorded)."""
    try:
        item = json.loads(raw, parse_constant=_not_json)
    except ValueError as e:
        # Not UTF-8, not JSON, or NaN/Infinity (Python's json writes them; no other parser
        # takes them): the line as a whole cannot be read.
        why = f" ({e})" if isinstance(e, NotJson) else ""
        v.problem(
            BatchError(
                code="invalid_json_line",
                message=f"This line is not parseable as valid JSON{why}.",
                line=number,
            )
        )
        return None
    except RecursionError:
        v.problem(
            BatchError(
                code="invalid_json_line",
                message="This line is not parseable: its JSON is nested too deeply.",
                line=number,
            )
        )
        return None
    if not isinstance(item, dict):
        v.problem(
            BatchError(
                code="invalid_json_line",
                message="This line is not a JSON object.",
                line=number,
            )
        )
        return None
    for name in ("custom_id", "method", "url", "body"):
        if name not in item:
            v.problem(
                BatchError(
                    code="missing_required_parameter",
                    message=f"Missing required parameter: {name!r}.",
                    param=name,
                    line=number,
                )
            )
            return None
    custom_id, method, url, body = item["custom_id"], item["method"], item["url"], item["body"]
    if not isinstance(custom_id, str) or not custom_id:
        v.problem(_invalid("custom_id", "a non-empty string", custom_id, number))
        return None
    if not _is_unicode(custom_id):
        v.problem(
            BatchError(
                code="invalid_value",
                message="The custom_id is not valid Unicode text (it holds a lone surrogate).",
                param="custom_id",
                line=number,
            )
        )
        return None
    if method != "POST":
        v.problem(
            BatchError(
                code="invalid_value",
                message=f"Invalid value: {method!r}. Supported values are: 'POST'.",
                param="method",
                line=number,
            )
        )
        return None
    if url != endpoint:
        v.problem(
            BatchError(
                code="invalid_url",
                message=f"The URL provided for this request ({url!r}) does not match the "
                f"batch endpoint ({endpoint!r}).",
                param="url",
                line=number,
            )
        )
        return None
    if not isinstance(body, dict):
        v.problem(_invalid("body", "an object", body, number))
        return None
    return custom_id, body


def _invalid(param: str, expected: str, value: object, line: int) -> BatchError:
    return BatchError(
        code="invalid_type",
        message=f"Invalid type for {param!r}: expected {expected}, but got "
        f"{_json_type(value)} instead.",
        param=param,
        line=line,
    )


class NotJson(ValueError):
    """A token Python's json reads that JSON has not."""


def _not_json(token: str) -> Any:
    raise NotJson(f"{token} is not a JSON number")


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
"""How a lone surrogate gets into a parsed line (raw bytes that are not UTF-8 do not parse):
only a line holding such an escape is searched for one."""


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
