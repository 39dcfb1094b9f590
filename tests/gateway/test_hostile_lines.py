"""A batch file written to hurt: every line the gateway reads is judged (a row, an error
line, or a problem of the file naming it), none raises, and no line is held whole past
`max_line_bytes` (ebb.gateway.requests and ebb.gateway.store, pure)."""

from __future__ import annotations

import gzip
import itertools
import json
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from ebb.gateway.requests import default_seed
from ebb.gateway.store import Oversize, split_lines

from .test_requests import judged, line


@pytest.mark.parametrize(
    ("raw", "code", "why"),
    [
        (
            b'{"custom_id": "a", "method": "POST", "body": {"max_tokens": NaN}}',
            "invalid_json_line",
            "NaN",
        ),
        (b'{"custom_id": Infinity}', "invalid_json_line", "Infinity"),
        (b'{"custom_id": -Infinity}', "invalid_json_line", "-Infinity"),
        (b"[" * 200_000 + b"]" * 200_000, "invalid_json_line", "nested too deeply"),
        (b"\xff\xfe\x00binary", "invalid_json_line", ""),
        (gzip.compress(b'{"custom_id": "a"}'), "invalid_json_line", ""),
        (
            b'{"custom_id": "\\ud800", "method": "POST", '
            b'"url": "/v1/chat/completions", "body": {}}',
            "invalid_value",
            "surrogate",
        ),
        (b'{"custom_id": 1' + b"9" * 5000 + b"}", "invalid_json_line", ""),
    ],
)
def test_a_line_no_parser_should_take_is_a_problem_of_the_file(
    raw: bytes, code: str, why: str
) -> None:
    found, _, errors = judged([line("ok"), raw], max_line_bytes=1 << 20)
    assert errors == []
    assert [(p.line, p.code) for p in found.problems] == [(2, code)], found.problems
    assert why in found.problems[0].message


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"max_tokens": 1e999}, "max_tokens", "invalid_type"),
        ({"max_tokens": -1e999}, "max_tokens", "invalid_type"),
        ({"max_tokens": 2**70}, "max_tokens", "invalid_value"),
        ({"max_tokens": 4.5}, "max_tokens", "invalid_type"),
        ({"seed": 2**70}, "seed", "invalid_value"),
        ({"seed": 2**63}, "seed", "invalid_value"),
        ({"seed": 1e300}, "seed", "invalid_value"),
        ({"temperature": 1e999}, "temperature", "invalid_type"),
        ({"top_p": -1e999}, "top_p", "invalid_type"),
        ({"n": 1e999}, "n", "unsupported_value"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, None, "invalid_value"),
        ({"messages": [{"role": "\udfff", "content": "hi"}]}, None, "invalid_value"),
        ({"stop": ["\ud83d"]}, None, "invalid_value"),
        ({"messages": [[[[[]]]]]}, "messages[0]", "invalid_type"),
    ],
)
def test_a_request_out_of_range_is_an_error_line_and_the_rest_run(
    body: dict[str, Any], param: str | None, code: str
) -> None:
    # As a file holds them: numbers too big for a float as JSON writes them (1e999).
    raw = json.dumps(line("bad", **body)).replace("Infinity", "1e999").encode()
    found, rows, errors = judged([line("ok"), raw])
    assert [r["custom_id"] for r in rows] == ["ok"] and found.problem_count == 0
    (error,) = errors
    assert error["custom_id"] == "bad"
    assert error["response"]["status_code"] == 400
    envelope = error["response"]["body"]["error"]
    assert (envelope["param"], envelope["code"]) == (param, code)
    json.dumps(error, ensure_ascii=False).encode()  # the error line itself is writable


def test_the_largest_values_a_request_may_give_are_taken() -> None:
    found, rows, errors = judged(
        [line("a", seed=2**63 - 1, max_tokens=2**63 - 1), line("b", seed=0.0, max_tokens=1.0)]
    )
    assert errors == [] and found.problem_count == 0
    assert [(r["seed"], r["max_tokens"]) for r in rows] == [(2**63 - 1, 2**63 - 1), (0, 1)]


def test_a_pair_of_surrogates_is_a_character_and_is_taken() -> None:
    raw = (
        b'{"custom_id": "\\ud83d\\ude00", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}}'
    )
    found, rows, errors = judged([raw])
    assert errors == [] and found.problem_count == 0
    assert rows[0]["custom_id"] == "\U0001f600"


def test_a_line_past_the_limit_is_never_parsed_and_names_its_size() -> None:
    big = line("big", messages=[{"role": "user", "content": "x" * 50_000}])
    found, _, _ = judged([line("a"), big, line("b")], max_line_bytes=4096)
    size = len(json.dumps(big))
    assert [(p.line, p.code) for p in found.problems] == [(2, "request_too_large")]
    assert f"{size} bytes" in found.problems[0].message and found.total == 3


def test_the_last_line_needs_no_newline() -> None:
    raw = json.dumps(line("last")).encode()
    assert list(split_lines([raw[:7], raw[7:]], max_bytes=len(raw))) == [raw]
    assert list(split_lines([raw], max_bytes=len(raw) - 1)) == [Oversize(len(raw))]


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=8),
    limit=st.integers(min_value=0, max_value=30),
    last_newline=st.booleans(),
)
def test_lines_split_from_any_pieces_are_the_file_s_and_none_past_the_limit_is_held(
    lines: list[bytes], cuts: list[int], limit: int, last_newline: bool
) -> None:
    raw = b"\n".join(lines) + (b"\n" if last_newline and lines else b"")
    bounds = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    pieces = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    got = list(split_lines(pieces, max_bytes=limit))
    expected: list[bytes | Oversize] = []
    for i, text in enumerate(lines):
        ends = i < len(lines) - 1 or last_newline
        if i == len(lines) - 1 and not ends and not text:
            continue  # an empty last line without its newline is no line
        expected.append(Oversize(len(text)) if len(text) > limit else text + b"\n" * ends)
    assert got == expected


def test_requests_without_a_seed_each_get_their_own_the_same_on_every_pass() -> None:
    same = [line(f"k{i}") for i in range(8)]  # pass@k: one prompt, eight samples
    _, rows, _ = judged(same)
    seeds = [r["seed"] for r in rows]
    assert len(set(seeds)) == 8
    assert seeds == [default_seed("batch_1", f"k{i}") for i in range(8)]
    assert [r["seed"] for r in judged(same)[1]] == seeds
    assert all(0 <= s < 2**63 for s in seeds)
    _, given_seed, _ = judged([line("a", seed=5), line("b", seed=5)])
    assert [r["seed"] for r in given_seed] == [5, 5]  # a seed asked for is kept
