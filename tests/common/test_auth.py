"""NATS permissions per role, enforced by a real nats-server: each role can do its work and
nothing more (a worker, which runs user code, can neither submit jobs nor touch JetStream)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import psutil
import pytest
from nats.aio.client import Client as NATS

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common import envvars
from ebb.common.errors import BusError, RemoteError
from ebb.common.job import parse_job
from ebb.common.messaging import auth, bus, identity
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import WORKER_OPS, Subjects, check_worker_id
from ebb.worker.service import default_worker_id

from ..helpers import (
    ASSETS,
    committed_files,
    embedded_stack,
    job_spec,
    read_output,
    wait_until,
    write_dataset,
    write_model,
)


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

    worker_config = stack.worker_nats_config("w1")
    worker_nc = await bus.connect(worker_config, name="worker")
    controller_nc = await bus.connect(stack.nats_config_for("controller"), name="controller")
    try:
        # worker: the lease protocol works...
        worker = MasterClient(worker_nc, worker_config)
        lease = await worker.lease(job, "w1")
        assert lease.shard is not None
        assert (await worker.renew(lease.token, worker="w1")).ok
        # ...but it cannot submit a job,
        await worker_nc.publish(subjects.submit, b"{}")
        await denied(stack, "Publish", subjects.submit)
        # nor cancel one,
        with pytest.raises(BusError):
            await once(worker_nc, worker_config).cancel(job)
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


async def test_credentials_this_installation_did_not_sign_are_refused_at_once(
    stack: LocalStack, prefix: str
) -> None:
    # No first_connect_timeout_s: without the refusal these would wait for ever.
    stranger = identity.Trust.new(prefix).worker_signer().credentials("w1")
    forged = dataclasses.replace(stack.worker_nats_config("w1"), creds=stranger)
    with pytest.raises(BusError, match="refused"):
        await asyncio.wait_for(bus.connect(forged, name="stranger"), 30)
    guess = NatsConfig(url=stack.nats.url, prefix=prefix, user=f"{prefix}-worker", password="x")
    with pytest.raises(BusError, match="refused"):
        await asyncio.wait_for(bus.connect(guess, name="guesser"), 30)


def test_the_configuration_reads_passwords_from_the_environment() -> None:
    text = auth.authorization_config("ebb", {r: f"$EBB_{r.upper()}_PASSWORD" for r in auth.ROLES})
    assert "password: $EBB_WORKER_PASSWORD" in text
    assert '"ebb-worker"' in text and '"_INBOX.ebb.worker.>"' in text
    literal = auth.authorization_config("ebb", dict.fromkeys(auth.ROLES, 'a"b'))
    assert 'password: "a\\"b"' in literal


async def test_a_worker_can_neither_hear_nor_act_for_another(
    stack: LocalStack, tmp_path: Path, prefix: str
) -> None:
    subjects = Subjects(prefix)
    write_dataset(tmp_path / "data", rows=200, row_group_size=100)
    spec = parse_job(job_spec(tmp_path, rows_per_shard=100))
    async with await EbbClient.connect(stack.nats_config_for("client")) as client:
        job = await client.submit(spec)
        a_config, b_config = stack.worker_nats_config("wa"), stack.worker_nats_config("wb")
        a_nc = await bus.connect(a_config, name="worker-a")
        b_nc = await bus.connect(b_config, name="worker-b")
        try:
            lease = await MasterClient(b_nc, b_config).lease(job, "wb")
            assert lease.status == "granted"
            # A cannot listen where B's replies (its lease tokens) come, nor to all workers'.
            for snoop in (
                f"{auth.worker_inbox(prefix, 'wb')}.>",
                f"{auth.inbox_prefix(prefix, 'worker')}.>",
                ">",
            ):
                await a_nc.subscribe(snoop)
                await denied(stack, "Subscription", snoop)
            # Nor ask anything in B's name.
            for op in WORKER_OPS:
                await a_nc.publish(subjects.worker_op(op, "wb"), b"{}")
                await denied(stack, "Publish", subjects.worker_op(op, "wb"))

            # B's token, come by some other way, and used by A as A: the master refuses it.
            before = (await client.master.status(job, include_leases=True)).jobs[0]
            a = once(a_nc, a_config)
            for call in (
                a.renew(lease.token, worker="wa"),
                a.commit(lease.token, worker="wa", rows=100, error_rows=0),
                a.release(lease.token, "mine", worker="wa", retryable=False),
            ):
                with pytest.raises(RemoteError) as e:
                    await call
                assert e.value.code == "not_holder"
            after = (await client.master.status(job, include_leases=True)).jobs[0]
            assert after.shards == before.shards == {**after.shards, "DOING": 1}
            assert (
                [(x.shard, x.attempt, x.worker) for x in after.leases]
                == [(x.shard, x.attempt, x.worker) for x in before.leases]
                == [(0, 1, "wb")]
            )
            # B itself carries on.
            assert (await MasterClient(b_nc, b_config).renew(lease.token, worker="wb")).ok
        finally:
            await a_nc.close()
            await b_nc.close()


@pytest.fixture
async def full_stack(tmp_path: Path, prefix: str) -> AsyncIterator[LocalStack]:
    async with embedded_stack(tmp_path, prefix, max_workers=2) as s:
        yield s


def _worker_credentials(controller: int) -> dict[str, str]:
    """Worker id -> the user name its NATS credential gives, for each worker the controller
    (pid `controller`) runs."""
    found = {}
    for proc in psutil.Process(controller).children():
        try:
            cmdline = proc.cmdline()
            environ = proc.environ()
        except psutil.Error:
            continue
        if "ebb.worker" not in cmdline or "--id" not in cmdline:
            continue
        creds = environ.get(envvars.NATS_CREDENTIALS, "")
        # Neither a role's password nor the key that mints workers' credentials.
        assert envvars.NATS_USER not in environ and envvars.NATS_PASSWORD not in environ
        assert envvars.WORKER_NATS_SIGNING_KEY not in environ
        found[cmdline[cmdline.index("--id") + 1]] = identity.credentials_name(creds) or ""
    return found


async def test_a_job_runs_exactly_once_with_a_credential_per_worker(
    full_stack: LocalStack, tmp_path: Path
) -> None:
    rows = 2_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=200)
    write_model(tmp_path / "model.onnx")
    stages = [
        {
            "name": "slow",
            "modelet": "ebbtest_modelets:Slow",
            "params": {"seconds_per_batch": 0.2},
            "batch_size": 100,
        },
        {"name": "model", "model": str(tmp_path / "model.onnx"), "batch_size": 200},
        {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 200},
    ]
    spec = parse_job(job_spec(tmp_path, rows_per_shard=200, stages=stages, workers=(2, 2)))
    async with await EbbClient.connect(full_stack.nats_config) as client:
        job = await client.submit(spec)
        # Each worker the controller started connects as itself: its credential names it.
        controller = full_stack.processes["controller"].pid

        def two_workers() -> dict[str, str] | None:
            found = _worker_credentials(controller)
            return found if len(found) == 2 else None

        seen = await wait_until(two_workers, timeout=60, what="two workers running")
        assert all(worker == name for worker, name in seen.items()), seen
        final = await client.wait(job)
    assert final.state == "SUCCEEDED", final.reason
    table, manifest = read_output(tmp_path / "out")
    ids = table.column("id").to_numpy().tolist()
    assert sorted(ids) == list(range(rows)), "every id exactly once"
    assert {f["path"] for f in manifest["files"]} == committed_files(tmp_path / "out")


def test_a_worker_id_is_one_subject_token() -> None:
    assert check_worker_id("job-1_a2") == "job-1_a2"
    for bad in ("a.b", "w*", "w>", "", "-w", "w 1", "x" * 129):
        with pytest.raises(ValueError, match="bad worker id"):
            check_worker_id(bad)
    # Whatever the host is called (dots and all), the default id is a valid one.
    check_worker_id(default_worker_id())


def test_a_minted_credential_names_its_worker_and_the_template_binds_to_the_name() -> None:
    signer = identity.Trust.new("ebb").worker_signer()
    creds = signer.credentials("w7", ttl_s=60)
    assert identity.credentials_name(creds) == "w7"
    jwt = creds.splitlines()[1]
    claims = identity.decode_jwt(jwt)
    assert claims["iss"] == signer.signing_key.public
    assert claims["nats"]["issuer_account"] == signer.account
    assert "pub" not in claims["nats"]  # permissions come from the key's template alone
    assert claims["exp"] > claims["iat"]
    template = auth.worker_template("ebb")
    assert "ebb.master.commit.{{name()}}" in template.publish
    assert template.subscribe == ("_INBOX.ebb.worker.{{name()}}.>",)
    with pytest.raises(ValueError, match="bad worker id"):
        signer.credentials("a.b")
