"""The traces of benchmark 6 (online load on the mixed pool, minute by minute, as a share of the
pool) and the clusters they run on: a CPU cluster whose online pods ask for cores, and a GPU
cluster whose online pods serve models, a GPU each."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

DAY_MINUTES = 24 * 60


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """What a cluster's nodes have and what its pods ask, in the resource its trace is of."""

    name: str
    resource: str
    """What the trace's load, the idle capacity and the harvest are counted in."""
    per_node: int
    """Of that resource, on each node."""
    nodes: dict[str, int]
    """Nodes per pool."""
    allocatable: dict[str, str]
    """Every node's."""
    online_pod: dict[str, str]
    """What an online pod requests."""
    batch: dict[str, float]
    """What a batch worker asks for (the job's resources: cpu, memory_gb, gpu)."""

    @property
    def online_units(self) -> int:
        """Of the resource, per online pod."""
        return int(float(self.online_pod[self.resource]))

    @property
    def batch_units(self) -> int:
        """Of the resource, per batch pod."""
        return int(self.batch["gpu" if self.resource == "nvidia.com/gpu" else "cpu"])

    @property
    def unit(self) -> str:
        return "GPU" if self.resource == "nvidia.com/gpu" else "CPU"


CPU_CLUSTER = Cluster(
    name="CPU",
    resource="cpu",
    per_node=8,
    nodes={"online": 6, "mixed": 8, "offline": 6},
    allocatable={"cpu": "8", "memory": "64Gi", "pods": "110"},
    online_pod={"cpu": "2"},
    batch={"cpu": 2, "memory_gb": 1},
)
GPU_CLUSTER = Cluster(
    name="GPU",
    resource="nvidia.com/gpu",
    per_node=8,
    nodes={"online": 2, "mixed": 8, "offline": 2},
    allocatable={"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8", "pods": "110"},
    online_pod={"cpu": "6", "memory": "48Gi", "nvidia.com/gpu": "1"},
    batch={"cpu": 6, "memory_gb": 48, "gpu": 1},
)


def diurnal(
    minute: int, rng: random.Random, *, amplitude: float = 1.0, peak: float = 16.0
) -> float:
    """A night trough (~10%), an afternoon peak (~85% times `amplitude`) at hour `peak`, and a
    2% chance of a one-minute spike of +30%."""
    phase = 2 * math.pi * (minute - (peak - 12) * 60) / DAY_MINUTES
    level = 0.1 + (0.375 - 0.375 * math.cos(phase)) * amplitude
    if rng.random() < 0.02:
        level += 0.3
    return level


def diurnal_trace(rng: random.Random, minutes: int) -> list[float]:
    return [diurnal(m, rng) for m in range(minutes)]


def week_trace(rng: random.Random, minutes: int) -> list[float]:
    out: list[float] = []
    for day in range(math.ceil(minutes / DAY_MINUTES)):
        amplitude = rng.uniform(0.45, 0.65) if day % 7 in (5, 6) else rng.uniform(0.85, 1.05)
        peak = 16 + rng.uniform(-1.5, 1.5)
        out += [diurnal(m, rng, amplitude=amplitude, peak=peak) for m in range(DAY_MINUTES)]
    return out[:minutes]


def flash_trace(rng: random.Random, minutes: int) -> list[float]:
    start, rise, hold, ebb = 3 * 60, 2, 40, 60
    out = []
    for m in range(minutes):
        base = diurnal(m, rng)
        t = m - start
        if 0 <= t < rise:
            surge = 0.75 * (t + 1) / rise
        elif rise <= t < rise + hold:
            surge = 0.75
        elif rise + hold <= t < rise + hold + ebb:
            surge = 0.75 * (1 - (t - rise - hold) / ebb)
        else:
            surge = 0.0
        out.append(max(base, min(0.85, base + surge)) if surge else base)
    return out


def cluster_trace(rng: random.Random, minutes: int) -> list[float]:
    """A high base (35%), a morning and an evening hump (+30% at 10:30, +40% at 20:30), and
    AR(1) noise (0.97, 1.2% a minute): see the module's text for what it stands for."""
    noise, out = 0.0, []
    for m in range(minutes):
        hour = (m % DAY_MINUTES) / 60
        humps = 0.3 * math.exp(-(((hour - 10.5) / 2.0) ** 2)) + 0.4 * math.exp(
            -(((hour - 20.5) / 1.8) ** 2)
        )
        noise = 0.97 * noise + rng.gauss(0.0, 0.012)
        out.append(max(0.05, 0.35 + humps + noise))
    return out


@dataclass(frozen=True)
class Trace:
    name: str
    days: int
    seed: int
    make: Callable[[random.Random, int], list[float]]
    cluster: Cluster = CPU_CLUSTER

    def load(self, minutes: int) -> list[float]:
        """Online demand on the mixed pool, minute by minute, in the cluster's resource."""
        pool = self.cluster.nodes["mixed"] * self.cluster.per_node
        return [max(0.0, level) * pool for level in self.make(random.Random(self.seed), minutes)]


TRACES = (
    Trace("diurnal", 1, 7, diurnal_trace),
    Trace("week", 7, 11, week_trace),
    Trace("flash crowd", 1, 13, flash_trace),
    Trace("cluster trace", 1, 17, cluster_trace),
    Trace("GPU diurnal", 2, 19, diurnal_trace, GPU_CLUSTER),
)
