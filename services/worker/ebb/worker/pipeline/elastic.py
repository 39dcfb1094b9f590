"""The elastic scheduler: how many processes each stage runs, decided while the job runs.

Every tick the router samples, per stage, how busy its processes were and how many items wait
for it. The busiest stage that has work waiting is the bottleneck. If the device it runs on
(CPU, or its GPU) has room, the bottleneck gets another process; if not, a process is taken
from a stage that is mostly idle, and the next decision may hand the room to the bottleneck.
A decision must hold for `confirm` ticks in a row (hysteresis), and after each change the
scheduler waits `cooldown_s` (a new process needs time to load its model and show its effect).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import psutil

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StageLoad:
    stage: int
    workers: int
    min_workers: int
    max_workers: int
    utilization: float
    """Busy fraction of its processes over the last tick, 0..1."""
    waiting: int
    """Items queued for it (in the router, or held by its processes but not running)."""
    device_busy: float
    """How busy the device it runs on is, 0..1 (the CPU, or its GPU)."""


Decision = tuple[Literal["add", "remove"], int]


@dataclass(frozen=True, kw_only=True)
class ElasticSettings:
    tick_s: float = 1.0
    """How often the stages are measured."""
    cooldown_s: float = 3.0
    """Quiet time after each change (a new process needs it to load its model)."""
    confirm: int = 2
    """Ticks in a row a decision must hold."""
    busy: float = 0.75
    """A stage this busy, with items waiting, is a bottleneck."""
    idle: float = 0.3
    """A stage less busy than this can give a process away."""
    device_full: float = 0.9
    """A device busier than this has no room for another process."""


class ElasticScheduler:
    def __init__(self, settings: ElasticSettings | None = None) -> None:
        s = settings or ElasticSettings()
        self.cooldown_s = s.cooldown_s
        self.confirm = s.confirm
        self.busy = s.busy
        self.idle = s.idle
        self.device_full = s.device_full
        self._last_change = float("-inf")
        self._pending: Decision | None = None
        self._seen = 0

    def decide(self, now: float, loads: list[StageLoad]) -> Decision | None:
        """What to change now, if anything. Pure but for its own hysteresis state."""
        wanted = self._want(loads)
        if wanted != self._pending:
            self._pending, self._seen = wanted, 0
        if wanted is None:
            return None
        self._seen += 1
        if self._seen < self.confirm or now - self._last_change < self.cooldown_s:
            return None
        self._last_change = now
        self._pending, self._seen = None, 0
        return wanted

    def _want(self, loads: list[StageLoad]) -> Decision | None:
        candidates = [
            s
            for s in loads
            if s.waiting > 0 and s.utilization >= self.busy and s.workers < s.max_workers
        ]
        if candidates:
            bottleneck = max(candidates, key=lambda s: (s.utilization, s.waiting))
            if bottleneck.device_busy < self.device_full:
                return ("add", bottleneck.stage)
            donors = [
                s
                for s in loads
                if s.stage != bottleneck.stage
                and s.workers > s.min_workers
                and s.utilization < self.idle
            ]
            if donors:
                return ("remove", min(donors, key=lambda s: s.utilization).stage)
            return None
        # No bottleneck: give back what sits idle.
        idle = [
            s
            for s in loads
            if s.workers > s.min_workers and s.waiting == 0 and s.utilization < self.idle / 2
        ]
        if idle:
            return ("remove", min(idle, key=lambda s: s.utilization).stage)
        return None


class DeviceMonitor:
    """How busy the worker's CPU budget and each of its GPUs are, measured once per tick.

    The CPU is the worker's own: the CPU time its processes (itself, its stage processes and
    their server) used over the tick, against its budget of cores. The machine's load says
    nothing of a pod's quota on a 64-core node, nor of a local worker's share beside others.
    GPUs through NVML, when a GPU and its driver are present."""

    def __init__(self, *, cores: float, gpus: tuple[str, ...] | None = None) -> None:
        self.cores = cores
        self.gpus = gpus
        self._me = psutil.Process()
        self._cpu_seconds = self._tree_cpu_seconds()
        self._at = time.monotonic()
        self._cpu_busy = 0.0
        self._nvml: Any = None
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml

    def sample(self, now: float) -> None:
        """Measure the CPU over the time since the last sample."""
        seconds = self._tree_cpu_seconds()
        elapsed = now - self._at
        if elapsed > 0:
            used = max(0.0, seconds - self._cpu_seconds)  # the dead take their time with them
            self._cpu_busy = min(1.0, used / elapsed / max(self.cores, 1e-9))
        self._cpu_seconds, self._at = seconds, now

    def _tree_cpu_seconds(self) -> float:
        total = 0.0
        for p in [self._me, *self._children()]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def _children(self) -> list[psutil.Process]:
        try:
            return self._me.children(recursive=True)
        except psutil.Error:
            return []

    def busy(self, device: str) -> float:
        """How busy `device` was at the last sample, 0..1: `cpu`, a stage's `cuda` (its
        GPUs on average), or `cuda:N`."""
        if not device.startswith("cuda") or self._nvml is None:
            return self._cpu_busy
        index = device.partition(":")[2]
        if self.gpus:
            ids = [self.gpus[int(index)]] if index else list(self.gpus)
        else:
            ids = [index or "0"]
        readings = [self._gpu_busy(i) for i in ids]
        return sum(readings) / len(readings)

    def _gpu_busy(self, gpu: str) -> float:
        try:
            if gpu.isdigit():
                handle = self._nvml.nvmlDeviceGetHandleByIndex(int(gpu))
            else:  # GPU-... or MIG-..., as the device plugin names them
                handle = self._nvml.nvmlDeviceGetHandleByUUID(gpu)
            return float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100
        except Exception as e:  # noqa: BLE001 - a GPU we cannot read is not "busy"
            log.debug("cannot read the utilisation of GPU %s: %s", gpu, e)
            return 0.0
