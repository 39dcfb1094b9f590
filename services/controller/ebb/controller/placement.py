"""Which nodes a group's worker pods may land on, judged as the scheduler judges them: the
node selector the pods carry (the controller's, a tier's merged over it) and the taints their
tolerations (the controller's and a tier's) tolerate.

Capacity counts for a group only the nodes it may land on: a CPU tier is not promised room on
tainted GPU nodes, nor a GPU tier on nodes without its GPU model's label, which would leave
pods Pending while the room they were counted in goes unused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_BARS = frozenset({"NoSchedule", "NoExecute"})
"""Taint effects that keep a pod that does not tolerate them off a node (PreferNoSchedule
only discourages)."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a group's pods may go: what they carry, and so what the scheduler checks."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)

    def over(
        self, node_selector: Mapping[str, str], tolerations: Iterable[Mapping[str, Any]]
    ) -> Placement:
        """This placement with a tier's: its selector wins key by key, its tolerations add
        to these."""
        added = [dict(t) for t in tolerations if dict(t) not in self.tolerations]
        return Placement(
            node_selector={**self.node_selector, **node_selector},
            tolerations=[*self.tolerations, *added],
        )

    def admits(self, labels: Mapping[str, str], taints: Sequence[Mapping[str, Any]]) -> bool:
        """A node with these labels and taints could take the pods."""
        if any(labels.get(k) != v for k, v in self.node_selector.items()):
            return False
        return all(
            tolerated(taint, self.tolerations) for taint in taints if taint.get("effect") in _BARS
        )


def tolerated(taint: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]) -> bool:
    """Some toleration matches the taint, by Kubernetes' rules: an empty effect matches
    every effect; `Exists` matches the key (an empty key: every key) whatever the value;
    `Equal` (the default) matches key and value."""
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False
