"""Metrics logged as an MLflow run, read back with MLflow's own client from a local store."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ebb.common.job.accumulators import MetricSpec, reduce_named, results_named, row_values_named
from ebb.common.mlflow_export import ARTIFACT, MlflowExportError, log_metrics

mlflow = pytest.importorskip("mlflow")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    # MLflow 3 keeps its folder store for those who ask for it (a database is its default).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def test_results_become_a_run(store: str) -> None:
    specs = {
        "rows": MetricSpec(kind="count"),
        "mean_p": MetricSpec(kind="mean", column="p"),
        "auc": MetricSpec(kind="auc", label="y", score="p"),
        "p_hist": MetricSpec(kind="histogram", column="p", range=[0, 1], bins=4),
        "min_q": MetricSpec(kind="min", column="q"),
    }
    columns = {
        "p": np.array([0.1, 0.4, 0.35, 0.8]),
        "y": np.array([0, 0, 1, 1]),
        "q": np.array([None] * 4, dtype=object),
    }
    values = results_named(specs, reduce_named(specs, row_values_named(specs, columns)))
    run_id = log_metrics(
        tracking_uri=store,
        experiment="churn",
        run_name="churn-1a2b",
        values=values,
        params={"job": "churn-1a2b"},
    )
    client = mlflow.MlflowClient(tracking_uri=store)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "churn-1a2b"
    assert client.get_experiment(run.info.experiment_id).name == "churn"
    assert run.data.params == {"job": "churn-1a2b"}
    # Numbers are metrics; a histogram, and a metric of no rows (null), only in the artifact.
    assert run.data.metrics == {"rows": 4.0, "mean_p": values["mean_p"], "auc": 0.75}
    artifact = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/{ARTIFACT}")
    assert artifact == values
    assert artifact["p_hist"]["counts"] == [1, 2, 0, 1]
    assert artifact["min_q"] is None

    again = log_metrics(
        tracking_uri=store, experiment="churn", run_name="r2", values={"rows": 1}, params={}
    )
    assert client.get_run(again).info.experiment_id == run.info.experiment_id


def test_without_mlflow_the_error_says_how_to_get_it(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(MlflowExportError, match=r"pip install 'ebb\[mlflow\]'"):
        log_metrics(tracking_uri=store, experiment="e", run_name="r", values={}, params={})


def test_a_store_that_refuses_is_an_export_error(store: str, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(MlflowExportError, match="cannot start a run") as e:
        log_metrics(
            tracking_uri=(tmp_path / "a-file").as_uri(),
            experiment="e",
            run_name="r",
            values={},
            params={},
        )
    assert isinstance(e.value.__cause__, NotADirectoryError)


def test_a_job_s_run_is_logged_once_however_often_it_is_logged(store: str) -> None:
    """The master logs a job's run at least once (it retries): the run tagged with the job is
    found again, finished as it is, or completed where an earlier try stopped half way."""
    first = log_metrics(
        tracking_uri=store, experiment="e", run_name="j-1", values={"rows": 3}, params={}, job="j-1"
    )
    again = log_metrics(
        tracking_uri=store, experiment="e", run_name="j-1", values={"rows": 3}, params={}, job="j-1"
    )
    assert again == first
    client = mlflow.MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("e")
    # A try that made the run and died before it finished it: the next completes that run.
    started = client.create_run(experiment.experiment_id, run_name="j-2", tags={"ebb.job": "j-2"})
    completed = log_metrics(
        tracking_uri=store, experiment="e", run_name="j-2", values={"rows": 5}, params={}, job="j-2"
    )
    assert completed == started.info.run_id
    run = client.get_run(completed)
    assert run.info.status == "FINISHED" and run.data.metrics == {"rows": 5.0}
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["j-1", "j-2"]
