"""A hostile client of the Batch API, and what the gateway must answer it: shared by the
suite's slice (test_campaign.py) and the benchmark's campaign (bench/hostile.py).

- `batch_file`: a file of requests mixing good ones with lines meant to hurt: requests out
  of range (each must come back as its own error line, the others run) or, in some files,
  lines no parser should take (the batch must fail at validation, naming them).
- `http_probes`: raw HTTP requests no client library would send (bodies that are not JSON,
  not UTF-8 or nested past any parser, wrong content types, oversize fields, ids of another
  owner): each must be answered with the API's error shape, never a 5xx.
- `check_batch`: every request of a batch that ran is in its output or error file exactly
  once, each refusal with the API's error envelope."""

from __future__ import annotations

import gzip
import io
import json
import random
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

CHAT = "/v1/chat/completions"
MODEL = "tiny-chat"


@dataclass
class FuzzFile:
    payload: bytes
    custom_ids: list[str] = field(default_factory=list)
    """Every request of the file (when it runs: each in the output or error file once)."""
    refused: dict[str, str] = field(default_factory=dict)
    """custom_id -> why: requests that must be error lines (4xx) whatever the model does."""
    fails: bool = False
    """The file holds a line no parser should take: the batch must fail at validation."""


def good(custom_id: str, rng: random.Random) -> dict[str, Any]:
    words = " ".join(rng.choice(["stone", "river", "cloud", "ember", "moss"]) for _ in range(6))
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": words}],
            "max_tokens": rng.randint(1, 4),
        },
    }


def _with(line: dict[str, Any], **body: Any) -> dict[str, Any]:
    return {**line, "body": {**line["body"], **body}}


REFUSALS: dict[str, Any] = {
    # kind: (body changes, raw replacements made in the line's JSON text)
    "max_tokens 1e999": ({"max_tokens": "HUGE"}, {'"HUGE"': "1e999"}),
    "seed 2**70": ({"seed": 2**70}, {}),
    "seed -1e999": ({"seed": "HUGE"}, {'"HUGE"': "-1e999"}),
    "temperature 1e308": ({"temperature": 1e308}, {}),
    "top_p 0": ({"top_p": 0}, {}),
    "n 2": ({"n": 2}, {}),
    "lone surrogate in content": ({"messages": [{"role": "user", "content": "\ud800"}]}, {}),
    "lone surrogate in stop": ({"stop": ["\udfff"]}, {}),
    "no such model": ({"model": "gpt-9"}, {}),
    "tools": ({"tools": [{"type": "function"}]}, {}),
    "stream": ({"stream": True}, {}),
    "messages nested": ({"messages": [[[[[[]]]]]]}, {}),
    "max_tokens 2.5": ({"max_tokens": 2.5}, {}),
}


def _unparseable(rng: random.Random, max_line_bytes: int) -> bytes:
    kind = rng.choice(["nan", "infinity", "deep", "huge", "binary", "gzip", "surrogate id"])
    if kind == "nan":
        return b'{"custom_id": "nan", "method": "POST", "body": {"max_tokens": NaN}}'
    if kind == "infinity":
        return b'{"custom_id": Infinity}'
    if kind == "deep":
        depth = rng.choice([2_000, 50_000, 200_000])
        return b"[" * depth + b"]" * depth
    if kind == "huge":
        return b'{"custom_id": "huge", "pad": "' + b"x" * (max_line_bytes + 10) + b'"}'
    if kind == "gzip":
        return gzip.compress(b'{"custom_id": "gz"}').replace(b"\n", b"")
    if kind == "surrogate id":
        return b'{"custom_id": "\\ud800", "method": "POST", "url": "' + CHAT.encode() + b'"}'
    return bytes(rng.randrange(128, 256) for _ in range(rng.randint(1, 300)))


def batch_file(
    rng: random.Random, *, n: int, tag: str, fails: bool, max_line_bytes: int
) -> FuzzFile:
    """`n` requests, about a third of them refusals; `fails`: one to three lines no
    parser should take among them. The last line ends without a newline half the time."""
    out = FuzzFile(payload=b"", fails=fails)
    lines: list[bytes] = []
    for i in range(n):
        custom_id = f"{tag}-{i:05d}"
        line = good(custom_id, rng)
        raw_changes: dict[str, str] = {}
        if rng.random() < 0.33:
            kind = rng.choice(list(REFUSALS))
            changes, raw_changes = REFUSALS[kind]
            line = _with(line, **changes)
            out.refused[custom_id] = kind
        text = json.dumps(line)
        for old, new in raw_changes.items():
            text = text.replace(old, new)
        lines.append(text.encode())
        out.custom_ids.append(custom_id)
    if fails:
        for _ in range(rng.randint(1, 3)):
            lines.insert(rng.randrange(len(lines) + 1), _unparseable(rng, max_line_bytes))
    out.payload = b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")
    return out


def check_batch(
    batch: Any, fuzz: FuzzFile, output: list[dict[str, Any]], errors: list[dict[str, Any]]
) -> None:
    """What a batch that ended must show of its file (raises AssertionError)."""
    if fuzz.fails:
        assert batch.status == "failed", (batch.id, batch.status)
        assert batch.errors is not None and batch.errors.data, batch.id
        assert output == [] and errors == []
        return
    assert batch.status in ("completed", "cancelled"), (batch.id, batch.status, batch.errors)
    ids = sorted(line["custom_id"] for line in output + errors)
    assert ids == sorted(fuzz.custom_ids), f"{batch.id}: not every request exactly once"
    assert batch.request_counts.total == len(fuzz.custom_ids)
    assert batch.request_counts.completed == len(output)
    assert batch.request_counts.failed == len(errors)
    refused = {line["custom_id"]: line for line in errors if line["custom_id"] in fuzz.refused}
    assert set(refused) == set(fuzz.refused), f"{batch.id}: a refusal ran"
    for line in refused.values():
        response = line["response"]
        assert 400 <= response["status_code"] < 500, line
        assert_error_shape(response["body"])
    for line in output:
        assert line["response"]["status_code"] == 200 and line["error"] is None


def assert_error_shape(body: Any) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] in ("invalid_request_error", "server_error"), error


@dataclass(frozen=True)
class Probe:
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    owner: str | None = "alice"
    """Whose key it is sent with (None: none, or one of `headers`)."""
    expect: int | None = None
    """The status it must get, where only one is right (another owner's id: 404)."""
    api_shape: bool = True
    """Answered by the API (its error envelope), not by the HTTP parser before it (a request
    line or header past its limits: a plain 4xx)."""


def http_probes(rng: random.Random, *, others: dict[str, str], n: int) -> list[Probe]:
    """`n` requests no client should send. `others`: ids of another owner's file and
    batch ({"file": ..., "batch": ...}), asked for with alice's key."""
    json_type = {"Content-Type": "application/json"}
    fixed = [
        Probe("POST", "/v1/batches", b"", json_type),
        Probe("POST", "/v1/batches", b"\xff\xfe\x00", json_type),
        Probe("POST", "/v1/batches", b"[" * 100_000, json_type, expect=400),
        Probe("POST", "/v1/batches", b'{"input_file_id": NaN}', json_type, expect=400),
        Probe("POST", "/v1/batches", b'{"input_file_id": "\\ud800"}', json_type),
        Probe("POST", "/v1/batches", b'{"endpoint": 1e999}', json_type),
        Probe(
            "POST",
            "/v1/batches",
            gzip.compress(b'{"input_file_id": "x"}'),
            {**json_type, "Content-Encoding": "gzip"},
        ),
        Probe("POST", "/v1/batches", b'{"input_file_id": "x"}', {"Content-Type": "text/plain"}),
        Probe("POST", "/v1/batches", b"x" * (2 * 1024 * 1024), json_type, expect=413),
        Probe(
            "POST",
            "/v1/batches",
            json.dumps(
                {
                    "input_file_id": others["file"],
                    "endpoint": CHAT,
                    "completion_window": "24h",
                    "metadata": {"k" * 10: "\ud800"},
                }
            ).encode(),
            json_type,
        ),
        Probe("POST", "/v1/files", b'{"purpose": "batch"}', json_type),
        Probe("POST", "/v1/files", b"--x\r\n\r\n", {"Content-Type": "multipart/form-data"}),
        Probe("POST", "/v1/files", b"garbage", {"Content-Type": "multipart/form-data; boundary=b"}),
        Probe(
            "POST",
            "/v1/files",
            b"--bnd\r\nContent-Disposition\r\n\r\nx\r\n--bnd--\r\n",  # a part's header cut
            {"Content-Type": "multipart/form-data; boundary=bnd"},
            expect=400,
        ),
        Probe(
            "POST",
            "/v1/files",
            _multipart({"purpose": "b" * 100_000}),
            {"Content-Type": "multipart/form-data; boundary=bnd"},
        ),
        Probe(
            "POST",
            "/v1/files",
            _multipart({"purpose": "batch"}),
            {"Content-Type": "multipart/form-data; boundary=bnd"},
        ),
        Probe(
            "POST",
            "/v1/files",
            _multipart({"purpose": "\udc80batch"}, raw=True),
            {"Content-Type": "multipart/form-data; boundary=bnd"},
        ),
        Probe("GET", f"/v1/files/{others['file']}", expect=404),
        Probe("GET", f"/v1/files/{others['file']}/content", expect=404),
        Probe("DELETE", f"/v1/files/{others['file']}", expect=404),
        Probe("GET", f"/v1/batches/{others['batch']}", expect=404),
        Probe("POST", f"/v1/batches/{others['batch']}/cancel", expect=404),
        Probe("GET", "/v1/files?limit=1e999"),
        Probe("GET", "/v1/files?limit=-1"),
        Probe("GET", "/v1/batches?order=sideways"),
        Probe("GET", "/v1/batches?after=%00%ff"),
        Probe("GET", "/v1/files/%ff%fe%00"),
        Probe("GET", "/v1/files/" + "f" * 4_000),
        Probe("GET", "/v1/files/" + "f" * 10_000, api_shape=False),
        Probe("GET", "/v1/files", headers={"X-Pad": "p" * 10_000}, api_shape=False),
        Probe("GET", "/v1/nothing-here"),
        Probe("PUT", "/v1/batches"),
        Probe("GET", "/v1/files", owner=None, expect=401),
        Probe("GET", "/v1/files", owner=None, headers={"Authorization": "Bearer " + "k" * 7000}),
        Probe("GET", "/v1/files", owner=None, headers={"Authorization": "Bearer sk-alice-é"}),
        Probe("GET", "/v1/files", owner=None, headers={"Authorization": "Basic abc"}, expect=401),
    ]
    probes = list(fixed)
    while len(probes) < n:
        probe = rng.choice(fixed)
        if probe.body is not None and rng.random() < 0.5:
            cut = rng.randrange(len(probe.body) + 1)  # a body cut short
            probe = replace(probe, body=probe.body[:cut], expect=None)
        probes.append(probe)
    rng.shuffle(probes)
    return probes


def _multipart(fields: dict[str, str], *, raw: bool = False) -> bytes:
    parts = []
    for name, value in fields.items():
        data = value.encode("utf-8", "surrogateescape") if raw else value.encode()
        parts.append(
            b'--bnd\r\nContent-Disposition: form-data; name="'
            + name.encode()
            + b'"\r\n\r\n'
            + data
            + b"\r\n"
        )
    return b"".join(parts) + b"--bnd--\r\n"


async def send(
    http: aiohttp.ClientSession, base: str, probe: Probe, keys: dict[str, str]
) -> tuple[int, Any]:
    """One probe: its status and its body (parsed, when JSON)."""
    headers = dict(probe.headers)
    if probe.owner is not None:
        headers["Authorization"] = f"Bearer {keys[probe.owner]}"
    async with http.request(
        probe.method,
        base + probe.path.removeprefix("/v1"),
        data=None if probe.body is None else io.BytesIO(probe.body),
        headers=headers,
        skip_auto_headers=["Content-Type"] if "Content-Type" in headers else (),
    ) as answer:
        raw = await answer.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw
        return answer.status, body
