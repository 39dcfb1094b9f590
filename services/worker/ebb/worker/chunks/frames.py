"""The byte format of messages between the pipeline router and its stage processes.

    header    <kind:u8><flags:u8><count:u32><segment:u16><buffers:u16>
    uids      count x int64 (little-endian), or, with the RUN flag, (first, step) as two
              int64: the uids first, first+step, ... (a chunk of consecutive rows)
    segment   the name of a shared-memory segment holding the large buffers (or nothing)
    released  with the RELEASED flag: <length:u16> and the comma-separated names of segments
              the sender has finished reading
    buffers   buffers x (offset:u64, length:u64), their places in the segment
    body      pickle (protocol 5) of the payload; its large buffers are out of band

The header and uids are readable without unpickling, so the router forwards a stage's output
to the next stage as the same bytes, and knows which items every process holds. Large array
buffers live in shared memory (see ebb.worker.chunks.shm) rather than in the pipes. These frames
join the processes of one worker (the worker and the stage processes it starts, forked from its own
fork server, in one container and one trust domain): pickle never crosses a host or a tenant.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from pickle import PickleBuffer, Pickler, dumps, loads
from typing import Any

import numpy as np

from .shm import Arena

HEADER = struct.Struct("<BBIHH")
PLACE = struct.Struct("<QQ")
RELEASED_LEN = struct.Struct("<H")
_MIN_OUT_OF_BAND = 2048
"""Smaller buffers stay inline in the pickle."""


class Kind(IntEnum):
    """What a frame is: the first byte of its header. Each side dispatches on it with `match`,
    naming every kind (those it never receives among them), so a kind added is a decision
    each side must make."""

    ITEMS = 1
    """Rows, in either direction: a chunk (see ebb.worker.chunks.columns) with one row per uid, in
    order."""
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
    RECLAIM = 8
    """Router -> stage: shared-memory segments of yours that nobody reads any more (payload)."""
    UNMAPPED = 10
    """Stage -> router: segments (payload) whose rows this stage has all consumed."""
    THREADS = 11
    """Router -> stage: run the model with this many intra-op threads from now on (payload): its
    share of the worker's cores changed."""
    FANOUT = 9
    """Fan-out stage -> router: the uids field holds the items' uids then their part counts;
    the payload is a chunk of every item's parts, flattened. The router renames the parts (new uids)
    and forwards the same bytes: the parts are never unpickled on the way."""


SOLO = 0x01
"""Flag: run these items one per batch (they were in a batch whose process died)."""
ARROW = 0x02
"""Flag: the payload is (schema, Arrow IPC record batch) of rows, not a chunk of columns."""
RELEASED = 0x08
"""Flag (set by `pack`/`splice`): after the segment come the names of segments that the
sending stage has finished reading (see ebb.worker.chunks.shm): told with its output, not in a
message of their own."""
RUN = 0x04
"""Flag: the uids are a run (first, step) rather than a list. A chunk's rows mostly are: the
frame stays a few hundred bytes whatever its rows, so a pipe holds many of them and the
router seldom waits to write to a busy stage."""


@dataclass(frozen=True, slots=True)
class Frame:
    """Rows on their way to a stage, as the bytes that will be sent (see `pack`), with what
    the router needs of their header kept beside them."""

    buf: bytes
    uids: np.ndarray
    flags: int
    segment: str = ""


@dataclass(frozen=True, slots=True)
class Header:
    kind: Kind
    flags: int
    uids: np.ndarray
    """int64, a view of the frame's bytes."""
    segment: str
    """The shared-memory segment of the frame's large buffers; "" when there is none."""
    released: list[str]
    """Segments the sender has finished reading."""


def _pickle(payload: Any, out_of_band: list[PickleBuffer] | None) -> bytes:
    stream = io.BytesIO()

    def keep_large(buffer: PickleBuffer) -> bool:
        assert out_of_band is not None
        if buffer.raw().nbytes < _MIN_OUT_OF_BAND:
            return True  # inline
        out_of_band.append(buffer)
        return False

    callback = keep_large if out_of_band is not None else None
    Pickler(stream, protocol=5, buffer_callback=callback).dump(payload)
    return stream.getvalue()


def pack(
    kind: Kind,
    uids: Sequence[int] | np.ndarray = (),
    payload: Any = None,
    *,
    flags: int = 0,
    arena: Arena | None = None,
    released: Sequence[str] = (),
) -> bytes:
    ids = np.asarray(uids, dtype="<i8")
    segment = b""
    places: list[tuple[int, int]] = []
    body = b""
    if payload is not None:
        large: list[PickleBuffer] | None = [] if arena is not None else None
        body = _pickle(payload, large)
        if large:
            raws = [b.raw() for b in large]
            if arena is not None and sum(r.nbytes for r in raws) >= arena.min_bytes:
                name, places = arena.store(raws)
                segment = name.encode()
            else:  # too little to be worth a segment: everything inline after all
                body = _pickle(payload, None)
    uid_flag, uid_bytes = _encode_uids(ids)
    flags |= uid_flag | (RELEASED if released else 0)
    parts = [
        HEADER.pack(kind, flags, len(ids), len(segment), len(places)),
        uid_bytes,
        segment,
        _released_bytes(released),
    ]
    parts += [PLACE.pack(offset, length) for offset, length in places]
    parts.append(body)
    return b"".join(parts)


def _encode_uids(ids: np.ndarray) -> tuple[int, bytes]:
    """The uids' bytes, as a run when they are one."""
    if len(ids) > 2:
        step = int(ids[1] - ids[0])
        if (
            step in (1, -1)
            and int(ids[-1] - ids[0]) == step * (len(ids) - 1)
            and (np.diff(ids) == step).all()
        ):
            return RUN, np.array([ids[0], step], dtype="<i8").tobytes()
    return 0, ids.tobytes()


def _released_bytes(names: Sequence[str]) -> bytes:
    if not names:
        return b""
    joined = ",".join(names).encode()
    return RELEASED_LEN.pack(len(joined)) + joined


@dataclass(frozen=True, slots=True)
class _Layout:
    kind: int
    flags: int
    """As sent (RUN and RELEASED included)."""
    count: int
    segment: str
    released: list[str]
    places_at: int
    """Where the places of the large buffers start; the body follows them."""
    n_places: int

    @property
    def body_at(self) -> int:
        return self.places_at + self.n_places * PLACE.size


def _layout(buf: bytes) -> _Layout:
    kind, flags, count, seg_len, n_places = HEADER.unpack_from(buf)
    at = HEADER.size + (16 if flags & RUN else 8 * count)
    segment = bytes(buf[at : at + seg_len]).decode()
    at += seg_len
    released: list[str] = []
    if flags & RELEASED:
        (length,) = RELEASED_LEN.unpack_from(buf, at)
        at += RELEASED_LEN.size
        released = bytes(buf[at : at + length]).decode().split(",")
        at += length
    return _Layout(kind, flags, count, segment, released, at, n_places)


def header(buf: bytes) -> Header:
    """Kind, flags, uids and segments, without touching the payload."""
    layout = _layout(buf)
    uids: np.ndarray
    if layout.flags & RUN:
        first, step = np.frombuffer(buf, dtype="<i8", count=2, offset=HEADER.size).tolist()
        uids = np.arange(first, first + step * layout.count, step, dtype=np.int64)
    else:
        uids = np.frombuffer(buf, dtype="<i8", count=layout.count, offset=HEADER.size)
    return Header(
        Kind(layout.kind), layout.flags & ~(RUN | RELEASED), uids, layout.segment, layout.released
    )


def splice(
    buf: bytes, kind: Kind, uids: Sequence[int] | np.ndarray, *, released: Sequence[str] = ()
) -> bytes:
    """The same frame (segment, buffers, body) under another kind, other uids and other
    released segments (none unless given)."""
    layout = _layout(buf)
    ids = np.asarray(uids, dtype="<i8")
    uid_flag, uid_bytes = _encode_uids(ids)
    flags = (layout.flags & ~(RUN | RELEASED)) | uid_flag | (RELEASED if released else 0)
    head = HEADER.pack(kind, flags, len(ids), len(layout.segment), layout.n_places)
    rest = memoryview(buf)[layout.places_at :]
    return b"".join(
        [head, uid_bytes, layout.segment.encode(), _released_bytes(released), bytes(rest)]
    )


def with_released(buf: bytes, names: Sequence[str]) -> bytes:
    """The same frame, also telling that the sender has finished reading `names`."""
    layout = _layout(buf)
    head = HEADER.pack(
        layout.kind, layout.flags | RELEASED, layout.count, len(layout.segment), layout.n_places
    )
    uid_end = HEADER.size + (16 if layout.flags & RUN else 8 * layout.count)
    names = [*layout.released, *names]
    return b"".join(
        [
            head,
            bytes(buf[HEADER.size : uid_end]),
            layout.segment.encode(),
            _released_bytes(names),
            bytes(memoryview(buf)[layout.places_at :]),
        ]
    )


def payload(buf: bytes, *, arena: Arena | None = None, copy: bool = False) -> Any:
    """The frame's payload. Its large buffers are views of shared memory, which stays mapped
    (in `arena`) until `arena.done(segment, ...)`; with copy=True they are copied out instead
    and the caller owes the segment nothing."""
    layout = _layout(buf)
    segment, count, start = layout.segment, layout.count, layout.places_at
    places = [PLACE.unpack_from(buf, start + i * PLACE.size) for i in range(layout.n_places)]
    start = layout.body_at
    if start >= len(buf):
        return None
    buffers: list[Any] = []
    if segment:
        if arena is None:
            raise ValueError("a frame with a shared-memory segment needs an arena")
        views = arena.views(segment, places, 0 if copy else count)
        if copy:
            buffers = [bytearray(v) for v in views]
            del views
            arena.done(segment, 0)
        else:
            buffers = views
    # Frames come only from this worker's own stage processes and router (see above).
    return loads(memoryview(buf)[start:], buffers=buffers)  # noqa: S301


def unsendable(values: Sequence[Any]) -> str:
    """Why the first of `values` that cannot go into a frame cannot; "" when all can."""
    for value in values:
        try:
            dumps(value, protocol=5)
        except Exception as e:  # noqa: BLE001 - any pickling failure is this value's
            return f"{type(e).__name__}: {e}"[:2000]
    return ""
