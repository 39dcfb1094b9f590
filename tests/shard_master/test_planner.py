"""Shard planning reads metadata only and covers every row exactly once."""

from __future__ import annotations

import csv
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebb.common.job import InputSpec, parse_job
from ebb.common.messaging.messages import ShardSpec
from ebb.shard_master.errors import PlanningError
from ebb.shard_master.planning.planner import list_input_files, plan_input, plan_shards
from ebb.shard_master.planning.sizing import (
    AUTO_MIN_ROWS,
    GENERATION_MIN_ROWS,
    few_shards_advice,
    fleet_shard_rows,
    least_rows,
)
from ebb.worker.shardio.reader import ShardReader, read_shard


def _ids_of_all_shards(spec: InputSpec) -> list[int | None]:
    ids: list[int | None] = []
    for shard in plan_shards(spec):
        data = read_shard(shard, None)
        assert data.table.num_rows == shard.rows or shard.format != "parquet"
        ids += data.table.column("id").to_pylist()
    return ids


def test_parquet_packs_small_row_groups_and_never_cuts_a_big_one(tmp_path: Path) -> None:
    table = pa.table({"id": list(range(10_000))})
    pq.write_table(table.slice(0, 3_000), tmp_path / "a.parquet", row_group_size=500)
    pq.write_table(table.slice(3_000), tmp_path / "b.parquet", row_group_size=7_000)
    spec = InputSpec(uri=str(tmp_path), format="parquet", rows_per_shard=2_000)
    shards = plan_shards(spec)
    # a: 6 groups of 500 -> 2000 + 1000; b: one group of 7000, read once, by one shard.
    assert [s.rows for s in shards] == [2000, 1000, 7000]
    assert [s.index for s in shards] == list(range(3))
    assert shards[2].row_groups == [0] and shards[2].row_offset == 0
    assert _ids_of_all_shards(spec) == list(range(10_000))


def _bytes_read(read: Callable[[], object]) -> int:
    """Bytes this process read (from files: /proc's rchar) while `read` ran."""

    def rchar() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        raise AssertionError("no rchar in /proc/self/io")

    before = rchar()
    read()
    return rchar() - before


def test_every_byte_of_parquet_as_its_tools_write_it_is_read_once(tmp_path: Path) -> None:
    """Files of one 50,000-row row group (pyarrow's default for them), shards of 10,000 rows
    asked: each byte is read once, not once for each of five shards cut from the group."""
    rng = np.random.default_rng(5)
    table = pa.table({"id": np.arange(50_000), "x": rng.random((50_000, 16)).tolist()})
    path = tmp_path / "data" / "part-0.parquet"
    path.parent.mkdir()
    pq.write_table(table, path)  # the library's defaults: one row group here
    spec = InputSpec(uri=str(path.parent), format="parquet", rows_per_shard=10_000)
    shards = plan_shards(spec)
    size = path.stat().st_size

    def read_all() -> None:
        for shard in shards:
            reader = ShardReader(shard, None, chunk_rows=4_096)
            while reader.next() is not None:
                pass

    read = _bytes_read(read_all)
    assert size * 0.9 <= read <= size * 1.3, (read, size)  # the footer read twice at most
    assert _ids_of_all_shards(spec) == list(range(50_000))


_PEAK = (
    "\nfor line in open('/proc/self/status'):\n"
    "    if line.startswith('VmHWM:'):\n"
    "        print(int(line.split()[1]))\n"
)
"""Prints the process's peak resident memory in kB (its own: ru_maxrss would carry the
peak of the process it was forked from, a test process holding a big table)."""


def _peak_rss_mb(script: str) -> float:
    """The peak resident memory of a Python process that runs `script`, in MB."""
    done = subprocess.run(
        [sys.executable, "-c", script + _PEAK],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return int(done.stdout.split()[-1]) / 1024


def test_a_shards_memory_does_not_grow_with_its_row_group(tmp_path: Path) -> None:
    """Row groups of 1M and 4M rows (72 and 288 MB decoded), written with the library's
    defaults, each one shard: reading either a chunk at a time peaks alike."""
    peaks = []
    for rows in (1_000_000, 4_000_000):
        path = tmp_path / f"rows-{rows}.parquet"
        columns = {f"c{k}": np.arange(rows, dtype=np.float64) + k for k in range(8)}
        pq.write_table(pa.table({"id": np.arange(rows), **columns}), path, row_group_size=rows)
        (shard,) = plan_shards(InputSpec(uri=str(path), rows_per_shard=10_000))
        assert shard.rows == rows and shard.row_groups == [0]
        peaks.append(
            _peak_rss_mb(
                "from ebb.common.messaging.messages import ShardSpec\n"
                "from ebb.worker.shardio.reader import ShardReader\n"
                f"shard = ShardSpec(index=0, path={str(path)!r}, format='parquet', "
                f"rows={rows}, row_groups=[0])\n"
                "reader = ShardReader(shard, None, chunk_rows=20_000)\n"
                "seen = 0\n"
                "while (data := reader.next()) is not None:\n"
                "    assert data.table.column('id')[0].as_py() == seen\n"
                "    seen += data.table.num_rows\n"
                f"assert seen == {rows}\n"
            )
        )
    small, large = peaks
    assert large - small < 50, peaks  # 216 MB more rows, no more memory


def test_a_shard_planned_with_a_row_offset_before_still_reads_its_rows(tmp_path: Path) -> None:
    """Jobs planned when row groups were cut into ranges are resumed by workers of today."""
    pq.write_table(pa.table({"id": list(range(7_000))}), tmp_path / "b.parquet")
    old = ShardSpec(
        index=3,
        path=str(tmp_path / "b.parquet"),
        format="parquet",
        rows=2_000,
        row_groups=[0],
        row_offset=4_000,
    )
    reader = ShardReader(old, None, chunk_rows=700)
    ids: list[int | None] = []
    while (data := reader.next()) is not None:
        ids += data.table.column("id").to_pylist()
    assert ids == list(range(4_000, 6_000))


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


@pytest.mark.parametrize(
    ("total", "workers", "rows"),
    [
        (100, 1, 1_000),  # never below AUTO_MIN_ROWS
        (24_000, 4, 1_500),
        (100_000, 1, 25_000),  # four shards for the one worker
        (8_000_000, 100, 20_000),
        (100_000_000, 10, 1_048_576),  # never above AUTO_MAX_ROWS
        (10**12, 1_000, 1_048_576),
    ],
)
def test_shards_sized_for_the_fleet_give_each_worker_four_within_bounds(
    total: int, workers: int, rows: int
) -> None:
    assert fleet_shard_rows(total, workers) == rows


def _job_of(tmp_path: Path, stages: list[dict[str, object]]) -> dict[str, object]:
    return {
        "name": "sized",
        "input": {"uri": str(tmp_path / "prompts.jsonl")},
        "pipeline": {"stages": stages},
        "output": {"uri": str(tmp_path / "out")},
    }


def test_a_job_that_generates_text_gets_shards_of_fewer_rows(tmp_path: Path) -> None:
    """1,536 prompts on two workers: a shard of an engine's batch for each, not one shard of
    them all (at AUTO_MIN_ROWS) that left the second worker idle."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(1536)))
    generates = parse_job(_job_of(tmp_path, [{"llm": {"model": str(tmp_path)}}]))
    tokenizes = parse_job(
        _job_of(tmp_path, [{"llm": {"model": str(tmp_path), "tokenize_only": True}}])
    )
    scores = parse_job(_job_of(tmp_path, [{"modelet": "m:M"}]))
    assert least_rows(generates) == GENERATION_MIN_ROWS
    assert least_rows(tokenizes) == least_rows(scores) == AUTO_MIN_ROWS
    spec = generates.input
    shards = plan_input(spec, workers=2, least_rows=least_rows(generates)).shards
    assert len(shards) >= 4
    assert all(s.rows <= 2 * GENERATION_MIN_ROWS for s in shards)
    assert [s.byte_start for s in shards[1:]] == [s.byte_end for s in shards[:-1]]
    assert (shards[0].byte_start, shards[-1].byte_end) == (0, path.stat().st_size)
    assert len(plan_input(spec, workers=2, least_rows=least_rows(scores)).shards) <= 2


@pytest.mark.parametrize(("workers", "shards"), [(1, 4), (2, 10), (10, 20)])
def test_parquet_sized_for_the_fleet_packs_whole_row_groups(
    tmp_path: Path, workers: int, shards: int
) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(100_000))}), path, row_group_size=5_000)
    planned = plan_shards(InputSpec(uri=str(path)), workers=workers)
    assert len(planned) == shards
    assert [s.index for s in planned] == list(range(shards))
    groups = [g for s in planned for g in s.row_groups]
    assert groups == list(range(20)), "every row group once, in order"
    assert sum(s.rows for s in planned) == 100_000


def test_text_sized_for_the_fleet_is_cut_by_the_rows_its_size_promises(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("id,v\n" + "".join(f"{i},{i % 7}\n" for i in range(100_000)))
    planned = plan_shards(InputSpec(uri=str(path)), workers=1)
    assert 3 <= len(planned) <= 5
    assert planned[0].byte_start == len("id,v\n") and planned[-1].byte_end == path.stat().st_size
    assert all(a.byte_end == b.byte_start for a, b in itertools.pairwise(planned))


def test_an_input_of_fewer_shards_than_workers_says_what_to_change(tmp_path: Path) -> None:
    table = pa.table({"x": np.arange(200_000)})
    pq.write_table(table, tmp_path / "one.parquet")  # pyarrow's defaults: one row group
    one = plan_shards(InputSpec(uri=str(tmp_path / "one.parquet")), workers=2)
    said = few_shards_advice(one, 2, rows_per_shard=None, split_tail=True)
    assert said.startswith(
        "the input makes 1 shard for up to 2 workers: 1 waits until a running shard is split"
    )
    assert "1 row group (the largest of 200,000 rows), and a row group is not cut before" in said
    assert "for every worker to start at once" in said and "row_group_size=100000" in said
    unsplit = few_shards_advice(one, 2, rows_per_shard=None, split_tail=False)
    assert "1 will have nothing to do" in unsplit
    assert few_shards_advice(one, 1, rows_per_shard=None, split_tail=True) == ""

    pq.write_table(table, tmp_path / "many.parquet", row_group_size=10_000)
    packed = InputSpec(uri=str(tmp_path / "many.parquet"), rows_per_shard=200_000)
    shards = plan_shards(packed, workers=4)
    assert few_shards_advice(shards, 4, rows_per_shard=200_000, split_tail=True).endswith(
        "Set input.rows_per_shard to 50,000 or less"
    )
    text = [ShardSpec(index=0, path="/a.csv", format="csv", rows=9_000)]
    told = few_shards_advice(text, 3, rows_per_shard=10_000, split_tail=True)
    assert "2 will have nothing to do" in told  # a text shard is not cut in two
    assert told.endswith("Set input.rows_per_shard to 3,000 or less (now 10,000)")
