"""Resume, end to end on the embedded stack (real processes): a job that FAILED for a reason
outside it is finished by `resume`, exactly once, and nothing it committed is redone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack
from ebb.common.data.layout import COMMITS_DIR
from ebb.common.job import parse_job

from ..e2e.test_e2e import assert_exactly_once, slow_stages
from ..helpers import embedded_stack, job_spec, write_dataset, write_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
async def stack(tmp_path: Path, prefix: str) -> AsyncIterator[LocalStack]:
    async with embedded_stack(tmp_path, prefix, max_workers=2) as s:  # resume is a client's op
        yield s


def commit_records(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in (out / COMMITS_DIR).glob("*.json")}


async def test_a_job_failed_by_a_vanished_input_file_is_resumed_and_ends_exactly_once(
    tmp_path: Path, stack: LocalStack
) -> None:
    rows = 12_000
    write_dataset(tmp_path / "data", rows=rows, files=3, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    spec = parse_job(
        job_spec(
            tmp_path,
            rows_per_shard=1_000,
            stages=slow_stages(tmp_path, 0.02),
            workers=(2, 2),
            fault={"lease_s": 5, "max_attempts": 1},
        )
    )
    last = tmp_path / "data" / "part-002.parquet"
    aside = tmp_path / "part-002.parquet.aside"
    async with await EbbClient.connect(stack.nats_config) as client:
        job_id = await client.submit(spec)
        # Planned: now the last file goes away before any worker reads it (they start
        # with the first file's shards, and take a few seconds to start at all).
        last.rename(aside)
        failed = await client.wait(job_id)
        assert failed.state == "FAILED", failed.reason
        assert "quarantined" in failed.reason and "part-002.parquet" in failed.reason
        assert failed.shards["QUARANTINED"] >= 1

        before = commit_records(tmp_path / "out")
        aside.rename(last)  # the operator puts the file back
        reply = await client.resume(job_id)
        assert reply.state == "RUNNING"
        assert reply.shards_retried == failed.shards["QUARANTINED"]
        assert reply.shards_done + reply.shards_todo == 12
        final = await client.wait(job_id)
        assert final.state == "SUCCEEDED", final.reason
        assert final.rows_done == rows and final.error_rows == 0
        assert_exactly_once(tmp_path, rows)
        after = commit_records(tmp_path / "out")
        # What the first run committed stays its output: no record rewritten, none redone.
        assert {name: after[name] for name in before} == before
        assert len(after) == 12
