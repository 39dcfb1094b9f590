"""Ebb's JetStream state on a three-node NATS cluster (three nats-server processes on
loopback): created with three replicas, it keeps taking writes with one server down, and the
server that comes back catches up."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from ebb.client.sdk import EbbClient
from ebb.common import envvars
from ebb.common.errors import BusError, RemoteError
from ebb.common.job import parse_job
from ebb.common.messaging import provision
from ebb.common.messaging.embedded import find_nats_server
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import Subjects

from ..helpers import (
    ASSETS,
    committed_files,
    free_port,
    job_spec,
    read_output,
    wait_until,
    write_dataset,
    write_model,
)


class Cluster:
    """Three nats-servers with JetStream, routed to each other."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clients = [free_port() for _ in range(3)]
        self.routes = [free_port() for _ in range(3)]
        self.processes: list[subprocess.Popen[bytes] | None] = [None, None, None]

    def url(self, k: int) -> str:
        return f"nats://127.0.0.1:{self.clients[k]}"

    @property
    def urls(self) -> str:
        return ",".join(self.url(k) for k in range(3))

    def start(self, k: int) -> None:
        routes = ", ".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.routes) if j != k)
        config = self.root / f"n{k}.conf"
        config.write_text(
            f"""
server_name: n{k}
listen: 127.0.0.1:{self.clients[k]}
jetstream {{ store_dir: "{self.root / f"store{k}"}" }}
cluster {{
  name: ebb-test
  listen: 127.0.0.1:{self.routes[k]}
  routes: [{routes}]
}}
"""
        )
        with open(self.root / f"n{k}.log", "ab") as log:  # the child keeps its own copy
            self.processes[k] = subprocess.Popen(
                [find_nats_server(), "--config", str(config)], stdout=log, stderr=log
            )

    def wait_listening(self, k: int, timeout_s: float = 30.0) -> None:
        """Until server k accepts connections on its client port (its own readiness)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.clients[k]), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
            process = self.processes[k]
            assert process is not None and process.poll() is None, f"n{k} exited"
            time.sleep(0.05)

    def stop(self, k: int) -> None:
        process = self.processes[k]
        if process is not None:
            process.kill()
            process.wait(timeout=10)
            self.processes[k] = None


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    for k in range(3):
        c.start(k)
    try:
        for k in range(3):
            c.wait_listening(k)
        yield c
    finally:
        for k in range(3):
            c.stop(k)


@pytest.fixture
async def nc(cluster: Cluster) -> AsyncIterator[NATS]:
    client = await nats.connect(servers=cluster.urls.split(","), max_reconnect_attempts=-1)
    try:
        yield client
    finally:
        await client.close()


async def test_state_at_three_replicas_survives_a_server_down(cluster: Cluster, nc: NATS) -> None:
    js = nc.jetstream()
    subjects = Subjects("ebbtest")

    async def jetstream_ready() -> bool:
        try:
            await provision.ensure_jetstream(js, subjects, leader_ttl_s=5.0, replicas=3)
        except (nats.errors.Error, TimeoutError):
            return False  # the cluster is still electing its meta leader
        return True

    await wait_until(jetstream_ready, timeout=60, what="JetStream on the cluster")
    info = await js.stream_info(subjects.jobs_stream)
    assert info.config.num_replicas == 3
    for bucket in (subjects.jobs_bucket, subjects.shards_bucket, subjects.leader_bucket):
        status = await (await js.key_value(bucket)).status()
        assert status.stream_info.config.num_replicas == 3, bucket
    shards = await js.key_value(subjects.shards_bucket)
    await shards.put("s0", b"before")

    cluster.stop(0)

    async def written() -> bool:
        try:
            await shards.put("s1", b"with one server down")
        except (nats.errors.Error, TimeoutError):
            return False  # the bucket's stream moving its leader off the dead server
        return True

    await wait_until(written, timeout=60, what="a write with one server down")
    assert (await shards.get("s0")).value == b"before"

    cluster.start(0)
    cluster.wait_listening(0)
    alone = await nats.connect(servers=[cluster.url(0)], max_reconnect_attempts=-1)
    try:

        async def caught_up() -> bool:
            try:
                kv = await alone.jetstream().key_value(subjects.shards_bucket)
                info = await kv.status()
            except (nats.errors.Error, TimeoutError):
                return False
            return info.stream_info.state.messages == 2

        await wait_until(caught_up, timeout=60, what="the restarted server to catch up")
    finally:
        await alone.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_job_runs_exactly_once_through_a_server_killed_and_restarted(
    cluster: Cluster, nc: NATS, tmp_path: Path, prefix: str
) -> None:
    """The shard master, the controller and its workers on the three-node cluster at three
    replicas; one server is SIGKILLed mid-job and later comes back. Every row exactly once."""
    subjects = Subjects(prefix)

    async def jetstream_ready() -> bool:
        try:
            await provision.ensure_jetstream(nc.jetstream(), subjects, leader_ttl_s=5.0, replicas=3)
        except (nats.errors.Error, TimeoutError):
            return False  # the cluster is still electing its meta leader
        return True

    await wait_until(jetstream_ready, timeout=60, what="JetStream on the cluster")
    rows = 12_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    write_model(tmp_path / "model.onnx")
    slow = {"name": "slow", "modelet": "ebbtest_modelets:Slow", "batch_size": 100}
    stages = [
        {**slow, "params": {"seconds_per_batch": 0.05}},
        {"name": "model", "model": str(tmp_path / "model.onnx"), "batch_size": 200},
        {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 200},
    ]
    spec = parse_job(
        job_spec(
            tmp_path, rows_per_shard=1_000, stages=stages, workers=(2, 2), fault={"lease_s": 5}
        )
    )
    env = {
        **os.environ,
        envvars.NATS_URL: cluster.urls,
        envvars.PREFIX: prefix,
        envvars.JS_REPLICAS: "3",
    }
    logs = tmp_path / "logs"
    logs.mkdir()
    roots = ["--data-root", str(tmp_path), "--data-root", str(ASSETS)]
    services = [
        ["-m", "ebb.shard_master", "--id", "m", *roots],
        ["-m", "ebb.controller", "--max-workers", "2", "--log-dir", str(logs / "workers")],
    ]
    processes = []
    for k, args in enumerate(services):
        with open(logs / f"service{k}.log", "ab") as log:  # the child keeps its own copy
            processes.append(
                await asyncio.create_subprocess_exec(
                    sys.executable, *args, env=env, stdout=log, stderr=log
                )
            )
    client = await EbbClient.connect(NatsConfig(url=cluster.urls, prefix=prefix))
    try:
        job_id = await client.submit(spec)

        async def done_shards(at_least: int) -> bool:
            try:
                status = await client.job(job_id)
            except (BusError, RemoteError):
                return False  # a request caught by the server going down
            return status.shards.get("DONE", 0) >= at_least

        await wait_until(lambda: done_shards(2), timeout=120, what="two shards done")
        cluster.stop(0)  # SIGKILL: no goodbye to its clients or its peers
        await wait_until(lambda: done_shards(6), timeout=120, what="progress with n0 down")
        cluster.start(0)
        cluster.wait_listening(0)
        final = await client.wait(job_id)
    finally:
        await client.close()
        for process in processes:
            process.terminate()
        for process in processes:
            await asyncio.wait_for(process.wait(), 60)
    assert final.state == "SUCCEEDED", final.reason
    table, manifest = read_output(tmp_path / "out")
    ids = sorted(table.column("id").to_numpy().tolist())
    assert ids == list(range(rows)), "every row exactly once"
    assert {f["path"] for f in manifest["files"]} == committed_files(tmp_path / "out")
