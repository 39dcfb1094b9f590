"""Where a job asks its workers to run: `resources.pool` (the legacy `online` included),
`resources.gpu_type`, and the job's own `node_selector` and `tolerations`, each checked when
the job is submitted, with the path of the bad field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ebb.common.errors import SpecError
from ebb.common.job import parse_job
from ebb.common.job.placement import asked_pool


def minimal(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "j",
        "input": {"uri": "/data/in.parquet"},
        "pipeline": {"stages": [{"name": "a", "model": "/models/m.onnx"}]},
        "output": {"uri": "/data/out"},
    }
    spec.update(overrides)
    return spec


def test_the_pool_is_auto_unless_the_job_says() -> None:
    assert parse_job(minimal()).resources.pool == "auto"
    assert asked_pool("auto") is None  # the controller's policy decides


@pytest.mark.parametrize(
    ("pool", "mode"),
    [("offline", "offline"), ("any", "any"), ("mixed", "mixed"), ("online", "any")],
)
def test_each_pool_a_job_may_ask_for(pool: str, mode: str) -> None:
    spec = parse_job(minimal(resources={"pool": pool}))
    assert spec.resources.pool == pool
    assert asked_pool(spec.resources.pool) == mode


def test_a_spec_stored_before_pools_were_read_still_loads() -> None:
    """The master stored every spec with its pool; `online` (which never meant anything)
    loads, and is read as `any`."""
    stored = minimal(resources={"min_workers": 1, "max_workers": 2, "pool": "online"})
    assert asked_pool(parse_job(stored).resources.pool) == "any"


def test_an_unknown_pool_is_refused() -> None:
    with pytest.raises(SpecError) as e:
        parse_job(minimal(resources={"pool": "gpu"}))
    assert e.value.path == "resources.pool"
    assert "'auto'" in e.value.problem


def test_a_gpu_type_places_workers_that_ask_for_gpus() -> None:
    resources = {"gpu": 1, "gpu_type": "NVIDIA-A100-SXM4-80GB"}
    spec = parse_job(minimal(resources=resources))
    assert spec.resources.gpu_type == "NVIDIA-A100-SXM4-80GB"
    assert parse_job(minimal()).resources.gpu_type is None


@pytest.mark.parametrize(
    ("resources", "problem"),
    [
        ({"gpu_type": "NVIDIA-A100-SXM4-80GB"}, "ask for no GPU: set `gpu`"),
        ({"gpu": 0, "gpu_type": "NVIDIA-A100-SXM4-80GB"}, "ask for no GPU"),
        ({"gpu": 1, "gpu_type": ""}, "must not be empty"),
        ({"gpu": 1, "gpu_type": "A100 80GB"}, "not a label value"),
        ({"gpu": 1, "gpu_type": 100}, "expected str"),
    ],
)
def test_a_gpu_type_is_checked(resources: dict[str, Any], problem: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_job(minimal(resources=resources))
    assert e.value.path == "resources.gpu_type"
    assert problem in e.value.problem


def test_a_tier_s_gpu_type_is_checked_in_its_own_resources() -> None:
    tiers = [{"name": "gpu", "stages": ["a"], "resources": {"gpu_type": "NVIDIA-L4"}}]
    with pytest.raises(SpecError) as e:
        parse_job(minimal(tiers=tiers))
    assert e.value.path == "tiers[0].resources.gpu_type"


def test_a_job_names_its_own_node_selector_and_tolerations() -> None:
    toleration = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    spec = parse_job(minimal(node_selector={"zone": "a"}, tolerations=[toleration]))
    assert spec.node_selector == {"zone": "a"}
    assert spec.tolerations == [toleration]


@pytest.mark.parametrize(
    ("fields", "path", "problem"),
    [
        ({"node_selector": {"bad key": "x"}}, "node_selector.bad key", "not a label key"),
        ({"node_selector": {"gpu": "a b"}}, "node_selector.gpu", "not a label value"),
        ({"tolerations": [{"key": "g", "operator": "In"}]}, "tolerations[0].operator", "Equal"),
        ({"tolerations": [{"value": "x"}]}, "tolerations[0].operator", "without a key"),
        (
            {"tolerations": [{"key": "g", "tolerationseconds": 5}]},
            "tolerations[0].tolerationseconds",
            "did you mean",
        ),
    ],
)
def test_a_job_s_placement_is_checked_as_a_tier_s_is(
    fields: dict[str, Any], path: str, problem: str
) -> None:
    with pytest.raises(SpecError) as e:
        parse_job(minimal(**fields))
    assert e.value.path == path
    assert problem in e.value.problem


def test_a_job_that_asks_nothing_new_is_the_map_it_was() -> None:
    """Services of the version before, which refuse a field (or a pool) they do not know,
    read the spec of a job that asks for none of them during an upgrade."""
    body = parse_job(minimal()).to_dict()
    assert "node_selector" not in body and "tolerations" not in body
    assert "pool" not in body["resources"] and "gpu_type" not in body["resources"]
    asked = minimal(
        resources={"gpu": 1, "gpu_type": "NVIDIA-L4", "pool": "mixed"}, node_selector={"a": "b"}
    )
    spec = parse_job(asked)
    body = spec.to_dict()
    assert body["resources"]["pool"] == "mixed" and body["node_selector"] == {"a": "b"}
    assert parse_job(body) == spec


def test_the_example_of_the_docs_places_a_job() -> None:
    page = (Path(__file__).parent.parent.parent / "docs" / "job-spec.md").read_text()
    section = page.split("\n## Placement\n", 1)[1]
    match = re.search(r"```yaml\n(.*?)```", section, flags=re.DOTALL)
    assert match is not None
    spec = parse_job({**minimal(), **yaml.safe_load(match.group(1))})
    assert (spec.resources.pool, spec.resources.gpu_type) == ("mixed", "NVIDIA-L4")
    assert spec.node_selector == {"topology.kubernetes.io/zone": "eu-west-1a"}
