"""Turning a shard's outcomes into its output table, and writing it with the commit protocol.

The output has one row per input row, in input order: the carryover columns (the input's own
Arrow buffers, untouched), the pipeline's result columns, and `_error` (null for rows that
went through, the reason for rows that did not; their result columns are null).
"""

from __future__ import annotations

import base64
import datetime
import decimal
import io
import json
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ebb.common.data.layout import OutputFile, attempt_dir
from ebb.common.data.output import OutputStore
from ebb.common.job import OutputSpec

from ..chunks.columns import VALUE, Columns, is_plain, num_rows, to_arrow

ERROR_COLUMN = "_error"
OutputFormat = Literal["parquet", "jsonl", "csv", "arrow"]
"""arrow: Arrow IPC files, what a tier hands to the next (ebb.worker.shardio.handoff)."""


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
    store: OutputStore,
    table: pa.Table,
    *,
    shard: int,
    attempt: int,
    error_rows: int | None = None,
    fmt: OutputFormat = "parquet",
    max_rows_per_file: int | None = None,
    first_part: int = 0,
) -> list[OutputFile]:
    """Write the attempt's data files, each complete or not at all, in `fmt`, at most
    `max_rows_per_file` rows each, numbered from `first_part` (a shard written a chunk at a
    time). Returns what to commit."""
    n = table.num_rows
    step = max_rows_per_file or max(n, 1)
    files: list[OutputFile] = []
    for part, start in enumerate(range(0, max(n, 1), step), start=first_part):
        piece = table.slice(start, step)
        data = encode(piece, fmt)
        path = f"{attempt_dir(shard, attempt)}/part-{part:05d}.{fmt}"
        store.write_file(path, data)
        errors = piece.num_rows - piece.column(ERROR_COLUMN).null_count
        files.append(OutputFile(path=path, rows=piece.num_rows, error_rows=errors, bytes=len(data)))
    if error_rows is not None and sum(f.error_rows for f in files) != error_rows:
        raise OutputError(f"{error_rows} error rows, but the files hold a different count")
    return files


def encode(table: pa.Table, fmt: OutputFormat) -> bytes:
    """A table as the bytes of one output file."""
    if fmt == "arrow":
        # Uncompressed: the next tier maps it and reads its buffers as they are.
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as ipc:
            ipc.write_table(table)
        return bytes(sink.getvalue())
    buffer = io.BytesIO()
    if fmt == "parquet":
        # pyarrow takes the columns to dictionary-encode as a list too; its stubs say bool.
        dictionary: Any = dictionary_columns(table.schema)
        pq.write_table(table, buffer, compression="zstd", use_dictionary=dictionary)
    elif fmt == "csv":
        pacsv.write_csv(_flat(table), buffer)
    else:
        for row in table.to_pylist():
            buffer.write(json.dumps(row, default=_json_value, ensure_ascii=False).encode())
            buffer.write(b"\n")
    return buffer.getvalue()


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The Parquet leaf columns worth dictionary encoding: all but floating-point ones.

    A model's scores and embeddings are floats that hardly ever repeat: the dictionary the
    writer tries first for every column grows to its page limit and is thrown away, which
    made encoding a float output cost nearly three times its plain encoding, and its file
    larger. Labels, ids and strings keep the dictionary (repeated values shrink to a few bits)."""
    return [path for path, kind in _leaves(schema) if not pa.types.is_floating(kind)]


def _leaves(schema: pa.Schema) -> list[tuple[str, pa.DataType]]:
    """Each Parquet leaf column's dotted path (lists as `name.list.element`, as pyarrow
    writes them) and its value type."""
    out: list[tuple[str, pa.DataType]] = []

    def walk(path: str, kind: pa.DataType) -> None:
        if pa.types.is_struct(kind):
            for i in range(kind.num_fields):
                walk(f"{path}.{kind.field(i).name}", kind.field(i).type)
        elif pa.types.is_map(kind):
            walk(f"{path}.key_value.key", kind.key_type)
            walk(f"{path}.key_value.value", kind.item_type)
        elif (
            pa.types.is_list(kind)
            or pa.types.is_large_list(kind)
            or pa.types.is_fixed_size_list(kind)
            or pa.types.is_list_view(kind)
            or pa.types.is_large_list_view(kind)
        ):
            walk(f"{path}.list.element", kind.value_type)
        else:
            out.append((path, kind))

    for field in schema:
        walk(field.name, field.type)
    return out


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | datetime.timedelta):
        return str(value)
    raise TypeError(f"{type(value).__name__} cannot be written as JSON")


def _flat(table: pa.Table) -> pa.Table:
    """CSV holds scalars only: nested columns (lists, maps, structs) become JSON text."""
    columns: list[Any] = []
    for column in table.columns:
        if pa.types.is_nested(column.type):
            values = [
                None if v is None else json.dumps(v, default=_json_value)
                for v in column.to_pylist()
            ]
            columns.append(pa.array(values, pa.string()))
        else:
            columns.append(column)
    return pa.table(columns, names=table.column_names)
