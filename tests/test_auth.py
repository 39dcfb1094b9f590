"""NATS permissions per role, enforced by a real nats-server: each role can do its work and
nothing more (a worker, which runs user code, can neither submit jobs nor touch JetStream)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest
from nats.aio.client import Client as NATS

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common import auth, bus
from ebb.common.api import MasterClient
from ebb.common.bus import Backoff, NatsConfig
from ebb.common.errors import BusError
from ebb.common.spec import parse_job
from ebb.common.subjects import Subjects

from .helpers import ASSETS, job_spec, wait_until, write_dataset


@pytest.fixture
async def stack(tmp_path: Path, prefix: str) -> AsyncIterator[LocalStack]:
    # The master only: this test plays the other roles itself.
    s = LocalStack(
        StackConfig(
            state_dir=tmp_path / "state",
            data_roots=[str(tmp_path), str(ASSETS)],
            prefix=prefix,
            controller=False,
        )
    )
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def denied(stack: LocalStack, what: str, subject: str) -> None:
    await wait_until(
        lambda: any(
            f"{what} Violation" in v and f'"{subject}"' in v for v in stack.nats.violations
        ),
        timeout=10,
        what=f"the server to refuse {what} {subject}",
    )


def once(nc: NATS, config: NatsConfig) -> MasterClient:
    """A client that asks once, briefly: for requests the server will not let through."""
    return MasterClient(
        nc, dataclasses.replace(config, request_timeout_s=1.0), backoff=Backoff(attempts=1)
    )


async def test_each_role_may_do_its_work_and_no_more(
    stack: LocalStack, tmp_path: Path, prefix: str
) -> None:
    subjects = Subjects(prefix)
    write_dataset(tmp_path / "data", rows=200, row_group_size=100)
    spec = parse_job(job_spec(tmp_path, rows_per_shard=100))

    # client: submits, reads, cancels.
    async with await EbbClient.connect(stack.nats_config_for("client")) as client:
        job = await client.submit(spec)
        assert (await client.job(job)).state == "RUNNING"

    worker_nc = await bus.connect(stack.nats_config_for("worker"), name="worker")
    controller_nc = await bus.connect(stack.nats_config_for("controller"), name="controller")
    try:
        # worker: the lease protocol works...
        worker = MasterClient(worker_nc, stack.nats_config_for("worker"))
        lease = await worker.lease(job, "w1")
        assert lease.shard is not None
        assert (await worker.renew(lease.token)).ok
        # ...but it cannot submit a job,
        await worker_nc.publish(subjects.submit, b"{}")
        await denied(stack, "Publish", subjects.submit)
        # nor cancel one,
        with pytest.raises(BusError):
            await once(worker_nc, stack.nats_config_for("worker")).cancel(job)
        await denied(stack, "Publish", subjects.master("cancel"))
        # nor read or write the lease table behind the master's back,
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await worker_nc.jetstream(timeout=1).key_value(subjects.shards_bucket)
        await denied(stack, "Publish", f"$JS.API.STREAM.INFO.KV_{subjects.shards_bucket}")
        await worker_nc.publish(f"$KV.{subjects.shards_bucket}.forged", b"x")
        await denied(stack, "Publish", f"$KV.{subjects.shards_bucket}.forged")
        # nor listen to the replies meant for clients.
        snoop = f"{auth.inbox_prefix(prefix, 'client')}.>"
        await worker_nc.subscribe(snoop)
        await denied(stack, "Subscription", snoop)

        # controller: reads status, may fail a job; may not cancel one.
        controller = MasterClient(controller_nc, stack.nats_config_for("controller"))
        assert (await controller.job(job)).state == "RUNNING"
        with pytest.raises(BusError):
            await once(controller_nc, stack.nats_config_for("controller")).cancel(job)
        await denied(stack, "Publish", subjects.master("cancel"))
        await controller.fail(job, "workers cannot run: test")
        assert (await controller.job(job)).state == "FAILED"
    finally:
        await worker_nc.close()
        await controller_nc.close()


async def test_a_wrong_password_is_refused_at_once(stack: LocalStack) -> None:
    config = stack.nats_config_for("worker")
    wrong = dataclasses.replace(config, password="guess")
    # No first_connect_timeout_s: without the refusal this would wait for ever.
    with pytest.raises(BusError, match="refused"):
        await asyncio.wait_for(bus.connect(wrong, name="stranger"), 30)


def test_the_configuration_reads_passwords_from_the_environment() -> None:
    text = auth.authorization_config("ebb", {r: f"$EBB_{r.upper()}_PASSWORD" for r in auth.ROLES})
    assert "password: $EBB_WORKER_PASSWORD" in text
    assert '"ebb-worker"' in text and '"_INBOX.ebb.worker.>"' in text
    literal = auth.authorization_config("ebb", dict.fromkeys(auth.ROLES, 'a"b'))
    assert 'password: "a\\"b"' in literal
