"""One shard attempt, without a master or NATS: read, compute, write, commit record."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebb.common.layout import OutputFile, attempt_dir
from ebb.common.messages import ShardSpec
from ebb.common.output import OutputStore, new_commit
from ebb.common.spec import JobSpec, parse_job
from ebb.worker.attempt import run_attempt
from ebb.worker.pipeline import Pipeline, PipelineBroken, PipelineConfig, RunResult

from .helpers import job_spec, reference_predictions, write_dataset, write_model

ROWS = 1_500


def _job(tmp_path: Path) -> tuple[JobSpec, ShardSpec]:
    """A job whose one shard is a file of three row groups."""
    write_dataset(tmp_path / "data", rows=ROWS, row_group_size=500)
    write_model(tmp_path / "model.onnx")
    spec = parse_job(job_spec(tmp_path, rows_per_shard=ROWS)).with_id()
    path = tmp_path / "data" / "part-000.parquet"
    shard = ShardSpec(index=0, path=str(path), format="parquet", rows=ROWS, row_groups=[0, 1, 2])
    return spec, shard


class Broken:
    """A pipeline that breaks at the first rows."""

    def __init__(self) -> None:
        self.runs = 0

    async def run_columns(self, rows: pa.Table) -> RunResult:
        self.runs += 1
        raise PipelineBroken("the router is gone")


async def test_an_attempt_writes_the_shard_s_output_and_its_commit_record(tmp_path: Path) -> None:
    spec, shard = _job(tmp_path)
    store = OutputStore(spec.output.uri)
    pipeline = Pipeline(
        PipelineConfig(stages=spec.pipeline.stages, code_paths=spec.pipeline.code_paths)
    )
    await pipeline.start()
    try:
        record = await run_attempt(
            spec, shard, 1, pipeline=pipeline, store=store, worker_id="w1", chunk_rows=400
        )
    finally:
        await pipeline.stop()
    assert (record.job, record.shard, record.attempt, record.worker) == (spec.id, 0, 1, "w1")
    assert (record.rows, record.error_rows) == (ROWS, 0)
    assert store.read_commit(0) == record
    out = Path(spec.output.uri)
    table = pa.concat_tables(pq.read_table(out / f.path) for f in record.files)
    expected = reference_predictions(tmp_path / "data", tmp_path / "model.onnx")
    assert sorted(table.column("id").to_numpy().tolist()) == list(range(ROWS))
    for row in table.select(["id", "label", "score"]).to_pylist():
        label, score = expected[row["id"]]
        assert row["label"] == label
        assert row["score"] == pytest.approx(score, rel=1e-5)


async def test_a_later_attempt_reports_the_earlier_record_and_computes_nothing(
    tmp_path: Path,
) -> None:
    spec, shard = _job(tmp_path)
    store = OutputStore(spec.output.uri)
    path = f"{attempt_dir(0, 1)}/part-00000.parquet"
    store.write_file(path, b"data")
    _, first = store.create_commit(
        new_commit(
            job=spec.id, shard=0, attempt=1, files=[OutputFile(path=path, rows=ROWS)], worker="w1"
        )
    )
    broken = Broken()
    again = await run_attempt(spec, shard, 2, pipeline=broken, store=store, worker_id="w2")
    assert again == first and broken.runs == 0


async def test_an_attempt_whose_pipeline_breaks_commits_nothing(tmp_path: Path) -> None:
    spec, shard = _job(tmp_path)
    store = OutputStore(spec.output.uri)
    broken = Broken()
    with pytest.raises(PipelineBroken, match="the router is gone"):
        await run_attempt(
            spec, shard, 1, pipeline=broken, store=store, worker_id="w1", chunk_rows=400
        )
    assert broken.runs >= 1
    assert store.read_commit(0) is None
