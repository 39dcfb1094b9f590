"""Reading one shard into Arrow tables, a chunk at a time.

A Parquet shard is whole row groups (the planner never cuts one: Parquet cannot read part of
one without decoding all of it), which may be far larger than a pipeline wants at once: its
rows are read a chunk at a time (`ShardReader`), as they go through the pipeline, so that a
shard's memory is bounded by its chunk size whatever its row groups' size, and every byte of
the input is read once. A text shard is a byte range sized by the planner: one chunk.

A row that cannot be decoded (a malformed CSV line, a JSONL line that is not JSON) is not
dropped: it stays in the table as a null row and is reported in `bad_rows`, so that it reaches
the output as an error row and the output keeps one row per input row.

Each chunk is read from the store as one retried operation (`storage.retrying`): a throttled
or dropped read opens the file again where the last chunk ended; a permanent error fails the
shard with the store's message.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from ebb.common.csvrows import first_row_end
from ebb.common.messages import ShardSpec
from ebb.common.spec import arrow_type
from ebb.common.storage import StoreError, retrying


class ShardReadError(Exception):
    """The shard cannot be read at all (missing file, corrupt Parquet footer or page)."""


@dataclass
class ShardData:
    table: pa.Table
    """One row per input row of the shard, in order."""
    bad_rows: dict[int, str] = field(default_factory=dict)
    """Rows that failed to decode: their index in `table` (where they are null) and why."""


CHUNK_ROWS = 65_536
"""Rows of a Parquet shard read at once, by default."""
_READ_BUFFER = 1 << 20


class ShardReader:
    """A shard's rows in order, a chunk of at most `chunk_rows` at a time (`next`, blocking:
    call it from a thread). `columns` restricts Parquet reads (None: every column).

    CSV: `column_types` types the columns it names (the job's, fixed when it was planned);
    `newlines_in_values` lets quoted values hold line breaks. Not thread-safe: one `next` at a
    time."""

    def __init__(
        self,
        shard: ShardSpec,
        columns: list[str] | None,
        *,
        column_types: Mapping[str, str] | None = None,
        newlines_in_values: bool = False,
        chunk_rows: int = CHUNK_ROWS,
    ) -> None:
        self.shard = shard
        self.columns = columns
        self.column_types = column_types or {}
        self.newlines_in_values = newlines_in_values
        self.chunk_rows = max(1, chunk_rows)
        self.rows_read = 0
        """Rows of the shard handed out so far."""
        self._batches: Iterator[pa.RecordBatch] | None = None
        self._file: Any = None
        self._ended = False
        self._all_read = False

    def next(self) -> ShardData | None:
        """The next chunk of the shard's rows, or None once they have all been read."""
        if self._ended:
            return None
        shard = self.shard
        what = f"read shard {shard.index} of {shard.path}"
        try:
            if shard.format == "parquet":
                table = retrying(what, self._next_parquet, passthrough=(ShardReadError,))
                if table is None:
                    self._all_read = True
                    self._end()
                    return None
                self.rows_read += table.num_rows
                return ShardData(table)
            header, chunk = retrying(what, lambda: _read_bytes(shard, self.newlines_in_values))
        except ShardReadError:
            self._end()
            raise
        except StoreError as e:
            self._end()
            raise ShardReadError(f"cannot {e}") from e
        except (OSError, pa.ArrowException) as e:
            self._end()
            raise ShardReadError(f"cannot read shard {shard.index} of {shard.path}: {e}") from e
        self._ended = self._all_read = True  # a text shard is one chunk
        if shard.format == "csv":
            data = _parse_csv(header, chunk, self.column_types, self.newlines_in_values)
        else:
            data = _parse_jsonl(chunk)
        if shard.row_offset:  # the remainder of a split shard: its part's rows are done
            data = _without_first(data, shard.row_offset)
        self.rows_read += data.table.num_rows
        return data

    @property
    def exhausted(self) -> bool:
        """Every row of the shard has been handed out."""
        if self.shard.format == "parquet" and self.rows_read >= self.shard.rows:
            return True
        return self._all_read

    def close(self) -> None:
        self._end()

    def _end(self) -> None:
        self._ended = True
        self._close_file()

    def _close_file(self) -> None:
        self._batches = None
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def _next_parquet(self) -> pa.Table | None:
        """One chunk; on any error the file is closed, and the next try (`retrying`) opens it
        again and goes on from the rows already handed out."""
        try:
            if self._batches is None:
                self._open_parquet()
            assert self._batches is not None
            left = self.shard.rows - self.rows_read
            batches: list[pa.RecordBatch] = []
            got = 0
            while got < min(self.chunk_rows, left):
                batch = next(self._batches, None)
                if batch is None:
                    break
                batches.append(batch)
                got += batch.num_rows
        except BaseException:
            self._close_file()
            raise
        if not batches:
            return None
        return pa.Table.from_batches(batches).slice(0, min(got, left))

    def _open_parquet(self) -> None:
        """Open the file at the shard's row `rows_read`: whole row groups before it are not
        read at all; rows before it within a row group (a legacy shard's row_offset, or a
        retry mid-group) are read and dropped."""
        shard = self.shard
        self._file = fsspec.open(shard.path, "rb").open()
        # A shard larger than a chunk is read buffered and not pre-buffered: pages as they
        # are decoded, not every column chunk of its row groups at once (a group of a million
        # rows would be whole in memory), so the peak is the same whatever the group's size.
        # One that fits in a chunk is pre-buffered: a few large reads, as object stores like.
        streamed = shard.rows > self.chunk_rows
        parquet = pq.ParquetFile(
            self._file, buffer_size=_READ_BUFFER if streamed else 0, pre_buffer=not streamed
        )
        if self.columns is not None:
            present = set(parquet.schema_arrow.names)
            missing = [c for c in self.columns if c not in present]
            if missing:
                raise ShardReadError(f"{shard.path} has no column(s) {missing}")
        skip = shard.row_offset + self.rows_read
        groups = list(shard.row_groups)
        while groups and parquet.metadata.row_group(groups[0]).num_rows <= skip:
            skip -= parquet.metadata.row_group(groups[0]).num_rows
            groups.pop(0)
        batches = parquet.iter_batches(
            batch_size=min(self.chunk_rows, 65_536),
            row_groups=groups,
            columns=self.columns,
            use_threads=False,
        )
        self._batches = _dropping(batches, skip)


def _without_first(data: ShardData, rows: int) -> ShardData:
    """`data` without its first `rows` rows."""
    bad = {i - rows: why for i, why in data.bad_rows.items() if i >= rows}
    return ShardData(data.table.slice(min(rows, data.table.num_rows)), bad)


def _dropping(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """`batches` without their first `rows` rows."""
    for batch in batches:
        if rows >= batch.num_rows:
            rows -= batch.num_rows
            continue
        yield batch.slice(rows) if rows else batch
        rows = 0


def read_shard(
    shard: ShardSpec,
    columns: list[str] | None,
    *,
    column_types: Mapping[str, str] | None = None,
    newlines_in_values: bool = False,
) -> ShardData:
    """A whole shard at once (every chunk of a `ShardReader`, concatenated): for tools and
    tests; the worker reads a chunk at a time."""
    reader = ShardReader(
        shard,
        columns,
        column_types=column_types,
        newlines_in_values=newlines_in_values,
        chunk_rows=max(shard.rows, 1),
    )
    try:
        parts: list[ShardData] = []
        while (data := reader.next()) is not None:
            parts.append(data)
    finally:
        reader.close()
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return ShardData(pa.table({c: [] for c in (columns or [])}))
    offset, bad = 0, {}
    for part in parts:
        bad.update({offset + i: why for i, why in part.bad_rows.items()})
        offset += part.table.num_rows
    return ShardData(pa.concat_tables([p.table for p in parts]), bad)


def _read_bytes(shard: ShardSpec, newlines_in_values: bool) -> tuple[bytes, bytes]:
    """The CSV header (empty for JSONL) and the shard's byte range."""
    with fsspec.open(shard.path, "rb") as f:
        header = _read_header(f, newlines_in_values) if shard.format == "csv" else b""
        f.seek(shard.byte_start)
        chunk = bytes(f.read(shard.byte_end - shard.byte_start))
    return header, chunk


def _read_header(f: Any, newlines_in_values: bool) -> bytes:
    """The file's first row (its header), line break included."""
    if not newlines_in_values:
        return bytes(f.readline())
    end = first_row_end(f)
    f.seek(0)
    return bytes(f.read() if end is None else f.read(end))


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


def _parse_csv(
    header: bytes, chunk: bytes, column_types: Mapping[str, str], newlines_in_values: bool
) -> ShardData:
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
    return ShardData(_with_nulls(good, total, malformed), bad)


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


def _parse_jsonl(chunk: bytes) -> ShardData:
    lines = [line for line in chunk.split(b"\n") if line.strip()]
    try:
        table = pajson.read_json(io.BytesIO(b"\n".join(lines) + b"\n"))
        if table.num_rows == len(lines):
            table, bad_text = _valid_text(table)
            return ShardData(table, bad_text)
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
