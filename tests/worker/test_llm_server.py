"""The `llm` stage with a server it runs itself (`engine: server`): a real `transformers serve`
started from the spec's command, fed over loopback, started again when it is SIGKILLed
mid-batch, stopped with the stage; a command that cannot start fails the pipeline's set-up."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from ebb.common.job import LLMSpec, SamplingSpec, StageSpec
from ebb.worker.llm.hf import TransformersEngine
from ebb.worker.llm.stage import LLMStage
from ebb.worker.pipeline.front import Pipeline, PipelineConfig, PipelineSetupError

from ..helpers import command_line
from ..llm_model import build_tiny_llm, corpus
from .test_llm import _greedy
from .test_llm_endpoint import SERVE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if SERVE is None:
        pytest.fail("the transformers CLI is missing: install ebb[dev] (transformers[serving])")
    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny")


def _spec(model: Path, command: list[str] | None = None, **llm: Any) -> StageSpec:
    assert SERVE is not None
    return StageSpec(
        name="gen",
        llm=LLMSpec(
            model=str(model),
            engine="server",
            command=command or [SERVE, "serve", "{model}", "--port", "{port}"],
            prompt_as="text",  # transformers serve takes text alone
            **llm,
        ),
    )


def _servers(model: Path) -> list[psutil.Process]:
    """Model servers among this test's descendants: `transformers serve <model> --port N`."""
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if command_line(p).split()[-4:-2] == ["serve", str(model)]
    ]


def test_a_server_killed_mid_batch_is_started_again_and_every_row_answered(
    tiny_llm: Path,
) -> None:
    stage = LLMStage(_spec(tiny_llm, max_in_flight=2, sampling=SamplingSpec(max_tokens=20)))
    stage.setup()
    assert stage.server is not None and stage.server.alive
    first = stage.server.process
    assert first is not None
    prompts = corpus(10, seed=11)
    result: dict[str, Any] = {}
    run = threading.Thread(
        target=lambda: result.update(
            out=stage.process_columns({"prompt": np.array(prompts, dtype=object)})
        )
    )
    run.start()
    deadline = time.monotonic() + 120
    while stage.server.log_path.read_text().count("POST /v1/completions") < 3:
        assert time.monotonic() < deadline, "the server answered nothing"
        time.sleep(0.05)
    first.kill()  # as the OOM killer would
    run.join(timeout=240)
    assert not run.is_alive()
    assert stage.server_starts == 2
    assert stage.engine_restarts == 1
    local = TransformersEngine(str(tiny_llm))
    for i, p in enumerate(prompts):
        expected = _greedy(local, local.encode(p), 20)
        assert result["out"]["text"][i] == local.tokenizer.decode(
            expected, skip_special_tokens=True
        )
    second = stage.server.process
    assert second is not None and second.pid != first.pid
    stage.server.close()
    assert second.poll() is not None


async def test_the_server_stops_with_its_stage(tiny_llm: Path) -> None:
    stage = _spec(tiny_llm, sampling=SamplingSpec(max_tokens=8))
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[]))
    await pipeline.start()
    try:
        outcomes = await pipeline.run([{"prompt": p} for p in corpus(3, seed=12)])
        assert all(ok for ok, _ in outcomes), outcomes
        servers = _servers(tiny_llm)
        assert len(servers) == 1
    finally:
        await pipeline.stop()
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert alive == []


async def test_a_server_command_that_cannot_start_fails_the_set_up(tiny_llm: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(3)", "{port}"]
    pipeline = Pipeline(PipelineConfig(stages=[_spec(tiny_llm, command)], code_paths=[]))
    with pytest.raises(PipelineSetupError, match=r"exited with code 3 .*no GPU here"):
        await pipeline.start()
    await pipeline.stop()
