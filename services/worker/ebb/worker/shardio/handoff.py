"""The rows one tier of a job hands to the next (`JobSpec.tiers`; docs/tiers.md).

A shard's attempt in a tier before the last commits, in place of output, a hand-off: Arrow
IPC files under the tier's root, one row per input row, in input order, holding
- the output's carryover columns, each named `CARRY` + its name (the rows' own columns may
  share a name with a result column until the last tier writes them side by side);
- the result columns of the tier's last stage as the pipeline holds them (`VALUE` for plain
  values), as the next tier's first stage reads them in a job of one tier;
- `_error`: why a row failed in this tier or one before (null for the rest);
- each row's values of the metrics of this tier's stages and those before, each named
  `METRIC` + the metric's name: a metric counts the rows of the job's output, which only the
  last tier knows (a row may pass this tier and fail in a later one; a later shard may be
  quarantined), so no tier but the last sums them up.
The next tier reads it as a shard (format "arrow"): the result columns go into its pipeline,
the rows that failed before go straight to its output as the error rows they are, its writer
takes the carryover columns back under their names, and the last tier reduces the metrics
carried over the rows it writes without error, beside its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from ebb.common.data.layout import tier_root
from ebb.common.errors import SpecError
from ebb.common.job import JobSpec, OutputSpec
from ebb.common.job.accumulators import MetricSpec

from ..chunks.columns import Columns, num_rows, to_arrow
from .reader import ShardData
from .writer import ERROR_COLUMN, OutputError

CARRY = "__carry__:"
METRIC = "__metric__:"


@dataclass(frozen=True, kw_only=True)
class TierEnds:
    """Where the rows of a worker's tier come from and where they go: chosen once per job
    session (`tier_view`), the same for every shard the worker runs."""

    reads_handoff: bool = False
    """The rows are the hand-off of the tier before (every tier but the first): its result
    columns go into the pipeline, its carried columns and metric values travel on."""
    hands_on: bool = False
    """The rows go to the next tier as a hand-off (every tier but the last), not to the
    output: written as Arrow under the tier's root, metric values carried, not reduced."""
    carried_metrics: dict[str, MetricSpec] = field(default_factory=dict)
    """The metrics of the tiers before, whose values the hand-offs it reads carry."""
    job_stages: dict[str, int] = field(default_factory=dict)
    """Each of the tier's stages' place in the job's `pipeline.stages` (empty: the job has
    no tiers, the places are the view's own): what a message naming a field uses."""

    @property
    def reduces_metrics(self) -> bool:
        """Only the last tier reduces metrics, over the rows it writes: the job's output."""
        return not self.hands_on


WHOLE_JOB = TierEnds()
"""A job without tiers: the input in, the output out."""


def tier_view(spec: JobSpec, tier: str) -> tuple[JobSpec, TierEnds]:
    """The job as a worker of `tier` runs it, and where its rows come from and go: the tier's
    stages and resources, its root for an output, and for a tier after the first, no
    `input.columns`: its rows as read are the hand-off of the tier before, all its columns,
    which the job's input columns do not name (its first stage may read a column an earlier
    tier made). SpecError for a tier the job has not."""
    names = spec.tier_names()
    if tier not in names:
        raise SpecError("tier", f"job {spec.id} has no tier {tier!r}; its tiers: {names}")
    if not spec.tiers:
        return spec, WHOLE_JOB
    k = names.index(tier)
    ends = TierEnds(
        reads_handoff=k > 0,
        hands_on=tier != spec.last_tier(),
        carried_metrics=_carried_metrics(spec, names[:k]),
        job_stages={stage.name: i for i, stage in enumerate(spec.pipeline.stages)},
    )
    output = spec.output
    if ends.hands_on:
        output = replace(output, uri=tier_root(output.uri, tier), max_rows_per_file=None)
    view = replace(
        spec,
        input=replace(spec.input, columns=None) if ends.reads_handoff else spec.input,
        pipeline=spec.tier_pipeline(tier),
        resources=spec.tier_resources(tier),
        output=output,
        tiers=[],
    )
    return view, ends


def _carried_metrics(spec: JobSpec, before: list[str]) -> dict[str, MetricSpec]:
    """The metrics of the stages of the tiers `before`: a shard of the tier after them finds
    their values in the hand-off it reads."""
    return {
        name: metric
        for earlier in before
        for name, metric in spec.tier_pipeline(earlier).all_metrics().items()
    }


def metric_columns(values: Mapping[str, np.ndarray]) -> dict[str, pa.Array[Any]]:
    """Metrics' per-row values (`accumulators.row_values`: (n,) or (n, 2) float64) as
    hand-off columns."""
    columns: dict[str, pa.Array[Any]] = {}
    for name, v in values.items():
        flat = pa.array(np.ascontiguousarray(v, dtype=np.float64).ravel(), type=pa.float64())
        column = pa.FixedSizeListArray.from_arrays(flat, v.shape[1]) if v.ndim == 2 else flat
        columns[METRIC + name] = column
    return columns


def metric_values(table: pa.Table, names: list[str]) -> dict[str, np.ndarray]:
    """The per-row values of metrics `names` a hand-off carries, as `metric_columns` wrote
    them. OutputError for a metric it lacks (a hand-off written by another version)."""
    values: dict[str, np.ndarray] = {}
    for name in names:
        if METRIC + name not in table.schema.names:
            raise OutputError(f"the hand-off carries no values of metric {name!r}")
        column = table.column(METRIC + name).combine_chunks()
        if isinstance(column, pa.FixedSizeListArray):
            width = column.type.list_size
            values[name] = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
        else:
            values[name] = column.to_numpy(zero_copy_only=False)
    return values


def handoff_table(
    input_table: pa.Table,
    results: Columns,
    errors: Mapping[int, str],
    output: OutputSpec,
    *,
    metrics: Mapping[str, pa.Array[Any]] | None = None,
) -> tuple[pa.Table, int]:
    """(the hand-off of a chunk, its number of error rows): `results` has a row per row of
    `input_table` (whose carryover columns are named as the output names them); `metrics`,
    hand-off columns of the rows' metric values (`metric_columns`)."""
    n = input_table.num_rows
    columns: dict[str, pa.Array[Any] | pa.ChunkedArray[Any]] = {
        CARRY + name: input_table.column(name) for name in output.carryover
    }
    columns.update(metrics or {})
    missing = np.zeros(n, dtype=bool)
    if errors:
        missing[np.fromiter(errors, dtype=np.int64, count=len(errors))] = True
    if results and num_rows(results) != n:
        raise OutputError(f"{num_rows(results)} results for {n} rows")
    for key, column in results.items():
        try:
            columns[key] = to_arrow(column, missing, keep_half=True)
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise OutputError(f"result {key!r} cannot be handed on: {e}") from e
    reasons = np.full(n, None, dtype=object)
    for i, why in errors.items():
        reasons[i] = str(why)
    columns[ERROR_COLUMN] = pa.array(reasons, type=pa.string())
    return pa.table(columns), len(errors)


def read_handoff(table: pa.Table) -> ShardData:
    """A chunk of a hand-off as a shard's rows: the rows that failed in a tier before are
    its bad rows, with their reasons, and reach the output as they are."""
    bad: dict[int, str] = {}
    if ERROR_COLUMN in table.schema.names:
        column = table.column(ERROR_COLUMN)
        if column.null_count < len(column):
            for i, why in enumerate(column.to_pylist()):
                if why is not None:
                    bad[i] = why
    return ShardData(table, bad)


def pipeline_inputs(table: pa.Table) -> pa.Table:
    """The columns of a hand-off that the next tier's pipeline takes: the results."""
    return table.select(
        [n for n in table.schema.names if not n.startswith((CARRY, METRIC)) and n != ERROR_COLUMN]
    )


def carried(table: pa.Table) -> pa.Table:
    """The carryover columns of a hand-off under their own names."""
    names = [n for n in table.schema.names if n.startswith(CARRY)]
    return table.select(names).rename_columns([n.removeprefix(CARRY) for n in names])
