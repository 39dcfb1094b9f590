"""Decoding a text shard's bytes (CSV, JSONL) into an Arrow table, one row per input row.

A row that cannot be decoded (a malformed CSV line, a JSONL line that is not JSON, a value not
of its column's type, text that is not UTF-8) stays in the table as a null row, or keeps its
other values, and is returned among the failed rows with the reason: it reaches the output as
an error row, and the output keeps one row per input row.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson

from ebb.common.job import arrow_type


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


def parse_csv(
    header: bytes, chunk: bytes, column_types: Mapping[str, str], newlines_in_values: bool
) -> tuple[pa.Table, dict[int, str]]:
    """The rows of a CSV byte range (under `header`), and the rows that failed, with why."""
    rejected: list[tuple[int | None, str]] = []

    def on_invalid(row: pacsv.InvalidRow) -> Literal["skip", "error"]:
        rejected.append((row.number, f"malformed CSV row: {row.text[:200]!r}"))
        return "skip"

    types = {name: arrow_type(t) for name, t in column_types.items()}
    parse = pacsv.ParseOptions(
        newlines_in_values=newlines_in_values, invalid_row_handler=on_invalid
    )
    read = pacsv.ReadOptions(use_threads=False)
    try:
        good = pacsv.read_csv(
            io.BytesIO(header + chunk),
            read_options=read,
            parse_options=parse,
            convert_options=pacsv.ConvertOptions(column_types=types),
        )
        text = False
    except pa.ArrowInvalid:
        # A value that is not of its column's type: read every column as text, then type
        # each column value by value, so that only the rows holding such values fail.
        names = pacsv.read_csv(io.BytesIO(header), parse_options=parse).column_names
        rejected.clear()
        good = pacsv.read_csv(
            io.BytesIO(header + chunk),
            read_options=read,
            parse_options=parse,
            # Bytes, not text: a value that is not UTF-8 must fail its row, not the read.
            convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(names, pa.binary())),
        )
        text = True
    # Row numbers count the header as row 1; positions count rows from 0.
    malformed = {number - 2: why for number, why in rejected if number is not None}
    total = good.num_rows + len(malformed)
    bad = dict(malformed)
    if text:
        good, unfit = _typed(good, types)
        if unfit:
            positions = [p for p in range(total) if p not in malformed]
            bad.update((positions[i], why) for i, why in unfit.items())
    return _with_nulls(good, total, malformed), bad


_NULL_VALUES = pa.array(list(pacsv.ConvertOptions().null_values or []), pa.string())


def _as_text(name: str, column: Any, unfit: dict[int, str]) -> Any:
    """A column of bytes as text; a value that is not UTF-8 becomes null, and its row is
    noted in `unfit` with the reason."""
    if column.type == pa.string():
        return column
    try:
        return pc.cast(column, pa.string())
    except pa.ArrowInvalid:
        values = column.to_pylist()
        for i, value in enumerate(values):
            try:
                values[i] = None if value is None else value.decode()
            except UnicodeDecodeError:
                unfit.setdefault(i, f"column {name!r}: {value[:200]!r} is not UTF-8 text")
                values[i] = None
        return pa.array(values, pa.string())


def _valid_text(table: pa.Table) -> tuple[pa.Table, dict[int, str]]:
    """`table` with every string value that is not UTF-8 made null (the JSON reader takes
    such bytes as they are), and the rows that held one, with the reason."""
    bad: dict[int, str] = {}
    for k, name in enumerate(table.column_names):
        column = table.column(name)
        if column.type != pa.string():
            continue
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:
            fixed = _as_text(name, pc.cast(column, pa.binary()), bad)
            table = table.set_column(k, name, fixed)
    return table, bad


def _typed(table: pa.Table, types: Mapping[str, pa.DataType]) -> tuple[pa.Table, dict[int, str]]:
    """A table of text (or bytes) columns cast to `types`, a value that does not fit its type
    (or is not UTF-8) made null, and the indices of the rows that held one, with the reason.
    (Such a row keeps its other values, carryover columns included: it stays findable in the
    output.)"""
    unfit: dict[int, str] = {}
    columns: list[pa.Array[Any] | pa.ChunkedArray[Any]] = []
    for name in table.column_names:
        column: Any = _as_text(name, table.column(name), unfit)
        target = types.get(name)
        if target is not None and target != pa.string():
            # What the CSV reader takes for null in a typed column ("", "NA", "null", ...).
            missing = pc.is_in(column, value_set=_NULL_VALUES)
            column = pc.if_else(missing, pa.scalar(None, pa.string()), column)
            try:
                column = pc.cast(column, target)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                values = column.to_pylist()
                for i, value in enumerate(values):
                    try:
                        pc.cast(pa.array([value], pa.string()), target)
                    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                        unfit.setdefault(i, f"column {name!r}: {value!r} is not {target}")
                        values[i] = None
                column = pc.cast(pa.array(values, pa.string()), target)
        columns.append(column)
    return pa.table(columns, names=table.column_names), unfit


def parse_jsonl(chunk: bytes) -> tuple[pa.Table, dict[int, str]]:
    """The rows of a JSONL byte range, and the rows that failed, with why."""
    lines = [line for line in chunk.split(b"\n") if line.strip()]
    try:
        table = pajson.read_json(io.BytesIO(b"\n".join(lines) + b"\n"))
        if table.num_rows == len(lines):
            return _valid_text(table)
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
    return _with_nulls(good, len(lines), bad), bad
