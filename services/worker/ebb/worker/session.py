"""The job a worker serves, once its spec is known: the spec, the pipeline that runs it, the
master that leases its shards, and the leases held.

The stage processes start (models load) as the session opens, while the first shard is
leased and read. Once they are ready, every lease and renew request says so (the master
learns the job's pipeline can start somewhere).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import pyarrow as pa

from ebb.common.aio import until
from ebb.common.job import JobSpec
from ebb.common.messaging.api import MasterClient

from . import metrics
from .leases import LeaseKeeper
from .pipeline.elastic import DeviceMonitor
from .pipeline.front import Pipeline, PipelineConfig, RowsBack, RunResult
from .resources import devices
from .shardio.handoff import WHOLE_JOB, TierEnds
from .shardio.reader import KeptReads

log = logging.getLogger(__name__)


def pipeline_config(spec: JobSpec, *, cores: float, gpus: tuple[str, ...] | None) -> PipelineConfig:
    """The job's pipeline on this worker's cores and GPUs. ValueError if the stages need
    GPUs this worker was not given."""
    memory = spec.fault.worker_memory_gb
    return PipelineConfig(
        stages=devices.spread(spec.pipeline.stages, gpus),
        code_paths=spec.pipeline.code_paths,
        batch_timeout_s=spec.fault.batch_timeout_s,
        memory_limit_bytes=int(memory * 2**30) if memory else None,
        cpus=cores,
        gpus=gpus,
    )


class JobSession:
    """One job as this worker serves it. Its pipeline starts as it is made; `close` stops it."""

    def __init__(
        self,
        *,
        spec: JobSpec,
        pipeline: Pipeline,
        master: MasterClient,
        worker: str,
        cores: float,
        gpus: tuple[str, ...] | None,
        on_failed_start: Callable[[BaseException], None],
        tier: str = "",
        ends: TierEnds = WHOLE_JOB,
    ) -> None:
        self.spec = spec
        """The job as this worker's tier runs it (`handoff.tier_view`)."""
        self.tier = tier
        self.ends = ends
        """Where the rows of this worker's tier come from and go, the same for every shard."""
        self.pipeline = pipeline
        self.master = master
        self.cores = cores
        """The cores this worker may use (ebb.worker.resources.cpus)."""
        self.gpus = gpus
        """The GPUs it may use (ebb.worker.resources.devices; None: nothing says)."""
        self.ready = False
        """The stage processes have started: lease and renew requests say so."""
        self.leases = LeaseKeeper(master, worker=worker, ready=lambda: self.ready)
        self.kept_reads = KeptReads()
        """The reader a part of a shard left open, for the piece this worker computes next."""
        self._on_failed_start = on_failed_start
        self._starting = asyncio.create_task(self._start(), name="pipeline-start")
        self._starting.add_done_callback(self._start_ended)

    async def _start(self) -> None:
        started = time.perf_counter()
        await self.pipeline.start()
        log.debug("stage processes ready in %.2fs", time.perf_counter() - started)
        self.ready = True
        # Tell the master now, not at the next renewal, which a long first shard may put
        # off for a third of a lease.
        self.leases.renew_soon()

    def _start_ended(self, task: asyncio.Task[None]) -> None:
        """A failed start stops the worker whether or not a shard waits for the pipeline
        (the master may have none to give, or only `wait`): it must say so, and promptly.
        Looking at the exception here also retrieves it, once and for all."""
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self._on_failed_start(error)

    async def started(self) -> None:
        """Returns once the stage processes have started, or failed to (the failure is
        `on_failed_start`'s to tell)."""
        await asyncio.wait([self._starting])

    async def run_columns(
        self,
        rows: pa.Table,
        *,
        stop: asyncio.Event | None = None,
        rows_back: RowsBack | None = None,
    ) -> RunResult:
        """The pipeline's results for `rows`, once it has started (raising why, if it cannot):
        an attempt reads its first rows while the models load. `stop`: as `Pipeline`'s."""
        if stop is None:
            await asyncio.shield(self._starting)
        elif not await until(_started(self._starting), stop):
            return RunResult(0, {})  # stopped while the models load: nothing computed
        return await self.pipeline.run_columns(rows, stop=stop, rows_back=rows_back)

    async def close(self, *, grace_s: float) -> None:
        """Stop the stage processes, started or starting."""
        if not self._starting.done():
            self._starting.cancel()
        await asyncio.wait([self._starting])
        self.kept_reads.close()
        await self.pipeline.stop(grace_s=grace_s)

    async def gauges(self) -> None:
        """Publish the pipeline's queue depths and its devices' utilisation (sampled)."""
        stages = self.spec.pipeline.stages
        names = [s.name for s in stages]
        used = sorted({"cpu", *(s.device for s in stages)})
        if self.gpus and any(d.startswith("cuda") for d in used):
            used = ["cpu", *(f"cuda:{i}" for i in range(len(self.gpus)))]
        # NVML's start-up can take a while.
        monitor = await asyncio.to_thread(
            functools.partial(DeviceMonitor, cores=self.cores, gpus=self.gpus)
        )
        while True:
            for name, depth in zip(names, self.pipeline.depths(), strict=False):
                metrics.QUEUE_DEPTH.labels(name).set(depth)
            metrics.LEASES_HELD.set(len(self.leases))
            monitor.sample(time.monotonic())
            for device in used:
                metrics.DEVICE_UTILIZATION.labels(device).set(monitor.busy(device))
            await asyncio.sleep(1.0)


async def _started(starting: asyncio.Future[None]) -> bool:
    await asyncio.shield(starting)
    return True
