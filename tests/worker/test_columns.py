"""Columnar chunks: rows <-> columns, joining chunks, putting results back in place."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from ebb.worker.chunks.columns import (
    VALUE,
    ChunkError,
    checked,
    concat,
    from_arrow,
    from_rows,
    scatter,
    to_rows,
)


def test_map_rows_become_columns_and_come_back() -> None:
    rows = [{"id": i, "x": np.full(3, i, dtype=np.float32), "name": f"n{i}"} for i in range(4)]
    chunk = from_rows(rows)
    assert chunk["id"].dtype == np.int64
    assert chunk["x"].shape == (4, 3) and chunk["x"].dtype == np.float32
    assert chunk["name"].dtype == object
    back = to_rows(chunk)
    assert [r["id"] for r in back] == [0, 1, 2, 3]
    assert type(back[0]["id"]) is int  # Python numbers, as per-row code expects
    np.testing.assert_array_equal(back[2]["x"], rows[2]["x"])


def test_plain_rows_are_one_value_column() -> None:
    chunk = from_rows([np.zeros(2), np.ones(2)])
    assert list(chunk) == [VALUE] and chunk[VALUE].shape == (2, 2)
    uneven = from_rows([np.zeros(2), np.zeros(3)])
    assert uneven[VALUE].dtype == object
    assert [len(v) for v in to_rows(uneven)] == [2, 3]


def test_chunks_of_different_shapes_join_as_objects() -> None:
    a = {"x": np.zeros((2, 3))}
    b = {"x": np.ones((1, 4))}
    joined = concat([a, b])
    assert joined["x"].dtype == object and len(joined["x"]) == 3
    missing = concat([{"x": np.zeros(1), "y": np.zeros(1)}, {"x": np.ones(1)}])
    assert missing["y"].tolist() == [0.0, None]


def test_scatter_puts_rows_back_in_place_and_marks_the_holes() -> None:
    pieces = [
        (np.array([3, 0]), {"v": np.array([30.0, 0.0])}),
        (np.array([1]), {"v": np.array([10.0])}),
    ]
    columns, holes = scatter(pieces, 5)
    assert columns["v"].tolist() == [0.0, 10.0, 0.0, 30.0, 0.0]
    assert holes.tolist() == [False, False, True, False, True]


def test_tensor_columns_from_arrow_are_one_array() -> None:
    images: Any = pa.FixedShapeTensorArray.from_numpy_ndarray(np.zeros((2, 4, 4, 3), np.uint8))
    table = pa.table({"img": images, "seq": pa.array([[1, 2], [3]])})
    chunk = from_arrow(table)
    assert chunk["img"].shape == (2, 4, 4, 3)
    assert [v.tolist() for v in chunk["seq"]] == [[1, 2], [3]]


def test_a_columnar_output_is_checked() -> None:
    with pytest.raises(ChunkError, match="3 rows"):
        checked({"a": np.zeros(3)}, 2, "m")
    with pytest.raises(ChunkError, match="not a map"):
        checked([1, 2], 2, "m")
    assert checked({"a": [1, 2]}, 2, "m")["a"].tolist() == [1, 2]


def every_kind(n: int) -> pa.Table:
    """A column of each kind Parquet readers hand over, nulls among them."""
    rng = np.random.default_rng(5)
    return pa.table(
        {
            "i": pa.array(range(n), pa.int64()),
            "f": pa.array(rng.normal(size=n), pa.float64()),
            "b": pa.array([k % 3 == 0 for k in range(n)]),
            "s": pa.array([f"row {k}" for k in range(n)]),
            "maybe_i": pa.array([None if k % 4 == 0 else k for k in range(n)], pa.int32()),
            "maybe_s": pa.array([None if k % 5 == 0 else str(k) for k in range(n)]),
            "ragged": pa.array([list(range(k % 4)) for k in range(n)], pa.list_(pa.int64())),
            "fixed": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.normal(size=n * 3).astype(np.float32)), 3
            ),
            "maybe_list": pa.array(
                [None if k % 6 == 0 else [float(k)] for k in range(n)], pa.list_(pa.float64())
            ),
        }
    )


def plain(value: Any) -> Any:
    """`value` as Python values: an array as a list of them, with its element type kept as
    the Python type of each (an int64 array's values are ints)."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def test_the_per_row_adapter_gives_each_column_kind_as_python_would_read_it() -> None:
    """Rows as a per-row modelet gets them (`to_rows` of the chunk a stage is handed): numbers
    as Python numbers, strings as str, nulls as None, lists as arrays of their values; and
    its rows back unchanged (`from_rows`) make the same rows again."""
    table = every_kind(50)
    rows = to_rows(from_arrow(table))
    expected = table.to_pylist()
    assert [list(r) for r in rows] == [list(w) for w in expected]
    for got, want in zip(rows, expected, strict=True):
        for name, value in want.items():
            assert plain(got[name]) == value, name
            assert type(plain(got[name])) is type(value), name
            if isinstance(value, list):
                pairs = zip(plain(got[name]), value, strict=True)
                assert all(type(v) is type(w) for v, w in pairs), name
    again = to_rows(from_rows(rows))
    assert [{k: plain(v) for k, v in r.items()} for r in again] == expected


def test_a_per_row_modelet_writing_into_its_row_changes_only_its_row() -> None:
    """A modelet that sets or deletes keys of its row through the adapter changes its row
    alone: the chunk it was handed and the other rows are as they were."""
    table = every_kind(8)
    chunk = from_arrow(table)
    rows = to_rows(chunk)
    rows[0]["i"] = 99
    rows[0]["new"] = "added"
    del rows[1]["s"]
    assert to_rows(chunk)[0]["i"] == 0 and "new" not in rows[1] and "s" in rows[2]
    assert [{k: plain(v) for k, v in r.items()} for r in to_rows(chunk)] == table.to_pylist()
