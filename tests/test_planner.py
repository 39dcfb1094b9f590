"""Shard planning reads metadata only and covers every row exactly once."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebb.common.spec import InputSpec
from ebb.shard_master.errors import PlanningError
from ebb.shard_master.planner import list_input_files, plan_input, plan_shards
from ebb.worker.reader import read_shard


def _ids_of_all_shards(spec: InputSpec) -> list[int | None]:
    ids: list[int | None] = []
    for shard in plan_shards(spec):
        data = read_shard(shard, None)
        assert data.table.num_rows == shard.rows or shard.format != "parquet"
        ids += data.table.column("id").to_pylist()
    return ids


def test_parquet_packs_small_row_groups_and_splits_big_ones(tmp_path: Path) -> None:
    table = pa.table({"id": list(range(10_000))})
    pq.write_table(table.slice(0, 3_000), tmp_path / "a.parquet", row_group_size=500)
    pq.write_table(table.slice(3_000), tmp_path / "b.parquet", row_group_size=7_000)
    spec = InputSpec(uri=str(tmp_path), format="parquet", rows_per_shard=2_000)
    shards = plan_shards(spec)
    # a: 6 groups of 500 -> 2000 + 1000; b: one group of 7000 -> 2000, 2000, 2000, 1000
    assert [s.rows for s in shards] == [2000, 1000, 2000, 2000, 2000, 1000]
    assert [s.index for s in shards] == list(range(6))
    assert shards[2].row_groups == [0] and shards[3].row_offset == 2000
    assert _ids_of_all_shards(spec) == list(range(10_000))


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_text_formats_split_on_line_boundaries(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"rows.{fmt}"
    if fmt == "csv":
        path.write_text("id,name\n" + "".join(f"{i},name-{i * 7}\n" for i in range(5_003)))
    else:
        path.write_text(
            "".join(json.dumps({"id": i, "name": f"n{i * 7}"}) + "\n" for i in range(5_003))
        )
    spec = InputSpec(uri=str(path), rows_per_shard=700)
    shards = plan_shards(spec)
    assert len(shards) > 5
    assert shards[0].byte_start == (len("id,name\n") if fmt == "csv" else 0)
    for before, after in itertools.pairwise(shards):
        assert before.byte_end == after.byte_start  # no gap, no overlap
    assert shards[-1].byte_end == path.stat().st_size
    assert _ids_of_all_shards(spec) == list(range(5_003))


def _read_all(spec: InputSpec) -> tuple[list[pa.Schema], list[dict[str, object]]]:
    plan = plan_input(spec)
    schemas, rows = [], []
    for shard in plan.shards:
        data = read_shard(
            shard,
            None,
            column_types=plan.column_types,
            newlines_in_values=spec.newlines_in_values,
        )
        assert not data.bad_rows
        schemas.append(data.table.schema)
        rows += data.table.to_pylist()
    return schemas, rows


def test_csv_columns_are_typed_once_for_every_shard(tmp_path: Path) -> None:
    # The score turns fractional two thirds of the way in, past the first 256 KiB: a shard
    # typing itself would read the first shards' scores as int64 and the last ones' as double.
    path = tmp_path / "rows.csv"
    n, fractional = 60_000, 40_000
    lines = [
        f"{i},{i if i < fractional else i + 0.5},{'' if i < 50_000 else 't'}\n" for i in range(n)
    ]
    path.write_text("id,score,tag\n" + "".join(lines))
    assert len("".join(lines[:fractional])) > 256 * 1024  # past the sample at the start
    spec = InputSpec(uri=str(path), rows_per_shard=1_000)
    assert plan_input(spec).column_types == {"id": "int64", "score": "double", "tag": "string"}
    schemas, rows = _read_all(spec)
    assert len(schemas) >= 20 and all(s == schemas[0] for s in schemas)
    assert [r["id"] for r in rows] == list(range(n))
    assert rows[0]["score"] == 0.0 and rows[-1]["score"] == n - 0.5


def test_quoted_line_breaks_split_only_between_rows(tmp_path: Path) -> None:
    n = 2_000
    notes = [
        f'first line of {i}\nsecond, "quoted" line\n\n' if i % 3 == 0 else f"note {i}"
        for i in range(n)
    ]
    path = tmp_path / "notes.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["id", "note"])
        writer.writerows(enumerate(notes))
    spec = InputSpec(uri=str(path), rows_per_shard=150, newlines_in_values=True)
    shards = plan_input(spec).shards
    assert [s.rows for s in shards] == [150] * (n // 150) + [n % 150]  # counted, not estimated
    for before, after in itertools.pairwise(shards):
        assert before.byte_end == after.byte_start
    _, rows = _read_all(spec)
    assert [r["id"] for r in rows] == list(range(n))
    assert [r["note"] for r in rows] == notes


def test_a_file_without_a_final_newline_keeps_its_last_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"id": i}) for i in range(100)))
    assert _ids_of_all_shards(InputSpec(uri=str(path), rows_per_shard=30)) == list(range(100))


def test_listing_skips_hidden_and_marker_files(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1]}), tmp_path / "part-0.parquet")
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".part-0.parquet.crc").write_text("")
    (tmp_path / "notes.txt").write_text("")
    assert list_input_files(str(tmp_path), "parquet") == [str(tmp_path / "part-0.parquet")]
    assert len(list_input_files(str(tmp_path / "*.parquet"), "parquet")) == 1


def test_a_missing_column_is_refused_at_planning(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1], "features": [[1.0]]}), tmp_path / "a.parquet")
    spec = InputSpec(uri=str(tmp_path / "a.parquet"))
    assert len(plan_shards(spec, required_columns=["id", "features"])) == 1
    with pytest.raises(PlanningError, match=r"has no column\(s\) \['feature'\]"):
        plan_shards(spec, required_columns=["id", "feature"])


def test_missing_empty_and_corrupt_inputs_are_planning_errors(tmp_path: Path) -> None:
    with pytest.raises(PlanningError, match="does not exist"):
        plan_shards(InputSpec(uri=str(tmp_path / "nope.parquet")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanningError, match="holds no parquet files"):
        plan_shards(InputSpec(uri=str(tmp_path / "empty"), format="parquet"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(PlanningError, match="cannot read Parquet metadata"):
        plan_shards(InputSpec(uri=str(tmp_path / "bad.parquet")))
