"""Pipelines that are not chains: branches side by side on the same rows, joined per row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from ebb.common.errors import SpecError
from ebb.common.job import PipelineSpec, StageSpec, parse_job
from ebb.worker.chunks.columns import VALUE
from ebb.worker.pipeline.front import Pipeline, PipelineConfig, RunResult

from ..helpers import ASSETS, CLASSES, FEATURES, write_model


def table_rows(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "id": np.arange(n, dtype=np.int64),
        "features": rng.normal(size=(n, FEATURES)).astype(np.float32),
    }


def weighted(name: str, weight: float, out: str, **kw: Any) -> StageSpec:
    params = {"weight": weight, "out": out}
    for key in ("poison", "crash_on"):
        if key in kw:
            params[key] = kw.pop(key)
    return StageSpec(name=name, modelet="ebbtest_modelets:Weighted", params=params, **kw)


async def run(stages: list[StageSpec], rows: dict[str, np.ndarray], **config: Any) -> RunResult:
    stages = PipelineSpec(stages=stages).stages
    pipeline = Pipeline(PipelineConfig(stages=stages, code_paths=[str(ASSETS)], **config))
    try:
        await pipeline.start()
        return await pipeline.run_columns(rows)
    finally:
        await pipeline.stop()


async def test_two_model_branches_equal_each_model_alone(tmp_path: Path) -> None:
    """Two ONNX models on one read: each branch's column is what its model gives alone, and
    the columns every branch passes through (`id`) are there once."""
    a = write_model(tmp_path / "a.onnx", seed=1)
    b = write_model(tmp_path / "b.onnx", seed=2)
    rows = table_rows(3_000)
    both = await run(
        [
            StageSpec(name="a", model=str(a), input="features", output="score_a", batch_size=64),
            StageSpec(
                name="b",
                model=str(b),
                input="features",
                output="score_b",
                after=[],
                batch_size=256,
            ),
        ],
        rows,
    )
    assert not both.errors
    assert sorted(both.columns) == ["id", "score_a", "score_b"]
    np.testing.assert_array_equal(both.columns["id"], rows["id"])
    for model, column in ((a, "score_a"), (b, "score_b")):
        alone = await run(
            [StageSpec(name="m", model=str(model), input="features", output=column)], rows
        )
        np.testing.assert_allclose(both.columns[column], alone.columns[column], rtol=1e-6)
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        direct = session.run(None, {"x": rows["features"]})[0]
        np.testing.assert_allclose(both.columns[column], direct, rtol=1e-5, atol=1e-6)


async def test_branches_batch_on_their_own_and_a_join_stage_reads_both() -> None:
    rows = table_rows(2_000)
    result = await run(
        [
            StageSpec(name="prep", modelet="ebb.worker.modelets:Identity", batch_size=64),
            weighted("a", 1.0, "a", batch_size=7),
            weighted("b", -2.0, "b", batch_size=100, after=["prep"]),
            StageSpec(name="diff", modelet="ebbtest_modelets:Difference", after=["a", "b"]),
        ],
        rows,
    )
    assert not result.errors
    sums = rows["features"].sum(axis=1)
    np.testing.assert_allclose(result.columns["diff"], sums * 3.0, rtol=1e-5)
    np.testing.assert_array_equal(result.columns["id"], rows["id"])


async def test_each_branch_batches_independently() -> None:
    rows = table_rows(3_000)
    result = await run(
        [weighted("a", 1.0, "a", batch_size=7), weighted("b", 1.0, "b", batch_size=200, after=[])],
        rows,
    )
    assert not result.errors
    assert result.columns["a_batch"].max() <= 7
    assert result.columns["b_batch"].max() > 7
    assert result.columns["b_batch"].max() <= 200


async def test_a_poison_row_in_one_branch_is_one_error_row_naming_it() -> None:
    rows = table_rows(1_000)
    result = await run(
        [
            weighted("a", 1.0, "a", batch_size=32, poison=[17, 500]),
            weighted("b", 2.0, "b", batch_size=32, after=[]),
        ],
        rows,
    )
    assert sorted(result.errors) == [17, 500]
    assert all("stage 'a'" in message for message in result.errors.values())
    ok = np.setdiff1d(np.arange(1_000), [17, 500])
    sums = rows["features"].sum(axis=1)
    np.testing.assert_allclose(result.columns["b"][ok], sums[ok] * 2.0, rtol=1e-5)
    np.testing.assert_allclose(result.columns["a"][ok], sums[ok], rtol=1e-5)


async def test_a_row_failing_in_both_branches_is_told_once() -> None:
    rows = table_rows(400)
    result = await run(
        [
            weighted("a", 1.0, "a", batch_size=16, poison=[33]),
            weighted("b", 2.0, "b", batch_size=16, after=[], poison=[33, 34]),
        ],
        rows,
    )
    assert sorted(result.errors) == [33, 34]
    assert result.rows == 400


async def test_a_process_killed_in_one_branch_loses_and_repeats_nothing() -> None:
    """The rows of a batch whose process died go through every branch again; the join keeps
    one copy, and the row that kills its process every time is one error row."""
    rows = table_rows(1_500)
    result = await run(
        [
            weighted("a", 1.0, "a", batch_size=16),
            weighted("b", 2.0, "b", batch_size=16, after=[], crash_on=[700]),
        ],
        rows,
        max_item_crashes=2,
    )
    assert sorted(result.errors) == [700]
    assert "stage 'b'" in result.errors[700]
    ok = np.setdiff1d(np.arange(1_500), [700])
    sums = rows["features"].sum(axis=1)
    np.testing.assert_allclose(result.columns["a"][ok], sums[ok], rtol=1e-5)
    np.testing.assert_allclose(result.columns["b"][ok], sums[ok] * 2.0, rtol=1e-5)
    np.testing.assert_array_equal(result.columns["id"][ok], ok)


async def test_a_plain_result_joins_under_its_stage_name(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a.onnx", seed=1)
    rows = table_rows(300)
    result = await run(
        [
            StageSpec(name="scores", model=str(a), input="features"),
            weighted("b", 1.0, "b", after=[]),
        ],
        rows,
    )
    assert VALUE not in result.columns
    assert result.columns["scores"].shape == (300, CLASSES)


def test_after_must_name_earlier_stages() -> None:
    with pytest.raises(SpecError, match="not a stage listed before"):
        PipelineSpec(stages=[weighted("a", 1.0, "a", after=["b"]), weighted("b", 1.0, "b")])
    with pytest.raises(SpecError, match="named twice"):
        PipelineSpec(stages=[weighted("a", 1.0, "a"), weighted("b", 1.0, "b", after=["a", "a"])])


def test_a_chain_is_a_chain_and_fan_out_needs_one() -> None:
    chain = PipelineSpec(stages=[weighted("a", 1.0, "a"), weighted("b", 1.0, "b")])
    assert chain.is_chain() and chain.inputs() == [[], [0]]
    explicit = PipelineSpec(stages=[weighted("a", 1.0, "a"), weighted("b", 1.0, "b", after=["a"])])
    assert explicit.is_chain()
    branched = PipelineSpec(stages=[weighted("a", 1.0, "a"), weighted("b", 1.0, "b", after=[])])
    assert not branched.is_chain() and branched.inputs() == [[], []]
    with pytest.raises(SpecError, match="fan-out needs a chain"):
        PipelineSpec(
            stages=[
                StageSpec(name="split", modelet="ebbtest_modelets:Split", fanout=True),
                weighted("b", 1.0, "b", after=[]),
            ]
        )


def test_joined_stages_may_not_write_the_same_key(tmp_path: Path) -> None:
    model = str(tmp_path / "m.onnx")
    with pytest.raises(SpecError, match="write the same key"):
        PipelineSpec(
            stages=[
                StageSpec(name="a", model=model, output="score"),
                StageSpec(name="b", model=model, output="score", after=[]),
            ]
        )


def test_after_in_a_job_file() -> None:
    spec = parse_job(
        {
            "name": "two",
            "input": {"uri": "/data/rows.parquet"},
            "output": {"uri": "/out"},
            "pipeline": {
                "stages": [
                    {"name": "a", "modelet": "m:A"},
                    {"name": "b", "modelet": "m:B", "after": []},
                    {"name": "c", "modelet": "m:C", "after": ["a", "b"]},
                ]
            },
        }
    )
    assert spec.pipeline.inputs() == [[], [], [0, 1]]


@pytest.mark.parametrize("modelet", ["ZeroInPlace", "ZeroColumnsInPlace"])
async def test_a_modelet_that_writes_into_its_rows_changes_no_other_branch_s(modelet: str) -> None:
    """A modelet writing into the arrays it was handed (a per-row modelet into its row's
    features, a columnar one into the batch's columns) changes what it computes with, and
    nothing another branch reads, nor the ids the rows are joined by."""
    rows = table_rows(1_000)
    features = rows["features"].copy()
    result = await run(
        [
            StageSpec(name="zero", modelet=f"ebbtest_modelets:{modelet}", batch_size=64),
            weighted("b", 1.0, "b", batch_size=100, after=[]),
        ],
        rows,
    )
    assert not result.errors
    sums = features.sum(axis=1)
    np.testing.assert_allclose(result.columns["b"], sums, rtol=1e-5)
    np.testing.assert_allclose(result.columns["zeroed"], sums, rtol=1e-5)
    np.testing.assert_array_equal(rows["features"], features)  # the caller's chunk
