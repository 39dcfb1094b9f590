"""Every subject, stream and bucket name Ebb uses on NATS, derived from one prefix."""

from __future__ import annotations

import re

WORKER_OPS: tuple[str, ...] = ("lease", "renew", "commit", "release")
"""The lease protocol: asked by one worker, on a subject that names it (`worker_op`)."""

WORKER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
"""A worker id is one NATS subject token (no dots, no wildcards) and a NATS user name."""


OWNER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
"""An owner (a team) is one NATS subject token and a NATS user name: the team's credential
names it, and its subjects end with it (`owner_submit`, `owner_op`, `events`)."""

OWNER_OPS: tuple[str, ...] = ("status", "cancel", "resume")
"""What an owner may ask of the master about its own jobs, on a subject that names it."""


def check_owner(owner: str) -> str:
    if not OWNER_RE.fullmatch(owner):
        raise ValueError(
            f"bad owner {owner!r}: 1-64 letters, digits, - and _, starting with a letter or digit"
        )
    return owner


def check_worker_id(worker: str) -> str:
    if not WORKER_ID_RE.match(worker):
        raise ValueError(
            f"bad worker id {worker!r}: 1-128 letters, digits, - and _, starting with a "
            "letter or digit"
        )
    return worker


class Subjects:
    """Every subject, stream and bucket name, derived from one prefix."""

    def __init__(self, prefix: str = "ebb") -> None:
        if not prefix or not all(c.isalnum() or c in "-_" for c in prefix):
            raise ValueError(f"bad subject prefix {prefix!r}: letters, digits, - and _ only")
        self.prefix = prefix
        self.submit = f"{prefix}.jobs.submit"
        """Where a job without an owner is submitted (the admin's client role)."""
        self.owners_submit = f"{prefix}.submit.*"
        """Every owner's submission subject (`owner_submit`): the jobs stream takes both."""
        self.all_events = f"{prefix}.jobs.*.events"
        """Every job without an owner's events."""
        self.all_owned_events = f"{prefix}.jobs.*.events.*"
        """Every owned job's events (`events` with an owner)."""
        self.jobs_stream = f"{prefix.upper().replace('-', '_')}_JOBS"
        self.jobs_bucket = f"{prefix}-jobs"
        self.shards_bucket = f"{prefix}-shards"
        self.leader_bucket = f"{prefix}-leader"
        self.gateway_files_bucket = f"{prefix}-gateway-files"
        """The Batch API gateway's files: who owns each, its name, size and purpose."""
        self.gateway_batches_bucket = f"{prefix}-gateway-batches"
        """The Batch API gateway's batches: each one's record as the API shows it, and its job."""

    def master(self, op: str) -> str:
        return f"{self.prefix}.master.{op}"

    def worker_op(self, op: str, worker: str) -> str:
        """Where `worker` asks for `op` of the lease protocol: the subject names the caller,
        so that NATS permissions can bind it to the worker's identity and the master can
        check that a lease token is used by the worker that holds it."""
        return f"{self.prefix}.master.{op}.{worker}"

    def worker_ops(self, op: str) -> str:
        """Every worker's subject for `op` (the master's subscription)."""
        return f"{self.prefix}.master.{op}.*"

    @property
    def every_event(self) -> tuple[str, str]:
        """What a listener to every job's events subscribes to: the jobs without an owner's,
        and the owned ones'."""
        return (self.all_events, self.all_owned_events)

    def owner_submit(self, owner: str) -> str:
        """Where `owner` submits its jobs: the subject names it, so that NATS permissions bind
        it to the team's identity and the master records whose job it is (never from the
        message, which anyone can write)."""
        return f"{self.prefix}.submit.{owner}"

    def owner_op(self, op: str, owner: str) -> str:
        """Where `owner` asks `op` (OWNER_OPS) about its own jobs, and no other's."""
        return f"{self.prefix}.master.{op}.{owner}"

    def events(self, job: str, owner: str = "") -> str:
        """Where the events of `job` are published: a job of an owner's under that owner,
        where only it (and the roles that hear every job) may listen."""
        base = f"{self.prefix}.jobs.{job}.events"
        return f"{base}.{owner}" if owner else base

    def submission_owner(self, subject: str) -> str:
        """The owner a submission's subject names; "" for the subject without one. ValueError
        for a subject that is neither (or names no valid owner)."""
        if subject == self.submit:
            return ""
        head, _, owner = subject.rpartition(".")
        if head != f"{self.prefix}.submit":
            raise ValueError(f"{subject} is not a subject jobs are submitted on")
        return check_owner(owner)

    @staticmethod
    def event_job(subject: str) -> str:
        """The job an events subject (`events`, with an owner or without) is about."""
        return subject.split(".")[2]
