"""A batch's job is its owner's on NATS: the gateway submits it under the API key's owner, so
that the owner's own NATS identity (a team's credential of the same name) reads it with the
SDK and the CLI, and another team's does not; a batch from before jobs had owners is still
followed to its end, on the subjects without one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from ebb.client.here import write_credentials
from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack
from ebb.common.errors import RemoteError
from ebb.common.messaging import bus
from ebb.common.messaging.subjects import Subjects

from ..helpers import wait_until
from .conftest import chat_line, client, create, jsonl, lines_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


async def _job(team: EbbClient, job: str) -> Any:
    try:
        return await team.job(job)
    except RemoteError as e:
        assert e.code == "not_found", e
        return None


def ebb(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ebb.client.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_a_batch_s_job_is_read_by_its_owner_s_team_and_no_other(
    gateway_stack: LocalStack, tmp_path: Path
) -> None:
    oa = client(gateway_stack, "alice")
    lines = [chat_line(f"r{i}", f"question {i}", max_tokens=4) for i in range(6)]
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("in.jsonl", jsonl(lines)), purpose="batch"
    )
    batch = await asyncio.to_thread(create, oa, uploaded.id)
    async with (
        await EbbClient.connect(gateway_stack.team_nats_config("alice")) as alice,
        await EbbClient.connect(gateway_stack.team_nats_config("bob")) as bob,
    ):
        status = await wait_until(
            lambda: _job(alice, batch.id), timeout=60, what="the batch's job, as alice"
        )
        assert status.owner == "alice" and status.name == f"batch {batch.id} (alice)"
        assert batch.id in [j.id for j in (await alice.status()).jobs]
        with pytest.raises(RemoteError) as e:
            await bob.job(batch.id)
        assert (e.value.code, e.value.message) == ("not_found", f"no job {batch.id!r}")
        assert (await bob.status()).jobs == []

        # The CLI, with each team's credentials (as `ebb up --team` writes them).
        as_alice = write_credentials(tmp_path / "alice.env", gateway_stack, team="alice")
        as_bob = write_credentials(tmp_path / "bob.env", gateway_stack, team="bob")
        seen = await asyncio.to_thread(ebb, "status", batch.id, "--credentials", str(as_alice))
        assert seen.returncode == 0, seen.stderr
        assert batch.id in seen.stdout and "alice" in seen.stdout
        refused = await asyncio.to_thread(ebb, "status", batch.id, "--credentials", str(as_bob))
        assert refused.returncode == 1 and f"no job '{batch.id}'" in refused.stderr
        listing = await asyncio.to_thread(ebb, "status", "--credentials", str(as_bob))
        assert listing.returncode == 0 and batch.id not in listing.stdout

        # The gateway follows the job on alice's subjects to its end; alice's wait with it.
        final = await asyncio.wait_for(alice.wait(batch.id), 240)
        assert final.state == "SUCCEEDED", final.reason
    done = await wait_for(oa, batch.id)
    assert done.status == "completed", done
    assert len(lines_of(oa, done.output_file_id)) == 6


async def test_a_batch_from_before_jobs_had_owners_is_followed_to_its_end(
    gateway_stack: LocalStack,
) -> None:
    """A batch in progress whose record says nothing of its job's owner, and whose job has
    none (as the previous versions of the gateway and the master wrote them): the gateway
    follows it on the subjects without an owner, and never submits it again."""
    subjects = Subjects(gateway_stack.config.prefix)
    oa = client(gateway_stack, "alice")
    lines = [chat_line(f"r{i}", f"question {i}", max_tokens=4) for i in range(3)]
    uploaded = await asyncio.to_thread(
        oa.files.create, file=("in.jsonl", jsonl(lines)), purpose="batch"
    )
    batch = await asyncio.to_thread(create, oa, uploaded.id)
    async with await EbbClient.connect(gateway_stack.nats_config) as admin:
        await wait_until(lambda: _job(admin, batch.id), timeout=60, what="the batch's job")
        await gateway_stack.kill("gateway")
        await gateway_stack.kill("master")
        nc = await bus.connect(gateway_stack.nats_config_for("master"), name="old-master")
        try:
            jobs = await nc.jetstream().key_value(subjects.jobs_bucket)
            entry = await jobs.get(batch.id)
            assert entry.value is not None
            record = msgpack.unpackb(entry.value)
            assert record.pop("owner") == "alice"
            await jobs.put(batch.id, msgpack.packb(record))
        finally:
            await nc.close()
        nc = await bus.connect(gateway_stack.nats_config_for("gateway"), name="old-gateway")
        try:
            batches = await nc.jetstream().key_value(subjects.gateway_batches_bucket)
            entry = await batches.get(f"alice.{batch.id}")
            assert entry.value is not None
            body = json.loads(entry.value)
            assert body["status"] == "in_progress" and body.pop("job_owned") is True
            await batches.put(f"alice.{batch.id}", json.dumps(body).encode())
        finally:
            await nc.close()
        await gateway_stack.restart("master")
        status = await wait_until(lambda: _job(admin, batch.id), timeout=60, what="the master")
        assert status.owner == ""
        await gateway_stack.restart("gateway")
        await gateway_stack.wait_for_gateway()
        done = await wait_for(oa, batch.id)
        assert done.status == "completed", done
        assert len(lines_of(oa, done.output_file_id)) == 3
        assert (await admin.job(batch.id)).owner == ""  # the one job, never submitted again
