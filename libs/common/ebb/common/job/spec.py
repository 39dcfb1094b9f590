"""The job spec: what to read, which pipeline to run on it, where to write, with what resources
and which fault policy. It is the same map whether it arrives as YAML, JSON or msgpack.

Every field is validated on load (types by `schema.load`, values by `__post_init__`), so a bad
spec is refused with the path of the first bad field before any state changes anywhere. The
sections are in `ebb.common.job.sections` and `ebb.common.job.pipeline`; what decides a job's
rows, compared when a job carries on in its output root, in `ebb.common.job.changes`."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from .. import schema
from ..errors import SchemaError, SpecError
from .changes import (
    LATER_STAGE_FIELDS,
    OUTPUT_LAYOUT_FIELDS,
    STAGE_PERFORMANCE_FIELDS,
    fields_digest,
    flatten,
)
from .fields import bad
from .pipeline import PipelineSpec, tier_pipeline
from .placement import check_node_placement
from .sections import (
    FaultPolicy,
    InputSpec,
    OutputSpec,
    ResourceSpec,
    TierSpec,
    TrackingSpec,
)
from .tiers import check_tiers

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A job: what to read, the pipeline to run on it, where to write, with what resources
    and which fault policy."""

    name: str
    """For people: shown by `ebb status`, and the stem of the id made when `id` is empty.
    1 to 200 characters."""
    id: str = ""
    """Unique job id, sent as `Nats-Msg-Id`: resubmitting is a no-op. Assigned if empty."""
    input: InputSpec
    """What to read (the `input` section)."""
    pipeline: PipelineSpec
    """What to run on each row (the `pipeline` section)."""
    output: OutputSpec
    """Where to write (the `output` section)."""
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    """Workers and what each asks for (the `resources` section). A job with `tiers` sizes
    and places each tier's workers by the tier's own `resources`; this section is not used
    then."""
    tiers: list[TierSpec] = field(default_factory=list)
    """The pipeline's stages placed in tiers, each run by workers of its own, scaled and
    placed apart from the others' (decoding and tokenizing on CPU nodes, the model on GPU
    nodes). Each tier runs consecutive stages, in the pipeline's order; every stage is in
    one tier. Rows cross from a tier to the next only from the tier's last stage: a later
    tier's stages read the stages of their own tier, or that one alone. `[]`: every worker
    runs the whole pipeline, as `resources` says."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels every worker of the job is placed on (a Kubernetes `nodeSelector`), over
    the controller's own, label by label; a tier's `node_selector` goes over this one."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Taints of nodes every worker of the job may run on (Kubernetes tolerations, as a
    tier's `tolerations` says them), besides the controller's; a tier's add to these."""
    fault: FaultPolicy = field(default_factory=FaultPolicy)
    """Leases, retries and error budget (the `fault` section)."""
    priority: int = 0
    """Higher-priority jobs get capacity first."""
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    """Where the metrics are logged besides `_metrics.json` (the `tracking` section)."""

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 200:
            raise bad("name", "must be 1 to 200 characters")
        if self.id and not JOB_ID_RE.match(self.id):
            raise bad("id", f"must match {JOB_ID_RE.pattern}, got {self.id!r}")
        if self.tracking.experiment is None:
            object.__setattr__(self, "tracking", replace(self.tracking, experiment=self.name))
        if self.tiers:
            check_tiers(self.tiers, self.pipeline)
        check_node_placement(self.node_selector, self.tolerations)
        if self.input.columns is not None:
            for column, named_by in self.input_columns_read().items():
                if column not in self.input.columns:
                    raise bad(
                        named_by,
                        f"{column!r} is not among input.columns {self.input.columns}, which "
                        "are all the rows as read hold",
                    )

    def input_columns_read(self) -> dict[str, str]:
        """The columns of the job's input that the stages reading it name, each with the
        first field that names it (`PipelineSpec.columns_read`). In a job of tiers, those of
        the first tier's stages: a later tier's stages read the rows the tier before hands
        on, which the input's columns do not constrain (a first stage there reads a column an
        earlier tier made)."""
        if not self.tiers:
            return self.pipeline.columns_read()
        # The first tier's stages are the pipeline's first: its fields' paths are the job's.
        return self.tier_pipeline(self.tiers[0].name).columns_read()

    def with_id(self) -> JobSpec:
        """This spec with an id: its own, or one made from the name and a random suffix."""
        if self.id:
            return self
        stem = re.sub(r"[^A-Za-z0-9_-]+", "-", self.name).strip("-_")[:40] or "job"
        return replace(self, id=f"{stem}-{secrets.token_hex(4)}")

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = schema.dump(self)
        # A job that asks nothing of the fields added since is the map it was before they
        # existed: services of that version, which refuse a field (or a pool) they do not
        # know, read it during an upgrade.
        for key in ("tiers", "node_selector", "tolerations"):
            if not body[key]:
                del body[key]
        for resources in (body["resources"], *(t["resources"] for t in body.get("tiers", []))):
            if resources["gpu_type"] is None:
                del resources["gpu_type"]
            if resources["pool"] == "auto":
                del resources["pool"]
        return body

    def tier_names(self) -> list[str]:
        """The tiers' names in order; `[""]` for a job without tiers, run by one kind of
        worker."""
        return [t.name for t in self.tiers] if self.tiers else [""]

    def tier_index(self, name: str) -> int:
        """The place of a tier among the job's tiers (`""`: 0 for a job without tiers)."""
        names = self.tier_names()
        if name not in names:
            if not self.tiers:
                raise bad("tiers", f"the job has no tiers, so no tier {name!r}")
            raise bad("tiers", f"the job has no tier {name!r}; its tiers: {names}")
        return names.index(name)

    def last_tier(self) -> str:
        """The tier whose workers write the output (`""` for a job without tiers)."""
        return self.tier_names()[-1]

    def tier_resources(self, name: str) -> ResourceSpec:
        """What each worker of a tier asks for, and how many the tier may have."""
        k = self.tier_index(name)
        return self.tiers[k].resources if self.tiers else self.resources

    def tier_pipeline(self, name: str) -> PipelineSpec:
        """The pipeline a worker of a tier runs: the tier's stages, each reading the rows
        the tier before handed on (its last stage's) as the rows as read. The whole pipeline
        for a job without tiers."""
        k = self.tier_index(name)
        if not self.tiers:
            return self.pipeline
        handed = self.tiers[k - 1].stages[-1] if k else None
        return tier_pipeline(self.pipeline, self.tiers[k].stages, handed=handed)

    def output_fields(self) -> dict[str, Any]:
        """What decides the rows of the output, field by field: {path: value}, paths as a
        refusal names them (`pipeline.stages[1].model`, `pipeline.stages[0].params.mean`).

        The input section whole: its rows_per_shard (and, for CSV, newlines_in_values) decide
        where shards are cut, and committed work is found again by shard number, so a job
        carrying on in its output must cut its input the same way. Each stage's model or
        modelet with its parameters, how it is fed and what it yields; where modelet code
        comes from; the output's format and columns. Not how fast or where the rows are
        computed (STAGE_PERFORMANCE_FIELDS, resources, tiers, fault policy, priority), nor
        where the output root is or how its files are cut: those may change between runs of
        one job.
        """
        body = self._body()
        stages = [
            {k: v for k, v in stage.items() if k not in STAGE_PERFORMANCE_FIELDS}
            for stage in body["pipeline"]["stages"]
        ]
        decisive = {
            "input": body["input"],
            "pipeline": {**body["pipeline"], "stages": stages},
            "output": {k: v for k, v in body["output"].items() if k not in OUTPUT_LAYOUT_FIELDS},
        }
        flat: dict[str, Any] = {}
        flatten(decisive, "", flat)
        # As JSON has them: what is compared with what was stored compares like with like.
        loaded: dict[str, Any] = json.loads(json.dumps(flat, sort_keys=True, default=str))
        return loaded

    def _body(self) -> dict[str, Any]:
        """`to_dict` less the stage fields of LATER_STAGE_FIELDS a stage leaves unset (None,
        or an empty map)."""
        body = self.to_dict()
        body["pipeline"]["stages"] = [
            {k: v for k, v in stage.items() if not (k in LATER_STAGE_FIELDS and v in (None, {}))}
            for stage in body["pipeline"]["stages"]
        ]
        return body

    def output_digest(self) -> str:
        """A digest of `output_fields`: equal for two specs that write the same rows."""
        return fields_digest(self.output_fields())

    def whole_sections_digest(self) -> str:
        """The digest an output root's owner record kept before `output_fields` existed: of
        the input, pipeline and output sections whole, batching and placement included."""
        body = self._body()
        decisive = {k: body[k] for k in ("input", "pipeline", "output")}
        text = json.dumps(decisive, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def parse_job(data: object) -> JobSpec:
    """Validate a decoded job map (from YAML, JSON or msgpack) as a JobSpec."""
    try:
        return schema.load(JobSpec, data, strict=True)
    except SpecError:
        raise
    except SchemaError as e:
        raise SpecError(e.path, e.problem) from None
