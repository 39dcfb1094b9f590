"""Shard planning: split a dataset into shards of about `rows_per_shard` rows, from metadata.

Without `rows_per_shard` (the default), shards are sized for the fleet
(`ebb.shard_master.planning.sizing`).

- Parquet: from the footer's row-group sizes. Small row groups are packed together; a row group
  larger than a shard is a shard of its own, never cut into row ranges: Parquet cannot read part
  of a row group without decoding all of it, so every shard cut from one would read the whole
  group (what pyarrow, Spark and pandas write by default is up to a million rows a group: 100x
  the bytes for shards of 10,000 rows). The worker reads such a shard a chunk at a time, so its
  memory stays bounded; every byte of the input is read once.
- CSV / JSONL: by byte ranges aligned to line starts, sized from the average line length of a
  sample at the start of the file (as Hadoop and Spark split text). Only a few bytes around each
  cut are read. With `newlines_in_values` (quoted CSV values holding line breaks, Spark's
  multiLine) a line start need not be a row start: each file is then read once, tracking
  quotes, and cut where rows end.

Every file is listed and read through `storage.retrying`: a throttled or dropped read plans the
file again; a store's permanent error refuses the job with the store's message.

CSV columns get their types here, once for the whole job, from the rows at the start of every
file and just after every cut: a worker typing its own shard would type an all-integer shard of
a column int64 and the next shard of it double, and the output files would disagree.
"""

from __future__ import annotations

import io
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ebb.common.data.csvrows import row_ends
from ebb.common.data.storage import StoreError, retrying
from ebb.common.job import FORMAT_SUFFIXES, InputFormat, InputSpec
from ebb.common.messaging.messages import ShardSpec

from ..errors import MissingColumns, PlanningError
from .sizing import AUTO_MIN_ROWS, fleet_shard_rows, pack

_SAMPLE_BYTES = 256 * 1024
_WINDOW_BYTES = 64 * 1024
_CUT_SAMPLE_BYTES = 16 * 1024
"""Rows sampled just after each cut, for typing CSV columns."""
_SAMPLE_BUDGET = 8 * 1024 * 1024
"""All the sampled rows of a job together, at most."""
_GLOB_CHARS = set("*?[")


def list_input_files(uri: str, fmt: InputFormat) -> list[str]:
    """The files a URI names, sorted: one file, every file of the format under a folder, or a glob.

    Hidden and underscore-prefixed files (`_SUCCESS`, `.crc`, `_manifest.json`) are skipped.
    """
    fs, path = fsspec.core.url_to_fs(uri)

    def listing() -> list[str]:
        if _GLOB_CHARS & set(path):
            return [p for p in fs.glob(path) if fs.isfile(p)]
        if fs.isdir(path):
            return [p for p in fs.find(path) if FORMAT_SUFFIXES.get(_suffix(p)) == fmt]
        if fs.isfile(path):
            return [path]
        raise PlanningError(f"input {uri!r} does not exist")

    try:
        found = retrying(f"list {uri}", listing, passthrough=(PlanningError,))
    except StoreError as e:
        raise PlanningError(f"cannot {e}") from e
    found = [p for p in found if not posixpath.basename(p).startswith(("_", "."))]
    if not found:
        raise PlanningError(f"input {uri!r} holds no {fmt} files")
    return sorted(fs.unstrip_protocol(p) if not _is_local(fs) else p for p in found)


def _suffix(path: str) -> str:
    return posixpath.splitext(path)[1].lower()


def _estimate_text_rows(files: Sequence[str], fmt: InputFormat) -> int:
    """Rows in text files, estimated from their sizes and the lines of the first one's start."""

    def estimate() -> int:
        fs, _ = fsspec.core.url_to_fs(files[0])
        sizes = [int(fs.size(fsspec.core.url_to_fs(f)[1])) for f in files]
        with fsspec.open(files[0], "rb") as f:
            sample = f.read(_SAMPLE_BYTES)
        if fmt == "csv":
            sample = sample[sample.find(b"\n") + 1 :]  # not the header
        avg_line = max(1.0, len(sample) / max(1, sample.count(b"\n")))
        return int(sum(sizes) / avg_line)

    try:
        return retrying(f"size up {files[0]}", estimate)
    except StoreError as e:
        raise PlanningError(f"cannot {e}") from e


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


@dataclass
class Plan:
    shards: list[ShardSpec]
    column_types: dict[str, str] = field(default_factory=dict)
    """CSV: every column's Arrow type (the spec's own, and those typed from samples)."""


def plan_input(
    spec: InputSpec,
    *,
    required_columns: Sequence[str] = (),
    workers: int = 1,
    least_rows: int = AUTO_MIN_ROWS,
) -> Plan:
    """Every shard of the input, numbered from 0 in file order, and the CSV column types.

    required_columns: columns every Parquet file must have (checked in each footer), so that a
    misspelt column is refused at submission rather than failing every shard later.
    workers: the most the job runs at once, for shards sized for the fleet (no
    `rows_per_shard` given), of at least `least_rows` rows (`sizing.least_rows`).
    """
    shards: list[ShardSpec] = []
    samples = _Samples()
    files = list_input_files(spec.uri, spec.fmt)
    rows_per_shard = spec.rows_per_shard
    if rows_per_shard is None and spec.fmt == "parquet":
        rows_per_shard = 1  # a row group each, packed below
    elif rows_per_shard is None:
        rows_per_shard = fleet_shard_rows(
            _estimate_text_rows(files, spec.fmt), workers, least=least_rows
        )
    for path in files:

        def plan_file(path: str = path) -> list[ShardSpec]:
            mark = samples.mark()
            try:
                if spec.fmt == "parquet":
                    return list(_plan_parquet(path, rows_per_shard, required_columns))
                if spec.newlines_in_values:
                    return list(_plan_csv_rows(path, rows_per_shard, samples))
                return list(_plan_text(path, spec.fmt, rows_per_shard, samples))
            except BaseException:
                samples.reset(mark)  # the file is planned again from its start, or not at all
                raise

        try:
            pieces = retrying(f"plan {path}", plan_file, passthrough=(PlanningError,))
        except StoreError as e:
            raise PlanningError(f"cannot {e}") from e
        shards += [replace(piece, index=len(shards) + i) for i, piece in enumerate(pieces)]
    if not shards:
        raise PlanningError(f"input {spec.uri!r} holds no rows")
    if spec.rows_per_shard is None and spec.fmt == "parquet":
        target = fleet_shard_rows(sum(s.rows for s in shards), workers, least=least_rows)
        shards = [replace(s, index=i) for i, s in enumerate(pack(shards, target))]
    types = samples.column_types(spec) if spec.fmt == "csv" else {}
    return Plan(shards, types)


def plan_shards(
    spec: InputSpec, *, required_columns: Sequence[str] = (), workers: int = 1
) -> list[ShardSpec]:
    return plan_input(spec, required_columns=required_columns, workers=workers).shards


class _Samples:
    """Whole CSV rows from across the input, under the first file's header."""

    def __init__(self) -> None:
        self.header: bytes | None = None
        self.rows: list[bytes] = []
        self.size = 0

    def mark(self) -> tuple[bytes | None, int, int]:
        return self.header, len(self.rows), self.size

    def reset(self, mark: tuple[bytes | None, int, int]) -> None:
        self.header, kept, self.size = mark
        del self.rows[kept:]

    def start_file(self, header: bytes) -> bool:
        """Take samples from a file with this header? (Only from files shaped like the first.)"""
        if self.header is None:
            self.header = header
        return header == self.header

    def add(self, rows: bytes) -> None:
        if rows and self.size < _SAMPLE_BUDGET:
            self.rows.append(rows if rows.endswith(b"\n") else rows + b"\n")
            self.size += len(rows)

    def column_types(self, spec: InputSpec) -> dict[str, str]:
        if self.header is None:
            return dict(spec.column_types)
        data = self.header + b"".join(self.rows)
        # A column whose type the spec gives is not typed here: a value in it that does not
        # fit becomes an error row when its shard is read, it does not refuse the job.
        given = dict.fromkeys(spec.column_types, pa.string())
        try:
            table = pacsv.read_csv(
                io.BytesIO(data),
                # One block: the types must fit every sampled row, not the first block's.
                read_options=pacsv.ReadOptions(use_threads=False, block_size=len(data) + 1),
                parse_options=pacsv.ParseOptions(
                    newlines_in_values=spec.newlines_in_values,
                    invalid_row_handler=lambda row: "skip",  # its shard will say so
                ),
                convert_options=pacsv.ConvertOptions(column_types=given),
            )
        except pa.ArrowInvalid as e:
            raise PlanningError(f"cannot read the CSV header and sampled rows: {e}") from e
        types = {}
        for column in table.schema:
            if column.name in spec.column_types:
                types[column.name] = spec.column_types[column.name]
            elif pa.types.is_null(column.type):  # empty in every sample: text is the safe guess
                types[column.name] = "string"
            else:
                types[column.name] = str(column.type)
        return types


def _plan_parquet(
    path: str, rows_per_shard: int, required_columns: Sequence[str]
) -> Iterator[ShardSpec]:
    try:
        with fsspec.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            metadata = parquet.metadata
            names = set(parquet.schema_arrow.names)
    except pa.ArrowInvalid as e:  # a corrupt footer; the store's own errors are retried
        raise PlanningError(f"cannot read Parquet metadata of {path}: {e}") from e
    missing = [c for c in required_columns if c not in names]
    if missing:
        raise MissingColumns(path, missing, sorted(names))
    pending: list[int] = []
    pending_rows = 0

    def flush() -> ShardSpec:
        return ShardSpec(
            index=0, path=path, format="parquet", rows=pending_rows, row_groups=list(pending)
        )

    for rg in range(metadata.num_row_groups):
        n = metadata.row_group(rg).num_rows
        if n == 0:
            continue
        if n > rows_per_shard:
            if pending:
                yield flush()
                pending, pending_rows = [], 0
            yield ShardSpec(index=0, path=path, format="parquet", rows=n, row_groups=[rg])
            continue
        if pending and pending_rows + n > rows_per_shard:
            yield flush()
            pending, pending_rows = [], 0
        pending.append(rg)
        pending_rows += n
    if pending:
        yield flush()


def _plan_text(
    path: str, fmt: InputFormat, rows_per_shard: int, samples: _Samples
) -> Iterator[ShardSpec]:
    fs, fpath = fsspec.core.url_to_fs(path)
    size = int(fs.size(fpath))
    if size == 0:
        return
    with fs.open(fpath, "rb") as f:
        sample = f.read(min(size, _SAMPLE_BYTES))
        start = 0
        sampling = False
        if fmt == "csv":
            header_end = sample.find(b"\n")
            if header_end < 0:
                return  # a header and no rows
            start = header_end + 1
            sampling = samples.start_file(sample[:start])
        body = sample[start:]
        if sampling:
            samples.add(body[: body.rfind(b"\n") + 1] if len(sample) < size else body)
        lines = body.count(b"\n") or 1
        avg_line = max(1.0, len(body) / lines)
        target = max(1, int(avg_line * rows_per_shard))
        while start < size:
            cut = start + target
            if cut >= size:
                end = size
            else:
                end, after = _next_line_start(f, cut, size)
                if sampling:
                    after = after[:_CUT_SAMPLE_BYTES]
                    samples.add(after[: after.rfind(b"\n") + 1])
            yield ShardSpec(
                index=0,
                path=path,
                format=fmt,
                rows=max(1, round((end - start) / avg_line)),
                byte_start=start,
                byte_end=end,
            )
            start = end


def _next_line_start(f: Any, offset: int, size: int) -> tuple[int, bytes]:
    """The offset just after the first newline at or after `offset` (or the file's end), and
    what was read after it."""
    position = offset
    while position < size:
        f.seek(position)
        window: bytes = f.read(_WINDOW_BYTES)
        if not window:
            break
        newline = window.find(b"\n")
        if newline >= 0:
            return position + newline + 1, window[newline + 1 :]
        position += len(window)
    return size, b""


def _whole_rows(data: bytes, *, complete: bool) -> bytes:
    """`data` (which starts at a row start) up to its last row end; all of it if `complete`."""
    if complete:
        return data
    ends = np.concatenate([np.zeros(1, np.int64), *row_ends(io.BytesIO(data))])
    return data[: int(ends[-1])]


def _plan_csv_rows(path: str, rows_per_shard: int, samples: _Samples) -> Iterator[ShardSpec]:
    """A CSV file whose quoted values may hold line breaks: read once, cut after every
    `rows_per_shard` rows (exact counts, blank lines included)."""
    fs, fpath = fsspec.core.url_to_fs(path)
    size = int(fs.size(fpath))
    if size == 0:
        return
    cuts: list[tuple[int, int, int]] = []
    with fs.open(fpath, "rb") as f:
        start = last = -1  # the header's end, once found
        rows = 0  # whole rows since `start`
        for block_ends in row_ends(f):
            ends = block_ends
            if start < 0 and len(ends):
                start = last = int(ends[0])
                ends = ends[1:]
            while rows + len(ends) >= rows_per_shard:
                end = int(ends[rows_per_shard - rows - 1])
                cuts.append((start, end, rows_per_shard))
                ends = ends[rows_per_shard - rows :]
                start, rows = end, 0
            if len(ends):
                rows, last = rows + len(ends), int(ends[-1])
        if 0 <= start < size:  # the rest, and a last row without a final line break
            cuts.append((start, size, rows + (last < size)))
        if not cuts:
            return
        f.seek(0)
        if samples.start_file(f.read(cuts[0][0])):
            # The first rows of the file and of every shard.
            for first, end, _ in cuts:
                f.seek(first)
                limit = _CUT_SAMPLE_BYTES if first > cuts[0][0] else _SAMPLE_BYTES
                complete = end - first <= limit
                samples.add(_whole_rows(f.read(min(end - first, limit)), complete=complete))
    for start, end, rows in cuts:
        yield ShardSpec(index=0, path=path, format="csv", rows=rows, byte_start=start, byte_end=end)
