"""Where CSV rows end, when quoted values may hold line breaks: shared by the shard master
(which cuts shards there) and the worker (which finds the header's end the same way)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

SCAN_BYTES = 4 * 1024 * 1024


def row_ends(f: Any, *, block_bytes: int = SCAN_BYTES) -> Iterator[np.ndarray]:
    """The offsets just after the line breaks that end CSV rows (those outside quotes), a
    block of the file at a time, from where `f` is (taken to be a row start). A doubled quote
    inside a quoted value ("") flips the state twice, so counting quotes holds."""
    in_quotes = 0
    offset = 0
    while block := f.read(block_bytes):
        data = np.frombuffer(block, dtype=np.uint8)
        quotes = data == ord('"')
        # Parity of the quotes so far at every byte (uint8 wraps, parity survives).
        parity = (np.cumsum(quotes, dtype=np.uint8) + in_quotes) & 1
        yield np.flatnonzero((data == ord("\n")) & (parity == 0)) + (offset + 1)
        in_quotes = (in_quotes + int(np.count_nonzero(quotes))) & 1
        offset += len(block)


def first_row_end(f: Any, *, block_bytes: int = 64 * 1024) -> int | None:
    """The offset just after the first row (None: the file is one row with no line break)."""
    for ends in row_ends(f, block_bytes=block_bytes):
        if len(ends):
            return int(ends[0])
    return None
