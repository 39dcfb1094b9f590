"""Every service started while NATS is unreachable says so (WARNING, with the URL and the
error) within seconds, keeps retrying, and stops on SIGTERM with exit code 0."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


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
    env = {**os.environ, "EBB_NATS_URL": url, "EBB_METRICS_PORT": "0"}
    process = subprocess.Popen(
        [sys.executable, *command], env=env, cwd=tmp_path, stderr=subprocess.PIPE
    )
    try:
        said = _read_until(process, url, timeout_s=10)
        assert "WARNING" in said and url in said, said
        assert process.poll() is None  # still trying, as configured (no budget set)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()
