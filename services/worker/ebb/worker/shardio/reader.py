"""Reading one shard into Arrow tables, a chunk at a time.

A Parquet shard is whole row groups (the planner never cuts one: Parquet cannot read part of
one without decoding all of it), which may be far larger than a pipeline wants at once: its
rows are read a chunk at a time (`ShardReader`), as they go through the pipeline, so that a
shard's memory is bounded by its chunk size whatever its row groups' size, and every byte of
the input is read once. A text shard is a byte range sized by the planner: one chunk.

A row that cannot be decoded (a malformed CSV line, a JSONL line that is not JSON) is not
dropped: it stays in the table as a null row and is reported in `bad_rows`, so that it reaches
the output as an error row and the output keeps one row per input row.

A shard cut in pieces within a row group (the liquid tail's halves) is read by each worker once:
a worker that committed a part keeps its reader open where the part ended (`keep_from`,
`KeptReads`), and the piece it computes next from the same row group goes on from there
instead of decoding the group again from its start.

Each chunk is read from the store as one retried operation (`storage.retrying`): a throttled
or dropped read opens the file again where the last chunk ended; a permanent error fails the
shard with the store's message.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from ebb.common.data.csvrows import first_row_end
from ebb.common.data.storage import StoreError, retrying
from ebb.common.messaging.messages import ShardSpec

from .textrows import parse_csv, parse_jsonl


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


@dataclass
class _Tally:
    rows: int = 0


@dataclass
class KeptRead:
    """A Parquet shard's reader left open where the rows its worker committed ended: the
    batches from row `at` on (counted from the start of the shard's first row group), the
    rows it had read past that point first."""

    path: str
    row_groups: tuple[int, ...]
    columns: tuple[str, ...] | None
    at: int
    batches: Iterator[pa.RecordBatch]
    file: Any
    metadata: pq.FileMetaData
    tally: _Tally

    def serves(self, shard: ShardSpec, columns: list[str] | None) -> bool:
        """Does going on from here read less of `shard` than opening it anew? Yes when it is
        the same row groups' columns and starts at or after `at`, in the row group `at` is
        in (a new reader decodes that group from its start up to the shard's first row)."""
        if (
            shard.format != "parquet"
            or shard.path != self.path
            or tuple(shard.row_groups) != self.row_groups
            or (tuple(columns) if columns is not None else None) != self.columns
            or shard.row_offset < self.at
        ):
            return False
        group_start = 0
        for group in self.row_groups:
            rows = self.metadata.row_group(group).num_rows
            if shard.row_offset < group_start + rows:
                break
            group_start += rows
        return self.at >= group_start

    def close(self) -> None:
        self.file.close()


class KeptReads:
    """The one reader a worker keeps open between the pieces of a shard (`KeptRead`)."""

    def __init__(self) -> None:
        self._kept: KeptRead | None = None

    def put(self, kept: KeptRead | None) -> None:
        if kept is None:
            return
        if self._kept is not None:
            self._kept.close()
        self._kept = kept

    def take(self, shard: ShardSpec, columns: list[str] | None) -> KeptRead | None:
        """The kept reader if it serves `shard` (it is then the caller's), else None."""
        kept = self._kept
        if kept is None or not kept.serves(shard, columns):
            return None
        self._kept = None
        return kept

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
            self._kept = None


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
        kept: KeptRead | None = None,
    ) -> None:
        """`kept`: a reader left open by a part of the same row groups (`KeptReads.take`),
        to go on from."""
        self.shard = shard
        self.columns = columns
        self.column_types = column_types or {}
        self.newlines_in_values = newlines_in_values
        self.chunk_rows = max(1, chunk_rows)
        self.rows_read = 0
        """Rows of the shard handed out so far."""
        self._tally = _Tally()
        self._tally_base = 0
        self._given_at: int | None = None
        self._batches: Iterator[pa.RecordBatch] | None = None
        self._file: Any = None
        self._metadata: pq.FileMetaData | None = None
        self._pending: list[pa.RecordBatch] = []
        """Rows taken from `_batches` past the last chunk handed out."""
        self._handed: deque[tuple[int, pa.Table]] = deque(maxlen=2)
        """The last chunks handed out, by their first row: rows read but not committed go
        back into a kept reader. A worker computes two chunks at once
        (`attempt._CHUNKS_IN_FLIGHT`), so the rows it did not commit are in the last two."""
        self._kept = kept
        self._ended = False
        self._all_read = False

    def next(self) -> ShardData | None:
        """The next chunk of the shard's rows, or None once they have all been read."""
        if self._ended:
            return None
        shard = self.shard
        what = f"read shard {shard.index} of {shard.path}"
        try:
            if shard.format in ("parquet", "arrow"):
                table = retrying(what, self._next_batches, passthrough=(ShardReadError,))
                if table is None:
                    self._all_read = True
                    self._end()
                    return None
                self._handed.append((self.rows_read, table))
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
            data = ShardData(*parse_csv(header, chunk, self.column_types, self.newlines_in_values))
        else:
            data = ShardData(*parse_jsonl(chunk))
        if shard.row_offset:  # the remainder of a split shard: its part's rows are done
            data = _without_first(data, shard.row_offset)
        self.rows_read += data.table.num_rows
        return data

    @property
    def rows_decoded(self) -> int:
        """Rows this reader decoded from the file, those before the shard's first row
        included (a kept reader's, from where it was taken on)."""
        end = self._tally.rows if self._given_at is None else self._given_at
        return end - self._tally_base

    @property
    def exhausted(self) -> bool:
        """Every row of the shard has been handed out."""
        if self.shard.format in ("parquet", "arrow") and self.rows_read >= self.shard.rows:
            return True
        return self._all_read

    def close(self) -> None:
        self._end()

    def keep_from(self, row: int) -> KeptRead | None:
        """This Parquet reader, open, for the piece of the shard that starts at its row `row`
        (the first its worker did not commit): the rows read past it go first. None if it
        cannot go on from there (nothing open, or those rows no longer at hand). The reader
        lets go of its file: close it after, as always."""
        if self.shard.format != "parquet" or self._batches is None or self._ended:
            return None
        assert self._file is not None and self._metadata is not None
        back = [(start, table) for start, table in self._handed if start + table.num_rows > row]
        if (back[0][0] > row if back else row != self.rows_read) or row > self.rows_read:
            return None
        again = [b for start, t in back for b in t.slice(max(row - start, 0)).to_batches()]
        kept = KeptRead(
            path=self.shard.path,
            row_groups=tuple(self.shard.row_groups),
            columns=tuple(self.columns) if self.columns is not None else None,
            at=self.shard.row_offset + row,
            batches=itertools.chain(again, self._pending, self._batches),
            file=self._file,
            metadata=self._metadata,
            tally=self._tally,
        )
        self._given_at = self._tally.rows
        self._file, self._batches, self._pending = None, None, []
        return kept

    def _end(self) -> None:
        self._ended = True
        self._close_file()

    def _close_file(self) -> None:
        self._batches = None
        self._pending = []
        if self._kept is not None:
            self._kept.close()
            self._kept = None
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def _next_batches(self) -> pa.Table | None:
        """One chunk; on any error the file is closed, and the next try (`retrying`) opens it
        again and goes on from the rows already handed out."""
        try:
            if self._batches is None:
                if self.shard.format == "arrow":
                    self._open_arrow()
                else:
                    self._open_parquet()
            assert self._batches is not None
            want = min(self.chunk_rows, self.shard.rows - self.rows_read)
            batches: list[pa.RecordBatch] = []
            got = 0
            while got < want:
                batch = self._pending.pop(0) if self._pending else next(self._batches, None)
                if batch is None:
                    break
                if got + batch.num_rows > want:  # the rest stays for the next chunk
                    self._pending.insert(0, batch.slice(want - got))
                    batch = batch.slice(0, want - got)
                batches.append(batch)
                got += batch.num_rows
        except BaseException:
            self._close_file()
            raise
        if not batches:
            return None
        return pa.Table.from_batches(batches)

    def _open_parquet(self) -> None:
        """Open the file at the shard's row `rows_read`: whole row groups before it are not
        read at all; rows before it within a row group (a legacy shard's row_offset, or a
        retry mid-group) are read and dropped."""
        shard = self.shard
        skip = shard.row_offset + self.rows_read
        kept, self._kept = self._kept, None
        if kept is not None and kept.serves(replace(shard, row_offset=skip), self.columns):
            self._file, self._metadata = kept.file, kept.metadata
            self._tally, self._tally_base = kept.tally, kept.tally.rows
            self._batches = _dropping(kept.batches, skip - kept.at)
            return
        if kept is not None:
            kept.close()
        self._file = _open_input(shard.path)
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
        self._metadata = parquet.metadata
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
        self._batches = _dropping(self._decoded(batches), skip)

    def _decoded(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        tally = self._tally
        for batch in batches:
            tally.rows += batch.num_rows
            yield batch

    def _open_arrow(self) -> None:
        """A hand-off between tiers (ebb.worker.shardio.handoff): its Arrow IPC files in order, from
        the shard's row `rows_read` on; whole files before it are not opened."""
        skip = self.shard.row_offset + self.rows_read
        parts = list(self.shard.parts)
        while parts and parts[0].rows <= skip:
            skip -= parts.pop(0).rows
        self._batches = _dropping(_ipc_batches([p.path for p in parts], self.columns), skip)


def _open_input(path: str) -> Any:
    """A Parquet file, open for reading: a local one as Arrow's own file (read by Arrow's C++
    with no Python file object between: that layer copied every byte once more and cost as
    much CPU as a third of the decoding), another through fsspec. Not memory-mapped: a file
    truncated while it is read must be a read error, not a SIGBUS."""
    fs, inner = fsspec.core.url_to_fs(path)
    if isinstance(fs, LocalFileSystem):
        return pa.OSFile(inner, "rb")
    return fsspec.open(path, "rb").open()


def _ipc_batches(paths: list[str], columns: list[str] | None) -> Iterator[pa.RecordBatch]:
    """The record batches of Arrow IPC files, one file open at a time: a local one mapped
    (its buffers read in place), another read whole (a file is one chunk of a shard)."""
    for path in paths:
        fs, inner = fsspec.core.url_to_fs(path)
        if isinstance(fs, LocalFileSystem):
            source: Any = pa.memory_map(inner)
        else:
            source = pa.py_buffer(fs.cat_file(inner))
        with pa.ipc.open_file(source) as ipc:
            for i in range(ipc.num_record_batches):
                batch = ipc.get_batch(i)
                yield batch.select(columns) if columns is not None else batch


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
