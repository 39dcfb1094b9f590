"""Reading shards (bad rows kept as error rows) and building outputs."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebb.common.job import OutputSpec
from ebb.common.messaging.messages import ShardSpec, rest_of
from ebb.worker.chunks.columns import VALUE, from_arrow, to_arrow
from ebb.worker.shardio.reader import KeptReads, ShardReader, ShardReadError, read_shard
from ebb.worker.shardio.writer import ERROR_COLUMN, OutputError, build_output, encode


def _text_shard(path: Path, fmt: str) -> ShardSpec:
    size = path.stat().st_size
    start = len(path.read_bytes().split(b"\n", 1)[0]) + 1 if fmt == "csv" else 0
    return ShardSpec(index=0, path=str(path), format=fmt, rows=0, byte_start=start, byte_end=size)  # type: ignore[arg-type]


def test_malformed_csv_rows_stay_in_place_as_error_rows(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("id,v\n1,a\n2,b,EXTRA\n3,c\n\n4\n5,e\n")
    data = read_shard(_text_shard(path, "csv"), None)
    assert data.table.num_rows == 5
    assert data.table.column("id").to_pylist() == [1, None, 3, None, 5]
    assert sorted(data.bad_rows) == [1, 3]
    assert "EXTRA" in data.bad_rows[1]


def test_a_value_that_breaks_type_inference_does_not_lose_the_shard(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("id,v\n1,2.5\n2,3.5\n3,oops\n")
    data = read_shard(_text_shard(path, "csv"), None)
    assert data.table.num_rows == 3
    assert data.table.column("v").to_pylist() == ["2.5", "3.5", "oops"]


def test_a_value_not_of_its_columns_type_fails_only_its_row(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("id,v,when\n1,2.5,2026-01-01\n2,oops,2026-01-02\n3,NA,\n4,4,2026-01-04\n")
    types = {"id": "int64", "v": "double", "when": "date32"}
    data = read_shard(_text_shard(path, "csv"), None, column_types=types)
    assert data.table.schema.types == [pa.int64(), pa.float64(), pa.date32()]
    assert data.table.column("id").to_pylist() == [1, 2, 3, 4]  # the row keeps its id
    assert data.table.column("v").to_pylist() == [2.5, None, None, 4.0]  # NA is a null
    assert data.bad_rows == {1: "column 'v': 'oops' is not double"}


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_the_remainder_of_a_split_text_shard_starts_where_its_part_ended(
    tmp_path: Path, fmt: str
) -> None:
    path = tmp_path / f"x.{fmt}"
    if fmt == "csv":
        path.write_text("id,v\n1,a\n2,b,EXTRA\n3,c\n4,d\n5,e\n")
    else:
        path.write_text('{"id": 1}\n{"id": 2\n{"id": 3}\n{"id": 4}\n{"id": 5}\n')
    shard = replace(_text_shard(path, fmt), rows=5)
    rest = rest_of(shard, 1, index=7)
    assert (rest.index, rest.rows, rest.row_offset) == (7, 4, 1)
    data = read_shard(rest, None)
    assert data.table.column("id").to_pylist() == [None, 3, 4, 5]
    assert list(data.bad_rows) == [0], "the bad row keeps its place, counted from the rest"
    again = read_shard(rest_of(rest, 2, index=8), None)
    assert again.table.column("id").to_pylist() == [4, 5] and not again.bad_rows


def test_the_remainder_of_a_split_parquet_shard_reads_from_the_row_after_its_part(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"id": list(range(1000))}), path, row_group_size=300)
    shard = ShardSpec(index=0, path=str(path), format="parquet", rows=1000, row_groups=[0, 1, 2, 3])
    rest = rest_of(shard, 650, index=1)
    assert read_shard(rest, None).table.column("id").to_pylist() == list(range(650, 1000))
    with pytest.raises(ValueError, match="one row or more"):
        rest_of(shard, 0, index=1)


def _ids(reader: ShardReader) -> list[int]:
    ids: list[int] = []
    while (data := reader.next()) is not None:
        ids += [int(i) for i in data.table.column("id").to_numpy()]
    reader.close()
    return ids


def test_a_worker_decodes_a_row_group_cut_in_pieces_once(tmp_path: Path) -> None:
    """The holder of a shard of one row group commits a part (2,000 rows; it had read 3,000)
    and keeps its reader; the rest is cut in two, the first half for another worker, the
    second kept for the holder. The holder reads on from where it was: it decodes each row of
    the group once in all, and the other worker the group up to its half's end, once."""
    path = tmp_path / "one.parquet"
    pq.write_table(pa.table({"id": np.arange(10_000), "x": np.ones(10_000)}), path)
    shard = ShardSpec(index=0, path=str(path), format="parquet", rows=10_000, row_groups=[0])
    holder = KeptReads()
    reader = ShardReader(shard, ["id"], chunk_rows=1_000)
    for _ in range(3):
        assert reader.next() is not None
    holder.put(reader.keep_from(2_000))
    decoded = reader.rows_decoded
    reader.close()
    assert decoded == 3_000
    rest = rest_of(shard, 2_000, index=1)
    first_half = replace(rest, index=2, rows=4_000)
    second_half = replace(rest, index=3, rows=4_000, row_offset=6_000)

    # What it does not serve stays kept: a piece that starts before it, other columns.
    assert holder.take(replace(shard, index=4, row_offset=1_000, rows=9_000), ["id"]) is None
    assert holder.take(second_half, None) is None

    other = ShardReader(first_half, ["id"], chunk_rows=1_000)
    assert _ids(other) == list(range(2_000, 6_000))
    assert other.rows_decoded == 6_000

    kept = holder.take(second_half, ["id"])
    assert kept is not None and holder.take(second_half, ["id"]) is None
    again = ShardReader(second_half, ["id"], chunk_rows=1_000, kept=kept)
    assert _ids(again) == list(range(6_000, 10_000))
    assert decoded + again.rows_decoded == 10_000


def test_a_part_keeps_no_reader_when_its_rows_are_no_longer_at_hand(tmp_path: Path) -> None:
    """Rows before the last two chunks read are gone from the reader: it cannot go on from
    there, and a fresh reader reads the piece."""
    path = tmp_path / "one.parquet"
    pq.write_table(pa.table({"id": np.arange(5_000)}), path)
    shard = ShardSpec(index=0, path=str(path), format="parquet", rows=5_000, row_groups=[0])
    reader = ShardReader(shard, None, chunk_rows=1_000)
    for _ in range(4):
        assert reader.next() is not None
    assert reader.keep_from(1_000) is None
    kept = reader.keep_from(2_500)
    reader.close()
    assert kept is not None and kept.at == 2_500
    rest = ShardReader(rest_of(shard, 2_500, index=1), None, chunk_rows=700, kept=kept)
    assert _ids(rest) == list(range(2_500, 5_000))


def test_malformed_jsonl_lines_become_error_rows(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"id": 1}\n{"id": 2\n[1, 2]\n{"id": 4}\n')
    data = read_shard(_text_shard(path, "jsonl"), None)
    assert data.table.column("id").to_pylist() == [1, None, None, 4]
    assert set(data.bad_rows) == {1, 2}
    assert "not an object" in data.bad_rows[2]


def test_text_that_is_not_utf8_fails_only_its_row(tmp_path: Path) -> None:
    csv = tmp_path / "x.csv"
    csv.write_bytes(b"id,name\n1,ok\n2,bad\xff\xfe\n3,fine\n")
    data = read_shard(_text_shard(csv, "csv"), None, column_types={"id": "int64", "name": "string"})
    assert data.table.column("id").to_pylist() == [1, 2, 3]  # the row stays findable
    assert data.table.column("name").to_pylist() == ["ok", None, "fine"]
    assert list(data.bad_rows) == [1] and "not UTF-8" in data.bad_rows[1]
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_bytes(b'{"id": 1, "t": "ok"}\n{"id": 2, "t": "bad\xff"}\n{"id": 3, "t": "x"}\n')
    data = read_shard(_text_shard(jsonl, "jsonl"), None)
    assert data.table.column("t").to_pylist() == ["ok", None, "x"]
    assert list(data.bad_rows) == [1] and "not UTF-8" in data.bad_rows[1]


def test_a_file_gone_since_planning_is_a_read_error(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("id\n1\n")
    shard = _text_shard(path, "csv")
    path.unlink()
    with pytest.raises(ShardReadError, match="cannot read shard"):
        read_shard(shard, None)


def test_unreadable_shard_raises(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    shard = ShardSpec(
        index=0, path=str(tmp_path / "x.parquet"), format="parquet", rows=1, row_groups=[0]
    )
    with pytest.raises(ShardReadError):
        read_shard(shard, None)


def test_arrow_columns_become_arrays_tensors_included() -> None:
    table = pa.table(
        {
            "id": [1, 2],
            "v": pa.FixedSizeListArray.from_arrays(pa.array([1.0, 2.0, 3.0, 4.0], pa.float32()), 2),
            "s": ["a", "b"],
        }
    )
    chunk = from_arrow(table, ["id", "v"])
    assert set(chunk) == {"id", "v"}
    assert chunk["id"].tolist() == [1, 2]
    assert chunk["v"].shape == (2, 2) and chunk["v"].dtype == np.float32
    np.testing.assert_array_equal(chunk["v"][1], np.array([3.0, 4.0], dtype=np.float32))
    assert from_arrow(table, ["s"])["s"].tolist() == ["a", "b"]


def test_output_has_one_row_per_input_with_errors_in_place() -> None:
    table = pa.table({"id": [10, 11, 12, 13], "extra": ["a", "b", "c", "d"]})
    results = {"label": np.array([1, 0, 0, 2]), "score": np.array([0.5, 0.0, 0.0, 0.9])}
    out, errors = build_output(
        table, results, {1: "boom", 2: "bad row"}, OutputSpec(uri="/o", carryover=["id"])
    )
    assert errors == 2
    assert out.column_names == ["id", "label", "score", ERROR_COLUMN]
    assert out.column("id").to_pylist() == [10, 11, 12, 13]
    assert out.column("label").to_pylist() == [1, None, None, 2]
    assert out.column(ERROR_COLUMN).to_pylist() == [None, "boom", "bad row", None]


def test_plain_results_fill_the_prediction_column() -> None:
    table = pa.table({"id": [1, 2]})
    out, errors = build_output(
        table, {VALUE: np.array(["x", "y"], dtype=object)}, {}, OutputSpec(uri="/o")
    )
    assert errors == 0
    assert out.column(OutputSpec(uri="/o").prediction_column).to_pylist() == ["x", "y"]
    assert out.column(ERROR_COLUMN).null_count == 2


def test_array_results_become_fixed_size_lists_with_nulls() -> None:
    column = to_arrow(
        np.array([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]], dtype=np.float32),
        np.array([False, True, False]),
    )
    assert column.type == pa.list_(pa.float32(), 2)
    assert column.to_pylist() == [[1.0, 2.0], None, [3.0, 4.0]]
    objects = np.array([np.float32(1.5), None], dtype=object)
    assert to_arrow(objects).to_pylist() == [1.5, None]
    images = to_arrow(np.zeros((2, 3, 4), dtype=np.uint8))
    assert images.type == pa.list_(pa.list_(pa.uint8(), 4), 3)


def test_result_clashing_with_carryover_is_an_error() -> None:
    table = pa.table({"label": [1]})
    with pytest.raises(OutputError, match="clashes"):
        build_output(table, {"label": np.array([2])}, {}, OutputSpec(uri="/o", carryover=["label"]))


def test_float_columns_are_written_without_a_dictionary_and_the_rest_with_one() -> None:
    """A model's floats hardly repeat: a dictionary for them costs CPU and bytes. Every other
    leaf keeps it, nested ones included, and every value reads back as written."""
    n = 1_000
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": np.arange(n),
            "score": rng.random(n, dtype=np.float32),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 4)), 4),
            "tags": pa.array([["a", "b"]] * n),
            "nested": pa.array([{"p": 1.5, "q": "x"}] * n),
            "weights": pa.array([[("k", 1.0)]] * n, type=pa.map_(pa.string(), pa.float64())),
            "label": pa.array(["cat", "dog"] * (n // 2)),
            ERROR_COLUMN: pa.nulls(n, pa.string()),
        }
    )
    data = encode(table, "parquet")
    meta = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
    dictionary = {
        meta.column(i).path_in_schema: meta.column(i).has_dictionary_page
        for i in range(meta.num_columns)
    }
    assert dictionary == {
        "id": True,
        "score": False,
        "embedding.list.element": False,
        "tags.list.element": True,
        "nested.p": False,
        "nested.q": True,
        "weights.key_value.key": True,
        "weights.key_value.value": False,
        "label": True,
        ERROR_COLUMN: True,
    }
    assert pq.read_table(io.BytesIO(data)).equals(table)
