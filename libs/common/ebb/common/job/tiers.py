"""How a job's tiers may cut its pipeline, and the Kubernetes placement a tier names (its
node selector and tolerations), checked when the job is submitted rather than when its first
pod is made. The job spec (ebb.common.job.spec) calls these; its fields' docstrings are the
reference. The checks read the spec through protocols: this module imports nothing of
ebb.common.job.spec."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any, Protocol

from ..errors import SpecError


class Stage(Protocol):
    """What the checks read of a stage (`spec.StageSpec`)."""

    @property
    def name(self) -> str: ...
    @property
    def fanout(self) -> bool: ...
    @property
    def fanin(self) -> bool: ...


class Pipeline(Protocol):
    """What the checks read of a pipeline (`spec.PipelineSpec`)."""

    @property
    def stages(self) -> Sequence[Stage]: ...
    def inputs(self) -> list[list[int]]: ...


class Tier(Protocol):
    """What the checks read of a tier (`spec.TierSpec`)."""

    @property
    def name(self) -> str: ...
    @property
    def stages(self) -> list[str]: ...


LABEL_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
TOLERATION_FIELDS = ("key", "operator", "value", "effect", "tolerationSeconds")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _bad(path: str, problem: str) -> SpecError:
    return SpecError(path, problem)


def label_key_problem(key: str) -> str | None:
    """Why a Kubernetes label key (`[prefix/]name`) would be refused by the API server."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN_RE.match(prefix)):
        return f"{prefix!r} is not a DNS subdomain (a label key's prefix, before `/`)"
    if not LABEL_NAME_RE.match(name):
        return (
            f"{key!r} is not a label key: a name of 1 to 63 letters, digits, `-`, `_` and "
            "`.`, a letter or digit at each end, after an optional `prefix/`"
        )
    return None


def label_value_problem(value: str) -> str | None:
    if value and not LABEL_NAME_RE.match(value):
        return (
            f"{value!r} is not a label value: up to 63 letters, digits, `-`, `_` and `.`, "
            "a letter or digit at each end"
        )
    return None


def check_toleration(path: str, toleration: dict[str, Any]) -> None:
    """Refuse a toleration the Kubernetes API server would refuse, when the job is submitted
    rather than when its first pod is made."""
    for key in toleration:
        if key not in TOLERATION_FIELDS:
            near = difflib.get_close_matches(key, TOLERATION_FIELDS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise _bad(
                f"{path}.{key}",
                f"unknown field; {hint}a toleration has {', '.join(TOLERATION_FIELDS)}",
            )
    for key in ("key", "operator", "value", "effect"):
        if not isinstance(toleration.get(key, ""), str):
            raise _bad(f"{path}.{key}", f"expected str, got {toleration[key]!r}")
    key = toleration.get("key", "")
    operator = toleration.get("operator", "Equal")
    value = toleration.get("value", "")
    effect = toleration.get("effect", "")
    if operator not in ("Equal", "Exists"):
        raise _bad(f"{path}.operator", f"expected Equal or Exists, got {operator!r}")
    if key:
        problem = label_key_problem(key)
        if problem:
            raise _bad(f"{path}.key", problem)
    elif operator != "Exists":
        raise _bad(f"{path}.operator", "a toleration without a key tolerates every taint: Exists")
    if operator == "Exists" and value:
        raise _bad(f"{path}.value", "an Exists toleration has no value")
    problem = label_value_problem(value)
    if problem:
        raise _bad(f"{path}.value", problem)
    if effect and effect not in TAINT_EFFECTS:
        raise _bad(f"{path}.effect", f"expected one of {', '.join(TAINT_EFFECTS)}, got {effect!r}")
    if "tolerationSeconds" in toleration:
        seconds = toleration["tolerationSeconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, int):
            raise _bad(f"{path}.tolerationSeconds", f"expected int, got {seconds!r}")
        if effect != "NoExecute":
            raise _bad(f"{path}.tolerationSeconds", "applies to the NoExecute effect only")


def check_tiers(tiers: Sequence[Tier], pipeline: Pipeline) -> None:
    """Refuse tiers that do not cut the pipeline into runs of its stages, in its order, each
    handing its rows on from its last stage alone: a tier's workers commit one stage's rows
    per shard, and the next tier reads nothing else of the tier before."""
    names = [s.name for s in pipeline.stages]
    tier_of: dict[str, int] = {}
    named: dict[str, int] = {}
    for k, tier in enumerate(tiers):
        if tier.name in named:
            raise _bad(
                f"tiers[{k}].name",
                f"{tier.name!r} names tiers[{named[tier.name]}] already: each tier has its own",
            )
        named[tier.name] = k
        for stage in tier.stages:
            if stage not in names:
                raise _bad(
                    f"tiers[{k}].stages",
                    f"{stage!r} is not a stage of the pipeline (its stages: {names})",
                )
            if stage in tier_of and tier_of[stage] == k:
                raise _bad(f"tiers[{k}].stages", f"{stage!r} is named twice")
            if stage in tier_of:
                raise _bad(
                    f"tiers[{k}].stages",
                    f"{stage!r} is in tiers[{tier_of[stage]}] already: a stage runs in one tier",
                )
            tier_of[stage] = k
    missing = [n for n in names if n not in tier_of]
    if missing:
        raise _bad("tiers", f"every stage of the pipeline runs in a tier; in none: {missing}")
    starts: list[int] = []
    for k, tier in enumerate(tiers):
        start = sum(len(t.stages) for t in tiers[:k])
        starts.append(start)
        expected = names[start : start + len(tier.stages)]
        if tier.stages != expected:
            raise _bad(f"tiers[{k}].stages", _order_problem(k, tier.stages, expected))
    reads = pipeline.inputs()
    for j, inputs in enumerate(reads):
        k = tier_of[names[j]]
        if k == 0:
            continue
        handed = starts[k] - 1
        if not inputs:
            raise _bad(
                f"tiers[{k}].stages",
                f"stage {names[j]!r} reads the rows as read (`after: []`), which only the "
                f"first tier's stages can: this tier's rows are {names[handed]!r}'s, handed on "
                "by the tier before",
            )
        for i in inputs:
            if i < handed:
                raise _bad(
                    f"tiers[{k}].stages",
                    f"stage {names[j]!r} reads {names[i]!r} of tier "
                    f"{tiers[tier_of[names[i]]].name!r}, but rows cross into a tier only from "
                    f"the last stage of the tier just before ({names[handed]!r}): read that, "
                    "or place the two stages in one tier",
                )
        if handed in inputs and len(inputs) > 1:
            # A join is of stages' outputs; the rows handed on are the next tier's rows as
            # read, which no stage can join with others: the join would lose their columns.
            others = [names[i] for i in inputs if i != handed]
            raise _bad(
                f"tiers[{k}].stages",
                f"stage {names[j]!r} joins {names[handed]!r}, whose rows the tier before hands "
                f"on, with {others}: a tier's stages read the rows handed on alone, never "
                f"joined; keep the join in one tier, or have {others} pass on the columns of "
                f"{names[handed]!r} that {names[j]!r} needs",
            )
    for k, tier in enumerate(tiers[:-1]):
        for stage in tier.stages[:-1]:
            i = names.index(stage)
            if not any(i in r for r in reads):
                raise _bad(
                    f"tiers[{k}].stages",
                    f"stage {stage!r} is read by no stage, so its rows would be joined with "
                    "the others' at the end of the pipeline, but a tier before the last hands "
                    f"on only its last stage's ({tier.stages[-1]!r}): have a later stage of "
                    "this tier read it",
                )
    fanouts = [s.name for s in pipeline.stages if s.fanout]
    fanins = [s.name for s in pipeline.stages if s.fanin]
    if fanouts:
        k = tier_of[fanouts[0]]
        if fanins and tier_of[fanins[0]] != k:
            raise _bad(
                f"tiers[{k}].stages",
                f"the fan-out stage {fanouts[0]!r} and its fan-in {fanins[0]!r} run in one "
                "tier: the parts of a row are gathered before its rows are handed on",
            )
        if not fanins and k != len(tiers) - 1:
            raise _bad(
                f"tiers[{k}].stages",
                f"the fan-out stage {fanouts[0]!r} has no fan-in, so its parts are gathered "
                "only at the end of the pipeline: it runs in the last tier",
            )


def _order_problem(k: int, stages: list[str], expected: list[str]) -> str:
    """Why a tier's stages (each a stage of the pipeline, each in one tier) are not the run of
    the pipeline's stages the tier holds at its place."""
    if stages[0] != expected[0]:
        where = "the pipeline's first stage" if k == 0 else f"the stage after tiers[{k - 1}]'s"
        return (
            f"tiers follow the pipeline's order, so this tier begins with {expected[0]!r} "
            f"({where}), not {stages[0]!r}"
        )
    i = next(i for i, (a, b) in enumerate(zip(stages, expected, strict=True)) if a != b)
    return (
        f"a tier runs consecutive stages, in the pipeline's order: {stages[i - 1]!r} is "
        f"followed by {expected[i]!r} in the pipeline, not {stages[i]!r}"
    )
