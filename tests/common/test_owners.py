"""Owners (teams) as NATS identities, on a real nats-server with JetStream and a real master:
a team submits, reads, cancels and resumes its own jobs and hears their events; another team
can do none of it, refused by nats-server on the team's subjects and answered "not found" by
the master on its own; the admin client still sees every job."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from nats.aio.client import Client as NATS

from ebb.client.sdk import EbbClient, SubmitError
from ebb.client.stack import LocalStack, StackConfig
from ebb.common.errors import BusError, RemoteError
from ebb.common.job import JobSpec, parse_job
from ebb.common.messaging import auth, bus, identity
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.messages import JobEvent
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import Subjects
from ebb.common.schema import decode

from ..helpers import ASSETS, job_spec, wait_until, write_dataset


@pytest.fixture
async def stack(tmp_path: Path, prefix: str) -> AsyncIterator[LocalStack]:
    # The master only: no worker takes the jobs, which stay RUNNING until cancelled.
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


def spec_in(tmp: Path, name: str) -> JobSpec:
    """A job of its own folder under `tmp` (its own input and output)."""
    folder = tmp / name
    folder.mkdir()
    write_dataset(folder / "data", rows=200, row_group_size=100)
    return parse_job(job_spec(folder, name=name, rows_per_shard=100)).with_id()


@dataclasses.dataclass
class Team:
    name: str
    config: NatsConfig
    client: EbbClient

    def once(self) -> MasterClient:
        """Asks once, briefly, on the team's own subjects."""
        return MasterClient(
            self.client.nc,
            dataclasses.replace(self.config, request_timeout_s=1.0),
            backoff=Backoff(attempts=1),
            owner=self.name,
        )


@pytest.fixture
async def teams(stack: LocalStack) -> AsyncIterator[tuple[Team, Team]]:
    made = []
    for name in ("team-a", "team-b"):
        config = stack.team_nats_config(name)
        made.append(Team(name, config, await EbbClient.connect(config)))
    try:
        yield made[0], made[1]
    finally:
        for team in made:
            await team.client.close()


async def violation(stack: LocalStack, what: str, subject: str) -> None:
    await wait_until(
        lambda: any(
            f"{what} Violation" in v and f'"{subject}"' in v for v in stack.nats.violations
        ),
        timeout=10,
        what=f"the server to refuse {what} {subject}",
    )


async def not_found(call: Any) -> str:
    with pytest.raises(RemoteError) as e:
        await call
    assert e.value.code == "not_found", e.value
    return e.value.message


async def test_a_team_submits_reads_and_acts_on_its_own_job_and_hears_it(
    stack: LocalStack, teams: tuple[Team, Team], tmp_path: Path, prefix: str
) -> None:
    a, _ = teams
    assert a.client.owner == "team-a"  # learnt from its credential
    heard: asyncio.Queue[JobEvent] = asyncio.Queue()

    async def on_event(msg: Any) -> None:
        heard.put_nowait(decode(JobEvent, msg.data))

    mine = await a.client.nc.subscribe(Subjects(prefix).events("*", "team-a"), cb=on_event)
    try:
        job = await a.client.submit(spec_in(tmp_path, "a1"))
        status = await a.client.job(job)
        assert (status.state, status.owner) == ("RUNNING", "team-a")
        assert [j.id for j in (await a.client.status()).jobs] == [job]
        accepted = await asyncio.wait_for(heard.get(), 10)
        assert (accepted.job, accepted.kind, accepted.owner) == (job, "accepted", "team-a")

        assert (await a.client.cancel(job)).state == "CANCELLED"
        event = await asyncio.wait_for(heard.get(), 10)
        assert (event.job, event.state) == (job, "CANCELLED")
        resumed = await a.client.resume(job)
        assert resumed.state == "RUNNING" and resumed.shards_todo == 2
    finally:
        await mine.unsubscribe()
    assert stack.nats.violations == []


async def test_another_team_can_neither_read_nor_act_on_nor_hear_a_team_s_job(
    stack: LocalStack, teams: tuple[Team, Team], tmp_path: Path, prefix: str
) -> None:
    a, b = teams
    subjects = Subjects(prefix)
    job = await a.client.submit(spec_in(tmp_path, "a1"))
    own = await b.client.submit(spec_in(tmp_path, "b1"))

    # On its own subjects the master answers of A's job as of a job that does not exist.
    nowhere = "no-such-job"
    assert await not_found(b.client.job(job)) == f"no job {job!r}"
    assert await not_found(b.client.job(nowhere)) == f"no job {nowhere!r}"
    assert [j.id for j in (await b.client.status()).jobs] == [own]
    assert await not_found(b.client.cancel(job)) == f"no job {job!r}"
    assert (await a.client.job(job)).state == "RUNNING"  # untouched
    await a.client.cancel(job)  # resumable now: still not B's to resume
    missing_words = (await not_found(b.client.resume(nowhere))).replace(nowhere, "X")
    assert (await not_found(b.client.resume(job))).replace(job, "X") == missing_words
    assert (await a.client.job(job)).state == "CANCELLED"

    # nats-server lets B on none of A's subjects, nor on those without an owner.
    for subject in (
        subjects.owner_submit("team-a"),
        subjects.submit,
        *(subjects.owner_op(op, "team-a") for op in ("status", "cancel", "resume")),
        subjects.master("status"),
        subjects.master("cancel"),
        subjects.worker_op("lease", "w1"),
    ):
        await b.client.nc.publish(subject, b"{}")
        await violation(stack, "Publish", subject)
    for subject in (
        subjects.events(job, "team-a"),
        subjects.events("*", "*"),
        f"{prefix}.jobs.*.events.>",
        subjects.all_events,
        f"{auth.team_inbox(prefix, 'team-a')}.>",
        f"{auth.inbox_prefix(prefix, 'client')}.>",
        ">",
    ):
        await b.client.nc.subscribe(subject)
        await violation(stack, "Subscription", subject)

    # What B may hear is its own jobs' events: A's job resumed before B's own job is
    # cancelled, both published by the one master in that order; B hears the second alone.
    heard: asyncio.Queue[JobEvent] = asyncio.Queue()

    async def on_event(msg: Any) -> None:
        heard.put_nowait(decode(JobEvent, msg.data))

    await wait_until(lambda: b.client.nc.is_connected, timeout=10, what="B reconnected")
    listening = await b.client.nc.subscribe(subjects.events("*", "team-b"), cb=on_event)
    try:
        await b.client.nc.flush()
        await a.client.resume(job)
        await b.client.cancel(own)
        first = await asyncio.wait_for(heard.get(), 10)
        assert (first.job, first.owner, first.state) == (own, "team-b", "CANCELLED")
    finally:
        await listening.unsubscribe()


async def test_the_admin_client_sees_and_acts_on_every_team_s_jobs(
    stack: LocalStack, teams: tuple[Team, Team], tmp_path: Path, prefix: str
) -> None:
    a, b = teams
    a_job = await a.client.submit(spec_in(tmp_path, "a1"))
    b_job = await b.client.submit(spec_in(tmp_path, "b1"))
    async with await EbbClient.connect(stack.nats_config) as admin:
        assert admin.owner == ""
        own = await admin.submit(spec_in(tmp_path, "admin"))
        listed = {j.id: j.owner for j in (await admin.status()).jobs}
        assert listed == {a_job: "team-a", b_job: "team-b", own: ""}
        # A team does not see the admin's job either.
        assert await not_found(a.client.job(own)) == f"no job {own!r}"
        # The admin hears an owned job's events, and acts on it.
        heard = asyncio.Event()

        async def on_event(_msg: Any) -> None:
            heard.set()

        sub = await admin.nc.subscribe(Subjects(prefix).events(b_job, "*"), cb=on_event)
        try:
            assert (await admin.cancel(b_job)).state == "CANCELLED"
            await asyncio.wait_for(heard.wait(), 10)
        finally:
            await sub.unsubscribe()
        assert (await b.client.job(b_job)).state == "CANCELLED"
        final = await asyncio.wait_for(admin.wait(b_job), 10)
        assert final.owner == "team-b"
    assert stack.nats.violations == []


async def test_an_id_another_owner_has_is_refused_and_that_job_left_alone(
    stack: LocalStack, teams: tuple[Team, Team], tmp_path: Path
) -> None:
    a, b = teams
    spec = spec_in(tmp_path, "a1")
    job = await a.client.submit(spec)
    taken = dataclasses.replace(spec_in(tmp_path, "b1"), id=job)
    with pytest.raises(SubmitError, match="is taken"):
        await b.client.submit(taken, accept_timeout_s=20)
    # A's refusal is B's alone; A's job is A's, as it was.
    assert (await a.client.status()).rejected == {}
    status = await a.client.job(job, include_spec=True)
    assert (status.owner, status.state) == ("team-a", "RUNNING")
    assert status.spec is not None and status.spec["name"] == "a1"
    # A submitting it again is a repeat of its own job, not a refusal.
    assert await a.client.submit(spec) == job


async def test_an_output_root_another_team_s_job_owns_is_refused_without_naming_it(
    stack: LocalStack, teams: tuple[Team, Team], tmp_path: Path
) -> None:
    a, b = teams
    spec = spec_in(tmp_path, "a1")
    job = await a.client.submit(spec)
    into = dataclasses.replace(spec_in(tmp_path, "b1"), output=spec.output)
    with pytest.raises(SubmitError) as e:
        await b.client.submit(into, accept_timeout_s=20)
    assert "another owner's job" in str(e.value) and job not in str(e.value)
    # The admin is told whose it is, as before.
    async with await EbbClient.connect(stack.nats_config) as admin:
        with pytest.raises(SubmitError, match=f"being written by job {job}"):
            await admin.submit(dataclasses.replace(into, id="admin-1"), accept_timeout_s=20)


async def test_the_owner_is_the_subject_s_and_never_the_message_s(
    stack: LocalStack, teams: tuple[Team, Team], tmp_path: Path, prefix: str
) -> None:
    a, b = teams
    subjects = Subjects(prefix)
    body = {**spec_in(tmp_path, "a1").to_dict(), "owner": "team-b", "v": 1}
    # A claims in the message that the job is B's: a job spec has no such field.
    ack = await a.client.nc.jetstream().publish(
        subjects.owner_submit("team-a"), msgpack.packb(body), stream=subjects.jobs_stream
    )
    assert not ack.duplicate
    reason = await wait_until(
        lambda: _rejection(a.client, body["id"]), timeout=20, what="the refusal"
    )
    assert "owner" in reason
    assert await not_found(b.client.job(body["id"])) == f"no job {body['id']!r}"
    # Without the claim, the job is A's.
    del body["owner"]
    await a.client.nc.jetstream().publish(
        subjects.owner_submit("team-a"), msgpack.packb(body), stream=subjects.jobs_stream
    )
    job = await wait_until(lambda: _job(a.client, body["id"]), timeout=20, what="A's job")
    assert job.owner == "team-a"


async def test_garbage_on_a_team_s_subjects_is_answered_and_the_master_serves_on(
    stack: LocalStack, teams: tuple[Team, Team], tmp_path: Path, prefix: str
) -> None:
    a, _ = teams
    subjects = Subjects(prefix)
    for op in ("status", "cancel", "resume"):
        for payload in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 1, "job": 7})):
            reply = await a.client.nc.request(subjects.owner_op(op, "team-a"), payload, timeout=5)
            body = msgpack.unpackb(reply.data)
            assert (body["ok"], body["code"]) == (False, "bad_request"), (op, payload, body)
    job = await a.client.submit(spec_in(tmp_path, "a1"))
    assert (await a.client.job(job)).state == "RUNNING"


async def _rejection(client: EbbClient, job: str) -> str:
    try:
        return (await client.status(job)).rejected.get(job, "")
    except RemoteError:
        return ""


async def _job(client: EbbClient, job: str) -> Any:
    try:
        return await client.job(job)
    except RemoteError:
        return None


async def test_a_team_credential_another_installation_signed_is_refused(
    stack: LocalStack, prefix: str
) -> None:
    stranger = identity.Trust.new(prefix).team_signer().credentials("team-a")
    forged = dataclasses.replace(stack.team_nats_config("team-a"), creds=stranger)
    with pytest.raises(BusError, match="refused"):
        await asyncio.wait_for(bus.connect(forged, name="stranger"), 30)
    # The worker's key signs no team: a "team" it signs gets a worker's subjects alone.
    as_worker = stack.trust.worker_signer().credentials("team-a") if stack.trust else ""
    nc: NATS = await bus.connect(
        dataclasses.replace(stack.team_nats_config("team-a"), creds=as_worker),
        name="worker-as-team",
    )
    try:
        subject = Subjects(prefix).owner_op("status", "team-a")
        await nc.publish(subject, b"{}")
        await violation(stack, "Publish", subject)
    finally:
        await nc.close()


async def test_a_job_record_from_before_owners_loads_and_serves_the_admin(
    stack: LocalStack, teams: tuple[Team, Team], tmp_path: Path, prefix: str
) -> None:
    """A record without `owner` (as the previous version wrote them) in KV when a master
    starts: it loads, the admin sees the job and acts on it, a team finds nothing."""
    a, _ = teams
    subjects = Subjects(prefix)
    job = await a.client.submit(spec_in(tmp_path, "old"))
    await stack.kill("master")
    nc = await bus.connect(stack.nats_config_for("master"), name="rewriter")
    try:
        kv = await nc.jetstream().key_value(subjects.jobs_bucket)
        entry = await kv.get(job)
        assert entry.value is not None
        body = msgpack.unpackb(entry.value)
        assert body.pop("owner") == "team-a"
        await kv.put(job, msgpack.packb(body))
    finally:
        await nc.close()
    await stack.restart("master")
    async with await EbbClient.connect(stack.nats_config) as admin:
        status = await wait_until(lambda: _job(admin, job), timeout=30, what="the master back")
        assert (status.state, status.owner) == ("RUNNING", "")
        assert await not_found(a.client.job(job)) == f"no job {job!r}"
        assert (await admin.cancel(job)).state == "CANCELLED"
