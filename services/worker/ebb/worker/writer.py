"""Turning a shard's outcomes into its output table, and writing it with the commit protocol.

The output has one row per input row, in input order: the carryover columns (the input's own
Arrow buffers, untouched), the pipeline's result columns, and `_error` (null for rows that
went through, the reason for rows that did not; their result columns are null).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.common.output import OutputFile, OutputStore, attempt_dir
from ebb.common.spec import OutputSpec

ERROR_COLUMN = "_error"


class OutputError(Exception):
    """The results cannot be turned into a table (clashing names, unconvertible values)."""


def to_arrow(values: Sequence[Any]) -> pa.Array[Any]:
    """One column from per-row values (None for missing). Equal-shape arrays become a
    fixed-size list column; numpy scalars become their Arrow type."""
    present = [v for v in values if v is not None]
    if not present:
        return pa.nulls(len(values))
    first = present[0]
    if isinstance(first, np.ndarray):
        shape, dtype = first.shape, first.dtype
        if first.ndim == 1 and all(
            isinstance(v, np.ndarray) and v.shape == shape and v.dtype == dtype for v in present
        ):
            mask = np.array([v is None for v in values])
            filler = np.zeros(shape, dtype=dtype)
            flat = np.stack([filler if v is None else v for v in values]).reshape(-1)
            fixed: pa.Array[Any] = pa.FixedSizeListArray.from_arrays(
                pa.array(flat), shape[0], mask=pa.array(mask) if mask.any() else None
            )
            return fixed
        nested: pa.Array[Any] = pa.array(
            [None if v is None else np.asarray(v).tolist() for v in values]
        )
        return nested
    if isinstance(first, np.generic):
        values = [None if v is None else v.item() for v in values]
    array: pa.Array[Any] = pa.array(list(values))
    return array


def build_output(
    input_table: pa.Table,
    outcomes: Sequence[tuple[bool, Any] | None],
    output: OutputSpec,
    bad_rows: dict[int, str],
) -> tuple[pa.Table, int]:
    """(output table, number of error rows). `outcomes[i]` is None for a row that never
    entered the pipeline (it failed to decode; its reason is in `bad_rows`)."""
    n = input_table.num_rows
    if len(outcomes) != n:
        raise OutputError(f"{len(outcomes)} outcomes for {n} rows")
    results: list[Any] = [None] * n
    errors: list[str | None] = [None] * n
    for i, outcome in enumerate(outcomes):
        if outcome is None:
            errors[i] = bad_rows.get(i, "row was not processed")
        elif outcome[0]:
            results[i] = outcome[1]
        else:
            errors[i] = str(outcome[1])
    columns: dict[str, pa.Array[Any] | pa.ChunkedArray[Any]] = {
        name: input_table.column(name) for name in output.carryover
    }
    ok = [r for r in results if r is not None]
    if ok and all(isinstance(r, dict) for r in ok):
        keys = list(dict.fromkeys(k for r in ok for k in r))
        for key in keys:
            if key in columns or key == ERROR_COLUMN:
                raise OutputError(f"result field {key!r} clashes with a carryover column")
            columns[key] = _column(key, [None if r is None else r.get(key) for r in results])
    else:
        name = output.prediction_column
        if name in columns:
            raise OutputError(f"prediction column {name!r} clashes with a carryover column")
        columns[name] = _column(name, results)
    columns[ERROR_COLUMN] = pa.array(errors, type=pa.string())
    return pa.table(columns), sum(e is not None for e in errors)


def _column(name: str, values: list[Any]) -> pa.Array[Any]:
    try:
        return to_arrow(values)
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise OutputError(f"result {name!r} cannot be stored as a column: {e}") from e


def write_attempt(
    store: OutputStore, table: pa.Table, *, shard: int, attempt: int, error_rows: int
) -> list[OutputFile]:
    """Write the attempt's data file (complete, or not at all). Returns what to commit."""
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    data = buffer.getvalue()
    path = f"{attempt_dir(shard, attempt)}/part-00000.parquet"
    store.write_file(path, data)
    return [OutputFile(path=path, rows=table.num_rows, error_rows=error_rows, bytes=len(data))]
