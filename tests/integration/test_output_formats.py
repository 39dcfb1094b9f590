"""Output formats (Parquet, JSONL, CSV) and output files bounded by `max_rows_per_file`."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from ebb.common.data.output import OutputStore
from ebb.common.errors import SpecError
from ebb.common.job import parse_job
from ebb.worker.shardio.writer import ERROR_COLUMN, OutputFormat, write_attempt


def _table(rows: int) -> pa.Table:
    return pa.table(
        {
            "id": list(range(rows)),
            "name": [f'row {i}, "quoted"' for i in range(rows)],
            "scores": [[i, i + 0.5] for i in range(rows)],
            ERROR_COLUMN: [("bad row" if i % 4 == 1 else None) for i in range(rows)],
        }
    )


def _read(path: Path, fmt: str) -> list[dict[str, object]]:
    if fmt == "parquet":
        return pq.read_table(path).to_pylist()
    if fmt == "csv":
        table = pacsv.read_csv(
            path, convert_options=pacsv.ConvertOptions(column_types={"scores": pa.string()})
        )
        return [{**r, "scores": json.loads(r["scores"])} for r in table.to_pylist()]
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_a_shard_is_written_in_parts_of_at_most_max_rows(tmp_path: Path, fmt: OutputFormat) -> None:
    table = _table(10)
    store = OutputStore(str(tmp_path / "out"))
    files = write_attempt(
        store,
        table,
        shard=2,
        attempt=1,
        error_rows=3,
        fmt=fmt,
        max_rows_per_file=3,
    )
    assert [f.rows for f in files] == [3, 3, 3, 1]
    assert [f.error_rows for f in files] == [1, 1, 0, 1]  # rows 1, 5 and 9
    assert all(f.path.endswith(f".{fmt}") for f in files)
    back = [row for f in files for row in _read(tmp_path / "out" / f.path, fmt)]
    assert [r["id"] for r in back] == list(range(10))
    assert back[7]["name"] == 'row 7, "quoted"'
    assert back[7]["scores"] == [7, 7.5]
    assert back[5][ERROR_COLUMN] == "bad row" and back[6][ERROR_COLUMN] in (None, "")


def test_without_a_bound_a_shard_is_one_file(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path / "out"))
    files = write_attempt(store, _table(10), shard=0, attempt=1, error_rows=3)
    assert [(f.path, f.rows) for f in files] == [
        ("data/shard=00000/attempt=1/part-00000.parquet", 10)
    ]
    empty = write_attempt(store, _table(0), shard=1, attempt=1, error_rows=0, fmt="jsonl")
    assert [f.rows for f in empty] == [0]  # an empty shard still commits a (empty) file


def test_jsonl_output_writes_bytes_as_base64(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path / "out"))
    table = pa.table({"blob": [b"\x00\xff"], ERROR_COLUMN: pa.nulls(1, pa.string())})
    (f,) = write_attempt(store, table, shard=0, attempt=1, fmt="jsonl")
    assert json.loads((tmp_path / "out" / f.path).read_text())["blob"] == "AP8="


def test_output_format_and_bound_are_validated() -> None:
    base = {
        "name": "x",
        "input": {"uri": "/d/in.parquet"},
        "pipeline": {"stages": [{"modelet": "m:C"}]},
    }
    spec = parse_job({**base, "output": {"uri": "/o", "format": "csv", "max_rows_per_file": 5}})
    assert (spec.output.format, spec.output.max_rows_per_file) == ("csv", 5)
    with pytest.raises(SpecError, match="max_rows_per_file"):
        parse_job({**base, "output": {"uri": "/o", "max_rows_per_file": 0}})
    with pytest.raises(SpecError, match="format"):
        parse_job({**base, "output": {"uri": "/o", "format": "orc"}})
