"""Tiers of a job: the pipeline cut into runs of stages, each run by workers of its own, every
cut one that a single stage's rows cross; the pipeline each tier's workers run; and tiers
deciding where rows are computed, never what they are."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from ebb.common.errors import SpecError
from ebb.common.job import JobSpec, PipelineSpec, ResourceSpec, TierSpec, parse_job

DOCS = Path(__file__).parent.parent.parent / "docs"

TWO_TIERS = """
name: embed
input: {uri: /data/docs.parquet}
pipeline:
  code_paths: [/code]
  stages:
    - {name: decode, modelet: mine:Decode}
    - {name: tokenize, modelet: mine:Tokenize, params: {max_len: 256}}
    - {name: model, model: /models/encoder.onnx, input: input_ids, output: embedding}
    - {name: post, modelet: mine:Post}
output: {uri: /data/out}
tiers:
  - name: cpu
    stages: [decode, tokenize]
    resources: {min_workers: 2, max_workers: 32, cpu: 8, memory_gb: 16}
    node_selector: {node.kubernetes.io/instance-type: c7i.2xlarge}
  - name: gpu
    stages: [model, post]
    resources: {max_workers: 4, cpu: 4, memory_gb: 32, gpu: 1}
    node_selector: {nvidia.com/gpu.present: "true"}
    tolerations:
      - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
      - {key: spot, value: "yes", effect: NoExecute, tolerationSeconds: 30}
"""


def two_tiers() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(TWO_TIERS)
    return data


def job(stages: list[dict[str, Any]], tiers: list[dict[str, Any]]) -> JobSpec:
    """A job of modelet stages (each `{"name": ..., **more}`) placed in tiers."""
    return parse_job(
        {
            "name": "j",
            "input": {"uri": "/data/in.parquet"},
            "pipeline": {"stages": [{"modelet": "mine:Stage", **s} for s in stages]},
            "output": {"uri": "/data/out"},
            "tiers": tiers,
        }
    )


def tiered(*runs: list[str]) -> list[dict[str, Any]]:
    return [{"name": f"t{k}", "stages": run} for k, run in enumerate(runs)]


def test_a_two_tier_job_parses_as_yaml_gives_it() -> None:
    spec = parse_job(two_tiers())
    cpu, gpu = spec.tiers
    assert cpu == TierSpec(
        name="cpu",
        stages=["decode", "tokenize"],
        resources=ResourceSpec(min_workers=2, max_workers=32, cpu=8.0, memory_gb=16.0),
        node_selector={"node.kubernetes.io/instance-type": "c7i.2xlarge"},
    )
    assert gpu.resources == ResourceSpec(max_workers=4, cpu=4.0, memory_gb=32.0, gpu=1)
    assert gpu.tolerations[0] == {
        "key": "nvidia.com/gpu",
        "operator": "Exists",
        "effect": "NoSchedule",
    }
    assert spec.tier_names() == ["cpu", "gpu"]
    assert spec.last_tier() == "gpu"
    assert [spec.tier_index(n) for n in ("cpu", "gpu")] == [0, 1]
    assert spec.tier_resources("cpu") is cpu.resources
    assert spec.tier_resources("gpu").gpu == 1


def test_each_tier_runs_its_stages_on_the_rows_the_tier_before_hands_on() -> None:
    spec = parse_job(two_tiers())
    cpu, gpu = spec.tier_pipeline("cpu"), spec.tier_pipeline("gpu")
    assert [s.name for s in cpu.stages] == ["decode", "tokenize"]
    assert [s.name for s in gpu.stages] == ["model", "post"]
    for tier in (cpu, gpu):
        assert tier.is_chain()
        assert tier.inputs() == [[], [0]]
        assert tier.code_paths == ["/code"]
    # The stages themselves are the pipeline's, batching, parameters and all.
    assert gpu.stages[0] == spec.pipeline.stages[2]
    assert cpu.stages[1].params == {"max_len": 256}


def test_a_job_without_tiers_is_one_tier_named_empty() -> None:
    spec = parse_job({k: v for k, v in two_tiers().items() if k != "tiers"})
    assert spec.tiers == []
    assert spec.tier_names() == [""]
    assert spec.last_tier() == ""
    assert spec.tier_index("") == 0
    assert spec.tier_pipeline("") is spec.pipeline
    assert spec.tier_resources("") is spec.resources
    with pytest.raises(SpecError) as e:
        spec.tier_pipeline("gpu")
    assert e.value.path == "tiers"
    assert "no tiers" in e.value.problem


def test_a_tiered_job_knows_only_its_tiers() -> None:
    spec = parse_job(two_tiers())
    for unknown in ("", "tpu"):
        with pytest.raises(SpecError) as e:
            spec.tier_resources(unknown)
        assert e.value.path == "tiers"
        assert "its tiers: ['cpu', 'gpu']" in e.value.problem


def test_one_tier_is_the_whole_pipeline_on_that_tier_s_workers() -> None:
    data = two_tiers()
    data["tiers"] = [{**data["tiers"][1], "stages": ["decode", "tokenize", "model", "post"]}]
    spec = parse_job(data)
    assert spec.tier_names() == ["gpu"]
    assert spec.tier_pipeline("gpu") == spec.pipeline
    assert spec.tier_resources("gpu").gpu == 1


# a -> {b, c} -> j -> m: a branch and its join, then one more stage.
BRANCHED: list[dict[str, Any]] = [
    {"name": "a"},
    {"name": "b", "after": ["a"]},
    {"name": "c", "after": ["a"]},
    {"name": "j", "after": ["b", "c"]},
    {"name": "m", "after": ["j"]},
]


def test_a_branch_and_its_join_stay_in_one_tier() -> None:
    spec = job(BRANCHED, tiered(["a", "b", "c", "j"], ["m"]))
    first, second = spec.tier_pipeline("t0"), spec.tier_pipeline("t1")
    assert first.inputs() == [[], [0], [0], [1, 2]]
    assert [s.after for s in first.stages] == [None, ["a"], ["a"], ["b", "c"]]
    assert not first.is_chain()
    assert [s.name for s in second.stages] == ["m"]
    assert second.stages[0].after is None
    assert second.is_chain()


@pytest.mark.parametrize(
    ("cut", "crossing"),
    [(1, "a"), (2, None), (3, None), (4, "j")],
)
def test_a_branching_pipeline_is_cut_only_where_one_stage_s_rows_cross(
    cut: int, crossing: str | None
) -> None:
    names = [s["name"] for s in BRANCHED]
    tiers = tiered(names[:cut], names[cut:])
    if crossing is None:
        with pytest.raises(SpecError) as e:
            job(BRANCHED, tiers)
        assert e.value.path == "tiers[1].stages"
        assert "last stage of the tier just before" in e.value.problem
        return
    spec = job(BRANCHED, tiers)
    # Stages that read the crossing stage read the rows as read of their tier instead.
    rest = spec.tier_pipeline("t1")
    assert [s.name for s in rest.stages] == names[cut:]
    assert rest.inputs()[0] == []
    assert all(crossing not in (s.after or []) for s in rest.stages)


def test_later_tiers_branch_from_the_rows_handed_on() -> None:
    stages: list[dict[str, Any]] = [
        {"name": "a"},
        {"name": "x", "after": ["a"]},
        {"name": "y", "after": ["a"]},
        {"name": "z", "after": ["x", "y"]},
    ]
    spec = job(stages, tiered(["a"], ["x", "y", "z"]))
    tier = spec.tier_pipeline("t1")
    assert [s.after for s in tier.stages] == [[], [], ["x", "y"]]
    assert tier.inputs() == [[], [], [0, 1]]
    assert not tier.is_chain()


def test_a_tier_that_reads_as_a_chain_is_written_as_one() -> None:
    stages: list[dict[str, Any]] = [
        {"name": "a"},
        {"name": "m", "after": ["a"]},
        {"name": "n", "after": ["m"]},
        {"name": "o"},
    ]
    spec = job(stages, tiered(["a"], ["m", "n", "o"]))
    tier = spec.tier_pipeline("t1")
    assert tier.is_chain()
    assert [s.after for s in tier.stages] == [None, None, None]
    assert tier == PipelineSpec(stages=[replace(s, after=None) for s in spec.pipeline.stages[1:]])


def test_every_split_of_a_chain_is_a_chain_of_tiers() -> None:
    names = ["s0", "s1", "s2", "s3", "s4"]
    stages = [{"name": n} for n in names]
    for cuts in itertools.chain.from_iterable(
        itertools.combinations(range(1, len(names)), k) for k in range(len(names))
    ):
        bounds = [0, *cuts, len(names)]
        runs = [names[i:j] for i, j in itertools.pairwise(bounds)]
        spec = job(stages, tiered(*runs))
        for name, run in zip(spec.tier_names(), runs, strict=True):
            tier = spec.tier_pipeline(name)
            assert [s.name for s in tier.stages] == run
            assert tier.is_chain()
            assert all(s.after is None for s in tier.stages)


def test_tiers_name_unnamed_stages_as_the_pipeline_does() -> None:
    spec = parse_job(
        {
            "name": "j",
            "input": {"uri": "/data/in.parquet"},
            "pipeline": {"stages": [{"modelet": "mine:A"}, {"modelet": "mine:B"}]},
            "output": {"uri": "/data/out"},
            "tiers": tiered(["stage0"], ["stage1"]),
        }
    )
    assert [s.name for s in spec.tier_pipeline("t1").stages] == ["stage1"]


def test_a_fan_out_and_its_fan_in_in_one_tier() -> None:
    stages: list[dict[str, Any]] = [
        {"name": "detect", "fanout": True},
        {"name": "crop"},
        {"name": "gather", "fanin": True},
        {"name": "score"},
    ]
    spec = job(stages, tiered(["detect", "crop", "gather"], ["score"]))
    assert [s.fanout for s in spec.tier_pipeline("t0").stages] == [True, False, False]
    assert spec.tier_pipeline("t1").stages[0].fanin is False
    alone = job(stages[:2], tiered(["detect", "crop"]))
    assert alone.tier_pipeline("t0") == alone.pipeline
    last = job([{"name": "read"}, *stages[:2]], tiered(["read"], ["detect", "crop"]))
    assert last.tier_pipeline("t1").stages[0].fanout


CHAIN: list[dict[str, Any]] = [{"name": n} for n in ("decode", "tokenize", "model", "post")]


@pytest.mark.parametrize(
    ("stages", "tiers", "path", "problem"),
    [
        (CHAIN, [{"name": "GPU", "stages": ["decode"]}], "tiers[0].name", "not a tier name"),
        (CHAIN, [{"name": "-gpu", "stages": ["decode"]}], "tiers[0].name", "not a tier name"),
        (CHAIN, [{"name": "g" * 21, "stages": ["decode"]}], "tiers[0].name", "1 to 20"),
        (CHAIN, [{"name": "cpu", "stages": []}], "tiers[0].stages", "at least one stage"),
        (
            CHAIN,
            [{"name": "t", "stages": ["decode", "tokenize"]}, {"name": "t", "stages": ["model"]}],
            "tiers[1].name",
            "'t' names tiers[0] already",
        ),
        (
            CHAIN,
            tiered(["decode", "tokenize"], ["model", "postprocess"]),
            "tiers[1].stages",
            "'postprocess' is not a stage of the pipeline",
        ),
        (
            CHAIN,
            tiered(["decode", "tokenize"], ["tokenize", "model", "post"]),
            "tiers[1].stages",
            "'tokenize' is in tiers[0] already",
        ),
        (
            CHAIN,
            tiered(["decode", "decode"], ["tokenize", "model", "post"]),
            "tiers[0].stages",
            "'decode' is named twice",
        ),
        (
            CHAIN,
            tiered(["decode", "tokenize"], ["model"]),
            "tiers",
            "in none: ['post']",
        ),
        (
            CHAIN,
            tiered(["model", "post"], ["decode", "tokenize"]),
            "tiers[0].stages",
            "tiers follow the pipeline's order, so this tier begins with 'decode'",
        ),
        (
            CHAIN,
            tiered(["tokenize", "decode"], ["model", "post"]),
            "tiers[0].stages",
            "tiers follow the pipeline's order",
        ),
        (
            CHAIN,
            tiered(["decode", "model"], ["tokenize", "post"]),
            "tiers[0].stages",
            "'decode' is followed by 'tokenize' in the pipeline, not 'model'",
        ),
        (
            CHAIN,
            tiered(["decode"], ["tokenize", "post", "model"]),
            "tiers[1].stages",
            "consecutive stages",
        ),
        (
            [{"name": "a"}, {"name": "b"}, {"name": "c", "after": ["b", "a"]}],
            tiered(["a", "b"], ["c"]),
            "tiers[1].stages",
            "stage 'c' reads 'a' of tier 't0', but rows cross into a tier only from the last "
            "stage of the tier just before ('b')",
        ),
        (
            [{"name": "a"}, {"name": "b"}, {"name": "c", "after": ["a", "b"]}],
            tiered(["a"], ["b"], ["c"]),
            "tiers[2].stages",
            "last stage of the tier just before ('b')",
        ),
        (
            [{"name": "a"}, {"name": "b"}, {"name": "c", "after": ["a", "b"]}],
            tiered(["a"], ["b", "c"]),
            "tiers[1].stages",
            "stage 'c' joins 'a', whose rows the tier before hands on, with ['b']",
        ),
        (
            [{"name": "a"}, {"name": "b", "after": []}],
            tiered(["a"], ["b"]),
            "tiers[1].stages",
            "reads the rows as read (`after: []`), which only the first tier's stages can",
        ),
        (
            [{"name": "a"}, {"name": "b"}, {"name": "c", "after": ["a"]}, {"name": "d"}],
            tiered(["a", "b", "c"], ["d"]),
            "tiers[0].stages",
            "stage 'b' is read by no stage",
        ),
        (
            [
                {"name": "detect", "fanout": True},
                {"name": "crop"},
                {"name": "gather", "fanin": True},
            ],
            tiered(["detect", "crop"], ["gather"]),
            "tiers[0].stages",
            "the fan-out stage 'detect' and its fan-in 'gather' run in one tier",
        ),
        (
            [{"name": "detect", "fanout": True}, {"name": "crop"}],
            tiered(["detect"], ["crop"]),
            "tiers[0].stages",
            "has no fan-in, so its parts are gathered only at the end of the pipeline",
        ),
    ],
)
def test_tiers_that_do_not_cut_the_pipeline_say_where(
    stages: list[dict[str, Any]], tiers: list[dict[str, Any]], path: str, problem: str
) -> None:
    with pytest.raises(SpecError) as e:
        job(stages, tiers)
    assert e.value.path == path
    assert problem in e.value.problem


def gpu_tier(**fields: Any) -> list[dict[str, Any]]:
    return [{"name": "gpu", "stages": [s["name"] for s in CHAIN], **fields}]


@pytest.mark.parametrize(
    ("fields", "path", "problem"),
    [
        (
            {"resources": {"min_workers": 3, "max_workers": 2}},
            "tiers[0].resources.min_workers",
            "exceeds",
        ),
        ({"resources": {"gpus": 1}}, "tiers[0].resources.gpus", "did you mean 'gpu'"),
        ({"node_selector": {"bad key": "x"}}, "tiers[0].node_selector.bad key", "not a label key"),
        ({"node_selector": {"Bad_/gpu": "x"}}, "tiers[0].node_selector.Bad_/gpu", "subdomain"),
        ({"node_selector": {"gpu": "a b"}}, "tiers[0].node_selector.gpu", "not a label value"),
        ({"node_selector": {"gpu": 1}}, "tiers[0].node_selector.gpu", "expected str"),
        (
            {"tolerations": [{"key": "g", "operator": "In"}]},
            "tiers[0].tolerations[0].operator",
            "Equal or Exists",
        ),
        (
            {"tolerations": [{"key": "g", "effect": "NoRun"}]},
            "tiers[0].tolerations[0].effect",
            "expected one of NoSchedule, PreferNoSchedule, NoExecute",
        ),
        (
            {"tolerations": [{"key": "g", "tolerationseconds": 5}]},
            "tiers[0].tolerations[0].tolerationseconds",
            "did you mean 'tolerationSeconds'?",
        ),
        (
            {"tolerations": [{"key": "g", "effect": "NoSchedule", "tolerationSeconds": 5}]},
            "tiers[0].tolerations[0].tolerationSeconds",
            "NoExecute effect only",
        ),
        (
            {"tolerations": [{"key": "g", "effect": "NoExecute", "tolerationSeconds": "5m"}]},
            "tiers[0].tolerations[0].tolerationSeconds",
            "expected int",
        ),
        (
            {"tolerations": [{"key": "g", "operator": "Exists", "value": "x"}]},
            "tiers[0].tolerations[0].value",
            "an Exists toleration has no value",
        ),
        ({"tolerations": [{"value": "x"}]}, "tiers[0].tolerations[0].operator", "without a key"),
        ({"tolerations": [{"key": 7}]}, "tiers[0].tolerations[0].key", "expected str"),
        ({"tolerations": ["nvidia.com/gpu"]}, "tiers[0].tolerations[0]", "expected a map"),
        ({"replicas": 2}, "tiers[0].replicas", "unknown field"),
    ],
)
def test_a_tier_s_placement_is_checked_as_kubernetes_would(
    fields: dict[str, Any], path: str, problem: str
) -> None:
    with pytest.raises(SpecError) as e:
        job(CHAIN, gpu_tier(**fields))
    assert e.value.path == path
    assert problem in e.value.problem


def test_tolerations_kubernetes_takes_are_taken() -> None:
    tolerations = [
        {"operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists"},
        {"key": "dedicated", "value": "ml", "effect": "PreferNoSchedule"},
        {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "tolerationSeconds": 0},
    ]
    spec = job(CHAIN, gpu_tier(tolerations=tolerations, node_selector={"pool": ""}))
    assert spec.tiers[0].tolerations == tolerations


def test_tiers_decide_where_rows_are_computed_not_what_they_are() -> None:
    with_tiers = parse_job(two_tiers())
    without = parse_job({k: v for k, v in two_tiers().items() if k != "tiers"})
    assert with_tiers.output_fields() == without.output_fields()
    assert with_tiers.output_digest() == without.output_digest()
    assert with_tiers.whole_sections_digest() == without.whole_sections_digest()
    other = two_tiers()
    other["tiers"] = [
        {"name": "all", "stages": ["decode", "tokenize", "model", "post"], "resources": {"gpu": 2}}
    ]
    assert parse_job(other).output_digest() == without.output_digest()


def test_a_job_without_tiers_is_the_map_it_was_before_tiers() -> None:
    body = parse_job({k: v for k, v in two_tiers().items() if k != "tiers"}).to_dict()
    assert list(body) == [
        "name",
        "id",
        "input",
        "pipeline",
        "output",
        "resources",
        "fault",
        "priority",
        "tracking",
    ]


def test_a_tiered_job_round_trips() -> None:
    spec = parse_job(two_tiers())
    body = spec.to_dict()
    assert [t["name"] for t in body["tiers"]] == ["cpu", "gpu"]
    assert parse_job(body) == spec
    assert parse_job(json.loads(json.dumps(body))) == spec
    assert parse_job(yaml.safe_load(yaml.safe_dump(body))) == spec


def test_the_example_of_the_docs_is_a_job_of_two_tiers() -> None:
    page = (DOCS / "job-spec.md").read_text()
    section = page.split("\n## Tiers\n", 1)[1]
    match = re.search(r"```yaml\n(.*?)```", section, flags=re.DOTALL)
    assert match is not None
    example = yaml.safe_load(match.group(1))
    rest = {"name": "j", "input": {"uri": "/d/in.parquet"}, "output": {"uri": "/d/out"}}
    spec = parse_job({**rest, **example})
    assert spec.tier_names() == ["cpu", "gpu"]
    assert spec.tier_resources("gpu").gpu == 1
    assert [s.name for s in spec.tier_pipeline("gpu").stages] == ["model", "post"]
    # The join the page says is refused.
    example["pipeline"]["stages"][3]["after"] = ["tokenize", "model"]
    with pytest.raises(SpecError) as e:
        parse_job({**rest, **example})
    assert e.value.path == "tiers[1].stages"
    assert "never joined" in e.value.problem


# The first tier makes `x` from `features`; the next tier's first stage, a model, reads it.
MADE_BEFORE: dict[str, Any] = {
    "name": "j",
    "input": {"uri": "/d/in.parquet", "columns": ["features"]},
    "pipeline": {
        "stages": [
            {"name": "pre", "modelet": "mine:Pre"},
            {
                "name": "model",
                "model": "/m.onnx",
                "input": "x",
                "batch_tokens": 64,
                "length_column": "n",
            },
            {"name": "post", "modelet": "mine:Post"},
        ]
    },
    "output": {"uri": "/d/out", "carryover": ["id"]},
    "tiers": [{"name": "prep", "stages": ["pre"]}, {"name": "infer", "stages": ["model", "post"]}],
}


def test_a_later_tier_s_first_stage_reads_the_rows_handed_on_not_the_input() -> None:
    spec = parse_job(MADE_BEFORE)
    assert spec.input_columns_read() == {}
    # The tier reads `x` and `n` of the rows handed on: known only as they come.
    assert spec.tier_pipeline("infer").columns_read() == {
        "x": "pipeline.stages[0].input",
        "n": "pipeline.stages[0].length_column",
    }
    # In one tier, the same stages read `x` of `pre`'s rows: the input's columns are unread.
    one = {**MADE_BEFORE, "tiers": [{"name": "all", "stages": ["pre", "model", "post"]}]}
    assert parse_job(one).input_columns_read() == {}
    # Read first, `x` is a column of the input, which input.columns must name.
    first = {**MADE_BEFORE, "tiers": [{"name": "all", "stages": ["model", "post"]}]}
    first["pipeline"] = {"stages": MADE_BEFORE["pipeline"]["stages"][1:]}
    with pytest.raises(SpecError) as e:
        parse_job(first)
    assert e.value.path == "pipeline.stages[0].input"
    assert "'x' is not among input.columns ['features']" in e.value.problem


def test_the_input_columns_a_tiered_job_reads_are_its_first_tier_s() -> None:
    stages: list[dict[str, Any]] = [
        {"name": "a", "model": "/m.onnx", "input": "features", "output": "a"},
        {"name": "b", "after": [], "llm": {"model": "/llm", "prompt": "question"}},
        {"name": "j", "modelet": "mine:Join", "after": ["a", "b"]},
        {"name": "m", "model": "/m.onnx", "input": "a"},
        {"name": "l", "after": ["j"], "llm": {"model": "/llm", "prompt": "text"}},
    ]
    data: dict[str, Any] = {
        "name": "j",
        "input": {"uri": "/d/in.parquet", "columns": ["features", "question"]},
        "pipeline": {"stages": stages},
        "output": {"uri": "/d/out"},
        "tiers": tiered(["a", "b", "j"], ["m", "l"]),
    }
    spec = parse_job(data)
    assert spec.input_columns_read() == {
        "features": "pipeline.stages[0].input",
        "question": "pipeline.stages[1].llm.prompt",
    }
    assert spec.tier_pipeline("t1").columns_read() == {
        "a": "pipeline.stages[0].input",
        "text": "pipeline.stages[1].llm.prompt",
    }
    data["input"]["columns"] = ["features"]
    with pytest.raises(SpecError) as e:
        parse_job(data)
    assert e.value.path == "pipeline.stages[1].llm.prompt"
