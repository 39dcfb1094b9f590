"""The `k8s/base` holds together: what each manifest names exists, the controller's
configuration loads, NATS accepts its configuration (operator mode, with the keys
make-secrets.sh makes) and lets each role in with its Secret's credentials and each worker
with the credential the controller mints, and the image is built the way the project pins it."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from ebb.common import schema
from ebb.common.errors import BusError
from ebb.common.messaging import auth, bus, identity, installation
from ebb.common.messaging.embedded import EmbeddedNats, find_nats_server
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.controller.kube.backend import KubeConfig

from .manifests import K8S, Obj, find, kustomization, objects

REPO = K8S.parent


def containers(obj: Obj) -> list[Obj]:
    spec: Obj = obj["spec"]["template"]["spec"]
    return list(spec["containers"])


def secrets_made() -> list[Obj]:
    """What `sh k8s/make-secrets.sh` prints (fresh keys each time)."""
    out = subprocess.run(
        ["sh", str(K8S / "make-secrets.sh")],
        capture_output=True,
        text=True,
        check=True,
        # The interpreter running the tests, with the source roots it imports Ebb from.
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHON": sys.executable,
            **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"},
        },
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def secret_data(secrets: list[Obj]) -> dict[str, dict[str, str]]:
    return {s["metadata"]["name"]: s["stringData"] for s in secrets}


def test_every_file_the_kustomization_names_exists_and_parses() -> None:
    k = kustomization()
    assert k["namespace"] == "ebb"
    for kind, name in [
        ("Namespace", "ebb"),
        ("StatefulSet", "ebb-nats"),
        ("Deployment", "ebb-master"),
        ("Deployment", "ebb-controller"),
        ("DaemonSet", "ebb-model-cache"),
        ("Service", "ebb-model-cache"),
        ("PriorityClass", "ebb-batch"),
        ("ConfigMap", "ebb-controller-config"),
        ("ConfigMap", "ebb-grafana-dashboard"),
        ("Deployment", "ebb-gateway"),
        ("Service", "ebb-gateway"),
        ("ConfigMap", "ebb-gateway-config"),
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
    assert config.model_cache_url == "http://ebb-model-cache:8080"
    assert find("Service", "ebb-model-cache")["spec"]["ports"][0]["port"] == 8080
    # Workers share no Secret: the controller mints each its own, with the signer's key.
    assert config.nats_secret is None
    deployment = find("Deployment", "ebb-controller")
    (controller,) = containers(deployment)
    env = {e["name"]: e for e in controller["env"]}
    for var, key in (
        ("EBB_WORKER_NATS_SIGNING_KEY", "signing_key"),
        ("EBB_WORKER_NATS_ACCOUNT", "account"),
    ):
        ref = {"name": "ebb-nats-worker-signer", "key": key}
        assert env[var]["valueFrom"]["secretKeyRef"] == ref
    assert controller["args"][-1] == "/etc/ebb/controller.yaml"
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    generated = find("ConfigMap", "ebb-controller-config")["metadata"]["name"]
    assert {"name": "config", "configMap": {"name": generated}} in volumes


def secret_volumes(pod: Obj) -> dict[str, tuple[str, list[str]]]:
    """Volume name -> (Secret, keys read) of a pod template's Secret volumes and projections,
    but the optional ones (a Secret the operator may create, or not)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for volume in pod.get("volumes", []):
        sources = [volume, *(volume.get("projected") or {}).get("sources", [])]
        for source in sources:
            secret = source.get("secret")
            if secret and not secret.get("optional"):
                name = secret.get("secretName") or secret.get("name")
                out[volume["name"]] = (name, [i["key"] for i in secret.get("items", [])])
    return out


def test_every_secret_a_pod_reads_is_one_make_secrets_writes_or_optional() -> None:
    made = secret_data(secrets_made())
    for obj in objects():
        if obj["kind"] not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        for container in containers(obj):
            for env in container.get("env", []):
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["key"] in made[ref["name"]], (obj["metadata"]["name"], env)
            for source in container.get("envFrom", []):
                assert source["secretRef"].get("optional") is True
        for name, keys in secret_volumes(obj["spec"]["template"]["spec"]).values():
            assert name in made and set(keys) <= set(made[name]), (obj["metadata"]["name"], name)


def test_make_secrets_makes_fresh_keys_and_gives_each_role_its_credentials() -> None:
    first, second = secret_data(secrets_made()), secret_data(secrets_made())
    roles: tuple[auth.Role, ...] = ("master", "controller", "client", "gateway")
    assert set(first) == {
        "ebb-nats-auth",
        "ebb-nats-worker-signer",
        "ebb-nats-tenant-signer",
        *(f"ebb-nats-{r}" for r in roles),
    }
    for role in roles:
        creds = first[f"ebb-nats-{role}"]["creds"]
        assert identity.credentials_name(creds) == auth.user_name("ebb", role)
        assert creds != second[f"ebb-nats-{role}"]["creds"]
    # No worker user: workers get credentials minted for each by the controller.
    assert "ebb-nats-worker" not in first
    signer = first["ebb-nats-worker-signer"]
    assert identity.Key.from_seed(signer["signing_key"]).public.startswith("A")
    conf = first["ebb-nats-auth"]["auth.conf"]
    assert "resolver: MEMORY" in conf and f"  {signer['account']}: " in conf
    assert conf != second["ebb-nats-auth"]["auth.conf"]
    assert signer["signing_key"] not in conf  # the server knows the public key only
    # The tenants' key signs teams' credentials: a key of the same account, no pod's (the
    # server trusting it: below, a team connects).
    tenants = first["ebb-nats-tenant-signer"]
    assert tenants["account"] == signer["account"]
    assert tenants["signing_key"] not in conf and tenants["signing_key"] != signer["signing_key"]


def test_each_service_connects_with_its_own_credentials() -> None:
    roles = {"ebb-master": "master", "ebb-controller": "controller", "ebb-gateway": "gateway"}
    for name, role in roles.items():
        pod = find("Deployment", name)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert "EBB_NATS_PASSWORD" not in env and "EBB_NATS_USER" not in env
        path = Path(env["EBB_NATS_CREDS"]["value"])
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
        assert mount["readOnly"] is True
        assert secret_volumes(pod)[mount["name"]] == (f"ebb-nats-{role}", [path.name])


def nats_conf(name: str = "nats.conf") -> str:
    text: str = find("ConfigMap", "ebb-nats-config")["data"][name]
    return text


def test_nats_runs_in_operator_mode_with_the_auth_file_beside_its_configuration() -> None:
    conf = nats_conf()
    assert "include ./auth.conf" in conf
    assert "authorization" not in conf and "password" not in conf
    pod = find("StatefulSet", "ebb-nats")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "nats"]
    config = container["args"][container["args"].index("--config") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(Path(config).parent)]
    assert secret_volumes(pod)[mount["name"]] == ("ebb-nats-auth", ["auth.conf"])
    assert not [
        e for e in container.get("env", []) if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    ]


@pytest.fixture
def k8s_nats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """nats-server running k8s/'s configuration, with the keys make-secrets.sh made. Only
    where it listens and stores changes: a free port, a temp store, no monitoring."""
    made = secret_data(secrets_made())
    monkeypatch.setenv("POD_NAME", "ebb-nats-0")
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_conf().replace("http_port: 8222\n", ""))
    (tmp_path / "cluster.conf").write_text(nats_conf("cluster.conf"))
    (tmp_path / "auth.conf").write_text(made["ebb-nats-auth"]["auth.conf"])
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
        yield server, made
    finally:
        server.stop()


async def test_nats_runs_that_configuration_and_lets_each_role_and_worker_in(k8s_nats: Any) -> None:
    server, made = k8s_nats
    base = NatsConfig(url=server.url)
    for role in ("master", "controller", "client"):
        config = dataclasses.replace(base, creds=made[f"ebb-nats-{role}"]["creds"])
        nc = await bus.connect(config, name="manifest-test")
        assert nc.is_connected
        await nc.close()
    signer_secret = made["ebb-nats-worker-signer"]
    signer = identity.WorkerSigner(
        account=signer_secret["account"],
        signing_key=identity.Key.from_seed(signer_secret["signing_key"]),
    )
    nc = await bus.connect(
        dataclasses.replace(base, creds=signer.credentials("w-1")), name="worker"
    )
    assert nc.is_connected
    await nc.close()
    tenants = installation.read_signer(
        yaml.safe_dump({"stringData": made["ebb-nats-tenant-signer"]})
    )
    nc = await bus.connect(
        dataclasses.replace(base, creds=tenants.credentials("team-a")), name="team"
    )
    assert nc.is_connected
    await nc.close()
    stranger = identity.Trust.new("ebb").worker_signer().credentials("w-1")
    for refused in (
        dataclasses.replace(base, creds=stranger),
        dataclasses.replace(base, creds=identity.Trust.new("ebb").team_signer().credentials("a")),
        dataclasses.replace(base, user="ebb-worker", password="not-the-secret"),
    ):
        with pytest.raises(BusError, match="refused"):
            await bus.connect(refused, name="stranger")


def test_the_image_pins_torch_as_the_project_does() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (torch,) = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert f'"{torch}"' in dockerfile
    (image,) = kustomization()["images"]
    for obj in objects():
        if obj["kind"] in ("Deployment", "DaemonSet"):
            # set by `images:`
            assert all(
                c["image"] == f"{image['newName']}:{image['newTag']}" for c in containers(obj)
            )


def test_the_gateway_s_catalogue_loads_with_keys_from_its_secret(tmp_path: Path) -> None:
    from ebb.gateway.config import load_config

    deployment = find("Deployment", "ebb-gateway")
    (gateway,) = containers(deployment)
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    config_path = Path(env["EBB_GATEWAY_CONFIG"])
    assert str(config_path.parent) == mounts["config"]
    text = find("ConfigMap", "ebb-gateway-config")["data"][config_path.name]
    # As the pod sees them: the ConfigMap's file, and the Secret's keys where keys_file says.
    keys_file = Path(yaml.safe_load(text)["keys_file"])
    assert str(keys_file.parent) == mounts["keys"]
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump([{"owner": "team-a", "key": "sk-a"}]))
    local = text.replace(str(keys_file), str(tmp_path / "keys.yaml"))
    (tmp_path / "gateway.yaml").write_text(local)
    config = load_config(tmp_path / "gateway.yaml")  # strict: a typo is an error
    assert [k.owner for k in config.keys] == ["team-a"]
    for model in config.models.values():
        assert model.stage_spec().llm is not None
    assert find("Service", "ebb-gateway")["spec"]["ports"][0]["port"] == int(
        env["EBB_GATEWAY_PORT"]
    )
    # Its keys are a Secret of the operator's: optional for the pod (it says what is missing).
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["keys"]["secret"] == {"secretName": "ebb-gateway-keys", "optional": True}
