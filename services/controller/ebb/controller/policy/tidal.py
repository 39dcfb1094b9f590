"""Tidal harvesting of the mixed pool: lend nodes to batch work while online load is low, take
them back when it rises.

Each mixed node carries a label `ebb.io/tidal` with its state:

    online --lend--> online2offline --(next sample)--> offline --reclaim--> offline2online
      ^                                                                          |
      +---------------------(its batch pods are gone)----------------------------+

Batch workers may be placed only on `offline` mixed nodes (and the offline pool). Reclaiming
a node drains its batch pods, gracefully; once none is left it is online again.

The online utilisation of the mixed pool (online pods' requests over allocatable, on each node
of the resource they use most of: GPUs on a GPU node serving models) is sampled
every `sample_s` and smoothed as the median of the last `window` samples, so that a spike of
one sample changes nothing. Nodes are lent while the smoothed utilisation of the nodes that
would stay online remains under `lend_below`; they are reclaimed, fewest batch pods first, as
soon as it rises over `reclaim_above` or an online pod cannot be scheduled (Pending), without
waiting for smoothing. After a reclaim, nothing is lent for `cooldown_s`. That is the
`threshold` policy.

The `forecast` policy (the default) lends by the resource rather than by the node. Batch pods
run at a lower priority than online pods, so a scheduler that finds no room for an online pod
preempts batch pods at once: a spike costs a few batch pods and a few seconds, never a Pending
online pod. What is left to the tide is the load it can see coming. Each sample it forecasts,
for each resource the controller counts (CPU, memory, `nvidia.com/gpu` and any extended
resource its config names), the online demand (running and Pending) `lead_s` ahead as the
largest of

* the level: the median of the last `window` samples (a one-sample spike is preemption's);
* the trend: the level plus the slope of the last `trend_samples` levels times `lead_s`;
* the season: the same time of day on earlier days (`period_s`), shifted to today's level;

and gives batch work the mixed pool's capacity of that resource minus that forecast minus
`headroom`: the batch budget, one per resource. GPU nodes serving models by day are lent by
night on their GPUs' forecast, whatever their CPUs do, and CPU-only batch pods may use the
cores a GPU-short online load leaves. Every mixed node beyond `min_online` is lent while the
budget has room for a batch pod (CPU and memory, which every pod asks for, both left); the
controller places no more batch pods on lent nodes than each budget allows. It drains batch
pods only when the forecast needs a resource they hold (not the headroom: noise moves the
budget, not the pods), one pod at a time, the youngest first of those holding it: a pod younger
than a shard has less of it done than any older one (the pod's age stands in for shard
progress, which the controller does not see). A lent node goes back online only once it has
no batch pods left, so nodes are never drained whole. The seasonal memory lives in the
process: a restarted or newly elected controller starts it afresh.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

Policy = Literal["forecast", "threshold"]
Amounts = dict[str, float]
"""Resource name -> amount in its base unit (cores, bytes, GPUs)."""
State = Literal["online", "online2offline", "offline", "offline2online"]
STATES: tuple[State, ...] = ("online", "online2offline", "offline", "offline2online")
LABEL = "ebb.io/tidal"
EVERY_POD = ("cpu", "memory")
"""What every batch pod asks for: a lent node is of use only while both have budget left."""


@dataclass(frozen=True, kw_only=True)
class TidalConfig:
    policy: Policy = "forecast"
    """forecast: lend by the resource against a forecast, preemption takes the spikes; threshold:
    lend and reclaim whole nodes at utilisation thresholds."""
    headroom: float = 0.25
    """forecast: free online capacity kept on the mixed pool, as a share of it (of each
    resource)."""
    lead_s: float = 180.0
    """forecast: how far ahead the forecast looks (a drain and a pod start, with a margin)."""
    trend_samples: int = 10
    """forecast: levels the trend is fitted to."""
    period_s: float = 86400.0
    """forecast: the length of the online load's cycle (a day)."""
    history_periods: int = 7
    """forecast: earlier periods remembered for the seasonal forecast."""
    lend_below: float = 0.45
    """Lend while the online nodes would stay under this utilisation."""
    reclaim_above: float = 0.7
    """Reclaim when the online nodes run over this utilisation."""
    sample_s: float = 60.0
    window: int = 3
    """Samples in the median. 1: no smoothing."""
    cooldown_s: float = 600.0
    """No lending for this long after a reclaim. 0: no cool-down."""
    min_online: int = 1
    """Mixed nodes that always stay online."""


@dataclass(frozen=True, kw_only=True)
class MixedNode:
    name: str
    state: State
    batch_pods: int
    """Batch (Ebb worker) pods running on it."""
    online_use: float = 0.0
    """Its online pods' requests over its allocatable, of the resource they use most of: the
    least used are lent first."""


@dataclass(frozen=True, kw_only=True)
class Move:
    node: str
    to: State


class Tide:
    """The lend/reclaim decision, one sample at a time. Pure but for its samples."""

    def __init__(self, config: TidalConfig) -> None:
        self.config = config
        self.samples: deque[float] = deque(maxlen=max(1, config.window))
        self.last_reclaim = -math.inf

    def smoothed(self) -> float:
        return float(statistics.median(self.samples)) if self.samples else 0.0

    def decide(
        self,
        now: float,
        *,
        online_load: float,
        pending_online: int,
        nodes: list[MixedNode],
        pending_load: float = 0.0,
    ) -> list[Move]:
        """online_load: the online pods' requests on the mixed pool, in nodes (1.0 = one full
        node); pending_load: the same for the online pods that cannot be scheduled. Returns
        the state changes to make now."""
        moves: list[Move] = []
        # Transitions that complete on their own.
        for node in nodes:
            if node.state == "online2offline":
                moves.append(Move(node=node.name, to="offline"))
            elif node.state == "offline2online" and node.batch_pods == 0:
                moves.append(Move(node=node.name, to="online"))
        total = len(nodes)
        if total == 0:
            return moves
        self.samples.append(online_load / total)
        load = self.smoothed() * total
        online = [n for n in nodes if n.state in ("online", "offline2online")]
        lent = sorted(
            (n for n in nodes if n.state in ("offline", "online2offline")),
            key=lambda n: (n.batch_pods, n.name),
        )
        serving = max(len(online), 1)
        latest = online_load / serving
        if pending_online > 0 or latest > self.config.reclaim_above:
            # Urgent: the raw sample, not the median. Enough nodes back for the load, and at
            # least one for every pod that cannot be scheduled.
            need = max(
                math.ceil((online_load + pending_load) / self.config.reclaim_above) - len(online),
                1 if pending_online else 0,
            )
            for node in [n for n in lent if n.state == "offline"][:need]:
                moves.append(Move(node=node.name, to="offline2online"))
                self.last_reclaim = now
            return moves
        if now - self.last_reclaim < self.config.cooldown_s:
            return moves
        keep = max(self.config.min_online, math.ceil(load / self.config.lend_below))
        spare = [n for n in nodes if n.state == "online"]
        for node in sorted(spare, key=lambda n: (n.online_use, n.name))[
            : max(0, len(online) - keep)
        ]:
            moves.append(Move(node=node.name, to="online2offline"))
        return moves


class Forecast:
    """The online demand of the mixed pool (in nodes), seen one sample at a time, and what it
    will be `lead_s` from now: the largest of its level, its trend and its season."""

    def __init__(self, config: TidalConfig) -> None:
        self.config = config
        self.recent: deque[float] = deque(maxlen=max(1, config.window))
        self.levels: deque[float] = deque(maxlen=max(2, config.trend_samples))
        self.season: dict[int, deque[tuple[int, float]]] = {}
        """Slot of the period -> (period number, level) of earlier periods."""

    def _slot(self, at: float) -> tuple[int, int]:
        """(period number, slot within it) of the moment `at`."""
        per_period = max(1, round(self.config.period_s / self.config.sample_s))
        index = math.floor(at / self.config.sample_s)
        return index // per_period, index % per_period

    def observe(self, now: float, demand: float) -> float:
        """Record one sample; returns the level (the median of the recent samples)."""
        self.recent.append(demand)
        level = float(statistics.median(self.recent))
        self.levels.append(level)
        period, slot = self._slot(now)
        seen = self.season.setdefault(slot, deque(maxlen=max(1, self.config.history_periods)))
        if seen and seen[-1][0] == period:
            seen[-1] = (period, level)
        else:
            seen.append((period, level))
        return level

    def trend(self) -> float:
        """Slope of the recent levels, per second (least squares)."""
        n = len(self.levels)
        if n < 2:
            return 0.0
        mean_x = (n - 1) / 2
        mean_y = sum(self.levels) / n
        sxx = sum((x - mean_x) ** 2 for x in range(n))
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(self.levels))
        return sxy / sxx / self.config.sample_s

    def seasonal(self, now: float) -> float | None:
        """The highest load earlier periods had between now and `lead_s` ahead, moved by how
        far today runs above or below them now; None before a period has been seen."""
        period, _ = self._slot(now)

        def earlier(at: float) -> float | None:
            values = [v for p, v in self.season.get(self._slot(at)[1], ()) if p < period]
            return sum(values) / len(values) if values else None

        base = earlier(now)
        if base is None or not self.levels:
            return None
        offset = self.levels[-1] - base
        steps = max(1, math.ceil(self.config.lead_s / self.config.sample_s))
        ahead = [earlier(now + k * self.config.sample_s) for k in range(1, steps + 1)]
        known = [a for a in ahead if a is not None]
        return max(known) + offset if known else None

    def ahead(self, now: float) -> float:
        if not self.levels:
            return 0.0
        level = self.levels[-1]
        candidates = [level, level + self.trend() * self.config.lead_s]
        seasonal = self.seasonal(now)
        if seasonal is not None:
            candidates.append(seasonal)
        return max(0.0, *candidates)


class ForecastTide:
    """The `forecast` policy: a batch budget for the mixed pool, per resource, and the node
    moves that let batch pods use it. Pure but for its samples."""

    def __init__(self, config: TidalConfig) -> None:
        self.config = config
        self.forecasts: dict[str, Forecast] = {}
        """Per resource: its online demand, sample by sample."""
        self.budget: Amounts = {}
        """What batch pods may take on the mixed pool, per resource (as of the last sample)."""
        self.expected: Amounts = {}
        """The online demand forecast at the last sample, per resource."""
        self.drain_above: Amounts = {}
        """Batch pods on the mixed pool holding more than this of a resource are drained: all
        but what the forecast needs."""

    def decide(
        self, now: float, *, demand: Amounts, capacity: Amounts, nodes: list[MixedNode]
    ) -> list[Move]:
        """demand: the online pods' requests on the mixed pool, running or Pending, per
        resource; capacity: the mixed pool's allocatable. Returns the state changes to make
        now."""
        for resource, total in capacity.items():
            if total <= 0:
                continue  # the pool has none (GPUs on CPU nodes): nothing to lend or forecast
            forecast = self.forecasts.setdefault(resource, Forecast(self.config))
            forecast.observe(now, demand.get(resource, 0.0))
            expected = self.expected[resource] = forecast.ahead(now)
            headroom = self.config.headroom * total
            self.budget[resource] = max(0.0, total - expected - headroom)
            self.drain_above[resource] = max(0.0, total - expected)
        room = all(self.budget.get(r, 0.0) > 0 for r in EVERY_POD if capacity.get(r, 0.0) > 0)
        moves: list[Move] = []
        # The nodes kept online: those online already, the busiest with online pods first.
        keep = min(len(nodes), self.config.min_online)
        ranked = sorted(
            nodes,
            key=lambda n: (n.state not in ("online", "offline2online"), -n.online_use, n.name),
        )
        staying = {n.name for n in ranked[:keep]}
        for node in nodes:
            if node.state == "online2offline":
                moves.append(Move(node=node.name, to="offline"))
            elif node.state == "offline2online" and node.batch_pods == 0:
                moves.append(Move(node=node.name, to="online"))
            elif room and node.state == "online" and node.name not in staying:
                moves.append(Move(node=node.name, to="online2offline"))
            elif not room and node.state == "offline" and node.batch_pods == 0:
                # Nothing to lend, and nothing to drain here: back online without a cost.
                moves.append(Move(node=node.name, to="offline2online"))
        return moves
