"""What `ebb` shows of a job's tokens: the metrics that sum an llm stage's `output_tokens`,
their total over the rows done and its rate; nothing for a job that counts none."""

from __future__ import annotations

from typing import Any

from ebb.client.display import token_metrics, tokens_text
from ebb.common.job import parse_job
from ebb.common.messaging.messages import JobStatus


def _spec(metrics: dict[str, Any], *, tokenize_only: bool = False) -> Any:
    return parse_job(
        {
            "name": "gen",
            "input": {"uri": "/data/prompts.jsonl"},
            "pipeline": {
                "stages": [
                    {
                        "name": "prep",
                        "modelet": "ebb.worker.modelets:Identity",
                        "metrics": {"rows": {"kind": "count"}},
                    },
                    {
                        "name": "gen",
                        "llm": {"model": "/models/m", "tokenize_only": tokenize_only},
                        "metrics": metrics,
                    },
                ]
            },
            "output": {"uri": "/out"},
        }
    )


def test_the_tokens_of_a_job_are_its_output_tokens_sums_and_their_rate() -> None:
    spec = _spec(
        {
            "made": {"kind": "sum", "column": "output_tokens"},
            "asked": {"kind": "sum", "column": "prompt_tokens"},
        }
    )
    assert token_metrics(spec) == ["made"]
    status = JobStatus(id="j", name="gen", state="RUNNING", metrics={"made": 1200.0, "asked": 99.0})
    assert tokens_text(spec, status, 4.0) == "1,200 output tokens (300 tokens/s)"
    # Before any shard is done the metric has no value yet: none counted.
    assert tokens_text(spec, JobStatus(id="j", name="gen", state="RUNNING"), 4.0).startswith(
        "0 output"
    )


def test_a_job_that_counts_no_tokens_shows_none() -> None:
    counted = {"made": {"kind": "sum", "column": "output_tokens"}}
    status = JobStatus(id="j", name="gen", state="RUNNING", metrics={"made": 5.0})
    assert tokens_text(_spec({}), status, 1.0) == ""
    assert tokens_text(_spec(counted, tokenize_only=True), status, 1.0) == ""
    assert tokens_text(None, status, 1.0) == ""
