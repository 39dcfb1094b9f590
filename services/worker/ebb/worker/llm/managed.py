"""An OpenAI-compatible server the stage runs beside it: `vllm serve`, SGLang's server,
`transformers serve`, started from the spec's `command` on a free port of loopback, with the
stage's devices (its environment: CUDA_VISIBLE_DEVICES), watched, and stopped with the stage.

The server is the stage process's child, in a session of its own: stopping it stops its whole
process group (a vLLM server's engine processes too), and the kernel kills it if the stage
process dies first (the parent-death signal), so no server outlives its stage. A server whose
command cannot start, or that does not answer its health check within `startup_s`, is an
`EngineError` at set-up: the stage cannot start, and the worker fails as a set-up failure
(the node's, until it is everyone's).
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

from .engine import EngineError

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long a server has to stop on SIGTERM before its process group is SIGKILLed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_stage() -> None:
    """In the server's process, before it runs: killed when the stage process dies."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PDEATHSIG


class ManagedServer:
    def __init__(
        self, command: list[str], *, model: str, served_model: str, startup_s: float
    ) -> None:
        self.template = command
        self.model = model
        self.served_model = served_model
        self.startup_s = startup_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="ebb-llm-server-", suffix=".log")[1])
        """The server's output: quoted when it cannot start."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.port = _free_port()
        fill = {"model": self.model, "port": str(self.port), "served_model": self.served_model}
        argv = [part.format(**fill) for part in self.template]
        log.info("starting the model server: %s", " ".join(argv))
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
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise EngineError(
                    f"the model server exited with code {code} before it answered: {self._tail()}"
                )
            if self._healthy():
                log.info("the model server answers on port %d", self.port)
                return
            time.sleep(0.2)
        self.stop()
        raise EngineError(
            f"the model server did not answer within {self.startup_s:.0f} s: {self._tail()}"
        )

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

    def _tail(self) -> str:
        text = self.log_path.read_text(errors="replace").strip()
        return text[-1500:] or "(it wrote nothing)"

    def stop(self) -> None:
        """Stop the server and every process of its group (SIGTERM, then SIGKILL)."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)
