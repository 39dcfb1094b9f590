"""An llm stage's engine in the worker's metrics: the tokens its rows took and made, counted
from its process's board (every row generated, once), its rows in flight and the tokens they
hold back to zero when the batch is done, and its restarts as the stage posts them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from ebb.common import envvars, failpoints
from ebb.common.job import LLMSpec, SamplingSpec, StageSpec
from ebb.worker.llm.stage import LLMStage
from ebb.worker.pipeline.front import Pipeline, PipelineConfig

from ..helpers import wait_until
from ..llm_model import build_tiny_llm, corpus


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny")


def _value(name: str, stage: str) -> float:
    return REGISTRY.get_sample_value(name, {"stage": stage}) or 0.0


async def test_the_worker_counts_the_tokens_its_llm_stage_took_and_made(tiny_llm: Path) -> None:
    stage = StageSpec(
        name="metered",
        llm=LLMSpec(model=str(tiny_llm), per_row={"max_tokens": "m"}, max_in_flight=4),
        batch_size=8,
    )
    rows: list[dict[str, Any]] = [
        {"prompt": p, "m": 2 + i % 7} for i, p in enumerate(corpus(20, seed=8))
    ]
    before_out = _value("ebb_llm_output_tokens_total", "metered")
    before_in = _value("ebb_llm_prompt_tokens_total", "metered")
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[]))
    await pipeline.start()
    try:
        outcomes = await pipeline.run(rows)
        assert all(ok for ok, _ in outcomes)
        made = sum(int(v["output_tokens"]) for _, v in outcomes)
        took = sum(int(v["prompt_tokens"]) for _, v in outcomes)
        assert made > 0

        def counted() -> bool:
            return (
                _value("ebb_llm_output_tokens_total", "metered") - before_out == made
                and _value("ebb_llm_prompt_tokens_total", "metered") - before_in == took
                and _value("ebb_llm_requests_in_flight", "metered") == 0
                and _value("ebb_llm_held_tokens", "metered") == 0
            )

        await wait_until(counted, timeout=30, what="the tokens counted")
    finally:
        await pipeline.stop()


def test_the_stage_posts_its_engine_s_restarts_and_an_empty_flight_after_a_batch(
    tiny_llm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(envvars.FAILPOINT_DIR, str(tmp_path))
    failpoints.arm(tmp_path, failpoints.WORKER_LLM_ENGINE_FAILS, when="step 3")
    stage = LLMStage(
        StageSpec(
            name="g",
            llm=LLMSpec(model=str(tiny_llm), max_in_flight=2, sampling=SamplingSpec(max_tokens=5)),
        )
    )
    posted: list[dict[str, int]] = []
    stage.set_engine_report(lambda **values: posted.append(values))
    stage.setup()
    out = stage.process_columns({"prompt": np.array(corpus(5, seed=2), dtype=object)})
    assert {"restarts": 1} in posted
    assert max(p["in_flight"] for p in posted if "in_flight" in p) == 2  # its max_in_flight
    assert posted[-1] == {"in_flight": 0, "held_tokens": 0, "restarts": 1}
    made = [p["output_tokens"] for p in posted if "output_tokens" in p]
    assert made == sorted(made) and made[-1] == int(np.sum(out["output_tokens"]))
