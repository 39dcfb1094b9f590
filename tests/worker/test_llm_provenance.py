"""A shard's commit record names what generated its text: the model's path and a digest of
its files' bytes (the same for a copy, another for one byte changed), the engine and its
version, the sampling and the structured output."""

from __future__ import annotations

import shutil
from pathlib import Path

from ebb.common.job import LLMSpec, SamplingSpec, StageSpec, StructuredSpec
from ebb.worker.llm.provenance import generation_records, model_digest

from ..llm_model import build_tiny_llm


def test_a_model_s_digest_follows_its_bytes_not_its_folder(tmp_path: Path) -> None:
    model = build_tiny_llm(tmp_path / "a")
    copy = tmp_path / "b"
    shutil.copytree(model, copy)
    assert model_digest(str(model)) == model_digest(str(copy))
    config = copy / "config.json"
    config.write_text(config.read_text().replace('"hidden_act"', '"hidden_act" ', 1))
    assert model_digest(str(copy)) != model_digest(str(model))
    (copy / "extra.txt").write_text("x")  # a file added changes it too
    before = model_digest(str(copy))
    (copy / "extra.txt").write_text("y")
    assert model_digest(str(copy)) != before


def test_the_record_names_model_engine_sampling_and_shape(tmp_path: Path) -> None:
    model = build_tiny_llm(tmp_path / "m")
    stages = [
        StageSpec(name="prep", modelet="ebb.worker.modelets:Identity"),
        StageSpec(
            name="gen",
            llm=LLMSpec(
                model=str(model),
                sampling=SamplingSpec(max_tokens=7, temperature=0.5, seed=3),
                structured=StructuredSpec(choice=["a", "b"]),
            ),
        ),
    ]
    records = generation_records(stages)
    assert set(records) == {"gen"}
    gen = records["gen"]
    assert gen["model"] == str(model) and gen["model_sha256"] == model_digest(str(model))
    assert gen["engine"] == "transformers" and gen["engine_version"].startswith("transformers 5")
    assert gen["sampling"]["max_tokens"] == 7 and gen["sampling"]["temperature"] == 0.5
    assert gen["sampling"]["seed"] == 3
    assert gen["structured"] == {"json": None, "choice": ["a", "b"], "regex": None}
    assert generation_records(stages[:1]) == {}
