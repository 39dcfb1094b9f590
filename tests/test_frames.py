"""The byte format between the router and its stage processes: batches of same-shaped rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ebb.worker import frames, shm
from ebb.worker.shm import Arena


def roundtrip(payload: Any, arena: Arena | None = None) -> Any:
    buf = frames.pack(frames.ITEMS, list(range(len(payload))), payload, arena=arena)
    assert frames.header(buf).uids == list(range(len(payload)))
    return frames.payload(buf, arena=arena, copy=True)


def test_rows_of_one_shape_travel_as_one_array_and_come_back_as_rows() -> None:
    rows = [np.arange(16, dtype=np.float32) + i for i in range(300)]
    compact = frames.pack(frames.ITEMS, list(range(300)), rows)
    one_by_one = frames.pack(frames.ITEMS, list(range(300)), [*rows[:-1], rows[-1].tolist()])
    # Per-row pickle records cost bytes (and time): the stacked form is markedly smaller.
    assert len(compact) < 0.8 * len(one_by_one)
    back = roundtrip(rows)
    assert isinstance(back, list) and len(back) == 300
    for got, want in zip(back, rows, strict=True):
        assert type(got) is np.ndarray and got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "payload",
    [
        [np.zeros(3), np.zeros(4)],  # shapes differ
        [np.zeros(3, np.float32), np.zeros(3, np.float64)],  # dtypes differ
        [np.zeros(3), [0.0, 0.0, 0.0]],  # not every row an array
        [np.array(["a", None], dtype=object)] * 2,  # objects: pickled as they are
        [np.float32(1.0), np.float32(2.0)],  # scalars
        [{"x": np.zeros(3)}, {"x": np.ones(3)}],
    ],
)
def test_anything_else_travels_as_it_is(payload: list[Any]) -> None:
    back = roundtrip(payload)
    assert len(back) == len(payload)
    for got, want in zip(back, payload, strict=True):
        assert type(got) is type(want)
        if isinstance(want, dict):
            np.testing.assert_array_equal(got["x"], want["x"])
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_large_batch_of_rows_goes_through_shared_memory() -> None:
    arena = Arena(min_bytes=1024)
    rows = [np.full((8, 8), i, dtype=np.float32) for i in range(64)]  # 16 KiB stacked
    buf = frames.pack(frames.ITEMS, list(range(64)), rows, arena=arena)
    segment = frames.header(buf).segment
    assert segment  # the stacked rows are out of band
    back = frames.payload(buf, arena=arena, copy=True)
    assert [float(r[0, 0]) for r in back] == list(range(64))
    arena.reclaim(segment)  # what the router does once the frame's items are through
    arena.close()
    assert not (Path(shm.SHM_DIR) / segment).exists()
