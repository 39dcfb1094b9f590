"""Scraping under the Prometheus Operator: the PodMonitors of k8s/components/monitoring (in
the prod overlay) select the pods that serve metrics, on ports those pods have; NATS's
exporter reads the server's monitoring port inside the pod and asks for what the dashboard
shows; only monitoring pods may reach either port."""

from __future__ import annotations

from typing import Any

from ebb.controller.kube.backend import KubeConfig
from ebb.controller.kube.podspec import worker_pod

from .manifests import BASE, PROD, Obj, find, objects


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions)."""
    if not selector:
        return False  # a PodMonitor with an empty selector would scrape everything
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        value, values = labels.get(e["key"]), e.get("values") or []
        ok = {
            "In": value in values,
            "NotIn": value not in values,
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[e["operator"]]
        if not ok:
            return False
    return True


def pods() -> dict[str, Obj]:
    """Every pod the overlay runs, and a worker pod as the controller makes it: name to pod."""
    out = {
        o["metadata"]["name"]: o["spec"]["template"]
        for o in objects(PROD)
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
    }
    out["a worker"] = worker_pod(
        "job-1",
        KubeConfig(tidal=None, metrics_port=9400),
        worker_id="w-1",
        shape={"cpu": 1.0, "memory": 2**30},
        avoid=[],
    )
    return out


def port_names(pod: Obj) -> set[str]:
    spec: Any = pod["spec"]
    return {p["name"] for c in spec["containers"] for p in c.get("ports") or [] if "name" in p}


def scraped_by(monitor: Obj) -> dict[str, Obj]:
    return {
        name: pod
        for name, pod in pods().items()
        if matches(monitor["spec"]["selector"], pod["metadata"].get("labels") or {})
    }


def test_ebbs_podmonitor_scrapes_the_master_the_controller_and_every_worker() -> None:
    monitor = find("PodMonitor", "ebb", PROD)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    scraped = scraped_by(monitor)
    assert set(scraped) == {
        "ebb-master",
        "ebb-controller",
        "ebb-gateway",
        "ebb-model-cache",
        "a worker",
    }
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["path"] == "/metrics"
        for name, pod in scraped.items():
            assert endpoint["port"] in port_names(pod), name


def test_the_nats_podmonitor_scrapes_the_exporter_beside_each_server() -> None:
    monitor = find("PodMonitor", "ebb-nats", PROD)
    scraped = scraped_by(monitor)
    assert set(scraped) == {"ebb-nats"}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    containers = {c["name"]: c for c in scraped["ebb-nats"]["spec"]["containers"]}
    exporter = containers["exporter"]
    ports = {p["name"]: p["containerPort"] for p in exporter["ports"]}
    assert endpoint["port"] in ports
    args = exporter["args"]
    assert args[args.index("-port") + 1] == str(ports[endpoint["port"]])
    # Streams and consumers too (the dashboard's storage and lag panels), from the server's
    # own monitoring port, reached inside the pod.
    assert "-jsz=all" in args
    monitor_port = {p["name"]: p["containerPort"] for p in containers["nats"]["ports"]}["monitor"]
    assert args[-1] == f"http://localhost:{monitor_port}"


def test_the_base_has_no_custom_resources_and_the_prod_overlay_has_the_monitors() -> None:
    assert not [o for o in objects(BASE) if o["apiVersion"].startswith("monitoring.coreos.com")]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects(PROD)}
    assert {("PodMonitor", "ebb"), ("PodMonitor", "ebb-nats")} <= kinds


def test_only_monitoring_pods_reach_the_exporter_and_the_monitoring_port() -> None:
    for root in (BASE, PROD):
        policy = find("NetworkPolicy", "ebb-nats", root)
        by_port = {
            port["port"]: rule["from"]
            for rule in policy["spec"]["ingress"]
            for port in rule["ports"]
        }
        for port in (7777, 8222):
            assert all(
                peer["podSelector"]["matchLabels"] == {"ebb.io/monitoring": "true"}
                for peer in by_port[port]
            ), (root, port)
