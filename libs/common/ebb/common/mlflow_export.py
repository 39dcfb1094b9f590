"""A job's metrics logged as one MLflow run.

Each number among the results (a count, a sum, an AUC...) becomes an MLflow metric of the
same name; the results whole (histograms, and metrics left undefined, as nulls) are logged
beside them as the run's `metrics.json` artifact, the same map as the job's `_metrics.json`.
MLflow metrics hold numbers only: the artifact is where a histogram can be read back.

A job's run is tagged with its id (`JOB_TAG`), and logging it again finds that run rather than
making a second: the master logs it at least once (it retries until the store takes it,
across its own restarts), and the tag makes that exactly one run.

mlflow is an optional dependency (`pip install 'ebb[mlflow]'`, mlflow-skinny), imported
only when a run is logged. The call blocks (it talks to the tracking server, or writes a
local store): run it in a thread from the event loop.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Mapping
from typing import Any

from .errors import EbbError

ARTIFACT = "metrics.json"
"""The run's artifact holding the results whole."""
JOB_TAG = "ebb.job"
"""The tag naming the job a run is the metrics of."""


class MlflowExportError(EbbError):
    """The run could not be logged: mlflow is not installed, or the tracking store refused or
    could not be reached (the cause is chained)."""


def available() -> bool:
    """Whether mlflow can be imported here (without importing it: that takes seconds)."""
    return importlib.util.find_spec("mlflow") is not None


def log_metrics(
    *,
    tracking_uri: str,
    experiment: str,
    run_name: str,
    values: Mapping[str, Any],
    params: Mapping[str, str],
    job: str = "",
) -> str:
    """Log `values` (metric results by name) as a finished run of `experiment` (made if it
    does not exist) at `tracking_uri`, with `params` (the job's id, say); the run's id.

    `job`: the run is that job's (tagged `JOB_TAG`): a finished run of it is the answer as it
    is, and one an earlier call left unfinished is completed, not made again.
    A run that fails half way is marked FAILED, and MlflowExportError raised."""
    try:
        import mlflow
    except ImportError as e:
        raise MlflowExportError(
            "logging metrics to MLflow needs mlflow: pip install 'ebb[mlflow]'"
        ) from e
    numbers = {
        name: float(value)
        for name, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    now_ms = int(time.time() * 1000)
    try:
        client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        experiment_id = _experiment_id(client, experiment)
        found = _run_of(client, experiment_id, job) if job else None
        if found is not None and found.info.status == "FINISHED":
            return str(found.info.run_id)
        if found is None:
            tags = {JOB_TAG: job} if job else None
            found = client.create_run(experiment_id, run_name=run_name, tags=tags)
        run_id = str(found.info.run_id)
    except (mlflow.exceptions.MlflowException, OSError) as e:
        raise MlflowExportError(f"MLflow at {tracking_uri}: cannot start a run: {e}") from e
    try:
        client.log_batch(
            run_id,
            metrics=[mlflow.entities.Metric(k, v, now_ms, 0) for k, v in numbers.items()],
            params=[mlflow.entities.Param(k, v) for k, v in params.items()],
        )
        client.log_dict(run_id, dict(values), ARTIFACT)
        client.set_terminated(run_id, status="FINISHED")
    except (mlflow.exceptions.MlflowException, OSError) as e:
        # The store is what failed: marking the run may fail too, and the error raised
        # below says why.
        with contextlib.suppress(mlflow.exceptions.MlflowException, OSError):
            client.set_terminated(run_id, status="FAILED")
        raise MlflowExportError(f"MLflow at {tracking_uri}: run {run_id}: {e}") from e
    return run_id


def _run_of(client: Any, experiment_id: str, job: str) -> Any:
    """The run tagged as `job`'s in the experiment (the oldest, were there several), or None."""
    quoted = job.replace("\\", "\\\\").replace("'", "\\'")
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{JOB_TAG}` = '{quoted}'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    return runs[0] if runs else None


def _experiment_id(client: Any, name: str) -> str:
    """The id of the experiment of that name, made if there is none (by this caller or by
    another one at the same moment)."""
    import mlflow

    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except mlflow.exceptions.MlflowException:
        found = client.get_experiment_by_name(name)  # made by another caller meanwhile
        if found is None:
            raise
        return str(found.experiment_id)
