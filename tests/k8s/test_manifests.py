"""The `k8s/base` holds together: what each manifest names exists, the controller's
configuration loads, NATS accepts its configuration and lets each role in with its Secret's
password, and the image is built the way the project pins it."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from ebb.common import auth, bus, schema
from ebb.common.bus import NatsConfig
from ebb.common.embedded import EmbeddedNats, find_nats_server
from ebb.common.errors import BusError
from ebb.controller.kube import KubeConfig

from .manifests import K8S, Obj, find, kustomization, objects

REPO = K8S.parent


def containers(obj: Obj) -> list[Obj]:
    spec: Obj = obj["spec"]["template"]["spec"]
    return list(spec["containers"])


def secrets_made() -> list[Obj]:
    """What `sh k8s/make-secrets.sh` prints."""
    out = subprocess.run(
        ["sh", str(K8S / "make-secrets.sh")], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_every_file_the_kustomization_names_exists_and_parses() -> None:
    k = kustomization()
    assert k["namespace"] == "ebb"
    for kind, name in [
        ("Namespace", "ebb"),
        ("StatefulSet", "ebb-nats"),
        ("Deployment", "ebb-master"),
        ("Deployment", "ebb-controller"),
        ("PriorityClass", "ebb-batch"),
        ("ConfigMap", "ebb-controller-config"),
        ("ConfigMap", "ebb-grafana-dashboard"),
    ]:
        find(kind, name)


def test_the_controller_configuration_loads_and_names_what_exists() -> None:
    text = find("ConfigMap", "ebb-controller-config")["data"]["controller.yaml"]
    config = schema.load(KubeConfig, yaml.safe_load(text))  # strict: a typo is an error
    assert config.owner_deployment == "ebb-controller"
    find("Deployment", config.owner_deployment)
    assert config.priority_class is not None
    assert find("PriorityClass", config.priority_class)["value"] < 0  # online pods preempt
    assert config.service_account is not None
    assert find("ServiceAccount", config.service_account)["automountServiceAccountToken"] is False
    assert config.nats.url == "nats://ebb-nats:4222"
    find("Service", "ebb-nats")
    assert config.nats_secret in {s["metadata"]["name"] for s in secrets_made()}
    deployment = find("Deployment", "ebb-controller")
    (controller,) = containers(deployment)
    assert controller["args"][-1] == "/etc/ebb/controller.yaml"
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    generated = find("ConfigMap", "ebb-controller-config")["metadata"]["name"]
    assert {"name": "config", "configMap": {"name": generated}} in volumes


def test_every_secret_a_pod_reads_is_one_make_secrets_writes_or_optional() -> None:
    made = {s["metadata"]["name"]: s["stringData"] for s in secrets_made()}
    for obj in objects():
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in containers(obj):
            for env in container.get("env", []):
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["key"] in made[ref["name"]], (obj["metadata"]["name"], env)
            for source in container.get("envFrom", []):
                assert source["secretRef"].get("optional") is True


def test_make_secrets_gives_each_role_its_user_and_a_fresh_password() -> None:
    first, second = secrets_made(), secrets_made()
    users = {s["metadata"]["name"]: s["stringData"]["user"] for s in first}
    assert users == {f"ebb-nats-{r}": auth.user_name("ebb", r) for r in auth.ROLES}
    passwords = [s["stringData"]["password"] for s in first + second]
    assert len(set(passwords)) == len(passwords) and all(len(p) >= 32 for p in passwords)


def test_each_service_connects_as_its_own_role() -> None:
    expected = {"ebb-master": "master", "ebb-controller": "controller"}
    for name, role in expected.items():
        (container,) = containers(find("Deployment", name))
        env = {e["name"]: e for e in container["env"]}
        ref = env["EBB_NATS_USER"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"ebb-nats-{role}", "key": "user"}


def nats_conf(name: str = "nats.conf") -> str:
    text: str = find("ConfigMap", "ebb-nats-config")["data"][name]
    return text


def test_the_nats_authorization_is_the_one_the_code_defines() -> None:
    env_refs: dict[auth.Role, str] = {r: f"$EBB_{r.upper()}_PASSWORD" for r in auth.ROLES}
    assert auth.authorization_config("ebb", env_refs) in nats_conf()


@pytest.fixture
def k8s_nats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """nats-server running k8s/'s configuration, with the passwords make-secrets.sh made.
    Only where it listens and stores changes: a free port, a temp store, no monitoring."""
    passwords = {s["stringData"]["user"]: s["stringData"]["password"] for s in secrets_made()}
    for role in auth.ROLES:
        monkeypatch.setenv(f"EBB_{role.upper()}_PASSWORD", passwords[auth.user_name("ebb", role)])
    monkeypatch.setenv("POD_NAME", "ebb-nats-0")
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_conf().replace("http_port: 8222\n", ""))
    (tmp_path / "cluster.conf").write_text(nats_conf("cluster.conf"))
    checked = subprocess.run(
        [find_nats_server(), "--config", str(conf), "-t"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Its store folder and port, as flags, are the ones the server takes.
    runnable = tmp_path / "runnable.conf"
    runnable.write_text(conf.read_text().replace("store_dir: /data/jetstream\n", ""))
    server = EmbeddedNats(state_dir=tmp_path / "store", config_file=str(runnable))
    server.start()
    try:
        yield server, passwords
    finally:
        server.stop()


async def test_nats_runs_that_configuration_and_lets_each_role_in(k8s_nats: Any) -> None:
    server, passwords = k8s_nats
    for user, password in passwords.items():
        nc = await bus.connect(
            NatsConfig(url=server.url, user=user, password=password), name="manifest-test"
        )
        assert nc.is_connected
        await nc.close()
    stranger = NatsConfig(url=server.url, user="ebb-worker", password="not-the-secret")
    with pytest.raises(BusError, match="refused"):
        await bus.connect(stranger, name="stranger")


def test_the_image_pins_torch_as_the_project_does() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (torch,) = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert f'"{torch}"' in dockerfile
    (image,) = kustomization()["images"]
    for obj in objects():
        if obj["kind"] in ("Deployment",):
            # set by `images:`
            assert all(
                c["image"] == f"{image['newName']}:{image['newTag']}" for c in containers(obj)
            )
