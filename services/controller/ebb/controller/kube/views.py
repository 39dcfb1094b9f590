"""Typed, read-only views of the Kubernetes objects the informers keep as JSON maps.

The informers keep what the API sent, untouched (no model classes on the hot path); a view
wraps one map and answers the questions the backend asks of it, each field's absence (the
API leaves out what is empty) handled here, once.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Collection
from typing import Any

from ..policy.capacity import Resources, add, quantities
from .informer import Obj

RESOURCES = ("cpu", "memory", "nvidia.com/gpu")
"""The resources capacity and the tide count, unless the controller's config names more
(KubeConfig.resources: an extended resource such as `amd.com/gpu`)."""


def _map(obj: Obj, key: str) -> Obj:
    value = obj.get(key)
    return value if isinstance(value, dict) else {}


def _list(obj: Obj, key: str) -> list[Obj]:
    value = obj.get(key)
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def parse_time(value: str | None) -> float:
    """An API timestamp as wall-clock seconds; now when there is none."""
    if not value:
        return time.time()
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class Meta:
    """An object's metadata."""

    __slots__ = ("_meta",)

    def __init__(self, obj: Obj) -> None:
        self._meta = _map(obj, "metadata")

    @property
    def name(self) -> str:
        return str(self._meta.get("name") or "")

    @property
    def namespace(self) -> str:
        return str(self._meta.get("namespace") or "")

    @property
    def uid(self) -> str:
        return str(self._meta.get("uid") or "")

    @property
    def labels(self) -> dict[str, str]:
        return _map(self._meta, "labels")

    @property
    def created(self) -> str:
        """creationTimestamp as the API wrote it (RFC 3339, sorts as time does); "" if unset."""
        return str(self._meta.get("creationTimestamp") or "")

    @property
    def deleting(self) -> bool:
        """A deletion was asked for (deletionTimestamp is set): the object is on its way out."""
        return bool(self._meta.get("deletionTimestamp"))


class PodView:
    __slots__ = ("meta", "obj")

    def __init__(self, obj: Obj) -> None:
        self.obj = obj
        self.meta = Meta(obj)

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def node(self) -> str:
        """The node the pod is bound to; "" while unscheduled."""
        return str(_map(self.obj, "spec").get("nodeName") or "")

    @property
    def phase(self) -> str:
        return str(_map(self.obj, "status").get("phase") or "Pending")

    def requests(self, resources: Collection[str] = RESOURCES) -> Resources:
        """What its containers request of `resources`. An extended resource (a GPU) may be
        given as a limit alone: Kubernetes then takes the limit as the request."""
        total: Resources = {}
        for container in _list(_map(self.obj, "spec"), "containers"):
            asked = _map(container, "resources")
            requests = {**_map(asked, "limits"), **_map(asked, "requests")}
            total = add(total, quantities({k: v for k, v in requests.items() if k in resources}))
        return total

    def cpu(self) -> float:
        return self.requests().get("cpu", 0.0)

    @property
    def unschedulable(self) -> bool:
        """The scheduler tried it and found no node with room: its PodScheduled condition is
        False for that reason. Not a pod just created (not tried yet), being bound, held by
        scheduling gates (SchedulingGated), or waiting for its volumes' claims to bind: more
        room would not place those."""
        for condition in _list(_map(self.obj, "status"), "conditions"):
            if condition.get("type") == "PodScheduled":
                return (
                    condition.get("status") == "False"
                    and condition.get("reason") == "Unschedulable"
                    and "persistentvolumeclaim" not in str(condition.get("message", "")).lower()
                )
        return False

    def could_run_on(self, labels: dict[str, str]) -> bool:
        """Its nodeSelector and required node affinity admit a node labelled `labels`
        (taints and room aside)."""
        spec = _map(self.obj, "spec")
        selector: dict[str, str] = spec.get("nodeSelector") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            return False
        required = _map(
            _map(_map(spec, "affinity"), "nodeAffinity"),
            "requiredDuringSchedulingIgnoredDuringExecution",
        )
        terms = _list(required, "nodeSelectorTerms")
        return not terms or any(_term_matches(term, labels) for term in terms)


def _term_matches(term: Obj, labels: dict[str, str]) -> bool:
    """A nodeSelectorTerm's matchExpressions all hold for `labels` (an empty term matches
    nothing, as Kubernetes reads it)."""
    expressions = _list(term, "matchExpressions")
    if not expressions:
        return False
    for e in expressions:
        key, op, values = e.get("key", ""), e.get("operator", ""), list(e.get("values") or [])
        value = labels.get(key)
        if op == "In" and value not in values:
            return False
        if op == "NotIn" and value in values:
            return False
        if op == "Exists" and value is None:
            return False
        if op == "DoesNotExist" and value is not None:
            return False
        if op in ("Gt", "Lt"):
            try:
                number, bound = int(value or ""), int(values[0])
            except (ValueError, IndexError):
                return False
            if (op == "Gt" and not number > bound) or (op == "Lt" and not number < bound):
                return False
    return True


class NodeView:
    __slots__ = ("meta", "obj")

    def __init__(self, obj: Obj) -> None:
        self.obj = obj
        self.meta = Meta(obj)

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def ready(self) -> bool:
        """Schedulable and reporting Ready."""
        if _map(self.obj, "spec").get("unschedulable"):
            return False
        for condition in _list(_map(self.obj, "status"), "conditions"):
            if condition.get("type") == "Ready":
                return bool(condition.get("status") == "True")
        return False

    def allocatable(self) -> Resources:
        allocatable: Any = _map(self.obj, "status").get("allocatable")
        return quantities(allocatable)

    def taints(self) -> list[Obj]:
        """spec.taints (Kubernetes' own form)."""
        return _list(_map(self.obj, "spec"), "taints")

    def cpu(self, default: float) -> float:
        """Allocatable CPU cores; `default` if the node does not say."""
        return self.allocatable().get("cpu", default)


def selector_matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (`a=b,c!=d,e`), as used for online pods."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.strip()) != v.strip().lstrip("="):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True
