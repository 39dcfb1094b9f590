"""One shard attempt, without a master or NATS: read, compute, write, commit record."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebb.common.data.layout import OutputFile, attempt_dir
from ebb.common.data.output import OutputStore, new_commit
from ebb.common.job import JobSpec, parse_job
from ebb.common.messaging.messages import ShardSpec, rest_of
from ebb.worker.attempt import AttemptStopped, run_attempt
from ebb.worker.pipeline.front import Pipeline, PipelineBroken, PipelineConfig, RowsBack, RunResult
from ebb.worker.progress import AttemptProgress
from ebb.worker.shardio.handoff import TierEnds

from ..helpers import (
    ASSETS,
    job_spec,
    reference_predictions,
    wait_until,
    write_dataset,
    write_model,
)

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

    async def run_columns(
        self,
        rows: pa.Table,
        *,
        stop: asyncio.Event | None = None,
        rows_back: RowsBack | None = None,
    ) -> RunResult:
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


def _slow(tmp_path: Path, seconds_per_batch: float) -> PipelineConfig:
    """The job's pipeline behind a stage that sleeps per batch of 100 rows."""
    stages = [
        {
            "name": "slow",
            "modelet": "ebbtest_modelets:Slow",
            "params": {"seconds_per_batch": seconds_per_batch},
            "batch_size": 100,
        },
        {"name": "model", "model": str(tmp_path / "model.onnx"), "batch_size": 200},
        {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 200},
    ]
    slow = parse_job(job_spec(tmp_path, stages=stages))
    return PipelineConfig(stages=slow.pipeline.stages, code_paths=slow.pipeline.code_paths)


def _ids(out: Path, files: list[OutputFile]) -> list[int]:
    table = pa.concat_tables(pq.read_table(out / f.path) for f in files)
    ids: list[int] = table.column("id").to_numpy().tolist()
    return ids


async def test_a_stopped_attempt_commits_its_first_rows_as_a_part_and_the_rest_follows(
    tmp_path: Path,
) -> None:
    spec, shard = _job(tmp_path)
    store = OutputStore(spec.output.uri)
    pipeline = Pipeline(_slow(tmp_path, 0.05))
    await pipeline.start()
    stop = asyncio.Event()
    seen: list[int] = []

    def progress(rows: int) -> None:
        seen.append(rows)
        stop.set()  # once the first chunk is written: the second is in the pipeline

    try:
        part = await run_attempt(
            spec,
            shard,
            1,
            pipeline=pipeline,
            store=store,
            worker_id="w1",
            chunk_rows=400,
            stop=stop,
            progress=AttemptProgress(on_written=progress),
        )
        rest = rest_of(shard, part.split_at, index=1)
        whole = await run_attempt(
            spec, rest, 1, pipeline=pipeline, store=store, worker_id="w2", chunk_rows=400
        )
    finally:
        await pipeline.stop()
    out = Path(spec.output.uri)
    assert seen[0] == 400 and 400 <= part.split_at < ROWS
    assert part.rows == part.split_at == seen[-1]
    assert store.read_commit(0) == part
    assert _ids(out, part.files) == list(range(part.split_at)), "the first rows, in order"
    assert (rest.rows, rest.row_offset) == (ROWS - part.split_at, part.split_at)
    assert whole.split_at == 0 and whole.rows == rest.rows
    assert _ids(out, whole.files) == list(range(part.split_at, ROWS))
    expected = reference_predictions(tmp_path / "data", tmp_path / "model.onnx")
    for f in [*part.files, *whole.files]:
        for row in pq.read_table(out / f.path).select(["id", "label"]).to_pylist():
            assert row["label"] == expected[row["id"]][0]


async def test_an_attempt_stopped_before_any_row_is_done_commits_nothing(tmp_path: Path) -> None:
    spec, shard = _job(tmp_path)
    store = OutputStore(spec.output.uri)
    pipeline = Pipeline(_slow(tmp_path, 0.05))
    await pipeline.start()
    stop = asyncio.Event()
    stop.set()
    try:
        with pytest.raises(AttemptStopped):
            await run_attempt(
                spec, shard, 1, pipeline=pipeline, store=store, worker_id="w1", stop=stop
            )
    finally:
        await pipeline.stop()
    assert store.read_commit(0) is None


async def test_a_stop_after_the_last_row_commits_the_whole_shard(tmp_path: Path) -> None:
    spec, shard = _job(tmp_path)
    store = OutputStore(spec.output.uri)
    pipeline = Pipeline(
        PipelineConfig(stages=spec.pipeline.stages, code_paths=spec.pipeline.code_paths)
    )
    await pipeline.start()
    stop = asyncio.Event()

    def progress(rows: int) -> None:
        if rows == ROWS:
            stop.set()

    try:
        record = await run_attempt(
            spec,
            shard,
            1,
            pipeline=pipeline,
            store=store,
            worker_id="w1",
            stop=stop,
            progress=AttemptProgress(on_written=progress),
        )
    finally:
        await pipeline.stop()
    assert stop.is_set() and record.split_at == 0 and record.rows == ROWS


async def test_progress_tells_the_rows_back_of_a_chunk_before_it_is_written(
    tmp_path: Path,
) -> None:
    """A slow model's chunk may take minutes: a renewal must hear of it before its end."""
    spec, shard = _job(tmp_path)
    store = OutputStore(spec.output.uri)
    pipeline = Pipeline(_slow(tmp_path, 0.05))
    await pipeline.start()
    progress = AttemptProgress()
    try:
        attempt = asyncio.create_task(
            run_attempt(
                spec,
                shard,
                1,
                pipeline=pipeline,
                store=store,
                worker_id="w1",
                chunk_rows=ROWS,  # the whole shard is one chunk
                progress=progress,
            )
        )
        midway = await wait_until(
            lambda: 0 < progress.rows_done() < ROWS and progress.written == 0,
            timeout=60,
            what="rows back before the chunk is written",
        )
        record = await attempt
    finally:
        await pipeline.stop()
    assert midway and record.rows == ROWS
    assert progress.written == progress.rows_done() == ROWS


@pytest.mark.parametrize("reads_handoff", [True, False])
async def test_a_shard_the_worker_s_tier_does_not_read_is_refused_before_any_work(
    tmp_path: Path, reads_handoff: bool
) -> None:
    """A tier reads hand-offs or the input, chosen once per job session: a shard of the other
    kind (a worker started for the wrong tier) is refused, nothing read, written or run."""
    spec, shard = _job(tmp_path)
    if not reads_handoff:
        shard = ShardSpec(index=0, path=str(tmp_path / "handoff"), format="arrow", rows=ROWS)
    broken = Broken()
    store = OutputStore(spec.output.uri)
    with pytest.raises(ValueError, match="hand-off"):
        await run_attempt(
            spec,
            shard,
            1,
            pipeline=broken,
            store=store,
            worker_id="w1",
            ends=TierEnds(reads_handoff=reads_handoff),
        )
    assert broken.runs == 0
    assert store.read_commit(0) is None
    assert not Path(spec.output.uri, attempt_dir(0, 1)).exists()


async def test_a_chunk_whose_every_row_fails_counts_no_metric_value_and_commits(
    tmp_path: Path,
) -> None:
    """Every row of every chunk an error row: the stage's metrics have no value for any of
    them (none came through), and the attempt commits the error rows, not a KeyError."""
    write_dataset(tmp_path / "data", rows=ROWS, row_group_size=500)
    stages = [
        {
            "name": "score",
            "modelet": "ebbtest_modelets:FailOn",
            "params": {"ids": list(range(ROWS))},
            "metrics": {
                "scored": {"kind": "count"},
                "auc": {"kind": "auc", "label": "id", "score": "id"},
            },
        }
    ]
    spec = parse_job(job_spec(tmp_path, rows_per_shard=ROWS, stages=stages)).with_id()
    shard = ShardSpec(
        index=0,
        path=str(tmp_path / "data" / "part-000.parquet"),
        format="parquet",
        rows=ROWS,
        row_groups=[0, 1, 2],
    )
    pipeline = Pipeline(PipelineConfig(stages=spec.pipeline.stages, code_paths=[str(ASSETS)]))
    await pipeline.start()
    try:
        record = await run_attempt(
            spec,
            shard,
            1,
            pipeline=pipeline,
            store=OutputStore(spec.output.uri),
            worker_id="w1",
            chunk_rows=400,
        )
    finally:
        await pipeline.stop()
    assert (record.rows, record.error_rows) == (ROWS, ROWS)
    assert record.metrics["scored"] == {"n": 0}
    assert record.metrics["auc"]["pos"] == record.metrics["auc"]["neg"] == []
