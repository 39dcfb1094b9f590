"""Reading one shard into an Arrow table, and turning its rows into pipeline items.

A row that cannot be decoded (a malformed CSV line, a JSONL line that is not JSON) is not
dropped: it stays in the table as a null row and is reported in `bad_rows`, so that it reaches
the output as an error row and the output keeps one row per input row.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from ebb.common.messages import ShardSpec


class ShardReadError(Exception):
    """The shard cannot be read at all (missing file, corrupt Parquet footer or page)."""


@dataclass
class ShardData:
    table: pa.Table
    """One row per input row of the shard, in order."""
    bad_rows: dict[int, str] = field(default_factory=dict)
    """Rows that failed to decode: their index in `table` (where they are null) and why."""


def read_shard(shard: ShardSpec, columns: list[str] | None) -> ShardData:
    """Read a shard's rows; `columns` restricts Parquet reads (None: every column)."""
    try:
        if shard.format == "parquet":
            return ShardData(_read_parquet(shard, columns))
        with fsspec.open(shard.path, "rb") as f:
            header = f.readline() if shard.format == "csv" else b""
            f.seek(shard.byte_start)
            chunk = f.read(shard.byte_end - shard.byte_start)
    except (OSError, pa.ArrowException) as e:
        raise ShardReadError(f"cannot read shard {shard.index} of {shard.path}: {e}") from e
    if shard.format == "csv":
        return _parse_csv(header, chunk)
    return _parse_jsonl(chunk)


def _read_parquet(shard: ShardSpec, columns: list[str] | None) -> pa.Table:
    with fsspec.open(shard.path, "rb") as f:
        parquet = pq.ParquetFile(f)
        if columns is not None:
            present = set(parquet.schema_arrow.names)
            missing = [c for c in columns if c not in present]
            if missing:
                raise ShardReadError(f"{shard.path} has no column(s) {missing}")
        table = parquet.read_row_groups(shard.row_groups, columns=columns, use_threads=False)
    if shard.row_offset or table.num_rows != shard.rows:
        table = table.slice(shard.row_offset, shard.rows)
    return table


def _with_nulls(good: pa.Table, total: int, bad: dict[int, str]) -> pa.Table:
    """`good` rows spread over `total` positions, with null rows at the bad positions."""
    if not bad:
        return good
    indices: list[int | None] = []
    next_good = 0
    for i in range(total):
        if i in bad:
            indices.append(None)
        else:
            indices.append(next_good)
            next_good += 1
    return good.take(pa.array(indices, type=pa.int64()))


def _parse_csv(header: bytes, chunk: bytes) -> ShardData:
    rejected: list[tuple[int | None, str]] = []

    def on_invalid(row: pacsv.InvalidRow) -> Literal["skip", "error"]:
        rejected.append((row.number, f"malformed CSV row: {row.text[:200]!r}"))
        return "skip"

    lines = sum(1 for line in chunk.split(b"\n") if line.strip())
    parse = pacsv.ParseOptions(invalid_row_handler=on_invalid)
    read = pacsv.ReadOptions(use_threads=False)
    try:
        good = pacsv.read_csv(io.BytesIO(header + chunk), read_options=read, parse_options=parse)
    except pa.ArrowInvalid:
        # A value that breaks its column's inferred type: read this shard's columns as text
        # and let the pipeline fail only the rows it cannot convert.
        names = pacsv.read_csv(io.BytesIO(header)).column_names
        rejected.clear()
        good = pacsv.read_csv(
            io.BytesIO(header + chunk),
            read_options=read,
            parse_options=parse,
            convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string())),
        )
    # Row numbers count the header as row 1; positions count data lines from 0.
    bad = {number - 2: why for number, why in rejected if number is not None}
    return ShardData(_with_nulls(good, lines, bad), bad)


def _parse_jsonl(chunk: bytes) -> ShardData:
    lines = [line for line in chunk.split(b"\n") if line.strip()]
    try:
        table = pajson.read_json(io.BytesIO(b"\n".join(lines) + b"\n"))
        if table.num_rows == len(lines):
            return ShardData(table)
    except pa.ArrowInvalid:
        pass
    # Some line is not JSON, or not an object: parse line by line to find which.
    records: list[dict[str, Any]] = []
    bad: dict[int, str] = {}
    for i, line in enumerate(lines):
        try:
            value = json.loads(line)
        except ValueError as e:
            bad[i] = f"malformed JSON line ({e}): {line[:200]!r}"
            continue
        if not isinstance(value, dict):
            bad[i] = f"JSON line is not an object: {line[:200]!r}"
            continue
        records.append(value)
    good = pa.Table.from_pylist(records)
    return ShardData(_with_nulls(good, len(lines), bad), bad)


def table_rows(table: pa.Table | pa.RecordBatch, columns: list[str] | None) -> list[dict[str, Any]]:
    """Rows as maps of column -> value; numeric list columns become numpy arrays."""
    names = columns if columns is not None else table.schema.names
    values = [_column_values(table.column(name)) for name in names]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def _column_values(column: pa.ChunkedArray[Any] | pa.Array[Any]) -> list[Any]:
    array: Any = column
    if isinstance(column, pa.ChunkedArray):
        array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    kind = array.type
    if (
        pa.types.is_fixed_size_list(kind)
        and array.null_count == 0
        and (pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type))
    ):
        flat = array.flatten().to_numpy(zero_copy_only=False)
        matrix = flat.reshape(len(array), kind.list_size)
        return list(matrix)
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and (
        pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type)
    ):
        return [None if v is None else np.asarray(v) for v in array.to_pylist()]
    values: list[Any] = array.to_pylist()
    return values
