"""examples/llm as its README runs it: `prepare.py`, then `ebb run job.yaml`: every prompt
answered once within its own budget, the tokens in `_metrics.json` those of the output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..client.test_cli import ebb, runs, said

__all__ = ["runs"]  # the CLI tests' fixture: where `ebb run` keeps its state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

EXAMPLE = Path(__file__).resolve().parent.parent.parent / "examples" / "llm"


def test_the_llm_example_runs_as_its_readme_says(tmp_path: Path) -> None:
    shutil.copy(EXAMPLE / "job.yaml", tmp_path / "job.yaml")
    prepared = subprocess.run(
        [sys.executable, str(EXAMPLE / "prepare.py"), "--rows", "60", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert prepared.returncode == 0, prepared.stderr
    result = ebb("run", "job.yaml", "--data-root", str(tmp_path), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, said(result)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    rows = [
        json.loads(line)
        for f in manifest["files"]
        for line in (tmp_path / "out" / f["path"]).read_text().splitlines()
    ]
    asked = {
        r["id"]: r for r in map(json.loads, (tmp_path / "prompts.jsonl").read_text().splitlines())
    }
    assert sorted(r["id"] for r in rows) == sorted(asked)
    for row in rows:
        assert row["_error"] is None, row["_error"]
        assert row["task"] == asked[row["id"]]["task"]
        assert 0 <= row["output_tokens"] <= asked[row["id"]]["max_tokens"]
        assert row["finish_reason"] in ("stop", "length")
    metrics = json.loads((tmp_path / "out" / "_metrics.json").read_text())["metrics"]
    assert metrics["output_tokens"] == sum(r["output_tokens"] for r in rows)
    assert metrics["answered"] == len(rows)
    # The run's summary counts them too, with their rate (the metric over output_tokens).
    assert f"tokens {int(metrics['output_tokens']):,} output tokens (" in said(result)
