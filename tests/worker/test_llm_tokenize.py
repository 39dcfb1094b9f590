"""Prompts tokenized by one stage (`tokenize_only`, a CPU tier's work) and generated from by
the next, which feeds the ids to its engine as they are: the same text as one stage that does
both, chats rendered with the template, a prompt that is neither an error row at the first."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ebb.common.job import LLMSpec, StageSpec
from ebb.worker.pipeline.front import Pipeline, PipelineConfig

from ..llm_model import build_tiny_llm, corpus


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny")


async def _run(stages: list[StageSpec], rows: list[dict[str, Any]]) -> list[tuple[bool, Any]]:
    pipeline = Pipeline(PipelineConfig(stages=stages, code_paths=[]))
    try:
        await pipeline.start()
        return await pipeline.run(rows)
    finally:
        await pipeline.stop()


async def test_ids_from_a_tokenizing_stage_generate_what_the_text_does(tiny_llm: Path) -> None:
    prompts: list[Any] = list(corpus(8, seed=12))
    prompts.append([{"role": "user", "content": prompts[0]}])
    rows: list[dict[str, Any]] = [
        {"id": i, "prompt": p, "m": 2 + i % 5} for i, p in enumerate(prompts)
    ]
    rows.append({"id": 99, "prompt": 42, "m": 3})  # neither text nor a chat nor ids
    generate = LLMSpec(model=str(tiny_llm), per_row={"max_tokens": "m"})
    both = await _run([StageSpec(name="gen", llm=generate, batch_size=16)], rows)
    tokenize = LLMSpec(model=str(tiny_llm), tokenize_only=True)
    split = await _run(
        [
            StageSpec(name="tok", llm=tokenize, batch_size=16),
            StageSpec(name="gen", llm=replace(generate, prompt="prompt_ids"), batch_size=16),
        ],
        rows,
    )
    for row, (ok_both, one), (ok_split, two) in zip(rows, both, split, strict=True):
        if row["id"] == 99:
            assert not ok_both and not ok_split
            assert "token ids" in str(two)
            continue
        assert ok_both and ok_split, (one, two)
        assert one["prompt_tokens"] == two["prompt_tokens"] > 0
        assert (one["text"], one["output_tokens"]) == (two["text"], two["output_tokens"])
