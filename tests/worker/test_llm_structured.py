"""Structured output in the `llm` stage: a JSON Schema, a choice list and a regex enforced
token by token by the transformers engine on the tiny model (whose random weights would write
none of them unguided), the stage's check making a row its `max_tokens` cut short an error
row, and the spec refusing a shape that constrains nothing or is not one."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ebb.common.errors import SpecError
from ebb.common.job import LLMSpec, SamplingSpec, StageSpec, StructuredSpec
from ebb.worker.llm.engine import GenerationRequest, Sampling
from ebb.worker.llm.hf import TransformersEngine
from ebb.worker.llm.structured import Structure, vocabulary_bytes
from ebb.worker.pipeline.front import Pipeline, PipelineConfig

from ..llm_model import build_tiny_llm, corpus

LABELS = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "urgent": {"type": "boolean"},
    },
    "required": ["label", "urgent"],
}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny")


def _generate(
    engine: TransformersEngine, spec: StructuredSpec | None, n: int, max_tokens: int = 48
) -> list[str]:
    structure = Structure.of(spec) if spec else None
    requests = [
        GenerationRequest(
            key=i,
            prompt_ids=engine.encode(p),
            sampling=Sampling(max_tokens=max_tokens, temperature=1.0 if i % 2 else 0.0, seed=i),
            structure=structure,
        )
        for i, p in enumerate(corpus(n, seed=3))
    ]
    got = {g.key: g.text for g in engine.generate(requests)}
    return [got[i] for i in range(n)]


def test_a_vocabulary_s_bytes_write_back_what_its_tokenizer_decodes(tiny_llm: Path) -> None:
    engine = TransformersEngine(str(tiny_llm))
    tokenizer = engine.tokenizer
    by_id = {
        i: data
        for data, ids in vocabulary_bytes(tokenizer, set(tokenizer.all_special_ids)).items()
        for i in ids
    }
    text = " ".join(corpus(3, seed=9))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(by_id[i] for i in ids).decode() == tokenizer.decode(ids)
    assert not set(tokenizer.all_special_ids) & set(by_id)


def test_unguided_text_has_no_shape_and_guided_text_has_each_one(tiny_llm: Path) -> None:
    engine = TransformersEngine(str(tiny_llm), max_in_flight=4)
    free = _generate(engine, None, 6)
    assert not any(t.startswith("{") for t in free)  # the shape is the guide's, not the model's

    as_json = _generate(engine, StructuredSpec(json=LABELS), 6)
    for text in as_json:
        value = json.loads(text)
        assert value["label"] in ("spam", "ham") and value["urgent"] in (True, False), text

    choices = ["river", "stone", "quick brown fox"]
    picked = _generate(engine, StructuredSpec(choice=choices), 6)
    assert set(picked) <= set(choices)

    dated = _generate(engine, StructuredSpec(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), 6)
    assert all(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", t) for t in dated), dated


def _stage(model: Path, **llm: Any) -> StageSpec:
    return StageSpec(name="gen", llm=LLMSpec(model=str(model), **llm), batch_size=16)


async def _outcomes(stage: StageSpec, rows: list[dict[str, Any]]) -> list[Any]:
    """Each row's (ok, outcome) through the stage in a pipeline of its own."""
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[]))
    try:
        await pipeline.start()
        return await pipeline.run(rows)
    finally:
        await pipeline.stop()


async def test_the_stage_makes_a_row_cut_before_its_shape_is_whole_an_error_row(
    tiny_llm: Path,
) -> None:
    rows: list[dict[str, Any]] = [
        {"id": i, "prompt": p, "budget": 3 if i < 2 else 48}
        for i, p in enumerate(corpus(6, seed=4))
    ]
    stage = _stage(
        tiny_llm,
        structured=StructuredSpec(json=LABELS),
        per_row={"max_tokens": "budget"},
        sampling=SamplingSpec(max_tokens=48),
    )
    outcomes = await _outcomes(stage, rows)
    for row, (ok, value) in zip(rows, outcomes, strict=True):
        if row["budget"] == 3:  # three tokens cannot write a whole object of the schema
            assert not ok
            assert "structured json (finish_reason length): not JSON" in str(value)
        else:
            assert ok, value
            assert json.loads(value["text"])["label"] in ("spam", "ham")
            assert value["finish_reason"] == "stop"


def test_a_shape_is_checked_when_the_job_is_submitted(tiny_llm: Path) -> None:
    with pytest.raises(SpecError, match="exactly one of json, choice, regex"):
        StructuredSpec(choice=["a"], regex="a")
    with pytest.raises(SpecError, match="exactly one of"):
        StructuredSpec()
    with pytest.raises(SpecError, match="constrains nothing"):
        StructuredSpec(json={})
    with pytest.raises(SpecError, match="none of them empty"):
        StructuredSpec(choice=["a", ""])
    with pytest.raises(SpecError, match="not a regular expression"):
        StructuredSpec(regex="(unclosed")


def test_a_server_is_sent_the_shape_in_vllm_s_and_sglang_s_fields() -> None:
    structure = Structure.of(StructuredSpec(json=LABELS))
    fields = structure.request_fields()
    # The schema as the regex this engine enforces: the same shape, whitespace bounded.
    assert fields["structured_outputs"] == {"regex": structure.regex} == {"regex": fields["regex"]}
    assert structure.check('{"label": "spam", "urgent": true}') is None
    fields = Structure.of(StructuredSpec(choice=["a.b", "c d"])).request_fields()
    assert fields["structured_outputs"] == {"choice": ["a.b", "c d"]}
    assert re.fullmatch(fields["regex"], "a.b") and not re.fullmatch(fields["regex"], "axb")
    check = Structure.of(StructuredSpec(choice=["yes", "no"])).check
    assert check("yes") is None and "none of" in str(check("maybe"))


async def test_each_row_may_bring_its_own_shape_and_a_bad_one_is_its_error_alone(
    tiny_llm: Path,
) -> None:
    """`per_row.structured`: rows of one batch under a schema, a choice list, the stage's
    shape (null) and shapes that cannot be enforced, each row held to its own."""
    choices = {"choice": ["river", "stone"]}
    shapes: list[str | None] = [
        json.dumps({"json": LABELS}),
        json.dumps(choices),
        None,
        "{not json",
        json.dumps({"json": LABELS, "regex": "a"}),
        json.dumps({"regex": "(?=a)a"}),  # Python's re reads a lookahead; the guide cannot
        json.dumps({"json": LABELS}),
        json.dumps(choices),
    ]
    rows: list[dict[str, Any]] = [
        {"id": i, "prompt": p, "shape": shape}
        for i, (p, shape) in enumerate(zip(corpus(len(shapes), seed=5), shapes, strict=True))
    ]
    stage = _stage(
        tiny_llm,
        structured=StructuredSpec(regex="[0-9]{3}"),
        per_row={"structured": "shape"},
        sampling=SamplingSpec(max_tokens=48),
    )
    outcomes = await _outcomes(stage, rows)
    (ok0, labelled), (ok1, picked), (ok2, digits) = outcomes[:3]
    assert ok0 and json.loads(labelled["text"])["label"] in ("spam", "ham"), labelled
    assert ok1 and picked["text"] in ("river", "stone"), picked
    assert ok2 and re.fullmatch("[0-9]{3}", digits["text"]), digits  # the stage's own
    assert not outcomes[3][0] and "structured: " in str(outcomes[3][1])
    assert not outcomes[4][0] and "exactly one of json, choice, regex" in str(outcomes[4][1])
    assert not outcomes[5][0] and "the model's tokens cannot write it" in str(outcomes[5][1])
    assert outcomes[6][0] and json.loads(outcomes[6][1]["text"])["label"] in ("spam", "ham")
    assert outcomes[7][0] and outcomes[7][1]["text"] in ("river", "stone")


def test_a_shape_too_slow_to_map_onto_the_vocabulary_is_refused_and_its_maker_killed(
    tiny_llm: Path,
) -> None:
    """A request's shape is mapped onto the tokens by a child process given a time limit: a
    top-level string of maxLength 256 takes outlines-core minutes on this vocabulary."""
    import psutil

    engine = TransformersEngine(str(tiny_llm))
    slow = Structure.of(StructuredSpec(json={"type": "string", "maxLength": 256}))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="took over 1 s"):
        engine.guides.guide(slow, time_limit=1.0)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    quick = Structure.of(StructuredSpec(choice=["river", "stone"]))
    guide = engine.guides.guide(quick, time_limit=60.0)  # made in the child, used here
    assert guide.get_tokens()
