"""The stage's own model server (`engine: server`) and its port: chosen free before the server
binds it, so another process may take it first. The server that finds it taken is started on
another, and a health check counts only from the server's own listener, never from the
process that took the port."""

from __future__ import annotations

import contextlib
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ebb.worker.llm import managed
from ebb.worker.llm.engine import EngineError
from ebb.worker.llm.managed import ManagedServer

from ..helpers import free_port

# A server that answers every GET with 200, on the port it is given (as a model server's
# health check is answered); it exits with Python's "Address already in use" when the port
# is taken.
HEALTHY = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def squatter() -> Iterator[int]:
    """Another process's server (here: a thread's) that answers health checks on its port."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_port_taken_before_the_server_binds_it_is_not_its_health(
    squatter: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The race made certain: the first port chosen is the squatter's.
    ports = iter([squatter, free_port()])
    monkeypatch.setattr(managed, "_free_port", lambda: next(ports))
    server = ManagedServer(
        [sys.executable, "-c", HEALTHY, "{port}"],
        model=str(tmp_path),
        served_model="m",
        startup_s=60,
    )
    server.start()
    try:
        assert server.port != squatter
        assert server.process is not None
        listening = {
            c.laddr.port
            for c in psutil.Process(server.process.pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert server.port in listening
    finally:
        server.close()


def test_a_server_that_finds_every_port_taken_fails_to_start(
    squatter: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(managed, "_free_port", lambda: squatter)
    server = ManagedServer(
        [sys.executable, "-c", HEALTHY, "{port}"],
        model=str(tmp_path),
        served_model="m",
        startup_s=60,
    )
    with pytest.raises(EngineError, match="port taken 3 times"):
        server.start()
    server.close()


# A server with an engine process below it, in its group, as vLLM's EngineCore is: the engine
# stops on nothing but SIGKILL and outlives the server (orphaned) if the server dies first.
WITH_ENGINE = (
    """
import subprocess, sys
engine = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(engine.pid, flush=True)
"""
    + HEALTHY
)

# The stage process: it starts the server, says the server's pid, and waits to be killed.
OWNER = """
import sys, time
from ebb.worker.llm.managed import ManagedServer
server = ManagedServer(
    [sys.executable, "-c", sys.argv[1], "{port}"], model=".", served_model="m", startup_s=60,
    stop_grace_s=1,
)
server.start()
print(server.process.pid, server.log_path, flush=True)
time.sleep(600)
"""


def test_a_servers_engine_processes_end_with_its_stage_though_the_server_died_first() -> None:
    """The OOM killer takes the server, orphaning its engine process (which holds the
    device's memory and ignores SIGTERM); then the stage process is SIGKILLed (its batch
    timeout) before it could start the server again. Nothing of the server is left."""
    owner = psutil.Popen(
        [sys.executable, "-c", OWNER, WITH_ENGINE], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    with owner.stdout:
        try:
            pid, log_path = owner.stdout.readline().split()
            server = psutil.Process(int(pid))
            engine = psutil.Process(int(Path(log_path).read_text().split()[0]))
            assert engine.ppid() == server.pid
            server.kill()  # a zombie until its parent, asleep, reaps it: dead all the same
            assert engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE
            owner.kill()
            owner.wait(timeout=30)
            _, alive = psutil.wait_procs([engine], timeout=60)
            assert alive == []
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                owner.kill()
            with contextlib.suppress(psutil.NoSuchProcess, UnboundLocalError):
                engine.kill()
