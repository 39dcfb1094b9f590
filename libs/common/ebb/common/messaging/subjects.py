"""Every subject, stream and bucket name Ebb uses on NATS, derived from one prefix."""

from __future__ import annotations

import re

WORKER_OPS: tuple[str, ...] = ("lease", "renew", "commit", "release")
"""The lease protocol: asked by one worker, on a subject that names it (`worker_op`)."""

WORKER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
"""A worker id is one NATS subject token (no dots, no wildcards) and a NATS user name."""


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
        self.all_events = f"{prefix}.jobs.*.events"
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

    def events(self, job: str) -> str:
        return f"{self.prefix}.jobs.{job}.events"
