"""Who may do what on NATS: one user per role, each allowed only the subjects it needs.

- master: owns the JetStream state (the jobs stream, the job, shard and leader buckets) and
  answers requests on `<prefix>.master.>`; publishes job events.
- controller: reads job status, fails jobs its workers cannot run, tells the master of
  workers that ended badly; hears job events.
- worker: the lease protocol only (lease, renew, commit, release, status). Workers run user
  code, so they get the least: no job submission, no JetStream API, no KV.
- client: the operator's (admin's) identity: submits jobs without an owner, reads every
  job's status, cancels and resumes any job; hears every job's events.
- gateway: the Batch API gateway, which submits each batch's job under the batch's owner and
  reads (status, cancel) every owner's, trusted to authenticate its API keys; it also keeps
  its files' and batches' records in two KV buckets of its own, and nothing else of JetStream.
- a team (an owner): not a role of one user but one identity per team, minted with the
  tenants' scoped signing key (ebb.common.messaging.identity) whose template, `team_template`,
  binds every subject to the team's name: it submits jobs as itself, asks status, cancel and
  resume of its own jobs only, and hears only their events. nats-server enforces it; the
  master checks in addition that the job a team names is its own (another's is not found).

Each role also gets its own inbox prefix, so that one role cannot read the replies meant for
another (a worker cannot see the master's KV reads, nor a client's job listings); a
connection as `<prefix>-<role>` uses its role's prefix without being told.

The same rules render to the `authorization` block of a nats-server configuration with
password users (`python -m ebb.common.messaging.auth`), and to the JWT claims of decentralised
authentication (ebb.common.messaging.identity), which the embedded stack and `k8s/` use.
"""

from __future__ import annotations

import argparse
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from .. import envvars
from .subjects import OWNER_OPS, WORKER_OPS, Subjects

Role = Literal["master", "controller", "worker", "client", "gateway"]
ROLES: tuple[Role, ...] = get_args(Role)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    """May reply to the requests it receives (the master serves requests)."""


def user_name(prefix: str, role: Role) -> str:
    return f"{prefix}-{role}"


def inbox_prefix(prefix: str, role: Role) -> str:
    return f"_INBOX.{prefix}.{role}"


def team_inbox(prefix: str, team: str) -> str:
    """One team's own inbox prefix: no other team (nor any role) hears its replies."""
    return f"_INBOX.{prefix}.team.{team}"


def worker_inbox(prefix: str, worker: str) -> str:
    """One worker's own inbox prefix, under the worker role's."""
    return f"{inbox_prefix(prefix, 'worker')}.{worker}"


def inbox_for_user(prefix: str, user: str) -> str | None:
    """The inbox prefix a connection as `user` must use: its role's, if it is one of Ebb's
    users; None (the NATS default) for anyone else's."""
    for role in ROLES:
        if user == user_name(prefix, role):
            return inbox_prefix(prefix, role)
    return None


def _jetstream_api(stream: str) -> list[str]:
    """The JetStream API subjects that act on one stream (and its consumers) and on no other."""
    return [
        f"$JS.API.STREAM.*.{stream}",  # INFO, CREATE, UPDATE, PURGE
        f"$JS.API.STREAM.MSG.*.{stream}",  # GET, DELETE
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.CONSUMER.*.{stream}",  # CREATE (ephemeral, ordered)
        f"$JS.API.CONSUMER.*.{stream}.>",  # CREATE <name>, INFO, DELETE
        f"$JS.API.CONSUMER.*.*.{stream}.>",  # DURABLE.CREATE, MSG.NEXT
        f"$JS.ACK.{stream}.>",
    ]


def permissions(prefix: str, role: Role) -> Permissions:
    s = Subjects(prefix)
    inbox = f"{inbox_prefix(prefix, role)}.>"
    if role == "master":
        streams = [s.jobs_stream] + [f"KV_{b}" for b in (s.jobs_bucket, s.shards_bucket)]
        streams.append(f"KV_{s.leader_bucket}")
        publish = ["$JS.API.INFO", *s.every_event]
        for stream in streams:
            publish += _jetstream_api(stream)
        publish += [f"$KV.{b}.>" for b in (s.jobs_bucket, s.shards_bucket, s.leader_bucket)]
        return Permissions(
            publish=tuple(publish),
            subscribe=(f"{prefix}.master.>", inbox),
            allow_responses=True,
        )
    if role == "controller":
        return Permissions(
            publish=(
                s.master("status"),
                s.master("fail"),
                s.master("worker_ended"),
                s.master("placement"),
            ),
            subscribe=(*s.every_event, inbox),
        )
    if role == "worker":
        # Any worker's subjects: with one user for every worker, NATS cannot tell them
        # apart; the master still refuses a lease token used by another worker than its
        # holder. Per-worker credentials narrow these to the worker's own id (see below).
        ops = tuple(s.worker_op(op, "*") for op in WORKER_OPS)
        return Permissions(publish=(*ops, s.master("status")), subscribe=(inbox,))
    if role == "gateway":
        buckets = (s.gateway_files_bucket, s.gateway_batches_bucket)
        # Each batch's job under its owner, followed on that owner's subjects; the subjects
        # without an owner only for the jobs of batches from before jobs had owners.
        publish = [
            s.owners_submit,
            s.owner_op("status", "*"),
            s.owner_op("cancel", "*"),
            s.master("status"),
            s.master("cancel"),
            "$JS.API.INFO",
        ]
        for bucket in buckets:
            publish += _jetstream_api(f"KV_{bucket}")
        publish += [f"$KV.{b}.>" for b in buckets]
        return Permissions(publish=tuple(publish), subscribe=(*s.every_event, inbox))
    return Permissions(
        publish=(s.submit, s.master("status"), s.master("cancel"), s.master("resume")),
        subscribe=(*s.every_event, inbox),
    )


WORKER_NAME = "{{name()}}"
"""In a scoped signing key's template (ebb.common.messaging.identity), nats-server puts the user's
name there: the worker id its JWT names."""


def worker_template(prefix: str) -> Permissions:
    """One worker's permissions, templated on its name: the lease protocol on its own
    subjects, the status of jobs, replies on its own inbox. Nothing of any other worker's."""
    s = Subjects(prefix)
    ops = tuple(s.worker_op(op, WORKER_NAME) for op in WORKER_OPS)
    return Permissions(
        publish=(*ops, s.master("status")),
        subscribe=(f"{worker_inbox(prefix, WORKER_NAME)}.>",),
    )


TEAM_NAME = WORKER_NAME
"""In the tenants' signing key's template, the team's name its JWT gives."""


def team_template(prefix: str) -> Permissions:
    """One team's permissions, templated on its name: submit as itself, ask status, cancel
    and resume on its own subjects, hear its own jobs' events, replies on its own inbox.
    Nothing of any other team's, nor of the jobs without an owner."""
    s = Subjects(prefix)
    return Permissions(
        publish=(
            s.owner_submit(TEAM_NAME),
            *(s.owner_op(op, TEAM_NAME) for op in OWNER_OPS),
        ),
        subscribe=(
            s.events("*", owner=TEAM_NAME),
            f"{team_inbox(prefix, TEAM_NAME)}.>",
        ),
    )


def new_passwords() -> dict[Role, str]:
    return {role: secrets.token_urlsafe(24) for role in ROLES}


def authorization_config(prefix: str, passwords: Mapping[Role, str]) -> str:
    """The nats-server `authorization` block for every role.

    A password that starts with `$` is written bare: nats-server reads it from that
    environment variable (how `k8s/` passes in the Secret's passwords).
    """
    users = []
    for role in ROLES:
        p = permissions(prefix, role)
        password = passwords[role]
        password_value = password if password.startswith("$") else json.dumps(password)
        lines = [
            f"user: {json.dumps(user_name(prefix, role))}",
            f"password: {password_value}",
            "permissions: {",
            *_allow("publish", p.publish),
            *_allow("subscribe", p.subscribe),
        ]
        if p.allow_responses:
            lines.append("  allow_responses: true")
        lines.append("}")
        body = "\n".join(f"      {line}" for line in lines)
        users.append(f"    {{\n{body}\n    }}")
    return "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n"


def _allow(what: str, subjects: tuple[str, ...]) -> list[str]:
    if len(subjects) <= 2:
        return [f"  {what}: {{ allow: {json.dumps(list(subjects))} }}"]
    items = ",\n".join(f"      {json.dumps(subject)}" for subject in subjects)
    return [f"  {what}: {{", "    allow: [", *items.split("\n"), "    ]", "  }"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m ebb.common.messaging.auth",
        description="Print the nats-server authorization block for Ebb's roles; passwords are "
        "read from environment variables EBB_<ROLE>_PASSWORD.",
    )
    p.add_argument("--prefix", default="ebb")
    args = p.parse_args(argv)
    env_refs: dict[Role, str] = {role: f"${envvars.role_password(role)}" for role in ROLES}
    print(authorization_config(args.prefix, env_refs), end="")


if __name__ == "__main__":
    main()
