"""Many models on one read, and metrics counted exactly once, end to end on the embedded stack
(real processes): a two-branch job against the single-model jobs, and the job's metrics
against the same metrics computed from its output files, with workers SIGKILLed, a straggler
speculated at the tail, and a job resumed after it failed."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack
from ebb.common.data.layout import METRICS
from ebb.common.job import JobSpec, accumulators, parse_job

from ..e2e.test_e2e import _pid_of, assert_exactly_once
from ..helpers import embedded_stack, job_spec, read_output, wait_until, write_dataset, write_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def mlflow_file_store(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow 3 writes a folder store only when asked to (the master inherits this).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


@pytest.fixture
async def stack(tmp_path: Path, prefix: str) -> AsyncIterator[LocalStack]:
    async with embedded_stack(tmp_path, prefix, max_workers=2) as s:
        yield s


@pytest.fixture
async def client(stack: LocalStack) -> AsyncIterator[EbbClient]:
    async with await EbbClient.connect(stack.nats_config) as c:
        yield c


def evaluation_stages(
    *, seconds_per_batch: float = 0.0, straggle: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Truth, then two light models side by side, each with its metrics; branch `a` may be
    slow, and slower still in one worker (`straggle`: claim, factor)."""
    slow: dict[str, Any] = {"seconds_per_batch": seconds_per_batch}
    if straggle:
        slow["straggle"] = straggle
    weights_a = [1.0, 0.5, -0.5, 0.2, 0.0, 0.1, -0.1, 0.3]
    weights_b = [0.6, -0.3, 0.4, 0.0, 0.2, 0.0, 0.1, -0.2]
    return [
        {"name": "truth", "modelet": "ebbtest_modelets:Labelled", "batch_size": 256},
        {
            "name": "a",
            "modelet": "ebbtest_modelets:Probability",
            "params": {"weights": weights_a, "out": "p_a", **slow},
            "batch_size": 100,
            "metrics": {
                "auc_a": {"kind": "auc", "label": "label", "score": "p_a"},
                "logloss_a": {"kind": "logloss", "label": "label", "score": "p_a"},
                "mean_a": {"kind": "mean", "column": "p_a"},
                "rows": {"kind": "count"},
                "p_a": {"kind": "histogram", "column": "p_a", "range": [0, 1]},
            },
        },
        {
            "name": "b",
            "modelet": "ebbtest_modelets:Probability",
            "params": {"weights": weights_b, "out": "p_b"},
            "after": ["truth"],
            "batch_size": 64,
            "metrics": {
                "auc_b": {"kind": "auc", "label": "label", "score": "p_b"},
                "max_b": {"kind": "max", "column": "p_b"},
                "positives": {"kind": "sum", "column": "label"},
            },
        },
    ]


def metrics_of_output(spec: JobSpec, table: pa.Table) -> dict[str, Any]:
    """The job's metrics computed again, from nothing but its output files."""
    specs = spec.pipeline.all_metrics()
    columns = {name: table.column(name).to_numpy() for name in ("label", "p_a", "p_b", "id")}
    values = accumulators.row_values_named(specs, columns)
    return accumulators.results_named(specs, accumulators.reduce_named(specs, values))


def assert_metrics_match_output(tmp_path: Path, spec: JobSpec, told: dict[str, Any]) -> None:
    table, _ = read_output(tmp_path / "out")
    expected = metrics_of_output(spec, table)
    written = json.loads((tmp_path / "out" / METRICS).read_text())
    assert written["metrics"] == expected
    assert told == expected
    assert expected["rows"] == table.num_rows
    assert 0.5 < expected["auc_a"] < 1.0 and 0.5 < expected["auc_b"] < 1.0


async def test_two_model_branches_equal_the_single_model_jobs_joined_by_id(
    tmp_path: Path, client: EbbClient
) -> None:
    rows = 6_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    a = write_model(tmp_path / "a.onnx", seed=1)
    b = write_model(tmp_path / "b.onnx", seed=2)

    def model(name: str, path: Path, out: str, **kw: Any) -> dict[str, Any]:
        return {"name": name, "model": str(path), "input": "features", "output": out, **kw}

    both = parse_job(
        job_spec(
            tmp_path,
            name="both",
            rows_per_shard=1_000,
            workers=(2, 2),
            carryover=["customer"],
            stages=[model("a", a, "score_a"), model("b", b, "score_b", after=[])],
        )
    )
    final = await client.wait(await client.submit(both))
    assert final.state == "SUCCEEDED", final.reason
    joined = assert_exactly_once(tmp_path, rows).sort_by("id")
    for path, column in ((a, "score_a"), (b, "score_b")):
        out = tmp_path / f"out-{column}"
        alone = parse_job(
            job_spec(
                tmp_path,
                name=f"alone-{column}",
                rows_per_shard=1_000,
                workers=(2, 2),
                carryover=["customer"],
                stages=[model("m", path, column)],
                output_uri=str(out),
            )
        )
        final = await client.wait(await client.submit(alone))
        assert final.state == "SUCCEEDED", final.reason
        single, _ = read_output(out)
        single = single.sort_by("id")
        assert single.column("id").equals(joined.column("id"))
        assert single.column("customer").equals(joined.column("customer"))
        np.testing.assert_allclose(
            np.asarray(joined.column(column).to_pylist()),
            np.asarray(single.column(column).to_pylist()),
            rtol=1e-6,
        )


async def test_metrics_count_each_row_once_when_a_worker_is_killed(
    tmp_path: Path, client: EbbClient
) -> None:
    rows = 12_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    mlruns = tmp_path / "mlruns"
    spec = parse_job(
        {
            **job_spec(
                tmp_path,
                rows_per_shard=1_000,
                workers=(2, 2),
                carryover=["customer"],
                stages=evaluation_stages(seconds_per_batch=0.05),
                fault={"lease_s": 3},
            ),
            "tracking": {"mlflow_uri": str(mlruns), "experiment": "evaluation"},
        }
    )
    job_id = await client.submit(spec)

    async def a_worker_with_a_lease() -> int | None:
        status = (await client.master.status(job_id, include_leases=True)).jobs[0]
        done = status.shards.get("DONE", 0)
        for lease in status.leases:
            pid = _pid_of(lease.worker)
            if pid is not None and done >= 1:
                return pid
        return None

    pid = await wait_until(a_worker_with_a_lease, timeout=120, what="a shard done, one held")
    os.kill(pid, signal.SIGKILL)
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert_exactly_once(tmp_path, rows)
    assert_metrics_match_output(tmp_path, spec, final.metrics)
    assert final.metrics["rows"] == rows
    # ...and as an MLflow run, in the store the spec named, once the master says it is.
    mlflow = pytest.importorskip("mlflow")
    tracking = mlflow.MlflowClient(tracking_uri=mlruns.as_uri())

    async def the_run() -> Any:
        status = await client.job(job_id)
        if status.mlflow_run in ("", "pending"):
            return None
        return tracking.get_run(status.mlflow_run)

    run = await wait_until(the_run, timeout=60, interval=0.5, what="the job's MLflow run")
    assert run.info.run_name == job_id
    assert run.data.metrics["auc_a"] == final.metrics["auc_a"]
    assert run.data.metrics["rows"] == rows


async def test_metrics_count_each_row_once_when_a_straggler_is_speculated(
    tmp_path: Path, client: EbbClient
) -> None:
    rows = 8_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=1_000)
    straggle = {"claim": str(tmp_path / "straggler"), "factor": 30}
    spec = parse_job(
        job_spec(
            tmp_path,
            rows_per_shard=1_000,
            workers=(2, 2),
            carryover=["customer"],
            stages=evaluation_stages(seconds_per_batch=0.02, straggle=straggle),
            fault={"lease_s": 10, "split_tail": False},
        )
    )
    job_id = await client.submit(spec)

    async def a_shard_run_twice() -> bool:
        status = (await client.master.status(job_id, include_leases=True)).jobs[0]
        shards = [lease.shard for lease in status.leases]
        return len(shards) > len(set(shards))

    await wait_until(a_shard_run_twice, timeout=180, what="a straggler's shard speculated")
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert_exactly_once(tmp_path, rows)
    assert_metrics_match_output(tmp_path, spec, final.metrics)


async def test_metrics_count_each_row_once_across_a_resume(
    tmp_path: Path, client: EbbClient
) -> None:
    rows = 9_000
    write_dataset(tmp_path / "data", rows=rows, files=3, row_group_size=1_000)
    spec = parse_job(
        job_spec(
            tmp_path,
            rows_per_shard=1_000,
            workers=(2, 2),
            carryover=["customer"],
            stages=evaluation_stages(seconds_per_batch=0.02),
            fault={"lease_s": 5, "max_attempts": 1},
        )
    )
    last = tmp_path / "data" / "part-002.parquet"
    aside = tmp_path / "part-002.parquet.aside"
    job_id = await client.submit(spec)
    last.rename(aside)  # gone before a worker reads it: its shards are quarantined
    failed = await client.wait(job_id)
    assert failed.state == "FAILED", failed.reason
    assert 0 < failed.metrics["rows"] < rows
    aside.rename(last)
    await client.resume(job_id)
    final = await client.wait(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert_exactly_once(tmp_path, rows)
    assert_metrics_match_output(tmp_path, spec, final.metrics)


FAIL_LAST = [17, 2_500, 3_999]
"""Rows the last stage fails: error rows of the output, in no metric."""
UNSTORABLE = 1_234
"""A row whose shard's every attempt fails in the last stage: that shard is quarantined."""


def gated_stages() -> list[dict[str, Any]]:
    """Truth and a model with its metrics, then a last stage that fails some rows and every
    attempt at one shard."""
    weights = [1.0, 0.5, -0.5, 0.2, 0.0, 0.1, -0.1, 0.3]
    return [
        {
            "name": "truth",
            "modelet": "ebbtest_modelets:Labelled",
            "batch_size": 128,
            "metrics": {"rows_truth": {"kind": "count"}},
        },
        {
            "name": "a",
            "modelet": "ebbtest_modelets:Probability",
            "params": {"weights": weights, "out": "p_a"},
            "batch_size": 100,
            "metrics": {
                "auc_a": {"kind": "auc", "label": "label", "score": "p_a"},
                "rows": {"kind": "count"},
                "p_a": {"kind": "histogram", "column": "p_a", "range": [0, 1]},
            },
        },
        {
            "name": "gate",
            "modelet": "ebbtest_modelets:Gate",
            "params": {"fail": FAIL_LAST, "unstorable": [UNSTORABLE]},
            "batch_size": 64,
        },
    ]


def in_tiers(spec: dict[str, Any], cuts: list[list[str]]) -> dict[str, Any]:
    each = {"min_workers": 1, "max_workers": 1, "cpu": 0.5, "memory_gb": 1}
    tiers = [{"name": f"t{k}", "stages": cut, "resources": each} for k, cut in enumerate(cuts)]
    return {**spec, "tiers": tiers}


@pytest.mark.parametrize(
    "cuts",
    [[], [["truth", "a"], ["gate"]], [["truth"], ["a"], ["gate"]]],
    ids=["one tier", "two tiers", "three tiers"],
)
async def test_metrics_count_the_rows_of_the_output_however_the_job_is_cut_into_tiers(
    tmp_path: Path, prefix: str, cuts: list[list[str]]
) -> None:
    """Rows that pass the first tiers and fail in the last, and a last-tier shard quarantined:
    the job's metrics count exactly the rows of its output without error, the same in one
    tier as in three (a worker for each tier)."""
    rows = 4_000
    write_dataset(tmp_path / "data", rows=rows, row_group_size=500)
    body = job_spec(
        tmp_path,
        rows_per_shard=500,
        carryover=["customer"],
        stages=gated_stages(),
        fault={"max_attempts": 2, "max_error_fraction": 0.5},
    )
    spec = parse_job(in_tiers(body, cuts) if cuts else body)
    async with (
        embedded_stack(tmp_path, prefix, max_workers=max(1, len(cuts))) as stack,
        await EbbClient.connect(stack.nats_config) as client,
    ):
        final = await client.wait(await client.submit(spec))
    assert final.state == "SUCCEEDED", final.reason
    assert final.shards["QUARANTINED"] == 1

    table, manifest = read_output(tmp_path / "out")
    assert [q["rows"] for q in manifest["quarantined"]] == [500]
    ids = table.column("id").to_numpy()
    assert len(ids) == rows - 500 and UNSTORABLE not in ids
    good = table.filter(pc.is_null(table.column("_error")))
    assert len(good) == rows - 500 - len(FAIL_LAST)
    specs = spec.pipeline.all_metrics()
    columns = {name: good.column(name).to_numpy() for name in ("label", "p_a")}
    expected = accumulators.results_named(
        specs, accumulators.reduce_named(specs, accumulators.row_values_named(specs, columns))
    )
    written = json.loads((tmp_path / "out" / METRICS).read_text())
    assert written["metrics"] == expected == final.metrics
    assert expected["rows"] == expected["rows_truth"] == len(good)
