"""Job specs: everything validated before anything happens, with the path of the bad field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from ebb.common.errors import SpecError
from ebb.common.job import JobSpec, TrackingSpec, check_roots, load_job_file, parse_job
from ebb.common.job.accumulators import MetricSpec


def minimal(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "j",
        "input": {"uri": "/data/in.parquet"},
        "pipeline": {"stages": [{"model": "/models/m.onnx"}]},
        "output": {"uri": "/data/out"},
    }
    spec.update(overrides)
    return spec


def test_defaults_and_inference() -> None:
    spec = parse_job(minimal())
    assert spec.input.format == "parquet"
    assert spec.pipeline.stages[0].runtime == "onnx"
    assert spec.pipeline.stages[0].name == "stage0"
    assert spec.fault.max_attempts == 3
    assert spec.resources.min_workers == 1


def test_runtime_modules_are_those_of_model_stages_only() -> None:
    stages = [
        {"model": "/models/a.onnx"},
        {"modelet": "mine:Tokenize"},
        {"model": "/models/b.pt"},
        {"model": "/models/c.onnx"},
    ]
    spec = parse_job(minimal(pipeline={"stages": stages}))
    assert spec.pipeline.runtime_modules() == ["onnxruntime", "torch"]
    only_modelets = parse_job(minimal(pipeline={"stages": [{"modelet": "mine:Tokenize"}]}))
    assert only_modelets.pipeline.runtime_modules() == []


def test_with_id_is_stable_once_set() -> None:
    spec = parse_job(minimal(name="My Job!")).with_id()
    assert spec.id.startswith("My-Job-")
    assert spec.with_id().id == spec.id


@pytest.mark.parametrize(
    ("change", "path", "problem"),
    [
        ({"input": {"uri": "/d/x.txt"}}, "input.format", "cannot infer"),
        (
            {"input": {"uri": "/d/x.parquet", "rows_per_shard": 0}},
            "input.rows_per_shard",
            "> 0",
        ),
        ({"pipeline": {"stages": []}}, "pipeline.stages", "at least one stage"),
        (
            {"pipeline": {"stages": [{"model": "/m.onnx", "modelet": "a:B"}]}},
            "pipeline.stages[0].modelet",
            "exactly one",
        ),
        (
            {"pipeline": {"stages": [{"modelet": "nocolon"}]}},
            "pipeline.stages[0].modelet",
            "module:Class",
        ),
        (
            {"pipeline": {"stages": [{"model": "/m.bin"}]}},
            "pipeline.stages[0].model",
            "unknown model suffix",
        ),
        (
            {"pipeline": {"stages": [{"model": "/m.onnx", "batch_size": -1}]}},
            "pipeline.stages[0].batch_size",
            "> 0",
        ),
        (
            {"pipeline": {"stages": [{"model": "/m.onnx", "batchsize": 4}]}},
            "pipeline.stages[0].batchsize",
            "did you mean 'batch_size'",
        ),
        ({"resources": {"min_workers": 3, "max_workers": 2}}, "resources.min_workers", "exceeds"),
        ({"fault": {"max_error_fraction": 2}}, "fault.max_error_fraction", "[0, 1]"),
        (
            {"input": {"uri": "/d/x.parquet", "column_types": {"id": "int64"}}},
            "input.column_types",
            "CSV input only",
        ),
        (
            {"input": {"uri": "/d/x.jsonl", "newlines_in_values": True}},
            "input.newlines_in_values",
            "CSV input only",
        ),
        (
            {"input": {"uri": "/d/x.csv", "column_types": {"v": "number"}}},
            "input.column_types.v",
            "not an Arrow type name",
        ),
        ({"id": "bad id!"}, "id", "must match"),
        ({"name": 7}, "name", "expected str"),
    ],
)
def test_bad_specs_say_where(change: dict[str, Any], path: str, problem: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_job(minimal(**change))
    assert e.value.path == path
    assert problem in e.value.problem


def test_job_file_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    spec = minimal(input={"uri": "data/x.parquet"}, output={"uri": "../out"})
    spec["pipeline"] = {"stages": [{"model": "m.onnx"}], "code_paths": ["."]}
    (tmp_path / "jobs" / "job.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_job_file(tmp_path / "jobs" / "job.yaml")
    assert loaded.input.uri == str(tmp_path / "jobs" / "data" / "x.parquet")
    assert loaded.pipeline.stages[0].model == str(tmp_path / "jobs" / "m.onnx")
    assert os.path.normpath(loaded.output.uri) == str(tmp_path / "out")


def test_unreadable_job_file_is_a_spec_error(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_job_file(tmp_path / "bad.yaml")
    with pytest.raises(SpecError, match="cannot read"):
        load_job_file(tmp_path / "missing.yaml")


def _rooted(tmp_path: Path, **paths: str) -> JobSpec:
    return parse_job(
        minimal(
            input={"uri": paths.get("input", str(tmp_path / "root" / "in.parquet"))},
            output={"uri": paths.get("output", str(tmp_path / "root" / "out"))},
            pipeline={"stages": [{"model": paths.get("model", str(tmp_path / "root" / "m.onnx"))}]},
        )
    )


def test_paths_must_stay_under_the_data_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    check_roots(_rooted(tmp_path), [str(root)])
    escape = str(root / ".." / "secret" / "in.parquet")
    with pytest.raises(SpecError, match="outside the allowed data roots") as e:
        check_roots(_rooted(tmp_path, input=escape), [str(root)])
    assert e.value.path == "input.uri"
    with pytest.raises(SpecError) as e:
        check_roots(_rooted(tmp_path, model="/etc/m.onnx"), [str(root)])
    assert e.value.path == "pipeline.stages[0].model"
    # An llm stage's model folder too, local or in a store.
    for model in ("/etc/llm", "s3://elsewhere/llm"):
        spec = _rooted(tmp_path)
        spec = parse_job(
            {**spec.to_dict(), "pipeline": {"stages": [{"name": "g", "llm": {"model": model}}]}}
        )
        with pytest.raises(SpecError, match="outside the allowed data roots") as e:
            check_roots(spec, [str(root)])
        assert e.value.path == "pipeline.stages[0].llm.model"


def test_a_symlink_cannot_escape_a_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SpecError, match="outside"):
        check_roots(_rooted(tmp_path, output=str(root / "link" / "out")), [str(root)])


def test_url_roots(tmp_path: Path) -> None:
    spec = _rooted(tmp_path, input="s3://bucket/team/in.parquet", output="s3://bucket/team/out")
    spec = parse_job(
        {**spec.to_dict(), "pipeline": {"stages": [{"model": "s3://bucket/team/m.onnx"}]}}
    )
    check_roots(spec, ["s3://bucket/team"])
    with pytest.raises(SpecError):
        check_roots(spec, ["s3://bucket/other"])
    sneaky = parse_job({**spec.to_dict(), "output": {"uri": "s3://bucket/team/../other/out"}})
    with pytest.raises(SpecError):
        check_roots(sneaky, ["s3://bucket/team"])


METRICS_YAML = """
name: scoring
input: {uri: /data/in.parquet}
pipeline:
  stages:
    - model: /models/m.onnx
      output: p
      metrics:
        auc: {kind: auc, label: churned, score: p, bins: 200}
        rows: {kind: count}
    - modelet: mine:Bucket
      metrics:
        p.hist: {kind: histogram, column: p, range: [0, 1]}
output: {uri: /data/out}
tracking: {mlflow_uri: "http://mlflow:5000"}
"""


def test_metrics_on_stages_round_trip() -> None:
    spec = parse_job(yaml.safe_load(METRICS_YAML))
    metrics = spec.pipeline.all_metrics()
    assert list(metrics) == ["auc", "rows", "p.hist"]
    assert metrics["auc"] == MetricSpec(kind="auc", label="churned", score="p", bins=200)
    assert metrics["auc"].range == [0.0, 1.0]
    assert metrics["p.hist"].bins == 10
    assert parse_job(spec.to_dict()) == spec
    # What a metric computes decides what a job's committed partials mean: it counts.
    assert spec.output_fields()["pipeline.stages[0].metrics.auc.bins"] == 200
    assert spec.tracking == TrackingSpec(mlflow_uri="http://mlflow:5000", experiment="scoring")


def test_a_spec_without_metrics_digests_as_before_metrics_existed() -> None:
    spec = parse_job(
        minimal(pipeline={"stages": [{"model": "/models/m.onnx"}, {"modelet": "a:B"}]})
    )
    # Computed by the version before stages had metrics (output roots' owner records keep them).
    assert spec.whole_sections_digest() == "b3e2304ad994af1945dbd7ca3109fba2"
    assert spec.output_digest() == "3227cb2b98c810f2c8efb930043939ef"


@pytest.mark.parametrize(
    ("stages", "path", "problem"),
    [
        (
            [{"model": "/m.onnx", "metrics": {"n": {"kind": "sum"}}}],
            "pipeline.stages[0].metrics.n.column",
            "sum needs the column",
        ),
        (
            [{"model": "/m.onnx", "metrics": {"n": {"kind": "count", "bins": 4}}}],
            "pipeline.stages[0].metrics.n.bins",
            "only a histogram or auc",
        ),
        (
            [{"model": "/m.onnx", "metrics": {"n": {"kind": "median", "column": "p"}}}],
            "pipeline.stages[0].metrics.n.kind",
            "expected one of 'sum'",
        ),
        (
            [{"model": "/m.onnx", "metrics": {"n": {"kind": "count", "colum": "p"}}}],
            "pipeline.stages[0].metrics.n.colum",
            "did you mean 'column'?",
        ),
        (
            [{"model": "/m.onnx", "metrics": {"2nd": {"kind": "count"}}}],
            "pipeline.stages[0].metrics.2nd",
            "a metric name must match",
        ),
        (
            [
                {"model": "/m.onnx", "name": "score", "metrics": {"n": {"kind": "count"}}},
                {"modelet": "a:B", "metrics": {"n": {"kind": "count", "column": "p"}}},
            ],
            "pipeline.stages[1].metrics.n",
            "stage 'score' has a metric of that name already",
        ),
    ],
)
def test_bad_metrics_say_where(stages: list[dict[str, Any]], path: str, problem: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_job(minimal(pipeline={"stages": stages}))
    assert e.value.path == path
    assert problem in e.value.problem


def test_a_local_tracking_store_is_a_path_under_the_data_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "jobs").mkdir()
    paths = {"input": {"uri": str(root / "in.parquet")}, "output": {"uri": str(root / "out")}}
    spec = minimal(**paths, pipeline={"stages": [{"model": str(root / "m.onnx")}]})
    spec["tracking"] = {"mlflow_uri": "../root/mlruns", "experiment": "churn"}
    (tmp_path / "jobs" / "job.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_job_file(tmp_path / "jobs" / "job.yaml")
    assert os.path.normpath(loaded.tracking.mlflow_uri or "") == str(root / "mlruns")
    assert loaded.tracking.experiment == "churn"
    check_roots(loaded, [str(root)])
    for inside in (f"file://{root}/mlruns", f"sqlite:///{root}/mlflow.db", "https://mlflow.x"):
        check_roots(parse_job({**spec, "tracking": {"mlflow_uri": inside}}), [str(root)])
    for outside in ("/etc/mlruns", "file:///etc/mlruns", "sqlite:////etc/mlflow.db", "file:x"):
        with pytest.raises(SpecError) as e:
            check_roots(parse_job({**spec, "tracking": {"mlflow_uri": outside}}), [str(root)])
        assert e.value.path == "tracking.mlflow_uri"


def test_the_columns_the_stages_reading_the_rows_name_are_known_before_a_row_is_read() -> None:
    stages = [
        {
            "name": "a",
            "model": "/m.onnx",
            "input": "pixels",
            "batch_tokens": 64,
            "length_column": "n",
        },
        {"name": "b", "model": "/m.onnx", "input": "later"},  # reads a's output: not known
        {
            "name": "c",
            "after": [],
            "llm": {"model": "/llm", "prompt": "question", "per_row": {"max_tokens": "budget"}},
        },
        {
            "name": "d",
            "after": [],
            "models": [
                {"model": "/a.onnx", "output": "a"},  # the whole row
                {"model": "/b.onnx", "input": "image", "output": "b"},
            ],
        },
    ]
    spec = parse_job(minimal(pipeline={"stages": stages}))
    assert spec.pipeline.columns_read() == {
        "pixels": "pipeline.stages[0].input",
        "n": "pipeline.stages[0].length_column",
        "question": "pipeline.stages[2].llm.prompt",
        "budget": "pipeline.stages[2].llm.per_row.max_tokens",
        "image": "pipeline.stages[3].models[1].input",
    }
    assert spec.input_columns_read() == spec.pipeline.columns_read()
    named = minimal(pipeline={"stages": stages[:1]})
    named["input"]["columns"] = ["pixels"]
    with pytest.raises(SpecError) as e:
        parse_job(named)
    assert e.value.path == "pipeline.stages[0].length_column"
    assert "'n' is not among input.columns ['pixels']" in str(e.value)
