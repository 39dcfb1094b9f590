"""Every subject, stream and bucket name Ebb uses on NATS, derived from one prefix."""

from __future__ import annotations


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

    def master(self, op: str) -> str:
        return f"{self.prefix}.master.{op}"

    def events(self, job: str) -> str:
        return f"{self.prefix}.jobs.{job}.events"
