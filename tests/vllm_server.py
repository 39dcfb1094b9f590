"""vLLM's CPU build, from the venv `make vllm` makes (.venv-vllm; `EBB_VLLM_PYTHON` names
another interpreter): its OpenAI-compatible server's command line, and a server a test starts
as a user would, on a port of its own, its output in a log."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

VLLM_PYTHON = Path(
    os.environ.get(
        "EBB_VLLM_PYTHON", Path(__file__).resolve().parent.parent / ".venv-vllm/bin/python"
    )
)
KV_CACHE_BYTES = 1 << 30
"""The KV cache a test's server keeps (vLLM's CPU default takes gigabytes)."""


def vllm_command(*extra: str) -> list[str]:
    """The server's command line, for a stage's `command` (`{model}`, `{port}` filled in).
    `python -m vllm.entrypoints.openai.api_server`: the `vllm` command of the CPU build looks
    up a package named `vllm` and fails. `-O0`: no torch.compile warm-up (a minute on this
    CPU) for a model this small."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM's venv is missing ({VLLM_PYTHON}): run `make vllm`")
    return [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "{model}",
        "--served-model-name",
        "{served_model}",
        "--port",
        "{port}",
        "--dtype",
        "float32",
        "-O0",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        *extra,
    ]


class VLLMServer:
    """A vLLM server started by the test, as a user starts one beside a job."""

    def __init__(self, model: Path, port: int, log: Path, *, served_model: str = "tiny") -> None:
        self.model, self.port, self.log, self.served_model = model, port, log, served_model
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 300) -> None:
        fill = {"model": str(self.model), "port": str(self.port), "served_model": self.served_model}
        argv = [part.format(**fill) for part in vllm_command()]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"vLLM did not answer: {self.log.read_text()[-3000:]}")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's own answer, asked directly (`path`: `/completions`, `/chat/completions`)."""
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps({"model": self.served_model, **body}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
            return answer

    def stop(self) -> None:
        """SIGKILL the server's whole process group (its engine processes too)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait(timeout=60)


def vllm_processes() -> set[int]:
    """Every vLLM process on this machine: API servers, engine cores, their workers."""
    found = set()
    for p in psutil.process_iter(["name", "cmdline"]):
        command = " ".join(p.info["cmdline"] or [])
        if (p.info["name"] or "").startswith("VLLM::") or "vllm.entrypoints" in command:
            found.add(p.pid)
    return found
