"""One tick of the elastic scheduler: measure each stage, decide (ebb.worker.pipeline.elastic), and
add a process to a stage or retire one of it (ebb.worker.pipeline.stagepool)."""

from __future__ import annotations

import logging
import time

from .. import metrics
from ..resources import cpus
from .config import PipelineConfig
from .elastic import DeviceMonitor, ElasticScheduler, StageLoad
from .stagepool import StagePools

log = logging.getLogger(__name__)


class Scaler:
    def __init__(self, config: PipelineConfig, *, cores: float) -> None:
        self.config = config
        self.tick_s = config.elastic.tick_s
        self.scheduler = ElasticScheduler(config.elastic)
        self.monitor = DeviceMonitor(cores=cores, gpus=config.gpus)
        self._next_tick = time.monotonic() + self.tick_s

    @classmethod
    def for_pipeline(cls, config: PipelineConfig, *, cores: float) -> Scaler | None:
        """A scaler for a pipeline with a stage whose process count may change; else None."""
        if all(s.min_workers == s.max_workers for s in config.stages):
            return None
        return cls(config, cores=cores)

    def due(self, now: float) -> bool:
        return now >= self._next_tick

    def tick(self, pools: StagePools, *, waiting: list[int]) -> None:
        """Measure each stage (`waiting`: rows in each one's backlog), maybe add or retire a
        process."""
        now = time.monotonic()
        self._next_tick = now + self.tick_s
        self.monitor.sample(now)
        loads = self._measure(pools, now, waiting)
        decision = self.scheduler.decide(now, loads)
        if decision is not None:
            action, k = decision
            name = pools[k].spec.name
            if action == "add":
                log.info("elastic: stage %s gets a process (%d)", name, loads[k].workers + 1)
                pools.spawn(k, pools[k].free_slot())
            elif pools.retire(k):
                log.info("elastic: stage %s gives a process back (%d)", name, loads[k].workers - 1)
        for pool in pools:
            metrics.STAGE_WORKERS.labels(pool.spec.name).set(len(pool.live()))

    def _measure(self, pools: StagePools, now: float, waiting: list[int]) -> list[StageLoad]:
        processes = pools.processes()
        loads = []
        for k, pool in enumerate(pools):
            spec = pool.spec
            utilization, held, running = pool.measure(now, self.tick_s)
            assert spec.min_workers is not None and spec.max_workers is not None
            most = spec.max_workers
            on_cpu = spec.serves_models and not spec.device.startswith("cuda")
            # Another model process only while each still gets a core of its own.
            if on_cpu and not cpus.room_for_model_process(pools.specs, processes, pools.cores):
                most = min(most, processes[k])
            loads.append(
                StageLoad(
                    stage=k,
                    workers=processes[k],
                    min_workers=spec.min_workers,
                    max_workers=most,
                    utilization=utilization,
                    waiting=waiting[k] + held - running,
                    device_busy=self.monitor.busy(spec.device),
                )
            )
            metrics.STAGE_UTILIZATION.labels(spec.name).set(utilization)
        return loads
