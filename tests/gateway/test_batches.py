"""The Batch API as its users run it: the official `openai` client, pointed at the gateway
on the embedded stack, uploads a file of chat requests, creates a batch, polls it to its end
and downloads its output and error files."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pyarrow.parquet as pq
import pytest

from ebb.client.stack import LocalStack

from ..llm_model import corpus
from .conftest import chat_line, client, create, jsonl, lines_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def requests(n: int) -> list[dict[str, Any]]:
    return [
        chat_line(f"q-{i}", prompt, max_tokens=2 + i % 7)
        for i, prompt in enumerate(corpus(n, seed=3))
    ]


async def test_a_batch_runs_every_request_once_with_the_model_s_own_answers(
    gateway_stack: LocalStack, reference: Any, tmp_path: Path
) -> None:
    oa = client(gateway_stack)
    good = requests(24)
    refused = [
        chat_line("too-long", " ".join(["stone"] * 400), max_tokens=8),
        {**chat_line("no-such-model", "hello"), "body": {"model": "gpt-9", "messages": []}},
        chat_line("two-choices", "hello", n=2),
        chat_line("streamed", "hello", stream=True),
    ]
    lines = good[:10] + refused + good[10:]
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("requests.jsonl", jsonl(lines)), purpose="batch"
    )
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    batch = await asyncio.to_thread(
        oa.batches.create,
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"purpose": "test"},
    )
    assert batch.status == "validating" and batch.metadata == {"purpose": "test"}
    done = await wait_for(oa, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (28, 24)
    assert done.request_counts.failed == 4
    assert done.completed_at is not None and done.in_progress_at is not None

    output = lines_of(oa, done.output_file_id)
    errors = lines_of(oa, done.error_file_id)
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # every request once
    assert {line["custom_id"] for line in errors} == {r["custom_id"] for r in refused}
    by_id = {line["custom_id"]: line for line in output}
    tokens = 0
    for request in good:
        line = by_id[request["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny-chat"
        text, count = reference(
            request["body"]["messages"][0]["content"], request["body"]["max_tokens"]
        )
        assert body["choices"][0]["message"] == {
            "role": "assistant",
            "content": text,
            "refusal": None,
        }
        assert body["usage"]["completion_tokens"] == count
        tokens += count
    assert done.usage is not None and done.usage.output_tokens == tokens
    # The same rows run as a job of their own, straight to the llm stage: the same answers.
    # The batch's own copy of its requests and its job's output went once its files were
    # written.
    assert not (tmp_path / "gateway" / "batches" / "alice" / batch.id).exists()
    direct = await direct_job(gateway_stack, tmp_path, batch.id, lines)
    assert direct == {
        r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in output
    }
    why = {line["custom_id"]: line["response"] for line in errors}
    assert why["too-long"]["status_code"] == 400
    assert why["too-long"]["body"]["error"]["code"] == "context_length_exceeded"
    assert why["no-such-model"]["status_code"] == 404
    assert why["no-such-model"]["body"]["error"]["code"] == "model_not_found"
    assert why["two-choices"]["body"]["error"]["param"] == "n"
    assert why["streamed"]["body"]["error"]["code"] == "streaming_unsupported"

    listed = await asyncio.to_thread(lambda: list(oa.batches.list()))
    assert [b.id for b in listed] == [batch.id]
    # The results are files of the owner's, listed and downloadable as any.
    files = {f.id: f for f in await asyncio.to_thread(lambda: list(oa.files.list()))}
    assert files[done.output_file_id].purpose == "batch_output"
    # A completed batch cannot be cancelled: the API's 409.
    with pytest.raises(openai.ConflictError, match="status 'completed'"):
        await asyncio.to_thread(oa.batches.cancel, batch.id)


async def direct_job(
    stack: LocalStack, tmp: Path, batch_id: str, lines: list[dict[str, Any]]
) -> dict[str, str]:
    """The batch's job input (its lines judged as the gateway judges them), run as an
    ordinary job submitted over NATS: its text by custom_id (the rows it answered)."""
    import pyarrow as pa

    from ebb.client.sdk import EbbClient
    from ebb.gateway.config import load_config
    from ebb.gateway.jobspec import batch_job, request_schema
    from ebb.gateway.requests import validate
    from ebb.gateway.store import split_lines

    catalogue = load_config(tmp / "gateway.yaml")
    rows: list[dict[str, Any]] = []
    validate(
        split_lines([jsonl(lines)], max_bytes=catalogue.max_line_bytes),
        batch_id=batch_id,
        endpoint="/v1/chat/completions",
        models=catalogue.models,
        max_requests=catalogue.max_requests,
        max_line_bytes=catalogue.max_line_bytes,
        accept=lambda row, _model: rows.append(row),
        reject=lambda _line: None,
    )
    schema = request_schema("/v1/chat/completions")
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp / "direct-requests.parquet")
    spec = batch_job(
        batch_id="direct-1",
        owner="alice",
        endpoint="/v1/chat/completions",
        model=catalogue.models["tiny-chat"],
        window=catalogue.windows["24h"],
        input_uri=str(tmp / "direct-requests.parquet"),
        output_uri=str(tmp / "direct"),
    )
    async with await EbbClient.connect(stack.nats_config) as ebb:
        final = await ebb.wait(await ebb.submit(spec))
    assert final.state == "SUCCEEDED", final.reason
    manifest = json.loads((tmp / "direct" / "_manifest.json").read_text())
    rows = [
        row
        for f in manifest["files"]
        for row in pq.read_table(tmp / "direct" / f["path"]).to_pylist()
    ]
    return {r["custom_id"]: r["text"] for r in rows if r["_error"] is None}


async def test_a_malformed_file_fails_its_batch_naming_every_bad_line(
    gateway_stack: LocalStack,
) -> None:
    oa = client(gateway_stack)
    good = requests(3)
    text = (
        jsonl(good[:1]).decode()
        + "this is not json\n"
        + jsonl([{**good[1], "url": "/v1/embeddings"}]).decode()
        + jsonl([{**good[2], "custom_id": "q-0"}]).decode()
        + '{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}\n'
    )
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("bad.jsonl", text.encode()), purpose="batch"
    )
    batch = await asyncio.to_thread(create, oa, uploaded.id)
    failed = await wait_for(oa, batch.id)
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.errors is not None and failed.errors.data is not None
    found = [(e.line, e.code, e.param) for e in failed.errors.data]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "invalid_url", "url"),
        (4, "duplicate_custom_id", "custom_id"),
        (5, "missing_required_parameter", "body"),
    ]
    assert failed.output_file_id is None and failed.error_file_id is None
    # No job ran for it: the master never heard of it.
    status = await gateway_stack_client_status(gateway_stack)
    assert batch.id not in status


async def gateway_stack_client_status(stack: LocalStack) -> set[str]:
    from ebb.client.sdk import EbbClient

    async with await EbbClient.connect(stack.nats_config) as ebb:
        return {job.id for job in (await ebb.status()).jobs}


async def test_refusals_have_the_api_s_shapes_and_change_nothing(
    gateway_stack: LocalStack, tmp_path: Path
) -> None:
    alice, bob = client(gateway_stack, "alice"), client(gateway_stack, "bob")
    mine = await asyncio.to_thread(
        alice.files.create, file=("in.jsonl", jsonl(requests(2))), purpose="batch"
    )
    # Another key's file is no file at all to bob: not listed, not readable, not usable.
    with pytest.raises(openai.NotFoundError) as found:
        await asyncio.to_thread(bob.files.retrieve, mine.id)
    assert found.value.status_code == 404 and mine.id in str(found.value.message)
    with pytest.raises(openai.NotFoundError):
        await asyncio.to_thread(bob.files.content, mine.id)
    with pytest.raises(openai.NotFoundError) as found:
        await asyncio.to_thread(create, bob, mine.id)
    assert found.value.param == "input_file_id"
    assert await asyncio.to_thread(lambda: list(bob.files.list())) == []
    assert await asyncio.to_thread(lambda: list(bob.batches.list())) == []
    # An endpoint or window this gateway does not serve.
    with pytest.raises(openai.BadRequestError) as bad:
        await asyncio.to_thread(
            alice.batches.create,
            input_file_id=mine.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
    assert bad.value.param == "endpoint" and bad.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as bad:
        await asyncio.to_thread(
            alice.batches.create,
            input_file_id=mine.id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    assert bad.value.param == "completion_window"
    # A file too big is refused as it streams in, and nothing of it is kept.
    from .conftest import MAX_FILE_BYTES

    with pytest.raises(openai.APIStatusError) as big:
        await asyncio.to_thread(
            alice.files.create,
            file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)),
            purpose="batch",
        )
    assert big.value.status_code == 413 and big.value.code == "file_too_large"
    kept = sorted(p.name for p in (tmp_path / "gateway" / "files" / "alice").iterdir())
    assert kept == [mine.id]
    # A purpose other than batch.
    with pytest.raises(openai.BadRequestError) as bad:
        await asyncio.to_thread(
            alice.files.create, file=("in.jsonl", jsonl(requests(1))), purpose="fine-tune"
        )
    assert bad.value.param == "purpose"
    assert [f.id for f in await asyncio.to_thread(lambda: list(alice.files.list()))] == [mine.id]
    # No key, or a wrong one.
    assert gateway_stack.gateway_url is not None
    stranger = openai.OpenAI(base_url=gateway_stack.gateway_url, api_key="sk-nobody")
    with stranger, pytest.raises(openai.AuthenticationError):
        await asyncio.to_thread(lambda: list(stranger.files.list()))
    # Deleting a file: gone for its owner, its bytes too.
    deleted = await asyncio.to_thread(alice.files.delete, mine.id)
    assert deleted.deleted and deleted.id == mine.id
    with pytest.raises(openai.NotFoundError):
        await asyncio.to_thread(alice.files.retrieve, mine.id)
    assert list((tmp_path / "gateway" / "files" / "alice").iterdir()) == []


async def test_a_key_s_quotas_refuse_what_is_past_them(gateway_stack: LocalStack) -> None:
    from .conftest import BOB_STORES

    bob = client(gateway_stack, "bob")
    data = jsonl(requests(30))
    assert len(data) < BOB_STORES
    first = await asyncio.to_thread(bob.files.create, file=("a.jsonl", data), purpose="batch")
    running = await asyncio.to_thread(create, bob, first.id)
    # One batch at a time for bob: a second waits for the first to end.
    with pytest.raises(openai.RateLimitError) as refused:
        await asyncio.to_thread(create, bob, first.id)
    assert refused.value.code == "quota_exceeded"
    assert [b.id for b in await asyncio.to_thread(lambda: list(bob.batches.list()))] == [running.id]
    # Bytes kept: an upload past what is left is refused as it streams in.
    left = BOB_STORES - len(data)
    with pytest.raises(openai.APIStatusError) as big:
        await asyncio.to_thread(
            bob.files.create, file=("b.jsonl", b"x" * (left + 1)), purpose="batch"
        )
    assert big.value.status_code == 413 and str(left) in big.value.message
    await asyncio.to_thread(bob.batches.cancel, running.id)
    await wait_for(bob, running.id)
    again = await asyncio.to_thread(create, bob, first.id)
    assert again.status == "validating"


async def test_a_key_s_quotas_hold_when_asked_at_once(gateway_stack: LocalStack) -> None:
    """Twenty creates at once against a quota of one batch make one batch; uploads at once
    share the bytes left, never each all of them (the quotas are reserved, then used)."""
    from .conftest import BOB_STORES, KEYS

    assert gateway_stack.gateway_url is not None
    url = gateway_stack.gateway_url
    bob = client(gateway_stack, "bob")
    data = jsonl(requests(30))
    first = await asyncio.to_thread(bob.files.create, file=("a.jsonl", data), purpose="batch")
    body = {
        "input_file_id": first.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    headers = {"Authorization": f"Bearer {KEYS['bob']}"}
    async with aiohttp.ClientSession(headers=headers) as http:

        async def create_one() -> int:
            async with http.post(f"{url}/batches", json=body) as answer:
                return answer.status

        statuses = await asyncio.gather(*(create_one() for _ in range(20)))
        assert sorted(statuses) == [200] + [429] * 19
        listed = await asyncio.to_thread(lambda: list(bob.batches.list()))
        assert len(listed) == 1

        left = BOB_STORES - len(data)
        size = left // 3 + 1  # two fit in what is left, three do not

        async def upload_one(i: int) -> int:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", b"x" * size, filename=f"{i}.jsonl")
            async with http.post(f"{url}/files", data=form) as answer:
                return answer.status

        statuses = await asyncio.gather(*(upload_one(i) for i in range(8)))
    assert statuses.count(200) in (1, 2), statuses
    assert set(statuses) <= {200, 413, 429}, statuses
    stored = await asyncio.to_thread(lambda: list(bob.files.list()))
    assert sum(f.bytes for f in stored) <= BOB_STORES
    assert len(stored) == 1 + statuses.count(200)
