"""A succeeded job's MLflow run is at least once and one run: due in the record that ends the
job, logged by the master's tracker until the tracking store takes it, its state in the job's
status, and logged by a new master if the first died before it could (the lease table on the
in-memory store, a local MLflow store)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ebb.common.job import parse_job
from ebb.common.messaging.bus import Backoff
from ebb.common.messaging.messages import JobStatus, StatusRequest
from ebb.shard_master.table.lease_table import LeaseTable
from ebb.shard_master.table.tracking import PENDING, MlflowRuns

from ..helpers import job_spec, write_dataset, write_model
from .test_lease_table import Clock, MemoryStore, commit_record, new_table

mlflow = pytest.importorskip("mlflow")


def status_of(table: LeaseTable, job: str) -> JobStatus:
    (status,) = table.status(StatusRequest(job=job)).jobs
    return status


@pytest.fixture(autouse=True)
def file_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


async def test_a_run_the_store_refuses_is_pending_then_logged_once_it_takes_it(
    tmp_path: Path,
) -> None:
    tracking = tmp_path / "mlruns"
    tracking.write_text("not a folder yet: the tracking store is down")
    write_dataset(tmp_path / "data", rows=100, row_group_size=100)
    write_model(tmp_path / "model.onnx")
    body = job_spec(tmp_path, rows_per_shard=100)
    body["tracking"] = {"mlflow_uri": tracking.as_uri(), "experiment": "evals"}
    spec = parse_job(body).with_id()
    store, clock = MemoryStore(), Clock()
    table = new_table(store, clock)
    table.mlflow = MlflowRuns(table.context, backoff=Backoff(first_s=10.0, max_s=10.0))
    assert await table.intake.submit(spec)
    reply = await table.lease(spec.id, "w1")
    commit_record(spec, reply)
    await table.commit(reply.token)
    job = table.jobs[spec.id]
    # Due in the very record that says SUCCEEDED.
    assert job.record.state == "SUCCEEDED"
    assert store.jobs[spec.id][0].mlflow_run == PENDING

    assert await table.mlflow.log_due() == 0
    status = status_of(table, spec.id)
    assert status.mlflow_run == PENDING and "cannot start a run" in status.mlflow_error
    assert await table.mlflow.log_due() == 0  # not before its backoff
    tracking.unlink()
    clock.now += 11
    # A new master (this one died): it finds the run due in the record, and logs it.
    restarted = new_table(store, Clock())
    await restarted.load()
    assert await restarted.mlflow.log_due() == 1
    run_id = store.jobs[spec.id][0].mlflow_run
    assert run_id not in ("", PENDING)
    assert status_of(restarted, spec.id).mlflow_run == run_id
    # The first master's backoff is over: told the run is due again (its record is old), it
    # finds the run the new one made rather than make another.
    job.record = replace(job.record, mlflow_run=PENDING)
    job.revision = store.jobs[spec.id][1]
    assert await table.mlflow.log_due() == 1
    client = mlflow.MlflowClient(tracking_uri=tracking.as_uri())
    experiment = client.get_experiment_by_name("evals")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["job"] == spec.id
