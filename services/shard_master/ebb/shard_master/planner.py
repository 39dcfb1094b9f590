"""Shard planning: split a dataset into shards of about `rows_per_shard` rows, from metadata.

- Parquet: from the footer's row-group sizes. Small row groups are packed together; a row group
  larger than a shard is split into row ranges.
- CSV / JSONL: by byte ranges aligned to line starts, sized from the average line length of a
  sample at the start of the file (as Hadoop and Spark split text). Only a few bytes around each
  cut are read. CSV fields must not contain line breaks (Spark's default, multiLine=false).
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import fsspec
import pyarrow.parquet as pq

from ebb.common.messages import ShardSpec
from ebb.common.spec import FORMAT_SUFFIXES, InputFormat, InputSpec

from .errors import PlanningError

_SAMPLE_BYTES = 256 * 1024
_WINDOW_BYTES = 64 * 1024
_GLOB_CHARS = set("*?[")


def list_input_files(uri: str, fmt: InputFormat) -> list[str]:
    """The files a URI names, sorted: one file, every file of the format under a folder, or a glob.

    Hidden and underscore-prefixed files (`_SUCCESS`, `.crc`, `_manifest.json`) are skipped.
    """
    fs, path = fsspec.core.url_to_fs(uri)
    if _GLOB_CHARS & set(path):
        found = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        found = [p for p in fs.find(path) if FORMAT_SUFFIXES.get(_suffix(p)) == fmt]
    elif fs.isfile(path):
        found = [path]
    else:
        raise PlanningError(f"input {uri!r} does not exist")
    found = [p for p in found if not posixpath.basename(p).startswith(("_", "."))]
    if not found:
        raise PlanningError(f"input {uri!r} holds no {fmt} files")
    return sorted(fs.unstrip_protocol(p) if not _is_local(fs) else p for p in found)


def _suffix(path: str) -> str:
    return posixpath.splitext(path)[1].lower()


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def plan_shards(spec: InputSpec, *, required_columns: Sequence[str] = ()) -> list[ShardSpec]:
    """Every shard of the input, numbered from 0 in file order.

    required_columns: columns every Parquet file must have (checked in each footer), so that a
    misspelt column is refused at submission rather than failing every shard later.
    """
    shards: list[ShardSpec] = []
    for path in list_input_files(spec.uri, spec.fmt):
        if spec.fmt == "parquet":
            pieces = _plan_parquet(path, spec.rows_per_shard, required_columns)
        else:
            pieces = _plan_text(path, spec.fmt, spec.rows_per_shard)
        shards += [replace(piece, index=len(shards) + i) for i, piece in enumerate(pieces)]
    if not shards:
        raise PlanningError(f"input {spec.uri!r} holds no rows")
    return shards


def _plan_parquet(
    path: str, rows_per_shard: int, required_columns: Sequence[str]
) -> Iterator[ShardSpec]:
    try:
        with fsspec.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            metadata = parquet.metadata
            names = set(parquet.schema_arrow.names)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... on a corrupt footer
        raise PlanningError(f"cannot read Parquet metadata of {path}: {e}") from e
    missing = [c for c in required_columns if c not in names]
    if missing:
        raise PlanningError(f"{path} has no column(s) {missing}; it has {sorted(names)}")
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
            for k in range(math.ceil(n / rows_per_shard)):
                offset = k * rows_per_shard
                yield ShardSpec(
                    index=0,
                    path=path,
                    format="parquet",
                    rows=min(rows_per_shard, n - offset),
                    row_groups=[rg],
                    row_offset=offset,
                )
            continue
        if pending and pending_rows + n > rows_per_shard:
            yield flush()
            pending, pending_rows = [], 0
        pending.append(rg)
        pending_rows += n
    if pending:
        yield flush()


def _plan_text(path: str, fmt: InputFormat, rows_per_shard: int) -> Iterator[ShardSpec]:
    fs, fpath = fsspec.core.url_to_fs(path)
    size = int(fs.size(fpath))
    if size == 0:
        return
    with fs.open(fpath, "rb") as f:
        sample = f.read(min(size, _SAMPLE_BYTES))
        start = 0
        if fmt == "csv":
            header_end = sample.find(b"\n")
            if header_end < 0:
                return  # a header and no rows
            start = header_end + 1
        body = sample[start:]
        lines = body.count(b"\n") or 1
        avg_line = max(1.0, len(body) / lines)
        target = max(1, int(avg_line * rows_per_shard))
        while start < size:
            cut = start + target
            end = size if cut >= size else _next_line_start(f, cut, size)
            yield ShardSpec(
                index=0,
                path=path,
                format=fmt,
                rows=max(1, round((end - start) / avg_line)),
                byte_start=start,
                byte_end=end,
            )
            start = end


def _next_line_start(f: Any, offset: int, size: int) -> int:
    """The offset just after the first newline at or after `offset` (or the file's end)."""
    position = offset
    while position < size:
        f.seek(position)
        window: bytes = f.read(_WINDOW_BYTES)
        if not window:
            break
        newline = window.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(window)
    return size
