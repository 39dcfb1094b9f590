"""What `ebb` shows of a running job: its progress line (rows in flight, tiers, splits,
losses, time left), and its tokens: the metrics that sum an llm stage's `output_tokens`,
their total over the rows done and its rate; nothing for a job that counts none."""

from __future__ import annotations

from typing import Any

from ebb.client.display import progress_line, token_metrics, tokens_text
from ebb.common.job import parse_job
from ebb.common.messaging.messages import JobStatus, TierStatus


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


def test_a_running_jobs_line_counts_the_rows_in_flight_each_tier_splits_and_losses() -> None:
    status = JobStatus(
        id="j",
        name="j",
        state="RUNNING",
        rows_total=10_000,
        rows_done=2_000,
        rows_in_flight=3_000,
        shards_total=6,
        shards={"DONE": 2, "DOING": 2, "TODO": 2},
        shards_split=1,
        error_rows=4,
        workers_lost={"capacity": 1},
        workers_drained=2,
        tiers=[
            TierStatus(name="cpu", shards={"DONE": 3, "DOING": 1}, rows_done=6_000),
            TierStatus(
                name="gpu", shards={"DONE": 2, "DOING": 1}, rows_done=2_000, rows_in_flight=3_000
            ),
        ],
    )
    assert progress_line(None, status, 10.0) == (
        "running: 5,000/10,000 rows (2,000 committed), 2/6 shards, 1 split, 4 errors, "
        "500 rows/s, 0m10s left; tier cpu: 3/4 shards, 6,000 rows; tier gpu: 2/3 shards, "
        "5,000 rows; workers 1 lost (1 capacity), 0 attempts forgiven; 2 drained"
    )
