"""A batch's job, from the catalogue: the model's stage with the requests' columns, the
window's priority and pool, no error budget (a failed request is an error line)."""

from __future__ import annotations

import pytest

from ebb.common.errors import SpecError
from ebb.common.job.sections import ResourceSpec
from ebb.gateway.config import CatalogueModel, Window
from ebb.gateway.jobspec import batch_job


def test_a_batch_s_job_is_its_model_s_stage_over_the_requests() -> None:
    model = CatalogueModel(
        stage={"llm": {"model": "/models/m", "max_in_flight": 64}, "batch_size": 256},
        resources=ResourceSpec(max_workers=4, gpu=1, pool="offline"),
        rows_per_shard=100,
        fault={"lease_s": 120, "max_error_fraction": 0.0},
    )
    spec = batch_job(
        batch_id="batch_1",
        owner="team",
        endpoint="/v1/chat/completions",
        model=model,
        window=Window(seconds=86400, priority=-10, pool="mixed"),
        input_uri="/data/gw/batches/team/batch_1/requests.parquet",
        output_uri="/data/gw/batches/team/batch_1/output",
    )
    (stage,) = spec.pipeline.stages
    assert stage.llm is not None and stage.llm.model == "/models/m"
    assert (stage.llm.prompt, stage.llm.output) == ("prompt", "text")
    assert set(stage.llm.per_row) == {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "structured",
    }
    assert stage.batch_size == 256 and stage.llm.max_in_flight == 64
    assert "output_tokens" in stage.metrics
    assert spec.id == "batch_1" and spec.priority == -10
    assert spec.resources.pool == "mixed" and spec.resources.gpu == 1
    assert spec.fault.max_error_fraction == 1.0 and spec.fault.lease_s == 120
    assert spec.input.format == "parquet" and spec.input.rows_per_shard == 100
    assert spec.output.carryover == ["custom_id", "line"]


def test_a_catalogue_model_names_its_llm_and_leaves_the_columns_to_the_gateway() -> None:
    with pytest.raises(SpecError, match=r"stage\.llm"):
        CatalogueModel(stage={"modelet": "m:M"})
    with pytest.raises(SpecError, match=r"stage\.llm\.prompt"):
        CatalogueModel(stage={"llm": {"model": "/m", "prompt": "question"}})
    with pytest.raises(SpecError, match="max_in_flight"):
        CatalogueModel(stage={"llm": {"model": "/m", "max_in_flight": 0}})


def test_an_embeddings_model_is_a_sentence_encoder_whose_columns_are_the_gateway_s() -> None:
    encoder = "ebb.worker.modelets:SentenceEncoder"
    model = CatalogueModel(
        stage={"modelet": encoder, "params": {"model": "/models/minilm", "backend": "onnx"}},
        dimensions=True,
    )
    assert model.embeds and model.endpoints == ("/v1/embeddings",)
    spec = batch_job(
        batch_id="batch_2",
        owner="team",
        endpoint="/v1/embeddings",
        model=model,
        window=Window(seconds=86400),
        input_uri="/data/gw/batches/team/batch_2/requests.parquet",
        output_uri="/data/gw/batches/team/batch_2/output",
    )
    (stage,) = spec.pipeline.stages
    assert stage.modelet == encoder and stage.name == "embed"
    assert stage.params["model"] == "/models/minilm" and stage.params["backend"] == "onnx"
    assert (stage.params["inputs"], stage.params["truncate"]) == ("many", False)
    assert spec.output.carryover == ["custom_id", "line", "encoding_format"]
    with pytest.raises(SpecError, match=r"stage\.params"):
        CatalogueModel(stage={"modelet": encoder})
    with pytest.raises(SpecError, match=r"stage\.params\.column"):
        CatalogueModel(stage={"modelet": encoder, "params": {"model": "/m", "column": "q"}})
    with pytest.raises(SpecError, match="dimensions"):
        CatalogueModel(stage={"llm": {"model": "/m"}}, dimensions=True)
