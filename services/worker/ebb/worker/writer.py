"""Turning a shard's outcomes into its output table, and writing it with the commit protocol.

The output has one row per input row, in input order: the carryover columns (the input's own
Arrow buffers, untouched), the pipeline's result columns, and `_error` (null for rows that
went through, the reason for rows that did not; their result columns are null).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.common.output import OutputFile, OutputStore, attempt_dir
from ebb.common.spec import OutputSpec

from .columns import VALUE, Columns, is_plain, num_rows, to_arrow

ERROR_COLUMN = "_error"


class OutputError(Exception):
    """The results cannot be turned into a table (clashing names, unconvertible values)."""


def build_output(
    input_table: pa.Table, results: Columns, errors: Mapping[int, str], output: OutputSpec
) -> tuple[pa.Table, int]:
    """(output table, number of error rows). `results` has a row per input row (those in
    `errors` failed, and are null in the result columns)."""
    n = input_table.num_rows
    columns: dict[str, pa.Array[Any] | pa.ChunkedArray[Any]] = {
        name: input_table.column(name) for name in output.carryover
    }
    missing = np.zeros(n, dtype=bool)
    if errors:
        missing[np.fromiter(errors, dtype=np.int64, count=len(errors))] = True
    if results and num_rows(results) != n:
        raise OutputError(f"{num_rows(results)} results for {n} rows")
    if results and not is_plain(results):
        for key, column in results.items():
            if key in columns or key == ERROR_COLUMN:
                raise OutputError(f"result field {key!r} clashes with a carryover column")
            columns[key] = _column(key, column, missing)
    else:
        name = output.prediction_column
        if name in columns:
            raise OutputError(f"prediction column {name!r} clashes with a carryover column")
        columns[name] = _column(name, results[VALUE], missing) if results else pa.nulls(n)
    if errors:
        reasons = np.full(n, None, dtype=object)
        for i, why in errors.items():
            reasons[i] = str(why)
        columns[ERROR_COLUMN] = pa.array(reasons, type=pa.string())
    else:
        columns[ERROR_COLUMN] = pa.nulls(n, type=pa.string())
    return pa.table(columns), len(errors)


def _column(name: str, values: np.ndarray, missing: np.ndarray) -> pa.Array[Any]:
    try:
        return to_arrow(values, missing)
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
