"""What one batch does to the gateway stays that batch's: a step that raises (the store lost
its file, a record no version of the gateway wrote) fails that batch with the reason, and
every other batch, and the API, go on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ebb.client.stack import LocalStack
from ebb.common.messaging import bus
from ebb.common.messaging.subjects import Subjects

from .conftest import chat_line, client, create, jsonl, lines_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_a_batch_whose_step_keeps_failing_fails_alone_and_the_gateway_serves_on(
    gateway_stack: LocalStack, tmp_path: Path
) -> None:
    oa = client(gateway_stack)
    lines = [chat_line(f"r{i}", f"question {i}", max_tokens=4) for i in range(3)]
    broken, sound = [
        await asyncio.to_thread(oa.files.create, file=("in.jsonl", jsonl(lines)), purpose="batch")
        for _ in range(2)
    ]
    # The store turns on the gateway: where the file's bytes were is now a folder (reading
    # it raises IsADirectoryError, an OSError no step expects).
    path = tmp_path / "gateway" / "files" / "alice" / broken.id
    path.unlink()
    path.mkdir()
    failing = await asyncio.to_thread(create, oa, broken.id)
    running = await asyncio.to_thread(create, oa, sound.id)

    failed = await wait_for(oa, failing.id)
    assert failed.status == "failed", failed
    assert failed.errors is not None and failed.errors.data is not None
    (error,) = failed.errors.data
    assert error.code == "server_error" and "IsADirectoryError" in (error.message or "")
    assert "'validating'" in (error.message or "")

    done = await wait_for(oa, running.id)
    assert done.status == "completed", done
    assert sorted(line["custom_id"] for line in lines_of(oa, done.output_file_id)) == [
        "r0",
        "r1",
        "r2",
    ]
    assert gateway_stack.processes["gateway"].returncode is None  # it never exited


async def test_a_record_that_does_not_read_is_left_out_and_the_rest_run(
    gateway_stack: LocalStack,
) -> None:
    nc = await bus.connect(gateway_stack.nats_config_for("gateway"), name="test")
    try:
        kv = await nc.jetstream().key_value(
            Subjects(gateway_stack.config.prefix).gateway_batches_bucket
        )
        await kv.put("alice.batch_000000000ffffffffffffffff", json.dumps({"id": 5}).encode())
        await kv.put("alice.batch_000000000eeeeeeeeeeeeeeee", b"\xff not json")
    finally:
        await nc.close()
    oa = client(gateway_stack)
    lines = [chat_line("only", "hello", max_tokens=4)]
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("in.jsonl", jsonl(lines)), purpose="batch"
    )
    batch = await asyncio.to_thread(create, oa, uploaded.id)
    done = await wait_for(oa, batch.id)
    assert done.status == "completed", done
    listed = await asyncio.to_thread(oa.batches.list)
    assert [b.id for b in listed.data] == [batch.id]
    assert gateway_stack.processes["gateway"].returncode is None
