"""A succeeded job's metrics as an MLflow run: logged at least once, and as one run.

The job's SUCCEEDED record says its run is due (`JobRecord.mlflow_run` "pending") in the
same write that ends the job, so that a master that dies a moment later, or an MLflow that
is down for an hour, loses nothing: the `tracker` agent logs every due run, retrying with a
backoff until the tracking store takes it, and then writes the run's id in the record. A run
is tagged with its job's id and found again before another is made (mlflow_export), so a
master that logged it and died before it wrote the id makes no second run.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from ebb.common import mlflow_export
from ebb.common.messaging.bus import Backoff

from ..errors import Deposed
from .context import TableContext
from .jobs import Job

log = logging.getLogger(__name__)

PENDING = "pending"
"""`JobRecord.mlflow_run` of a job whose run is due and not yet logged."""
RETRIES = Backoff(first_s=2.0, max_s=300.0)
"""How a run the tracking store refused is tried again: for as long as the job is kept."""


class MlflowRuns:
    """The runs due, and the tries at them (in memory: a new master tries at once)."""

    def __init__(self, context: TableContext, *, backoff: Backoff = RETRIES) -> None:
        self._context = context
        self._backoff = backoff
        self._next_try: dict[str, float] = {}
        self._tries: dict[str, int] = {}

    def pending(self) -> list[Job]:
        now = self._context.clock()
        return [
            job
            for job in self._context.jobs.values()
            if job.record.mlflow_run == PENDING and self._next_try.get(job.id, 0.0) <= now
        ]

    async def log_due(self) -> int:
        """Log each run due now; how many were logged. One that fails is tried again later
        (its error shown in the job's status), the others still go."""
        logged = 0
        for job in self.pending():
            logged += await self._log(job)
        return logged

    async def _log(self, job: Job) -> bool:
        tracking = job.spec.tracking
        if tracking.mlflow_uri is None:  # pragma: no cover - pending only with a tracking URI
            return False
        try:
            run = await asyncio.to_thread(
                mlflow_export.log_metrics,
                tracking_uri=tracking.mlflow_uri,
                experiment=tracking.experiment or job.spec.name,
                run_name=job.id,
                values=job.record.metrics,
                params={"job": job.id, "rows": str(job.record.rows_done)},
                job=job.id,
            )
        except mlflow_export.MlflowExportError as e:
            tries = self._tries[job.id] = self._tries.get(job.id, 0) + 1
            delay = self._backoff.delay(tries - 1)
            self._next_try[job.id] = self._context.clock() + delay
            job.mlflow_error = str(e)
            log.warning(
                "job %s: its metrics are not logged to MLflow yet (try %d; again in %.0fs): %s",
                job.id,
                tries,
                delay,
                e,
            )
            return False
        async with job.lock:
            if job.record.mlflow_run != PENDING:  # pragma: no cover - one tracker a master
                return False
            record = replace(job.record, mlflow_run=run)
            job.revision = await self._context.store.update_job(record, last=job.revision)
            job.record = record
        job.mlflow_error = ""
        self._tries.pop(job.id, None)
        self._next_try.pop(job.id, None)
        log.info("job %s: metrics logged to MLflow as run %s", job.id, run)
        return True

    async def tracker(self, *, interval_s: float = 1.0) -> None:
        """Log the runs due, for as long as this master leads."""
        while True:
            try:
                await self.log_due()
            except Deposed:
                raise
            except Exception:
                log.exception("logging runs to MLflow failed; retrying")
            await asyncio.sleep(interval_s)
