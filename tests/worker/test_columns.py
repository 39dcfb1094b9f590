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
