"""Which nodes a group's worker pods may land on, judged as the scheduler judges them: the
pools their node affinity allows (ebb.controller.policy.pools), the node selector they carry (the
controller's, the job's over it, a tier's over that, the GPU type's last) and the taints their
tolerations (the controller's, the job's and a tier's) tolerate.

Capacity counts for a group only the nodes it may land on: a CPU tier is not promised room on
tainted GPU nodes, nor a GPU tier on nodes without its GPU model's label, which would leave
pods Pending while the room they were counted in goes unused. And when no node of the
cluster could ever take them (`unplaceable`), the job is told why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ebb.common.job.placement import PoolMode

from ..policy.capacity import Resources, fits
from ..policy.pools import allows

_BARS = frozenset({"NoSchedule", "NoExecute"})
"""Taint effects that keep a pod that does not tolerate them off a node (PreferNoSchedule
only discourages)."""
_PASSING = "node.kubernetes.io/"
"""The prefix of taints Kubernetes puts on a node for a while (not ready, unreachable,
cordoned, under pressure): a node so tainted may take pods later."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a group's pods may go: what they carry, and so what the scheduler checks."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    pool: PoolMode = "any"
    """The pools they may run on, and which first (ebb.controller.policy.pools)."""

    def over(
        self, node_selector: Mapping[str, str], tolerations: Iterable[Mapping[str, Any]]
    ) -> Placement:
        """This placement with a narrower one's (the job's over the controller's, a tier's
        over the job's): its selector wins key by key, its tolerations add to these."""
        added = [dict(t) for t in tolerations if dict(t) not in self.tolerations]
        return replace(
            self,
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


@dataclass(frozen=True, kw_only=True)
class NodeFacts:
    """What `unplaceable` reads of a node."""

    name: str
    pool: str
    """Its pool label's value."""
    labels: Mapping[str, str]
    taints: Sequence[Mapping[str, Any]]
    allocatable: Resources


def unplaceable(
    placement: Placement,
    shape: Resources,
    nodes: Sequence[NodeFacts],
    *,
    pool_label: str,
    gpu_label: str,
) -> str:
    """Why no node of `nodes` (ready or not, lent or not, free or full) could ever take a
    pod placed so that requests `shape`; "" if one could. The first of the pod's demands
    that no node left meets names the reason: its pool, a label of its node selector (its
    GPU type, `gpu_label`), the taints, then its size."""
    pooled = [n for n in nodes if allows(placement.pool, n.pool)]
    if not pooled:
        pools = "offline pool" if placement.pool == "offline" else "offline or mixed pool"
        return (
            f"pool {placement.pool}: no node of the cluster is in the {pools} "
            f"(node label {pool_label}: `kubectl label node NODE {pool_label}=offline`)"
        )
    for key, value in placement.node_selector.items():
        if not any(n.labels.get(key) == value for n in pooled):
            if key == gpu_label:
                return f"gpu_type {value}: no node of its pools has that GPU (label {key})"
            return f"node_selector {key}={value}: no node of its pools has that label"
    labelled = [n for n in pooled if placement.admits(n.labels, [])]
    if not labelled:
        wanted = ", ".join(f"{k}={v}" for k, v in placement.node_selector.items())
        return f"node_selector: no node of its pools has all of {wanted}"
    admitted = [n for n in labelled if placement.admits(n.labels, _lasting(n.taints))]
    if not admitted:
        barring = {
            _taint(t)
            for n in labelled
            for t in _lasting(n.taints)
            if t.get("effect") in _BARS and not tolerated(t, placement.tolerations)
        }
        return (
            "tolerations: every node it may use has a taint they do not tolerate "
            f"({', '.join(sorted(barring))})"
        )
    if not any(fits(n.allocatable, shape) for n in admitted):
        short = [
            f"{_amount(resource, amount)} (the most a node it may use has: "
            f"{_amount(resource, most)})"
            for resource, amount in sorted(shape.items())
            if amount > (most := max(n.allocatable.get(resource, 0.0) for n in admitted)) + 1e-9
        ]
        asked = ", ".join(_amount(r, v) for r, v in sorted(shape.items()))
        return "a worker asks for more than any node it may use has: " + (
            "; ".join(short) or f"no one node has all of {asked}"
        )
    return ""


def _amount(resource: str, value: float) -> str:
    if resource == "memory":
        return f"{value / 2**30:g} GiB memory"
    if resource == "cpu":
        return f"{value:g} CPUs"
    if resource.endswith("/gpu"):
        return f"{value:g} GPUs"
    return f"{value:g} {resource}"


def _lasting(taints: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [t for t in taints if not str(t.get("key") or "").startswith(_PASSING)]


def _taint(taint: Mapping[str, Any]) -> str:
    value = f"={taint['value']}" if taint.get("value") else ""
    return f"{taint.get('key', '')}{value}:{taint.get('effect', '')}"
