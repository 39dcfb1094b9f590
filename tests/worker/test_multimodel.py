"""A `models` stage: several models in one stage process give, row for row, what each gives
as a stage of its own; the spec refuses a malformed one; whatever asks "is this a model
stage" (runtime modules, thread shares, data roots) sees it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from ebb.common.errors import SpecError
from ebb.common.job import ModelSpec, StageSpec, check_roots, load_job_file, parse_job
from ebb.worker.chunks.columns import from_rows
from ebb.worker.modelets.multimodel import MultiModelStage, model_stage_spec
from ebb.worker.modelets.runtimes import OnnxStage, load_runtime
from ebb.worker.pipeline.front import Pipeline, PipelineConfig
from ebb.worker.resources.cpus import room_for_model_process, shares

from ..helpers import ASSETS, FEATURES, write_model


def job(*stages: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "j",
        "input": {"uri": "/data/in.parquet"},
        "pipeline": {"stages": list(stages)},
        "output": {"uri": "/data/out"},
    }


def torchscript_model(path: Path, *, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(torch.nn.Linear(FEATURES, 2).eval()), str(path))
    return path


def rows(n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(7)
    return [
        {
            "id": i,
            "a": rng.normal(size=FEATURES).astype(np.float32),
            "b": rng.normal(size=FEATURES).astype(np.float32),
        }
        for i in range(n)
    ]


def test_a_models_stage_is_a_model_stage() -> None:
    spec = parse_job(
        job(
            {"modelet": "mine:Tokenize"},
            {
                "models": [
                    {"model": "/models/a.onnx", "input": "a", "output": "score_a"},
                    {"model": "/models/b.pt", "output": "score_b", "dtype": "float16"},
                ]
            },
        )
    )
    stage = spec.pipeline.stages[1]
    assert stage.models is not None
    assert [m.runtime for m in stage.models] == ["onnx", "torchscript"]
    assert stage.serves_models and stage.runtimes() == {"onnx", "torchscript"}
    assert spec.pipeline.runtime_modules() == ["onnxruntime", "torch"]
    # Its processes share the cores as a `model` stage's do; the modelet's get none.
    assert shares(spec.pipeline.stages, [1, 2], cores=4) == [0, 2]
    assert not room_for_model_process(spec.pipeline.stages, [1, 4], cores=4)
    fields = spec.output_fields()
    assert fields["pipeline.stages[1].models[1].model"] == "/models/b.pt"
    assert fields["pipeline.stages[1].models[1].dtype"] == "float16"
    # A stage that names no `models` decides its rows as before the field came.
    assert not any(".models" in path for path in parse_job(job({"modelet": "m:C"})).output_fields())


def test_each_models_path_is_resolved_and_must_lie_under_a_data_root(tmp_path: Path) -> None:
    spec = job({"models": [{"model": "a.onnx", "output": "x"}, {"model": "b.pt", "output": "y"}]})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_job_file(tmp_path / "job.yaml")
    models = loaded.pipeline.stages[0].models
    assert models is not None
    assert [m.model for m in models] == [str(tmp_path / "a.onnx"), str(tmp_path / "b.pt")]
    with pytest.raises(SpecError) as e:
        check_roots(loaded, ["/data", str(tmp_path / "elsewhere")])
    assert e.value.path == "pipeline.stages[0].models[0].model"


@pytest.mark.parametrize(
    ("stage", "path", "problem"),
    [
        ({"name": "s"}, "modelet", "exactly one of `modelet`, `model`, `models` or `llm`"),
        (
            {"model": "/m.onnx", "models": [{"model": "/n.onnx", "output": "y"}]},
            "modelet",
            "exactly one",
        ),
        ({"models": []}, "models", "at least one model"),
        (
            {"models": [{"model": "/m.onnx", "output": "y"}, {"model": "/n.pt", "output": "y"}]},
            "models",
            "an output of its own: ['y']",
        ),
        ({"models": [{"model": "/m.onnx"}]}, "models[0].output", "required field is missing"),
        ({"models": [{"model": "/m.onnx", "output": ""}]}, "models[0].output", "name a column"),
        (
            {"models": [{"model": "/m.onnx", "output": "y"}, {"model": "/m.bin", "output": "z"}]},
            "models[1].model",
            "unknown model suffix",
        ),
        (
            {"models": [{"model": "/m.onnx", "output": "y", "runtime": "torchscript"}]},
            "models[0].runtime",
            "does not match",
        ),
        (
            {"models": [{"model": "/m.onnx", "output": "y"}], "output": "y"},
            "output",
            "each model its own output",
        ),
        (
            {"models": [{"model": "/m.onnx", "output": "y"}], "dtype": "float16"},
            "dtype",
            "each model its own dtype",
        ),
    ],
)
def test_bad_models_stages_say_where(stage: dict[str, Any], path: str, problem: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_job(job(stage))
    assert e.value.path == f"pipeline.stages[0].{path}"
    assert problem in e.value.problem


def test_each_model_gives_what_it_gives_alone_and_none_sees_another(tmp_path: Path) -> None:
    entries = [
        ModelSpec(model=str(write_model(tmp_path / "a.onnx", seed=3)), input="a", output="p"),
        ModelSpec(model=str(write_model(tmp_path / "c.onnx", seed=5)), input="a", output="q"),
        ModelSpec(model=str(torchscript_model(tmp_path / "b.pt")), input="b", output="a"),
    ]
    stage = StageSpec(name="ab", models=entries, threads=2)
    multi = MultiModelStage(stage)
    multi.setup()
    batch = from_rows(rows(50))
    out = multi.process_columns(batch)
    # `a` and `b` were read (consumed); the third model's output takes the name `a`.
    assert sorted(out) == ["a", "id", "p", "q"]
    np.testing.assert_array_equal(out["id"], batch["id"])
    for entry in entries:
        alone = load_runtime(model_stage_spec(stage, entry))
        alone.setup()
        np.testing.assert_array_equal(out[entry.output], alone.process_columns(batch)[entry.output])
    before = torch.get_num_threads()
    try:
        sessions = [m for m in multi.models if isinstance(m, OnnxStage)]
        assert [s.session.get_session_options().intra_op_num_threads for s in sessions] == [2, 2]
        multi.set_threads(1)
        assert [s.session.get_session_options().intra_op_num_threads for s in sessions] == [1, 1]
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


async def run(stages: list[StageSpec], items: list[Any]) -> list[Any]:
    pipeline = Pipeline(PipelineConfig(stages=stages, code_paths=[str(ASSETS)]))
    try:
        await pipeline.start()
        return await pipeline.run(items)
    finally:
        await pipeline.stop()


async def test_one_process_scores_as_a_stage_per_model_does(tmp_path: Path) -> None:
    onnx = str(write_model(tmp_path / "a.onnx"))
    scripted = str(torchscript_model(tmp_path / "b.pt"))
    items = rows(600)
    items[17]["b"] = np.full(FEATURES, np.nan, dtype=np.float32)  # fails model b, so its row
    together = await run(
        [
            StageSpec(
                name="ab",
                models=[
                    ModelSpec(model=onnx, input="a", output="score_a"),
                    ModelSpec(model=scripted, input="b", output="score_b"),
                ],
                batch_size=64,
            )
        ],
        items,
    )
    apart = await run(
        [
            StageSpec(name="a", model=onnx, input="a", output="score_a", batch_size=64),
            StageSpec(name="b", model=scripted, input="b", output="score_b", batch_size=64),
        ],
        items,
    )
    assert [ok for ok, _ in together] == [ok for ok, _ in apart] == [i != 17 for i in range(600)]
    assert "NaN" in together[17][1]
    for (_, mine), (_, theirs) in zip(together, apart, strict=True):
        if isinstance(mine, str):
            continue
        assert sorted(mine) == sorted(theirs) == ["id", "score_a", "score_b"]
        assert mine["id"] == theirs["id"]
        np.testing.assert_allclose(mine["score_a"], theirs["score_a"], rtol=1e-6)
        np.testing.assert_allclose(mine["score_b"], theirs["score_b"], rtol=1e-6)
