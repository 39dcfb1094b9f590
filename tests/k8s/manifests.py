"""The `k8s/` kustomize base as data, and an RBAC authorizer over it.

No kustomize binary here: this reads the base the way `kubectl apply -k` would for what the
tests check (the listed resources, the generated ConfigMaps, the namespace set on every
namespaced object).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"

Obj = dict[str, Any]

_CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding"}


def kustomization() -> Obj:
    data: Obj = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return data


def objects() -> list[Obj]:
    """Every object the base creates, namespaced as kustomize would."""
    k = kustomization()
    out: list[Obj] = []
    for name in k["resources"]:
        out += [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    for generator in k.get("configMapGenerator", []):
        data = {}
        for entry in generator["files"]:
            key, _, path = entry.rpartition("=")
            data[key or Path(path).name] = (K8S / path).read_text()
        out.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"]},
                "data": data,
            }
        )
    for obj in out:
        if obj["kind"] not in _CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = k["namespace"]
    return out


def find(kind: str, name: str) -> Obj:
    for obj in objects():
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise KeyError(f"no {kind} {name} in k8s/")


# -- RBAC ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Access:
    """One API request, as the authorizer sees it."""

    verb: str
    group: str
    resource: str
    namespace: str | None
    name: str | None

    def __str__(self) -> str:
        where = f" in {self.namespace}" if self.namespace else " (cluster-wide)"
        what = f"{self.resource}.{self.group}" if self.group else self.resource
        return f"{self.verb} {what}{'/' + self.name if self.name else ''}{where}"


_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


def access(method: str, path: str, query: dict[str, str]) -> Access | None:
    """The RBAC view of an HTTP request; None for discovery and other non-resource paths."""
    m = _PATH.match(path)
    if m is None:
        return None
    resource, name, namespace = m["resource"], m["name"], m["ns"]
    if m["sub"]:
        resource = f"{resource}/{m['sub']}"  # pods/status, pods/eviction...
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "1") else ("get" if name else "list")
    else:
        verb = {
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if name else "deletecollection",
        }[method]
    return Access(verb, m["group"] or "", resource, namespace, name)


def _allows(rules: list[Obj], a: Access) -> bool:
    for rule in rules:
        if (
            a.group in rule.get("apiGroups", [])
            and (a.resource in rule.get("resources", []) or "*" in rule.get("resources", []))
            and (a.verb in rule.get("verbs", []) or "*" in rule.get("verbs", []))
            and (not rule.get("resourceNames") or a.name in rule["resourceNames"])
        ):
            return True
    return False


def allowed(service_account: str, namespace: str, a: Access) -> bool:
    """Would the base's RBAC let `namespace/service_account` make this request?"""
    everything = objects()
    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}

    def bound(binding: Obj) -> bool:
        return any(
            {k: s.get(k) for k in ("kind", "name", "namespace")} == subject
            for s in binding.get("subjects", [])
        )

    for binding in everything:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding") or not bound(binding):
            continue
        if binding["kind"] == "RoleBinding" and a.namespace != binding["metadata"]["namespace"]:
            continue  # a RoleBinding grants within its namespace only
        ref = binding["roleRef"]
        role = next(
            (
                o
                for o in everything
                if o["kind"] == ref["kind"]
                and o["metadata"]["name"] == ref["name"]
                and (ref["kind"] == "ClusterRole" or o["metadata"]["namespace"] == a.namespace)
            ),
            None,
        )
        if role is not None and _allows(role.get("rules", []), a):
            return True
    return False
