"""Every service started while NATS is unreachable says so (WARNING, with the URL and the
error) within seconds, keeps retrying, and stops on SIGTERM with exit code 0."""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ebb.common import metrics
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.shard_master.service import MasterConfig, ShardMaster

from ..helpers import wait_until


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read_until(process: subprocess.Popen[bytes], text: str, timeout_s: float) -> str:
    """The process's stderr up to and including the first line holding `text`."""
    assert process.stderr is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stderr, selectors.EVENT_READ)
    seen = b""
    deadline = time.monotonic() + timeout_s
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or process.poll() is not None:
            break
        if selector.select(left):
            chunk = os.read(process.stderr.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
    selector.close()
    return seen.decode(errors="replace")


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()


async def test_a_master_connected_and_leading_is_ready(nats_config: NatsConfig) -> None:
    master = ShardMaster(MasterConfig(nats=nats_config, id="probe-master", leader_ttl_s=3.0))
    port = metrics.serve(0)
    assert port is not None
    task = asyncio.create_task(master.run())
    try:
        seen: list[tuple[int, str]] = []

        async def leading() -> bool:
            seen.append(await asyncio.to_thread(_get, port, "/readyz"))
            return seen[-1] == (200, "leading")

        await wait_until(leading, timeout=30, what="the master to lead")
        # Not ready before its connection (503), ready from then on (standing by, leading).
        statuses = [status for status, _ in seen]
        assert statuses[statuses.index(200) :] == [200] * len(statuses[statuses.index(200) :])
    finally:
        master.request_stop()
        await task
        metrics.set_readiness(lambda: (False, "stopped"))


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "ebb.shard_master", "--id", "m1"],
        ["-m", "ebb.controller", "--backend", "local"],
        ["-m", "ebb.worker", "--job", "some-job"],
    ],
    ids=["master", "controller", "worker"],
)
def test_a_service_with_nats_away_says_so_and_stops_on_sigterm(
    command: list[str], tmp_path: Path
) -> None:
    url = f"nats://127.0.0.1:{_unused_port()}"
    port = _unused_port()
    env = {**os.environ, "EBB_NATS_URL": url, "EBB_METRICS_PORT": str(port)}
    process = subprocess.Popen(
        [sys.executable, *command], env=env, cwd=tmp_path, stderr=subprocess.PIPE
    )
    try:
        said = _read_until(process, url, timeout_s=10)
        assert "WARNING" in said and url in said, said
        assert process.poll() is None  # still trying, as configured (no budget set)
        # Alive, but not ready: the probes tell Kubernetes the truth about it.
        assert _get(port, "/healthz") == (200, "alive")
        assert _get(port, "/readyz")[0] == 503
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()
