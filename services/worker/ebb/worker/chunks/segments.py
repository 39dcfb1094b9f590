"""Who reads which shared-memory segment, and handing each back to its maker once read.

A frame too big for a pipe travels in a segment (ebb.worker.chunks.shm): its maker (a stage process,
or the router's own arena) writes it, the router forwards the frame, a reader maps it. Once nobody
reads a segment any more it goes back to its maker, which reuses it; segments of a maker that
died are unlinked instead, since nobody would reuse them. Reclaims are told to each maker once
per turn of the router's loop, together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .shm import Arena, remove_all_of, unlink


def maker_of(segment: str) -> int:
    """The pid of the process that made `segment` (its name says so: see ebb.worker.chunks.shm)."""
    return int(segment.split("-")[1])


class SegmentLedger:
    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        """The router's own segments (rows it packs for the first stage, or a fan-in)."""
        self._mapped: dict[int, set[str]] = {}
        """Segments sent to each process (by pid) that it has not yet finished reading."""
        self._reclaims: dict[int, list[str]] = {}
        """Segments to hand back to their makers, by the maker's pid."""

    def mapped(self, reader: int, segment: str) -> None:
        """`segment` was sent to the process `reader`."""
        self._mapped.setdefault(reader, set()).add(segment)

    def unmapped(self, reader: int, segment: str) -> None:
        """The process `reader` is done with `segment`."""
        self._mapped.get(reader, set()).discard(segment)
        self.done(segment)

    def process_gone(self, pid: int, waiting: Iterable[str]) -> None:
        """The process `pid` died. What it was reading goes back to the makers; its own free
        segments die with it, those still on their way to a reader (`waiting` in a backlog,
        or sent) stay until read."""
        for segment in self._mapped.pop(pid, ()):
            self.done(segment)
        remove_all_of(pid, keep=self.in_flight(waiting))

    def done(self, segment: str) -> None:
        """Nobody reads `segment` any more: back to the process that made it, for reuse."""
        if self.arena.owns(segment):
            self.arena.reclaim(segment)
            return
        self._reclaims.setdefault(maker_of(segment), []).append(segment)

    def in_flight(self, waiting: Iterable[str]) -> set[str]:
        """Segments somebody will still read: those of frames `waiting` to be sent, and those
        sent and not yet read."""
        return set(waiting).union(*self._mapped.values())

    def send_reclaims(self, tell: Callable[[int, list[str]], bool]) -> None:
        """Hand the segments read since the last call back to their makers: `tell(pid,
        segments)` is False when the maker is gone, and then they are unlinked."""
        reclaims, self._reclaims = self._reclaims, {}
        for maker, segments in reclaims.items():
            if not tell(maker, segments):
                for segment in segments:
                    unlink(segment)

    def close(self, pids: Iterable[int], waiting: Iterable[str]) -> None:
        """The router stops, its processes (`pids`) are gone: every segment goes, whoever
        made it, and the router's own arena with them."""
        for segment in self.in_flight(waiting):
            unlink(segment)
        for pid in pids:
            remove_all_of(pid, keep=set())
        self._mapped.clear()
        self._reclaims.clear()
        self.arena.close()
