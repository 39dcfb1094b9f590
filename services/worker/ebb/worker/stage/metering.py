"""A stage's metrics in its process: the per-row values each metric reads, put beside the rows
as they leave the stage (columns.METRIC), with those of earlier stages carried around the
modelet, which never sees them. The worker's front counts them for the rows it writes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ebb.common.job import accumulators

from ..chunks.columns import HIDDEN, METRIC, VALUE, Columns, is_plain


class MetricFailure(Exception):
    """A metric could not read the stage's output (a column missing, say): its rows fail."""


def with_metrics(
    chunk: Columns,
    uids: np.ndarray,
    *,
    stage: str,
    metrics: Mapping[str, accumulators.MetricSpec],
    batch_uids: np.ndarray,
    carried: Columns,
) -> Columns:
    """The output of rows `uids` (`chunk`, from the modelet) with the metrics' values:
    those `carried` from earlier stages (found by the rows' places among `batch_uids`) and
    this stage's own, read from its output and from the columns the modelet returned for them
    alone (HIDDEN: dropped here)."""
    if not (carried or metrics or any(k.startswith(HIDDEN) for k in chunk)):
        return chunk
    hidden = {k.removeprefix(HIDDEN): v for k, v in chunk.items() if k.startswith(HIDDEN)}
    if hidden:
        chunk = {k: v for k, v in chunk.items() if not k.startswith(HIDDEN)}
    if not chunk:
        raise MetricFailure(f"stage {stage!r}: returned only columns for its metrics, no output")
    out = dict(chunk)
    if carried:
        order = np.argsort(batch_uids, kind="stable")
        places = order[np.searchsorted(batch_uids, uids, sorter=order)]
        out.update({METRIC + name: values[places] for name, values in carried.items()})
    # A result that is not a map is named after the stage, as in a join.
    view = {stage: chunk[VALUE], **chunk} if is_plain(chunk) else dict(chunk)
    view.update(hidden)
    try:
        for name, values in accumulators.row_values_named(metrics, view).items():
            out[METRIC + name] = values
    except (ValueError, TypeError) as e:
        raise MetricFailure(f"stage {stage!r}: {e}") from e
    return out
