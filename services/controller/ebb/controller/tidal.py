"""Tidal harvesting of the mixed pool: lend nodes to batch work while online load is low, take
them back when it rises.

Each mixed node carries a label `ebb.io/tidal` with its state:

    online --lend--> online2offline --(next sample)--> offline --reclaim--> offline2online
      ^                                                                          |
      +---------------------(its batch pods are gone)----------------------------+

Batch workers may be placed only on `offline` mixed nodes (and the offline pool). Reclaiming
a node drains its batch pods, gracefully; once none is left it is online again.

The online utilisation of the mixed pool (online pods' requests over allocatable) is sampled
every `sample_s` and smoothed as the median of the last `window` samples, so that a spike of
one sample changes nothing. Nodes are lent while the smoothed utilisation of the nodes that
would stay online remains under `lend_below`; they are reclaimed, fewest batch pods first, as
soon as it rises over `reclaim_above` or an online pod cannot be scheduled (Pending), without
waiting for smoothing. After a reclaim, nothing is lent for `cooldown_s`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

State = Literal["online", "online2offline", "offline", "offline2online"]
STATES: tuple[State, ...] = ("online", "online2offline", "offline", "offline2online")
LABEL = "ebb.io/tidal"


@dataclass(frozen=True, kw_only=True)
class TidalConfig:
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
    """Its online pods' requests over its allocatable: the least used are lent first."""


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
