"""How far an attempt has got: what its renewals tell the master.

The rows of a shard written so far, and beyond them the rows of the chunk now computing that
have come back from the pipeline from the first on (read when a renewal asks, not counted as
they come): with a slow model a chunk may take minutes, and the master, judging whether a
holder straggles, should not wait for the chunk's end to hear of it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class AttemptProgress:
    def __init__(self, on_written: Callable[[int], None] | None = None) -> None:
        self.written = 0
        """Rows of the shard written (a chunk's output at a time)."""
        self.computing: deque[Callable[[], int]] = deque()
        """For each chunk in the pipeline, oldest first: its rows back from the first on."""
        self._on_written = on_written

    def wrote(self, rows: int) -> None:
        """The shard's rows written so far are `rows` (its oldest chunk is written)."""
        self.written = rows
        if self.computing:
            self.computing.popleft()
        if self._on_written is not None:
            self._on_written(rows)

    def rows_done(self) -> int:
        """Rows written, and those of the oldest chunk computing that have come back."""
        return self.written + (self.computing[0]() if self.computing else 0)
