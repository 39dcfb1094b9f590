"""The columns a job's stages name, checked before a row is read against the rows each stage
really reads: the job's input for the first tier's stages that read the rows as read; the rows
handed on, whatever an earlier tier made, for a later tier's first stages; another stage's
output for the rest. Generated jobs (tiers, branches and joins, model, `models` and llm
stages, carryover) whose stages read what their rows hold are taken as the spec is read and
by every tier's workers; one whose stage reads a column the input lacks is refused."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ebb.common.errors import SpecError
from ebb.common.job import parse_job
from ebb.worker.shardio.handoff import tier_view

INPUT = ["id", "features", "text", "n", "budget"]
"""The columns the input's files have."""
MADE = ["x", "tokens", "embedding", "features"]
"""Columns stages make (`features` too: a later tier may read a column named as one of the
input's, made anew)."""
ABSENT = "not_in_input"
"""A column no stage may read from the input: named neither by input.columns nor the files."""

CASES = settings(
    max_examples=int(os.environ.get("EBB_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclass
class Generated:
    """A generated job map, and what it should read of its input."""

    data: dict[str, Any]
    reads_input: dict[str, str]
    """The input's columns the stages reading it name, each with the first field naming it."""


def _stage(draw: st.DrawFn, k: int, columns: list[str]) -> dict[str, Any]:
    """Stage `k`, naming columns among `columns` where it names any: a modelet, a model (its
    `input`, maybe `length_column`), a `models` stage (a model's `input`) or an llm stage (its
    `prompt`, maybe a `per_row` column)."""
    name = f"s{k}"
    column = st.sampled_from(columns)
    kind = draw(st.sampled_from(["modelet", "model", "models", "llm"]))
    if kind == "modelet":
        return {"name": name, "modelet": "mine:Stage"}
    if kind == "model":
        stage: dict[str, Any] = {"name": name, "model": "/m.onnx", "output": f"out_{name}"}
        if draw(st.booleans()):
            stage["input"] = draw(column)
        if draw(st.booleans()):
            stage.update(batch_tokens=64, length_column=draw(column))
        return stage
    if kind == "models":
        models: list[dict[str, Any]] = [{"model": "/a.onnx", "output": "a"}]
        if draw(st.booleans()):
            models.append({"model": "/b.pt", "input": draw(column), "output": "b"})
        return {"name": name, "models": models}
    llm: dict[str, Any] = {"model": "/llm", "prompt": draw(column), "output": f"text_{name}"}
    if draw(st.booleans()):
        llm["per_row"] = {"max_tokens": draw(column)}
    return {"name": name, "llm": llm}


def _named(stage: dict[str, Any], field: str) -> str:
    """The column `stage` names in `field` (a dotted path, `models[1].input` included)."""
    value: Any = stage
    for part in field.split("."):
        key, _, index = part.partition("[")
        value = value[key]
        if index:
            value = value[int(index.rstrip("]"))]
    assert isinstance(value, str)
    return value


def _after(
    draw: st.DrawFn, stages: list[dict[str, Any]], start: int, *, hands_on: bool
) -> list[str] | None:
    """What the next stage of a tier beginning at `start` reads (`after`; `stages`, those
    before it): the stage before (None), the rows as read (`[]`, a branch: the first tier's
    only), the stage the tier before handed on (a later tier's branch), or stages of its own
    tier before it (one, or a join). The last stage of a tier that `hands_on` reads those of
    its tier no stage reads: a tier hands on its last stage's rows alone."""
    k = len(stages)
    own = [s["name"] for s in stages[start:]]
    if hands_on:
        unread = [n for n in own if not _read(stages, n)]
        if unread:
            return unread
    choices: list[list[str] | None] = [None]
    if start == 0 and k > 0:
        choices.append([])
    if start > 0:
        choices.append([f"s{start - 1}"])
    if own:
        choices.append(draw(st.lists(st.sampled_from(own), min_size=1, unique=True)))
    after: list[str] | None = draw(st.sampled_from(choices))
    return after


def _read(stages: list[dict[str, Any]], name: str) -> bool:
    """Whether a stage of `stages` reads stage `name`: by `after`, or as the next in a chain."""
    k = int(name[1:])
    return any(
        name in (s.get("after") or []) or (i == k + 1 and "after" not in s)
        for i, s in enumerate(stages)
    )


def _absent(draw: st.DrawFn, stage: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`stage` (one reading the input) made a stage naming ABSENT, and the field it does in."""
    name = stage["name"]
    made: dict[str, Any] = {"name": name, **({"after": stage["after"]} if "after" in stage else {})}
    field = draw(st.sampled_from(["input", "length_column", "models[1].input", "llm.prompt"]))
    if field == "input":
        made.update(model="/m.onnx", input=ABSENT, output=f"out_{name}")
    elif field == "length_column":
        made.update(model="/m.onnx", batch_tokens=64, length_column=ABSENT)
    elif field == "models[1].input":
        made["models"] = [
            {"model": "/a.onnx", "output": "a"},
            {"model": "/b.pt", "input": ABSENT, "output": "b"},
        ]
    else:
        made["llm"] = {"model": "/llm", "prompt": ABSENT, "output": f"text_{name}"}
    return made, field


@st.composite
def jobs(draw: st.DrawFn, *, valid: bool = True) -> Generated:
    """A job of 1 to 3 tiers of 1 to 3 stages each, maybe with input.columns, and carryover
    (of columns input.columns may leave out). Valid: the stages reading the input name
    columns input.columns (or, without it, the files) has; the others name any, columns an
    earlier stage made. Not valid: one stage reading the input names ABSENT, with
    input.columns given."""
    sizes = draw(st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=3))
    listed = draw(st.lists(st.sampled_from(INPUT), min_size=1, unique=True))
    named = not valid or draw(st.booleans())
    stages: list[dict[str, Any]] = []
    tiers: list[dict[str, Any]] = []
    for tier, size in enumerate(sizes):
        start = len(stages)
        for k in range(start, start + size):
            last = k == start + size - 1
            after = _after(draw, stages, start, hands_on=last and tier < len(sizes) - 1)
            reads = after == [] or (after is None and k == 0)
            stage = _stage(draw, k, (listed if named else INPUT) if reads else MADE + INPUT)
            if after is not None:
                stage["after"] = after
            stages.append(stage)
        tiers.append({"name": f"t{tier}", "stages": [s["name"] for s in stages[start:]]})
    readers = [
        k for k, s in enumerate(stages) if s.get("after") == [] or (k == 0 and "after" not in s)
    ]
    reads_input: dict[str, str] = {}
    if not valid:
        k = draw(st.sampled_from(readers))
        stages[k], field = _absent(draw, stages[k])
        reads_input[ABSENT] = f"pipeline.stages[{k}].{field}"
    for k in readers:
        for field in _fields(stages[k]):
            reads_input.setdefault(_named(stages[k], field), f"pipeline.stages[{k}].{field}")
    data: dict[str, Any] = {
        "name": "j",
        "input": {"uri": "/d/in.parquet", "columns": listed if named else None},
        "pipeline": {"stages": stages},
        "output": {
            "uri": "/d/out",
            "carryover": draw(st.lists(st.sampled_from([*INPUT, "customer"]), unique=True)),
        },
    }
    if len(tiers) > 1 or draw(st.booleans()):
        data["tiers"] = tiers
    return Generated(data=data, reads_input=reads_input)


def _fields(stage: dict[str, Any]) -> list[str]:
    """The fields `stage` names columns in, in the order `columns_read` looks at them."""
    fields: list[str] = [f for f in ("input", "length_column") if f in stage]
    fields += [f"models[{i}].input" for i, m in enumerate(stage.get("models", [])) if "input" in m]
    if "llm" in stage:
        fields.append("llm.prompt")
        fields += [f"llm.per_row.{key}" for key in stage["llm"].get("per_row", {})]
    return fields


@CASES
@given(jobs())
def test_a_job_whose_stages_read_what_their_rows_hold_is_taken_by_every_tier(
    job: Generated,
) -> None:
    spec = parse_job(job.data)
    assert spec.input_columns_read() == job.reads_input
    if spec.input.columns is not None:
        assert set(job.reads_input) <= set(spec.input.columns)
    for k, tier in enumerate(spec.tier_names()):
        view, ends = tier_view(spec, tier)  # no SpecError: the worker runs it
        assert ends.reads_handoff == (k > 0)
        if k > 0:
            assert view.input.columns is None  # the hand-off's, all of them
        else:
            assert view.input == spec.input
            assert view.input_columns_read() == job.reads_input


@CASES
@given(jobs(valid=False))
def test_a_stage_reading_a_column_the_input_lacks_is_refused_as_the_spec_is_read(
    job: Generated,
) -> None:
    with pytest.raises(SpecError) as e:
        parse_job(job.data)
    assert e.value.path == job.reads_input[ABSENT]
    assert f"{ABSENT!r} is not among input.columns" in e.value.problem
