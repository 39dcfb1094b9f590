"""An `llm` stage with `engine: vllm` in a pipeline of its own (the stage in its own process,
as a worker runs it), over rows read as JSON from stdin; prints each row's outcome as JSON.
Run with the interpreter of vLLM's venv, where Ebb is installed too (`make vllm`), by
tests/worker/test_llm_vllm.py.

stdin: {"model": folder, "rows": [{"prompt", "m", "t"}...], "engine_args": {...},
"max_in_flight": n, "batch_size": n, "structured": {...} (optional)}; a row's "shape" (a
JSON text, or null) its own structured output."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from ebb.common.job import LLMSpec, StageSpec, StructuredSpec
from ebb.worker.pipeline.front import Pipeline, PipelineConfig


async def main() -> None:
    asked = json.load(sys.stdin)
    stage = StageSpec(
        name="gen",
        llm=LLMSpec(
            model=asked["model"],
            engine="vllm",
            dtype="float32",
            engine_args=asked["engine_args"],
            max_in_flight=asked["max_in_flight"],
            per_row={
                "max_tokens": "m",
                "temperature": "t",
                **({"structured": "shape"} if any("shape" in r for r in asked["rows"]) else {}),
            },
            structured=StructuredSpec(**asked["structured"]) if "structured" in asked else None,
        ),
        batch_size=asked["batch_size"],
    )
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[]))
    await pipeline.start()
    try:
        outcomes = await pipeline.run(asked["rows"])
    finally:
        await pipeline.stop()
    out: list[Any] = []
    for ok, value in outcomes:
        if not ok:
            out.append([False, str(value)])
            continue
        out.append(
            [
                True,
                {k: value[k] for k in ("text", "finish_reason", "prompt_tokens", "output_tokens")},
            ]
        )
    print("OUTCOMES " + json.dumps(out, default=int), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
