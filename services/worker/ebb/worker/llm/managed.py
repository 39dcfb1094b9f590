"""An OpenAI-compatible server the stage runs beside it: `vllm serve`, SGLang's server,
`transformers serve`, started from the spec's `command` on a free port of loopback, with the
stage's devices (its environment: CUDA_VISIBLE_DEVICES), watched, and stopped with the stage.

The server is the stage process's child, in a session of its own: stopping it stops its whole
process group (a vLLM server's engine processes too, even those a server killed by the OOM
killer left orphaned), and no server outlives its stage: the kernel tells it to stop if the
stage process dies first (the parent-death signal, SIGTERM), and a reaper
(ebb.common.reaper) ends its group, orphans included, once the stage process is gone however
it went (killed by its batch timeout, by the worker's shutdown). A server whose
command cannot start, or that does not answer its health check within `startup_s`, is an
`EngineError` at set-up: the stage cannot start, and the worker fails as a set-up failure
(the node's, until it is everyone's).

The port is a free one of loopback, chosen before the server binds it: another process may
take it between the two. So a server that exits because its port was taken is started again
on another, and a health check counts only once the port's listener is the server's own
process (or one of its children): never another process that took the port first.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from .engine import EngineError

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long a server has to stop on SIGTERM before its process group is SIGKILLed."""
PORT_TRIES = 3
"""Ports tried before a server that finds each one taken fails to start."""
_PORT_TAKEN = ("address already in use", "errno 98")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_stage() -> None:
    """In the server's process, before it runs: told to stop (SIGTERM) when the stage
    process dies. Not SIGKILL: a server killed outright leaves its engine processes (vLLM's
    EngineCore and workers, each holding its KV cache) orphaned, alive; told to stop, it
    stops them."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG


class ManagedServer:
    def __init__(
        self,
        command: list[str],
        *,
        model: str,
        served_model: str,
        startup_s: float,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        self.template = command
        self.model = model
        self.served_model = served_model
        self.startup_s = startup_s
        self.stop_grace_s = stop_grace_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.reaper: subprocess.Popen[bytes] | None = None
        """Ends the server's process group if this process dies without stopping it."""
        self.log_path = Path(tempfile.mkstemp(prefix="ebb-llm-server-", suffix=".log")[1])
        """The server's output: quoted when it cannot start."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        for attempt in range(1, PORT_TRIES + 1):
            try:
                self._start_on(_free_port())
                return
            except _PortTaken:
                if attempt == PORT_TRIES:
                    raise EngineError(
                        f"the model server found its port taken {PORT_TRIES} times: {self._tail()}"
                    ) from None
                log.info("the model server's port %d was taken: another port", self.port)

    def _start_on(self, port: int) -> None:
        self.port = port
        fill = {"model": self.model, "port": str(port), "served_model": self.served_model}
        argv = [part.format(**fill) for part in self.template]
        log.info("starting the model server: %s", " ".join(argv))
        start = self.log_path.stat().st_size
        with self.log_path.open("ab") as out:
            try:
                self.process = subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_die_with_stage,  # noqa: PLW1509 - prctl only, before exec
                )
            except OSError as e:
                raise EngineError(f"the model server cannot start: {argv[0]}: {e}") from e
        self._tell_reaper(f"group {self.process.pid}")
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                if any(p in self._tail(since=start).lower() for p in _PORT_TAKEN):
                    raise _PortTaken
                raise EngineError(
                    f"the model server exited with code {code} before it answered: {self._tail()}"
                )
            if self._healthy() and self._listens():
                log.info("the model server answers on port %d", self.port)
                return
            time.sleep(0.2)
        self.stop()
        raise EngineError(
            f"the model server did not answer within {self.startup_s:.0f} s: {self._tail()}"
        )

    def _tell_reaper(self, line: str) -> None:
        """`line` to the reaper (started with the first server): ebb.common.reaper's words."""
        if self.reaper is None:
            self.reaper = subprocess.Popen(
                [sys.executable, "-m", "ebb.common.reaper", str(self.stop_grace_s)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a signal to the stage's group misses it
            )
        assert self.reaper.stdin is not None
        with contextlib.suppress(OSError):  # it died: nothing left to tell
            self.reaper.stdin.write(f"{line}\n".encode())
            self.reaper.stdin.flush()

    def _listens(self) -> bool:
        """Whether the port's listener is this server's process or one of its children."""
        if self.process is None:
            return False
        try:
            root = psutil.Process(self.process.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        for p in family:
            try:
                connections = p.net_connections(kind="tcp")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if any(
                c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port
                for c in connections
            ):
                return True
        return False

    def _healthy(self) -> bool:
        for path in ("/health", "/v1/models"):
            try:
                url = f"http://127.0.0.1:{self.port}{path}"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except OSError:
                continue
        return False

    def _tail(self, since: int = 0) -> str:
        with self.log_path.open("rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace").strip()
        return text[-1500:] or "(it wrote nothing)"

    def stop(self) -> None:
        """Stop the server and every process of its group (SIGTERM, then SIGKILL)."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        # The group is gone: its number may name another's one day.
        self._tell_reaper(f"forget {process.pid}")

    def close(self) -> None:
        self.stop()
        reaper, self.reaper = self.reaper, None
        if reaper is not None:
            with contextlib.suppress(OSError):
                assert reaper.stdin is not None
                reaper.stdin.write(b"done\n")
                reaper.stdin.close()
            reaper.wait()
        self.log_path.unlink(missing_ok=True)


class _PortTaken(Exception):
    """The server exited because another process had its port."""
