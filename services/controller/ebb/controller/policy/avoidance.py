"""Nodes where worker pods keep failing, avoided for a while."""

from __future__ import annotations

import logging
from collections import defaultdict, deque

from .failures import Failure

log = logging.getLogger(__name__)


class NodeAvoidance:
    """Counts failed worker pods per node, each pod once; a node with `after` failures
    within `window_s` is avoided for `for_s`. Times are the event loop's clock."""

    def __init__(self, *, after: int, window_s: float, for_s: float) -> None:
        self.after = after
        self.window_s = window_s
        self.for_s = for_s
        self._failures: dict[str, deque[float]] = defaultdict(deque)
        self._until: dict[str, float] = {}
        self._seen: set[str] = set()

    def note_failure(self, *, pod_uid: str, node: str, failure: Failure | None, now: float) -> None:
        """A worker pod `pod_uid` failed on `node`: count it against the node, once."""
        if pod_uid in self._seen or not node:
            return
        self._seen.add(pod_uid)
        if failure is not None and failure.kind == "capacity":
            return  # evicted or preempted: not the node's fault
        history = self._failures[node]
        history.append(now)
        while history and history[0] < now - self.window_s:
            history.popleft()
        if len(history) >= self.after:
            self._until[node] = now + self.for_s
            history.clear()
            log.warning("node %s: worker pods keep failing there; avoiding it", node)

    def avoids(self, node: str, now: float) -> bool:
        return self._until.get(node, 0.0) > now

    def avoided(self, now: float) -> list[str]:
        """The nodes avoided at `now`, sorted."""
        return sorted(n for n, until in self._until.items() if until > now)
