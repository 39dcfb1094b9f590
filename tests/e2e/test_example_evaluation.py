"""examples/evaluation: two rankers scored and compared on one read, run as a user runs it
(`python prepare.py`, then `ebb run job.yaml`): one table with both scores, and each ranker's
AUC and log loss equal to the same metrics computed from that table."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from ebb.common.data.layout import MANIFEST, METRICS
from ebb.common.job import accumulators, load_job_file

from ..client.test_cli import ebb, runs, said

__all__ = ["runs"]  # the fixture, used by name

EXAMPLE = Path(__file__).resolve().parent.parent.parent / "examples" / "evaluation"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def prepare() -> Iterator[Any]:
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield importlib.import_module("prepare")
    finally:
        sys.path.remove(str(EXAMPLE))


def exact_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The Mann-Whitney statistic over every (clicked, not clicked) pair, ties counted half."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    for value in np.unique(scores[np.diff(np.sort(scores), prepend=np.nan) == 0]):
        tied = scores == value
        ranks[tied] = ranks[tied].mean()
    positives = labels == 1
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_two_rankers_compared_on_one_read(tmp_path: Path, prepare: Any) -> None:
    rows = 20_000
    prepare.prepare(tmp_path, rows, train_rows=20_000)
    shutil.copy(EXAMPLE / "job.yaml", tmp_path / "job.yaml")
    result = ebb("run", "job.yaml", cwd=tmp_path)
    assert result.returncode == 0, said(result)
    assert "metric   auc_a = " in result.stdout and "metric   auc_b = " in result.stdout

    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    table = pq.read_table(
        [str(tmp_path / "out" / f["path"]) for f in manifest["files"]], partitioning=None
    )
    assert sorted(table.column("id").to_numpy().tolist()) == list(range(rows))
    assert {"p_a", "p_b", "clicked"} <= set(table.column_names)

    spec = load_job_file(tmp_path / "job.yaml")
    specs = spec.pipeline.all_metrics()
    columns = {name: table.column(name).to_numpy() for name in ("clicked", "p_a", "p_b")}
    expected = accumulators.results_named(
        specs, accumulators.reduce_named(specs, accumulators.row_values_named(specs, columns))
    )
    written = json.loads((tmp_path / "out" / METRICS).read_text())["metrics"]
    assert written == expected
    # Binned by 1,000 over [0, 1]: within a thousandth of the AUC over every pair.
    clicked = columns["clicked"]
    for model in ("a", "b"):
        scores = columns[f"p_{model}"].astype(np.float64)
        assert written[f"auc_{model}"] == pytest.approx(exact_auc(clicked, scores), abs=1e-3)
    # The MLP sees the interactions the logistic regression cannot.
    assert written["auc_b"] > written["auc_a"] + 0.03
    assert written["logloss_b"] < written["logloss_a"]
