"""A pipeline that cannot start: the node's fault until it is everyone's.

A worker whose pipeline cannot start (exit code 4: a model that would not load, a GPU that
would not open, a download that timed out) may be on a bad node, or the job may be wrong. One
flaky node must not fail a job that runs fine elsewhere, and a typo in a model path must still
fail it within seconds, with the reason. The evidence that tells them apart: did any worker of
the job ever start its pipeline, and how many workers on how many nodes failed to.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class SetupPolicy:
    workers: int = 3
    """Distinct workers whose pipeline could not start before the job is failed."""
    nodes: int = 2
    """...on at least this many distinct nodes, where the job could run on as many (on one
    machine, or where one node alone fits the job, one is enough)."""


@dataclass(kw_only=True)
class SetupFailures:
    """The workers of one job whose pipeline could not start, where, and why."""

    workers: set[str] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)

    def note(self, *, worker: str, node: str, reason: str) -> None:
        self.workers.add(worker)
        self.nodes.add(node)
        self.reasons = [*self.reasons, reason][-3:]

    def verdict(self, policy: SetupPolicy, *, ever_ready: bool, nodes_available: int) -> str:
        """Why the job cannot run, or "" while the failures may still be the nodes'.

        `ever_ready`: some worker of the job started its pipeline (then it can start, and a
        failure is its node's). `nodes_available`: nodes the job could run on, those it
        failed on included."""
        if ever_ready or len(self.workers) < policy.workers:
            return ""
        if len(self.nodes) < min(policy.nodes, max(1, nodes_available)):
            return ""
        where = f"on {len(self.nodes)} node{'s' if len(self.nodes) > 1 else ''}"
        return (
            f"the pipeline could not start on {len(self.workers)} workers {where}, and on no "
            f"worker of the job: {self.reasons[-1]}"
        )
