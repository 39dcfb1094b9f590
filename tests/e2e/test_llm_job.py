"""A generation job as a user runs it: `ebb run` on the embedded stack, prompts in JSONL, an
`llm` stage on a tiny model built here, two workers: every row once in the output, its text
what the model makes of its prompt alone, the row the model cannot take an error row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from ebb.common.data.layout import COMMITS_DIR
from ebb.worker.llm.provenance import model_digest

from ..client.test_cli import ebb, runs, said
from ..llm_model import build_tiny_llm, corpus
from ..worker.test_llm import _greedy

__all__ = ["runs"]  # the CLI tests' fixture: where `ebb run` keeps its state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_a_generation_job_writes_every_row_once(tmp_path: Path) -> None:
    from ebb.worker.llm.hf import TransformersEngine

    model = build_tiny_llm(tmp_path / "model")
    prompts = corpus(40, seed=9)
    rows: list[dict[str, Any]] = [
        {"id": i, "prompt": p, "budget": 2 + i % 9} for i, p in enumerate(prompts)
    ]
    rows.append({"id": 40, "prompt": " ".join(["stone"] * 300), "budget": 4})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = {
        "name": "generate",
        "input": {"uri": "prompts.jsonl", "rows_per_shard": 10},
        "pipeline": {
            "stages": [
                {
                    "name": "gen",
                    "llm": {
                        "model": "model",
                        "per_row": {"max_tokens": "budget"},
                        "max_in_flight": 4,
                    },
                    "batch_size": 16,
                    "metrics": {
                        "tokens": {"kind": "sum", "column": "output_tokens"},
                        "rows": {"kind": "count"},
                    },
                }
            ]
        },
        "output": {"uri": "out", "carryover": ["id"]},
        "resources": {"max_workers": 2},
        "fault": {"max_error_fraction": 0.05},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = ebb(
        "run", "job.yaml", "--max-workers", "2", "--data-root", str(tmp_path), cwd=tmp_path
    )
    assert result.returncode == 0, said(result)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    table = pq.ParquetDataset([str(tmp_path / "out" / f["path"]) for f in manifest["files"]])
    out = table.read().to_pylist()
    assert sorted(r["id"] for r in out) == list(range(41))
    engine = TransformersEngine(str(model))
    by_id = {r["id"]: r for r in out}
    assert by_id[40]["_error"] and "context" in by_id[40]["_error"]
    for row in rows[:40]:
        got = by_id[row["id"]]
        assert got["_error"] is None, got["_error"]
        expected = _greedy(engine, engine.encode(row["prompt"]), row["budget"])
        assert got["text"] == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert got["output_tokens"] == len(expected)
    # The tokens made, counted once per row written whatever ran twice: the output's own sum.
    metrics = json.loads((tmp_path / "out" / "_metrics.json").read_text())
    assert metrics["metrics"]["tokens"] == sum(
        r["output_tokens"] for r in out if r["_error"] is None
    )
    assert metrics["metrics"]["rows"] == 40
    # Every shard's commit record names what generated it: the same model bytes, engine, sampling.
    records = [json.loads(p.read_text()) for p in (tmp_path / "out" / COMMITS_DIR).glob("*.json")]
    assert {r["shard"] for r in records} >= {f["shard"] for f in manifest["files"]}
    for record in records:
        gen = record["generation"]["gen"]
        assert gen["model_sha256"] == model_digest(str(model)), gen
        assert gen["engine"] == "transformers" and gen["per_row"] == {"max_tokens": "budget"}
        assert gen["sampling"]["temperature"] == 0.0


def test_prompts_tokenized_on_one_tier_are_generated_from_on_the_next(tmp_path: Path) -> None:
    """Tokenizing on a CPU tier, generating on another (a GPU's, on a cluster): every row
    once, each one's text what the model makes of its prompt alone."""
    from ebb.worker.llm.hf import TransformersEngine

    model = build_tiny_llm(tmp_path / "model")
    rows = [{"id": i, "prompt": p, "budget": 2 + i % 5} for i, p in enumerate(corpus(24, seed=3))]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = {
        "name": "tiered-generate",
        "input": {"uri": "prompts.jsonl", "rows_per_shard": 8},
        "pipeline": {
            "stages": [
                {"name": "tok", "llm": {"model": "model", "tokenize_only": True}},
                {
                    "name": "gen",
                    "llm": {
                        "model": "model",
                        "prompt": "prompt_ids",
                        "per_row": {"max_tokens": "budget"},
                    },
                },
            ]
        },
        "tiers": [
            {"name": "cpu", "stages": ["tok"], "resources": {"max_workers": 1}},
            {"name": "gpu", "stages": ["gen"], "resources": {"max_workers": 1}},
        ],
        "output": {"uri": "out", "carryover": ["id"]},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = ebb(
        "run", "job.yaml", "--max-workers", "2", "--data-root", str(tmp_path), cwd=tmp_path
    )
    assert result.returncode == 0, said(result)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    out = (
        pq.ParquetDataset([str(tmp_path / "out" / f["path"]) for f in manifest["files"]])
        .read()
        .to_pylist()
    )
    assert sorted(r["id"] for r in out) == list(range(24))
    engine = TransformersEngine(str(model))
    for got in out:
        row = rows[got["id"]]
        expected = _greedy(engine, engine.encode(row["prompt"]), row["budget"])
        assert got["text"] == engine.tokenizer.decode(expected, skip_special_tokens=True)
