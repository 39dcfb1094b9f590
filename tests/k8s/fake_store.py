"""The fake API server's storage: what etcd and the apiserver's registry do, in memory.

Everything the HTTP layer and the fake kubelet change goes through `Store`, which

* keeps one global, monotonically increasing resourceVersion (etcd's revision);
* records every change in a bounded history, so watches can resume from a resourceVersion and
  exact lists can be served from the past, and answers 410 Expired once that history is gone;
* applies each resource's create/update/delete rules (defaulting, validation, status kept apart
  from spec, graceful deletion, finalizers), so that clients see the same answers a real
  server gives, including the awkward ones.

Stored objects are never changed in place: every write stores a new dict. That lets a `Change`
share the stored dict, and readers get deep copies.
"""

from __future__ import annotations

import base64
import copy
import random
import re
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

Obj = dict[str, Any]

TERMINAL_PHASES = ("Succeeded", "Failed")


# --------------------------------------------------------------------------------------------
# Errors: an HTTP code plus the Status object the real server sends with it.
# --------------------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: Obj | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> Obj:
        status: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            status["details"] = self.details
        return status


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def expired(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


# --------------------------------------------------------------------------------------------
# Resource types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    # With a status subresource, writes to the object keep its status and writes to /status
    # keep everything else: a controller that "sets" pod status through the main resource is
    # silently ignored by a real server, and must be here too.
    status_subresource: bool = False
    create_on_update: bool = False  # PUT of a missing object creates it (leases, events)
    return_deleted_object: bool = False  # DELETE answers with the object, not a Status
    field_labels: tuple[str, ...] = ()  # fields a fieldSelector may name, beyond metadata.*

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How error messages name the resource: `pods`, `leases.coordination.k8s.io`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def selectable_fields(self) -> tuple[str, ...]:
        scope = ("metadata.name", "metadata.namespace") if self.namespaced else ("metadata.name",)
        return scope + self.field_labels

    def details(self, name: str) -> Obj:
        details: Obj = {"name": name, "kind": self.plural}
        if self.group:
            details["group"] = self.group
        return details

    def not_found(self, name: str) -> ApiError:
        return ApiError(
            404, "NotFound", f'{self.qualified} "{name}" not found', details=self.details(name)
        )

    def already_exists(self, name: str) -> ApiError:
        return ApiError(
            409,
            "AlreadyExists",
            f'{self.qualified} "{name}" already exists',
            details=self.details(name),
        )

    def conflict(self, name: str, why: str) -> ApiError:
        return ApiError(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {self.qualified} "{name}": {why}',
            details=self.details(name),
        )


PODS = ResourceType(
    "",
    "v1",
    "pods",
    "Pod",
    namespaced=True,
    status_subresource=True,
    return_deleted_object=True,
    field_labels=(
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ),
)
NODES = ResourceType(
    "",
    "v1",
    "nodes",
    "Node",
    namespaced=False,
    status_subresource=True,
    field_labels=("spec.unschedulable",),
)
NAMESPACES = ResourceType(
    "",
    "v1",
    "namespaces",
    "Namespace",
    namespaced=False,
    status_subresource=True,
    return_deleted_object=True,
    field_labels=("status.phase",),
)
EVENTS = ResourceType(
    "",
    "v1",
    "events",
    "Event",
    namespaced=True,
    create_on_update=True,
    field_labels=(
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    ),
)
LEASES = ResourceType(
    "coordination.k8s.io", "v1", "leases", "Lease", namespaced=True, create_on_update=True
)

DEPLOYMENTS = ResourceType(
    "apps", "v1", "deployments", "Deployment", namespaced=True, status_subresource=True
)
PRIORITY_CLASSES = ResourceType(
    "scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", namespaced=False
)
SECRETS = ResourceType("", "v1", "secrets", "Secret", namespaced=True, field_labels=("type",))

RESOURCES: tuple[ResourceType, ...] = (
    PODS,
    NODES,
    NAMESPACES,
    EVENTS,
    LEASES,
    DEPLOYMENTS,
    PRIORITY_CLASSES,
    SECRETS,
)

SYSTEM_PRIORITY_CLASSES: tuple[Obj, ...] = (
    {"metadata": {"name": "system-cluster-critical"}, "value": 2_000_000_000},
    {"metadata": {"name": "system-node-critical"}, "value": 2_000_001_000},
)
"""The classes every real API server creates at start."""


def lookup(group: str, version: str, plural: str) -> ResourceType | None:
    for rt in RESOURCES:
        if (rt.group, rt.version, rt.plural) == (group, version, plural):
            return rt
    return None


# --------------------------------------------------------------------------------------------
# Small value helpers shared with the kubelet
# --------------------------------------------------------------------------------------------

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY_RE = re.compile(
    r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(?:(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE]([+-]?[0-9]+))?"
)


def parse_quantity(value: Any) -> Fraction:
    """A resource quantity ("500m", "32Gi", "1e3", 4) as an exact number."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Fraction(str(value))
    m = _QUANTITY_RE.fullmatch(str(value))
    if m is None:
        raise ValueError(
            "quantities must match the regular expression "
            "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
        )
    number = Fraction(m[1])
    if m[2] in _BINARY:
        return number * _BINARY[m[2]]
    exponent = int(m[3]) if m[3] is not None else _DECIMAL[m[2] or ""]
    return number * Fraction(10) ** exponent


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_rfc3339(offset_seconds: float = 0) -> str:
    return rfc3339(datetime.now(UTC) + timedelta(seconds=offset_seconds))


def _micro_time(value: Any, field: str) -> str:
    """Leases carry MicroTime; the server re-renders whatever RFC 3339 form the client sent."""
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        raise bad_request(f"{field}: invalid time {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------------------------
# Validation: 422 Invalid with the field causes the real server reports
# --------------------------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_SUBDOMAIN_HELP = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
    "'-' or '.', and must start and end with an alphanumeric character"
)
_RESTART_POLICIES = ("Always", "OnFailure", "Never")
_PREEMPTION_POLICIES = ("Never", "PreemptLowerPriority")


class _Causes:
    def __init__(self) -> None:
        self.causes: list[tuple[str, str, str]] = []  # (reason, field, message)

    def required(self, field: str, detail: str = "") -> None:
        self.causes.append(
            ("FieldValueRequired", field, "Required value" + (f": {detail}" if detail else ""))
        )

    def invalid(self, field: str, value: Any, detail: str) -> None:
        self.causes.append(
            ("FieldValueInvalid", field, f"Invalid value: {_go_repr(value)}: {detail}")
        )

    def unsupported(self, field: str, value: Any, supported: Iterable[str]) -> None:
        choices = ", ".join(f'"{s}"' for s in supported)
        message = f"Unsupported value: {_go_repr(value)}: supported values: {choices}"
        self.causes.append(("FieldValueNotSupported", field, message))

    def duplicate(self, field: str, value: Any) -> None:
        self.causes.append(("FieldValueDuplicate", field, f"Duplicate value: {_go_repr(value)}"))

    def forbidden(self, field: str, detail: str) -> None:
        self.causes.append(("FieldValueForbidden", field, f"Forbidden: {detail}"))

    def raise_if_any(self, rt: ResourceType, name: str) -> None:
        if not self.causes:
            return
        parts = [f"{field}: {message}" for _, field, message in self.causes]
        summary = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
        details = rt.details(name)
        details["kind"] = rt.kind
        details["causes"] = [
            {"reason": reason, "message": message, "field": field}
            for reason, field, message in self.causes
        ]
        raise ApiError(422, "Invalid", f'{rt.kind} "{name}" is invalid: {summary}', details=details)


def _go_repr(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _validate_name(causes: _Causes, rt: ResourceType, name: str) -> None:
    if rt is NAMESPACES:
        if len(name) > 63 or not _DNS_LABEL.fullmatch(name):
            causes.invalid(
                "metadata.name",
                name,
                "a lowercase RFC 1123 label must consist of "
                "lower case alphanumeric characters or '-'",
            )
    elif len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        causes.invalid("metadata.name", name, _SUBDOMAIN_HELP)


def _validate_labels(causes: _Causes, meta: Obj) -> None:
    for field in ("labels", "annotations"):
        values = meta.get(field) or {}
        if not isinstance(values, dict):
            causes.invalid(f"metadata.{field}", values, "must be a map of strings")
            continue
        for key, value in values.items():
            prefix, _, name = key.rpartition("/")
            if (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix)) or not (
                len(name) <= 63 and _LABEL_NAME.fullmatch(name)
            ):
                causes.invalid(
                    f"metadata.{field}",
                    key,
                    "name part must consist of alphanumeric characters, '-', '_' or '.'",
                )
            if not isinstance(value, str):
                causes.invalid(f"metadata.{field}", value, "must be a string")
            elif field == "labels" and (len(value) > 63 or not _LABEL_VALUE.fullmatch(value)):
                causes.invalid(
                    "metadata.labels",
                    value,
                    "a valid label must be an empty string or consist of alphanumeric characters",
                )


def _validate_pod(causes: _Causes, pod: Obj) -> None:
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        causes.required("spec")
        return
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        causes.required("spec.containers")
        return
    seen: set[str] = set()
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or []):
            field = f"spec.{kind}[{i}]"
            name = container.get("name")
            if not name:
                causes.required(f"{field}.name")
            elif len(name) > 63 or not _DNS_LABEL.fullmatch(name):
                causes.invalid(f"{field}.name", name, "a lowercase RFC 1123 label")
            elif name in seen:
                causes.duplicate(f"{field}.name", name)
            seen.add(name or "")
            if not container.get("image"):
                causes.required(f"{field}.image")
            _validate_resources(causes, f"{field}.resources", container.get("resources") or {})
    policy = spec.get("restartPolicy")
    if policy not in _RESTART_POLICIES:
        causes.unsupported("spec.restartPolicy", policy, _RESTART_POLICIES)


def _validate_resources(causes: _Causes, field: str, resources: Obj) -> None:
    parsed: dict[str, dict[str, Fraction]] = {"requests": {}, "limits": {}}
    for which, amounts in parsed.items():
        for resource, value in (resources.get(which) or {}).items():
            try:
                amounts[resource] = parse_quantity(value)
            except ValueError as e:
                causes.invalid(f"{field}.{which}[{resource}]", value, str(e))
    for resource, request in parsed["requests"].items():
        limit = parsed["limits"].get(resource)
        if limit is not None and request > limit:
            given, most = resources["requests"][resource], resources["limits"][resource]
            causes.invalid(
                f"{field}.requests",
                str(given),
                f"must be less than or equal to {resource} limit of {most}",
            )


# Pod specs are immutable but for these fields (what the real server allows).
_POD_MUTABLE_SPEC = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds")


def _validate_pod_update(causes: _Causes, new: Obj, old: Obj) -> None:
    def comparable(spec: Obj) -> Obj:
        spec = {k: v for k, v in spec.items() if k not in _POD_MUTABLE_SPEC}
        for kind in ("containers", "initContainers"):
            if kind in spec:
                spec[kind] = [{k: v for k, v in c.items() if k != "image"} for c in spec[kind]]
        return spec

    if comparable(new.get("spec") or {}) != comparable(old.get("spec") or {}):
        causes.forbidden(
            "spec",
            "pod updates may not change fields other than `spec.containers[*].image`,"
            "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
            "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds`",
        )


def _validate(rt: ResourceType, obj: Obj, old: Obj | None) -> None:
    causes = _Causes()
    meta = obj["metadata"]
    _validate_name(causes, rt, meta["name"])
    _validate_labels(causes, meta)
    if rt is PODS:
        _validate_pod(causes, obj)
        if old is not None:
            _validate_pod_update(causes, obj, old)
    elif rt is PRIORITY_CLASSES:
        value = obj.get("value")
        if not isinstance(value, int) or isinstance(value, bool):
            causes.required("value")
        elif value > 1_000_000_000 and not meta["name"].startswith("system-"):
            causes.forbidden(
                "value", "maximum allowed value of a user defined priority is 1000000000"
            )
        if obj.get("preemptionPolicy") not in _PREEMPTION_POLICIES:
            causes.unsupported(
                "preemptionPolicy", obj.get("preemptionPolicy"), _PREEMPTION_POLICIES
            )
        if old is not None and old.get("value") != value:
            causes.invalid("value", value, "field is immutable")
    elif rt is SECRETS:
        _validate_secret(causes, obj, old)
    elif rt is LEASES:
        spec = obj.get("spec") or {}
        duration = spec.get("leaseDurationSeconds")
        if duration is not None and (not isinstance(duration, int) or duration <= 0):
            causes.invalid("spec.leaseDurationSeconds", duration, "must be greater than 0")
        transitions = spec.get("leaseTransitions")
        if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
            causes.invalid(
                "spec.leaseTransitions", transitions, "must be greater than or equal to 0"
            )
    causes.raise_if_any(rt, meta["name"])


_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def _validate_secret(causes: _Causes, secret: Obj, old: Obj | None) -> None:
    data = secret.get("data") or {}
    if not isinstance(data, dict):
        causes.invalid("data", data, "must be a map of strings")
        return
    for key, value in data.items():
        if len(key) > 253 or not _SECRET_KEY.fullmatch(key):
            causes.invalid(
                f"data[{key}]",
                key,
                "a valid config key must consist of alphanumeric characters, '-', '_' or '.'",
            )
        try:
            base64.b64decode(str(value), validate=True)
        except ValueError:
            causes.invalid(f"data[{key}]", "<secret contents redacted>", "illegal base64 data")
    if old is None:
        return
    if old.get("type", "Opaque") != secret.get("type", "Opaque"):
        causes.invalid("type", secret.get("type"), "field is immutable")
    if old.get("immutable"):
        if not secret.get("immutable"):
            causes.forbidden("immutable", "field is immutable when `immutable` is set")
        if (old.get("data") or {}) != data:
            causes.forbidden("data", "field is immutable when `immutable` is set")


def _normalize_secret(secret: Obj) -> None:
    """stringData is write-only: the API server folds it into data (base64), where it wins
    over a key of the same name."""
    string_data = secret.pop("stringData", None) or {}
    if isinstance(string_data, dict) and string_data:
        data = secret.get("data")
        data = dict(data) if isinstance(data, dict) else {}
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        secret["data"] = data
    secret.setdefault("type", "Opaque")


# --------------------------------------------------------------------------------------------
# Defaulting: what admission and defaulting add to a new object
# --------------------------------------------------------------------------------------------


def _default_pod(pod: Obj) -> None:
    spec = pod.setdefault("spec", {})
    if not isinstance(spec, dict):
        return  # validation reports it
    for key, value in (
        ("restartPolicy", "Always"),
        ("terminationGracePeriodSeconds", 30),
        ("dnsPolicy", "ClusterFirst"),
        ("schedulerName", "default-scheduler"),
        ("serviceAccountName", "default"),
        ("serviceAccount", "default"),
        ("securityContext", {}),
        ("enableServiceLinks", True),
    ):
        spec.setdefault(key, value)
    # The DefaultTolerationSeconds admission plugin adds these to every pod.
    tolerations = spec.setdefault("tolerations", [])
    for taint in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        if not any(t.get("key") == taint for t in tolerations):
            tolerations.append(
                {
                    "key": taint,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                }
            )
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or []:
            image = str(container.get("image", ""))
            tagged = "@" in image or ":" in image.rsplit("/", 1)[-1]
            latest = not tagged or image.endswith(":latest")
            container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            container.setdefault("terminationMessagePolicy", "File")
            resources = container.setdefault("resources", {})
            # Limits without requests default the requests: the scheduler then counts them.
            if resources.get("limits"):
                requests = resources.setdefault("requests", {})
                for resource, value in resources["limits"].items():
                    requests.setdefault(resource, value)
    pod["status"] = {"phase": "Pending", "qosClass": _qos_class(spec)}


def _qos_class(spec: Obj) -> str:
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    requests = [(c.get("resources") or {}).get("requests") or {} for c in containers]
    limits = [(c.get("resources") or {}).get("limits") or {} for c in containers]
    if not any(requests) and not any(limits):
        return "BestEffort"
    for req, lim in zip(requests, limits, strict=True):
        for resource in ("cpu", "memory"):
            if resource not in lim or str(req.get(resource)) != str(lim[resource]):
                return "Burstable"
    return "Guaranteed"


def _prepare_create(rt: ResourceType, obj: Obj, namespace: str) -> None:
    meta = obj["metadata"]
    obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
    if rt.namespaced:
        meta["namespace"] = namespace
    else:
        meta.pop("namespace", None)
    meta["uid"] = str(uuid.uuid4())
    meta["creationTimestamp"] = now_rfc3339()
    for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
        meta.pop(field, None)
    if rt is PODS:
        _default_pod(obj)
    elif rt is NAMESPACES:
        obj["spec"] = {"finalizers": ["kubernetes"]}
        obj["status"] = {"phase": "Active"}
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
    elif rt is LEASES:
        _normalize_lease(obj)
    elif rt is PRIORITY_CLASSES:
        obj.setdefault("preemptionPolicy", "PreemptLowerPriority")
    elif rt is SECRETS:
        _normalize_secret(obj)


def _normalize_lease(lease: Obj) -> None:
    spec = lease.get("spec") or {}
    for field in ("acquireTime", "renewTime"):
        if spec.get(field) is not None:
            spec[field] = _micro_time(spec[field], f"spec.{field}")


_IMMUTABLE_META = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
)


def _prepare_update(rt: ResourceType, new: Obj, old: Obj, subresource: str | None) -> Obj:
    new["apiVersion"], new["kind"] = rt.api_version, rt.kind
    meta = new.setdefault("metadata", {})
    for field in _IMMUTABLE_META:
        if field in old["metadata"]:
            meta[field] = old["metadata"][field]
        else:
            meta.pop(field, None)
    if rt.status_subresource:
        if subresource == "status":
            # /status writes change only the status (and labels/annotations, as pods allow).
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status", {})
            for field in ("labels", "annotations"):
                if field in meta:
                    merged["metadata"][field] = meta[field]
            new = merged
        elif "status" in old:
            new["status"] = copy.deepcopy(old["status"])
        else:
            new.pop("status", None)
    if rt is LEASES:
        _normalize_lease(new)
    elif rt is SECRETS:
        _normalize_secret(new)
    return new


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------

Key = tuple[ResourceType, str, str]  # (resource, namespace or "", name)


@dataclass(frozen=True)
class Change:
    """One write, as a watch reports it. `obj` is the state after the write (for DELETED: the
    last state, carrying the deletion's resourceVersion); `prev` the state before it."""

    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    rt: ResourceType
    obj: Obj
    prev: Obj | None


def key_of(rt: ResourceType, obj: Obj) -> Key:
    meta = obj["metadata"]
    return (rt, meta.get("namespace", "") if rt.namespaced else "", meta["name"])


def _deletion_due(obj: Obj) -> bool:
    """Deleted once the grace period is over (for pods: the kubelet says so by setting it to 0)
    and no finalizer holds the object back."""
    meta = obj["metadata"]
    return (
        bool(meta.get("deletionTimestamp"))
        and not meta.get("finalizers")
        and meta.get("deletionGracePeriodSeconds", 0) == 0
    )


def _without_rv(obj: Obj) -> Obj:
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    return {**obj, "metadata": meta}


_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the real generator's alphabet: no vowels, no 0/1/3


class Store:
    def __init__(self, *, history_limit: int = 1000) -> None:
        self.rv = 0
        self._objects: dict[Key, Obj] = {}
        self._history: deque[Change] = deque()
        self._history_limit = history_limit
        # Every change after this resourceVersion is still in the history.
        self._oldest = 0
        self._listeners: list[Callable[[Change], None]] = []

    # ---- reading ---------------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str, name: str) -> Obj | None:
        obj = self._objects.get((rt, namespace if rt.namespaced else "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def objects(self, rt: ResourceType, namespace: str | None = None) -> list[Obj]:
        """Current objects in etcd's order: by namespace, then name."""
        return [
            copy.deepcopy(obj)
            for key, obj in sorted(self._objects.items(), key=lambda kv: kv[0][1:])
            if key[0] is rt and (namespace is None or key[1] == namespace)
        ]

    def view(self, rt: ResourceType, namespace: str | None = None) -> list[Obj]:
        """The stored objects themselves, in the same order, for readers that never change
        them (the fake kubelet reads every pod on every pass: copies would dominate)."""
        return [
            obj
            for key, obj in sorted(self._objects.items(), key=lambda kv: kv[0][1:])
            if key[0] is rt and (namespace is None or key[1] == namespace)
        ]

    def objects_at(self, rt: ResourceType, rv: int) -> list[Obj]:
        """The objects as they were at resourceVersion `rv`, rebuilt by undoing later changes."""
        if rv < self._oldest:
            raise expired("The resourceVersion for the provided list is too old.")
        self.require_reached(rv)
        state = {k: v for k, v in self._objects.items() if k[0] is rt}
        for change in reversed(self._history):
            if change.rv <= rv:
                break
            if change.rt is not rt:
                continue
            key = key_of(rt, change.obj)
            if change.type == "ADDED":
                state.pop(key, None)
            elif change.prev is not None:
                state[key] = change.prev
        return [copy.deepcopy(obj) for _, obj in sorted(state.items(), key=lambda kv: kv[0][1:])]

    def require_reached(self, rv: int) -> None:
        """A resourceVersion from the future: the real server waits a few seconds for it, then
        gives up with this."""
        if rv > self.rv:
            raise ApiError(
                504,
                "Timeout",
                f"Too large resource version: {rv}, current: {self.rv}",
                details={"causes": [{"reason": "ResourceVersionTooLarge"}], "retryAfterSeconds": 1},
            )

    def changes_since(self, rv: int) -> list[Change]:
        if rv < self._oldest:
            raise expired(f"too old resource version: {rv} ({self._oldest})")
        return [c for c in self._history if c.rv > rv]

    def subscribe(self, listener: Callable[[Change], None]) -> Callable[[], None]:
        """Call `listener` synchronously on every change, so a subscriber that reads the
        history and subscribes without awaiting in between misses nothing."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def compact(self) -> None:
        self._history.clear()
        self._oldest = self.rv

    # ---- writes through the API: defaulting, validation, preconditions ---------------------

    def create(self, rt: ResourceType, namespace: str, body: Any, *, dry_run: bool = False) -> Obj:
        obj = _as_object(body, rt)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            raise ApiError(
                500,
                "InternalError",
                "Internal error occurred: resourceVersion should not be set on objects to be "
                "created",
            )
        if rt.namespaced:
            self._require_namespace(namespace)
        generate = not meta.get("name") and meta.get("generateName")
        for _ in range(8):
            if generate:
                suffix = "".join(random.choices(_NAME_CHARS, k=5))
                meta["name"] = f"{meta['generateName']}{suffix}"
            if not meta.get("name"):
                causes = _Causes()
                causes.required("metadata.name", "name or generateName is required")
                causes.raise_if_any(rt, "")
            _prepare_create(rt, obj, namespace)
            _validate(rt, obj, None)
            if rt is PODS:
                self._admit_priority(obj)
            key = key_of(rt, obj)
            if key not in self._objects:
                break
            if not generate:
                raise rt.already_exists(meta["name"])
        else:
            raise rt.already_exists(meta["name"])
        if dry_run:
            return obj
        return copy.deepcopy(self._commit("ADDED", key, obj, None))

    def update(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> tuple[Obj, bool]:
        """Replace an object; returns it and whether it was created."""
        key: Key = (rt, namespace if rt.namespaced else "", name)
        obj = _as_object(body, rt)
        meta = obj["metadata"]
        if meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL "
                f"({name})"
            )
        meta["name"] = name
        old = self._objects.get(key)
        if old is None:
            if rt.create_on_update and subresource is None:
                meta.pop("resourceVersion", None)
                return self.create(rt, namespace, obj, dry_run=dry_run), True
            raise rt.not_found(name)
        self._check_preconditions(rt, old, meta.get("uid"), meta.get("resourceVersion"))
        new = _prepare_update(rt, obj, old, subresource)
        _validate(rt, new, old)
        if _without_rv(new) == _without_rv(old):
            return copy.deepcopy(old), False  # a no-op write: no new resourceVersion, no event
        if dry_run:
            return new, False
        stored = self._commit("DELETED" if _deletion_due(new) else "MODIFIED", key, new, old)
        return copy.deepcopy(stored), False

    def delete(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        *,
        grace_period: int | None = None,
        uid: str | None = None,
        resource_version: str | None = None,
        dry_run: bool = False,
    ) -> tuple[Obj, bool]:
        """Delete (or begin deleting) an object; returns its state and whether it is gone."""
        key: Key = (rt, namespace if rt.namespaced else "", name)
        old = self._objects.get(key)
        if old is None:
            raise rt.not_found(name)
        self._check_preconditions(rt, old, uid, resource_version)
        if rt is NAMESPACES and not dry_run:
            # No namespace controller here: the contents go at once, with the namespace.
            for k in [k for k in self._objects if k[0].namespaced and k[1] == name]:
                self._commit("DELETED", k, self._objects[k], self._objects[k])
        grace = self._grace_period(rt, old, grace_period)
        meta = old["metadata"]
        terminating = bool(meta.get("deletionTimestamp"))
        if terminating and grace >= meta.get("deletionGracePeriodSeconds", 0):
            return copy.deepcopy(old), False  # only a shorter grace period changes anything
        new = copy.deepcopy(old)
        new["metadata"]["deletionTimestamp"] = now_rfc3339(grace)
        new["metadata"]["deletionGracePeriodSeconds"] = grace
        gone = _deletion_due(new)
        if dry_run:
            return new, gone
        if gone and not terminating:
            return copy.deepcopy(self._commit("DELETED", key, old, old)), True
        return copy.deepcopy(self._commit("DELETED" if gone else "MODIFIED", key, new, old)), gone

    # ---- writes by the fake kubelet and test helpers: no validation ------------------------

    def mutate(
        self, rt: ResourceType, namespace: str, name: str, change: Callable[[Obj], None]
    ) -> Obj | None:
        """Apply `change` to a copy of the object and store it if it differs."""
        key: Key = (rt, namespace if rt.namespaced else "", name)
        old = self._objects.get(key)
        if old is None:
            return None
        new = copy.deepcopy(old)
        change(new)
        if _without_rv(new) == _without_rv(old):
            return copy.deepcopy(old)
        return copy.deepcopy(
            self._commit("DELETED" if _deletion_due(new) else "MODIFIED", key, new, old)
        )

    def remove(self, rt: ResourceType, namespace: str, name: str) -> Obj | None:
        key: Key = (rt, namespace if rt.namespaced else "", name)
        old = self._objects.get(key)
        if old is None:
            return None
        return copy.deepcopy(self._commit("DELETED", key, old, old))

    # ---- internals -------------------------------------------------------------------------

    def _commit(self, kind: str, key: Key, obj: Obj, prev: Obj | None) -> Obj:
        """Store a write under the next resourceVersion and tell every listener; returns the
        object as stored (for DELETED: as last seen)."""
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        if kind == "DELETED":
            del self._objects[key]
        else:
            self._objects[key] = obj
        change = Change(self.rv, kind, key[0], obj, prev)
        if len(self._history) >= self._history_limit:
            self._oldest = self._history.popleft().rv
        self._history.append(change)
        for listener in list(self._listeners):
            listener(change)
        return obj

    def _admit_priority(self, pod: Obj) -> None:
        """The Priority admission plugin: `priorityClassName` (or the global default class)
        resolved to spec.priority and spec.preemptionPolicy; a class that does not exist, or a
        priority the pod sets itself that differs from its class's, is forbidden."""
        spec = pod["spec"]
        name = spec.get("priorityClassName") or ""
        classes = [o for k, o in self._objects.items() if k[0] is PRIORITY_CLASSES]
        if name:
            found = next((c for c in classes if c["metadata"]["name"] == name), None)
            if found is None:
                raise _forbidden(pod, f"no PriorityClass with name {name} was found")
        else:
            defaults = [c for c in classes if c.get("globalDefault")]
            # Of several global defaults, the real plugin takes the lowest value.
            found = min(defaults, key=lambda c: int(c.get("value", 0)), default=None)
        value = int(found.get("value", 0)) if found else 0
        policy = (found or {}).get("preemptionPolicy") or "PreemptLowerPriority"
        given = spec.get("priority")
        if given is not None and given != value:
            raise _forbidden(
                pod,
                f"the integer value of priority ({given}) must not be provided in pod spec; "
                f"priority admission controller computed {value} from the given PriorityClass "
                "name",
            )
        given_policy = spec.get("preemptionPolicy")
        if given_policy is not None and given_policy != policy:
            raise _forbidden(
                pod,
                f"the string value of PreemptionPolicy ({given_policy}) must not be provided in "
                f"pod spec; priority admission controller computed {policy} from the given "
                "PriorityClass name",
            )
        spec["priority"] = value
        spec["preemptionPolicy"] = policy
        if found is not None:
            spec["priorityClassName"] = found["metadata"]["name"]

    def _require_namespace(self, namespace: str) -> None:
        if (NAMESPACES, "", namespace) not in self._objects:
            raise NAMESPACES.not_found(namespace)

    def _check_preconditions(
        self, rt: ResourceType, old: Obj, uid: str | None, resource_version: str | None
    ) -> None:
        meta = old["metadata"]
        if uid and uid != meta["uid"]:
            raise rt.conflict(
                meta["name"],
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: "
                f"{meta['uid']}",
            )
        if resource_version and resource_version != meta["resourceVersion"]:
            raise rt.conflict(
                meta["name"],
                "the object has been modified; please apply your changes to the latest version "
                "and try again",
            )

    @staticmethod
    def _grace_period(rt: ResourceType, obj: Obj, requested: int | None) -> int:
        if rt is not PODS:
            return 0  # only pods delete gracefully; finalizers hold other objects back
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        # A pod no kubelet runs (unscheduled, or already finished) has nobody to wait for.
        if not spec.get("nodeName") or status.get("phase") in TERMINAL_PHASES:
            return 0
        if requested is None:
            requested = spec.get("terminationGracePeriodSeconds", 30)
        return max(int(requested), 0)


def _forbidden(pod: Obj, why: str) -> ApiError:
    name = pod["metadata"]["name"]
    return ApiError(
        403, "Forbidden", f'pods "{name}" is forbidden: {why}', details=PODS.details(name)
    )


def _as_object(body: Any, rt: ResourceType) -> Obj:
    if not isinstance(body, dict):
        raise bad_request(f"the body of the request must be a {rt.kind} object")
    obj = copy.deepcopy(body)
    for field, expected in (("apiVersion", rt.api_version), ("kind", rt.kind)):
        if obj.get(field) not in (None, "", expected):
            raise bad_request(
                f"the {field} in the data ({obj[field]}) does not match the expected {field} "
                f"({expected})"
            )
    if not isinstance(obj.setdefault("metadata", {}), dict):
        raise bad_request("metadata must be an object")
    return obj
