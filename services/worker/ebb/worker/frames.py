"""The byte format of messages between the pipeline router and its stage processes.

    header  <kind:u8><flags:u8><count:u32>
    uids    count x int64 (little-endian)
    body    pickled payload (ITEMS: list of values, ERRORS: list of messages, ...)

The header and uids are readable without unpickling, so the router forwards a stage's
output to the next stage as the same bytes, and knows which items every process holds.
These pipes join processes of one worker, spawned by it: pickle never crosses a host.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

HEADER = struct.Struct("<BBI")

ITEMS = 1
"""Items, in either direction: values keyed by uid."""
ERRORS = 2
"""Stage -> router: items that failed, one message per uid."""
FLUSH = 3
"""Router -> stage: nothing more is coming for now; run partial batches without waiting."""
STOP = 4
"""Router -> stage: finish what you hold, then exit."""
READY = 5
"""Stage -> router: set up and taking items."""
SETUP_FAILED = 6
"""Stage -> router: the modelet could not be built; the body says why."""
RECYCLE = 7
"""Stage -> router: over my memory limit; send me nothing more, then STOP me."""

SOLO = 0x01
"""Flag: run these items one per batch (they were in a batch whose process died)."""


def pack(kind: int, uids: Sequence[int] = (), payload: Any = None, *, flags: int = 0) -> bytes:
    ids = np.asarray(uids, dtype="<i8")
    body = b"" if payload is None else bytes(ForkingPickler.dumps(payload, protocol=5))
    return HEADER.pack(kind, flags, len(ids)) + ids.tobytes() + body


def header(buf: bytes) -> tuple[int, int, list[int]]:
    """(kind, flags, uids) without touching the payload."""
    kind, flags, count = HEADER.unpack_from(buf)
    uids = np.frombuffer(buf, dtype="<i8", count=count, offset=HEADER.size).tolist()
    return kind, flags, uids


def payload(buf: bytes) -> Any:
    count = HEADER.unpack_from(buf)[2]
    start = HEADER.size + 8 * count
    if start >= len(buf):
        return None
    return ForkingPickler.loads(memoryview(buf)[start:])
