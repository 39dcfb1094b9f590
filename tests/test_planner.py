"""Shard planning reads metadata only and covers every row exactly once."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebb.common.spec import InputSpec
from ebb.shard_master.errors import PlanningError
from ebb.shard_master.planner import list_input_files, plan_shards
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
