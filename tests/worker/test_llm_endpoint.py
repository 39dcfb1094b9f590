"""The `llm` stage fed by an OpenAI-compatible server over HTTP: a real one, `transformers
serve` on the tiny model, started by the test. Greedy text as the model makes it; the server
killed mid-batch and started again: every row answered once."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ebb.common.job import LLMSpec, SamplingSpec, StageSpec
from ebb.worker.llm.hf import TransformersEngine
from ebb.worker.llm.stage import LLMStage

from ..helpers import free_port
from ..llm_model import build_tiny_llm, corpus
from .test_llm import _greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVE = shutil.which("transformers", path=str(Path(sys.executable).parent))


class Server:
    """`transformers serve` on the model, on a port of its own, its output in a log."""

    def __init__(self, model: Path, port: int, log: Path) -> None:
        self.model, self.port, self.log = model, port, log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        assert SERVE is not None
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [SERVE, "serve", str(self.model), "--port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"transformers serve did not answer: {self.log.read_text()[-2000:]}")

    def answered(self) -> int:
        return self.log.read_text().count('"POST /v1/completions HTTP/1.1" 200')

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny")


@pytest.fixture
def server(tiny_llm: Path, tmp_path: Path) -> Iterator[Server]:
    if SERVE is None:
        pytest.fail("the transformers CLI is missing: install ebb[dev] (transformers[serving])")
    s = Server(tiny_llm, free_port(), tmp_path / "serve.log")
    s.start()
    try:
        yield s
    finally:
        s.kill()


def _stage(model: Path, url: str, **llm: Any) -> LLMStage:
    spec = StageSpec(
        name="gen",
        llm=LLMSpec(model=str(model), engine="endpoint", endpoint=url, prompt_as="text", **llm),
    )
    stage = LLMStage(spec)
    stage.setup()
    return stage


def test_an_endpoint_s_greedy_text_is_the_model_s(tiny_llm: Path, server: Server) -> None:
    prompts = corpus(6, seed=7)
    budgets = np.array([3, 9, 1, 6, 12, 4])
    stage = _stage(
        tiny_llm,
        server.url,
        served_model=str(tiny_llm),
        per_row={"max_tokens": "budget"},
        max_in_flight=3,
    )
    out = stage.process_columns({"prompt": np.array(prompts, dtype=object), "budget": budgets})
    local = TransformersEngine(str(tiny_llm))
    for i, p in enumerate(prompts):
        expected = _greedy(local, local.encode(p), int(budgets[i]))
        assert out["text"][i] == local.tokenizer.decode(expected, skip_special_tokens=True)
        assert out["output_tokens"][i] == len(expected)
        assert out["prompt_tokens"][i] == len(local.encode(p))
    assert server.answered() == len(prompts)


def test_a_server_killed_mid_batch_and_started_again_answers_every_row_once(
    tiny_llm: Path, server: Server
) -> None:
    prompts = corpus(12, seed=8)
    stage = _stage(
        tiny_llm,
        server.url,
        served_model=str(tiny_llm),
        max_in_flight=2,
        sampling=SamplingSpec(max_tokens=24),
    )
    result: dict[str, Any] = {}
    run = threading.Thread(
        target=lambda: result.update(
            out=stage.process_columns({"prompt": np.array(prompts, dtype=object)})
        )
    )
    run.start()
    deadline = time.monotonic() + 120
    while server.answered() < 3:
        assert time.monotonic() < deadline, "the server answered nothing"
        time.sleep(0.05)
    server.kill()
    server.start()  # the same port: the stage's requests reach the new server
    run.join(timeout=240)
    assert not run.is_alive()
    out = result["out"]
    local = TransformersEngine(str(tiny_llm))
    for i, p in enumerate(prompts):
        expected = _greedy(local, local.encode(p), 24)
        assert out["text"][i] == local.tokenizer.decode(expected, skip_special_tokens=True)
    assert stage.engine.requests_sent > len(prompts)  # some were asked again
    assert stage.engine_restarts == 0  # the server came back within the engine's patience
