"""The seam between the reconciler and the place workers run: local processes or Kubernetes pods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from ebb.common.messages import JobStatus

Phase = Literal["starting", "running", "terminating", "succeeded", "failed"]


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    id: str
    job: str
    phase: Phase
    started_at: float
    """Monotonic (local backend) or wall-clock seconds (Kubernetes); only differences matter."""
    exit_code: int | None = None
    reason: str = ""
    """Why it failed, in the backend's words (exit code, OOMKilled, Evicted...)."""

    @property
    def alive(self) -> bool:
        return self.phase in ("starting", "running")

    @property
    def ended(self) -> bool:
        return self.phase in ("succeeded", "failed")


class ClusterBackend(Protocol):
    """Where workers run. Every method is idempotent: the reconciler may repeat itself."""

    async def observe(self) -> list[WorkerInfo]:
        """Every worker this backend knows of, ended ones included until `forget`."""
        ...

    async def capacity(self) -> int:
        """How many workers (of the usual size) may run at once now, counting those running."""
        ...

    async def launch(self, job: JobStatus, worker_id: str) -> None: ...

    async def terminate(self, worker_id: str, *, grace_s: float) -> None:
        """Ask a worker to drain and exit (SIGTERM); kill it if it is still there after grace_s."""
        ...

    async def forget(self, worker_id: str) -> None:
        """Drop an ended worker from `observe` once its outcome has been accounted for."""
        ...

    async def close(self, *, grace_s: float) -> None:
        """The controller stops: what becomes of the workers is the backend's to decide."""
        ...
