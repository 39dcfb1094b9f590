"""The byte format between the router and its stage processes: chunks of columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ebb.worker.chunks import frames, shm
from ebb.worker.chunks.shm import Arena


def roundtrip(payload: Any, arena: Arena | None = None) -> Any:
    n = len(next(iter(payload.values())))
    buf = frames.pack(frames.Kind.ITEMS, np.arange(n), payload, arena=arena)
    assert frames.header(buf).uids.tolist() == list(range(n))
    return frames.payload(buf, arena=arena, copy=True)


def test_a_chunk_travels_as_a_few_buffers_whatever_its_rows() -> None:
    chunk = {"x": np.arange(300 * 16, dtype=np.float32).reshape(300, 16), "id": np.arange(300)}
    packed = frames.pack(frames.Kind.ITEMS, np.arange(300), chunk)
    # No pickle record per row: the frame is the arrays' bytes and a small header.
    assert len(packed) < 300 * 16 * 4 + 300 * 8 + 8 * 300 + 1024
    back = roundtrip(chunk)
    assert set(back) == {"x", "id"}
    np.testing.assert_array_equal(back["x"], chunk["x"])
    np.testing.assert_array_equal(back["id"], chunk["id"])


@pytest.mark.parametrize(
    "column",
    [
        np.array(["a", None, "c"], dtype=object),
        np.array([{"k": 1}, [1, 2], 3.5], dtype=object),
        np.zeros((3, 2, 2), dtype=np.uint8),
    ],
)
def test_columns_of_any_kind_travel_as_they_are(column: np.ndarray) -> None:
    back = roundtrip({"c": column})
    assert back["c"].dtype == column.dtype
    assert back["c"].tolist() == column.tolist()


def test_a_large_batch_of_rows_goes_through_shared_memory() -> None:
    arena = Arena(min_bytes=1024)
    rows = {"x": np.repeat(np.arange(64, dtype=np.float32), 64).reshape(64, 8, 8)}  # 16 KiB
    buf = frames.pack(frames.Kind.ITEMS, list(range(64)), rows, arena=arena)
    segment = frames.header(buf).segment
    assert segment  # the tensor column is out of band
    back = frames.payload(buf, arena=arena, copy=True)
    assert [float(r[0, 0]) for r in back["x"]] == list(range(64))
    arena.reclaim(segment)  # what the router does once the frame's items are through
    arena.close()
    assert not (Path(shm.SHM_DIR) / segment).exists()


@pytest.mark.parametrize(
    "uids",
    [
        np.arange(5, 1_029),  # a chunk's consecutive rows: sent as a run
        np.arange(-7, -40, -1),  # a fan-out's parts
        np.array([3, 4, 9]),  # rows after some failed
        np.array([1, 2]),
        np.array([], dtype=np.int64),
    ],
)
def test_uids_survive_the_header_and_a_splice(uids: np.ndarray) -> None:
    buf = frames.pack(frames.Kind.ITEMS, uids, {"v": np.arange(len(uids))}, flags=frames.SOLO)
    h = frames.header(buf)
    assert h.uids.tolist() == uids.tolist() and h.flags == frames.SOLO
    assert frames.payload(buf)["v"].tolist() == list(range(len(uids)))
    other = frames.splice(buf, frames.Kind.FANOUT, np.arange(100, 100 + len(uids)))
    assert frames.header(other).uids.tolist() == list(range(100, 100 + len(uids)))
    assert frames.payload(other)["v"].tolist() == list(range(len(uids)))
    if len(uids) > 100:
        assert len(frames.pack(frames.Kind.ITEMS, uids)) < 100  # a run, not 8 bytes a row
