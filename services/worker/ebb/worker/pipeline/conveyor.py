"""Where rows go between stages: each stage's backlog, fan-out and gathering, and the way out.

Rows come out of a stage as a frame; the frame goes on to the next stage's backlog as it came
(as bytes, without unpickling), and the router hands it to that stage's least-loaded process.
Rows leave the pipeline as results, from the last stage, or as errors, from any stage. Between
a fan-out stage and the gathering (the fan-in stage, or the end of the pipeline) each part of
an item travels as an item of its own (ebb.worker.pipeline.families).

A pipeline that is not a chain (stages that name what they read: `after`) sends a stage's rows
to each stage that reads it, and through joins where branches meet (ebb.worker.pipeline.joins).

Rows nobody waits for any more (their run was cancelled: a lost lease, a drain) are cancelled
by uid range: what still waits in a backlog is dropped, and reported as errors, which the
asyncio front ignores for a run it no longer has; what a process holds finishes as usual.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from ebb.common.job import PipelineSpec, StageSpec

from .. import metrics
from ..chunks import frames
from ..chunks.columns import Columns, from_rows, take, to_rows
from ..chunks.frames import Kind
from ..chunks.segments import SegmentLedger
from .families import Families
from .joins import Graph, Join, Settled
from .ledger import Blame, RowLedger, blame

log = logging.getLogger(__name__)

ResultsCallback = Callable[[np.ndarray, Columns], None]
ErrorsCallback = Callable[[np.ndarray, list[str]], None]
OUT = -1
"""Where the rows of the last stages go: out of the pipeline."""


class Conveyor:
    """Moves rows from stage to stage, and out. Only the router's thread uses it."""

    def __init__(
        self,
        specs: list[StageSpec],
        *,
        rows: RowLedger,
        segments: SegmentLedger,
        on_results: ResultsCallback,
        on_errors: ErrorsCallback,
    ) -> None:
        self.stages = len(specs)
        self.names = [s.name for s in specs]
        self.rows = rows
        self.segments = segments
        self.arena = segments.arena
        self.on_results = on_results
        self.on_errors = on_errors
        self.backlog: list[deque[frames.Frame]] = [deque() for _ in specs]
        """Frames waiting for a process of each stage."""
        fanouts = [k for k, s in enumerate(specs) if s.fanout]
        fanins = [k for k, s in enumerate(specs) if s.fanin]
        self.fanout_stage: int | None = fanouts[0] if fanouts else None
        self.fanin_stage: int | None = fanins[0] if fanins else None
        self.families = Families()
        self.graph = Graph.of(specs, PipelineSpec(stages=specs).inputs())
        self.branched = not self.graph.is_chain
        """Stages read other stages than the one before them: rows go by the graph."""
        self.readers = [self.graph.readers(k) or [OUT] for k in range(self.stages)]
        self.joins: dict[int, Join] = {}
        """Where branches meet, by the stage that reads them (OUT: the end of the pipeline)."""
        self.failed = Settled()
        """Rows told as errors while copies of them may still run in other branches."""
        self.resent = Settled()
        """Rows sent through the branches again (a process that held them died)."""
        sinks = self.graph.sinks
        for k, reads in enumerate(self.graph.inputs):
            if len(reads) > 1:
                self.joins[k] = Join(reads, [self.names[i] for i in reads], resent=self.resent)
        if len(sinks) > 1:
            self.joins[OUT] = Join(sinks, [self.names[i] for i in sinks], resent=self.resent)

    def waiting(self, stage: int) -> int:
        """Rows in the backlog of `stage`."""
        return sum(len(f.uids) for f in self.backlog[stage])

    def segments_waiting(self) -> set[str]:
        """Segments of frames still in a backlog."""
        return {f.segment for b in self.backlog for f in b if f.segment}

    def joined(self) -> int:
        """Rows waiting in joins for another branch."""
        return sum(len(j) for j in self.joins.values())

    def submit(self, start: int, data: pa.RecordBatch | Columns, rows: int) -> None:
        """Rows for the first stage(s), kept until each is out."""
        self.rows.keep(start, data, rows)
        self._enqueue_source(np.arange(start, start + rows, dtype=np.int64), data, 0)

    def resend(self, uids: list[int], *, solo: bool) -> None:
        """Send rows through the pipeline again, from the first stage(s)
        (ebb.worker.pipeline.ledger)."""
        flags = frames.SOLO if solo else 0
        if self.branched:
            # Through every branch again: a join keeps the first copy that reaches it.
            self.resent.add(uids)
        for group, part in self.rows.resend(uids, solo=solo):
            self._enqueue_source(group, part, flags)

    def take_output(self, stage: int, buf: bytes, h: frames.Header) -> np.ndarray:
        """What a process of `stage` sent back (ITEMS, ERRORS or FANOUT), sent on; the uids
        of the rows it no longer holds."""
        uids = h.uids
        if h.kind == Kind.ERRORS:
            self.fail(uids, frames.payload(buf))
            return uids
        name = self.names[stage]
        if h.kind == Kind.FANOUT:
            parents, counts = uids[: len(uids) // 2], uids[len(uids) // 2 :]
            metrics.BATCH_SIZE.labels(name).observe(len(parents))
            self._fan_out(stage, buf, parents, counts, h)
            return parents
        metrics.BATCH_SIZE.labels(name).observe(len(uids))
        try:
            self._route(stage, frames.Frame(buf, uids, h.flags, h.segment))
        except Exception as e:  # noqa: BLE001 - e.g. a result type we cannot import
            message = f"stage {name!r}: its result could not be read: {e!r}"
            self.fail(uids, [message] * len(uids))
        return uids

    def take_back(
        self, held: np.ndarray, running: np.ndarray, *, max_item_crashes: int, error: str
    ) -> Blame:
        """The rows a dead process `held` (`running` those of its batch): each sent again,
        alone, or out as an error saying `error` (ledger.blame decides)."""
        if self.branched and len(self.failed):
            held = held[~self.failed.mask(held)]  # told already: nothing to do for them
        verdict = blame(
            held.tolist(),
            running.tolist(),
            owner_of=self.families.owner,
            crashes=self.rows.crashes,
            max_item_crashes=max_item_crashes,
        )
        self.rows.convict(verdict)
        for item in verdict.items:
            self.families.disband(item)  # a family starts over, or fails, whole
        for uid in verdict.retry_alone:
            self.resend([uid], solo=True)
        if verdict.innocent:
            self.resend(verdict.innocent, solo=False)
        if verdict.failed:
            ids = np.asarray(verdict.failed, dtype=np.int64)
            self.fail(ids, [error] * len(ids))
        return verdict

    def _route(self, stage: int, frame: frames.Frame) -> None:
        """Rows that came out of `stage`: on to the next stage, back to their family, or out
        of the pipeline."""
        if self.branched:
            self._route_graph(stage, frame)
            return
        after = stage + 1
        if after < self.stages and not self._gathers_after(stage):
            self.backlog[after].append(frame)  # as it came: no unpickling here
            return
        chunk = self._read(frame.buf, frame.segment)
        if self._gathers_after(stage):
            self._gather(frame.uids, chunk)
        else:
            self.rows.release(frame.uids)
            self.on_results(frame.uids.copy(), chunk)

    def _route_graph(self, stage: int, frame: frames.Frame) -> None:
        """Rows that came out of `stage` of a pipeline that is not a chain: to each stage
        that reads it (as they came, when only one does), into joins, or out."""
        readers = self.readers[stage]
        if len(readers) == 1 and readers[0] != OUT and readers[0] not in self.joins:
            self.backlog[readers[0]].append(frame)
            return
        uids = frame.uids
        chunk = self._read(frame.buf, frame.segment)
        told = self.failed.mask(uids)
        if told.any():
            uids, chunk = uids[~told], take(chunk, ~told)
        flags = frame.flags & frames.SOLO
        for reader in readers:
            if reader not in self.joins:
                self._enter(reader, uids, chunk, flags)
                continue
            self.joins[reader].add(stage, uids, chunk)

    def settle_joins(self) -> None:
        """Send on the rows that every branch has sent to a join (once per turn of the
        router's loop: a join's cost is per turn, not per batch of each branch)."""
        for reader, join in self.joins.items():
            done, joined = join.settle()
            if len(done):
                self._enter(reader, done, joined, 0)

    def _enter(self, stage: int, uids: np.ndarray, chunk: Columns, flags: int) -> None:
        """Rows for `stage`, or out of the pipeline (OUT)."""
        if stage != OUT:
            self._enqueue(stage, uids, chunk, flags)
            return
        self.rows.release(uids)
        self.on_results(uids.copy(), chunk)

    def _fan_out(
        self, stage: int, buf: bytes, parents: np.ndarray, counts: np.ndarray, h: frames.Header
    ) -> None:
        """A fan-out stage's output: name each part (a new uid) and send the frame's bytes on
        to the next stage as they are."""
        if self._gathers_after(stage):  # nothing between the fan-out and the gathering
            parts = to_rows(self._read(buf, h.segment))
            at = 0
            for parent, count in zip(parents.tolist(), counts.tolist(), strict=True):
                self._complete(parent, parts[at : at + count], h.flags)
                at += count
            return
        children: list[int] = []
        for parent, count in zip(parents.tolist(), counts.tolist(), strict=True):
            if count == 0:
                self._complete(parent, [], h.flags)
            else:
                children += self.families.split(parent, count, h.flags)
        if children:
            ids = np.asarray(children, dtype=np.int64)
            forwarded = frames.splice(buf, Kind.ITEMS, ids)
            self.backlog[stage + 1].append(frames.Frame(forwarded, ids, h.flags, h.segment))
        elif h.segment:
            self.segments.done(h.segment)

    def fail(self, uids: np.ndarray, messages: list[str]) -> None:
        """Errors: a row fails; a fanned-out part fails its whole item, once."""
        out_uids: list[int] = []
        out_messages: list[str] = []
        for uid, message in zip(uids.tolist(), messages, strict=True):
            if uid < 0:
                found = self.families.place(uid)
                if found is None:
                    continue
                parent, index = found
                self.families.disband(parent)
                out_uids.append(parent)
                out_messages.append(f"part {index} of its fan-out: {message}")
            else:
                out_uids.append(uid)
                out_messages.append(message)
        if out_uids:
            failed = np.asarray(out_uids, dtype=np.int64)
            if self.branched:
                # A row fails once, in whichever branch fails it first; its copies in the
                # other branches are dropped where they wait, or when they reach a join.
                fresh = ~self.failed.mask(failed)
                failed = failed[fresh]
                out_messages = [
                    m for m, keep in zip(out_messages, fresh.tolist(), strict=True) if keep
                ]
                if not len(failed):
                    return
                self.failed.add(failed.tolist())
                for join in self.joins.values():
                    join.drop(failed)
            self.rows.release(failed)
            self.on_errors(failed, out_messages)

    def cancel(self, start: int, rows: int) -> None:
        """Drop the frames, at every stage, that hold only rows of start..start+rows-1, and
        report those rows as errors: that releases their sources and tells the front how
        many rows left the pipeline. A frame that holds other rows too, or parts of a fan-out
        (negative uids), goes on: the rows that share it are still wanted, and a family is
        not ours to break up here. Rows inside a process finish as usual."""
        end = start + rows
        dropped: list[np.ndarray] = []
        for backlog in self.backlog:
            kept: list[frames.Frame] = []
            for frame in backlog:
                uids = frame.uids
                if len(uids) and int(uids.min()) >= max(start, 0) and int(uids.max()) < end:
                    dropped.append(uids)
                    if frame.segment:
                        self.segments.done(frame.segment)
                else:
                    kept.append(frame)
            if len(kept) < len(backlog):
                backlog.clear()
                backlog.extend(kept)
        if dropped:
            uids = np.concatenate(dropped)
            log.debug("cancelled %d rows of uids %d..%d", len(uids), start, end - 1)
            self.fail(uids, ["cancelled: nobody waits for this row"] * len(uids))

    def _enqueue_source(self, uids: np.ndarray, data: pa.RecordBatch | Columns, flags: int) -> None:
        """Rows for the first stage(s), as submitted (or taken again from their source): a
        frame of its own for each stage that reads the rows as read."""
        if not isinstance(data, pa.RecordBatch):
            for stage in self.graph.sources:
                self._enqueue(stage, uids, data, flags)
            return
        # Arrow IPC: one copy into shared memory (a copy for each stage that reads the rows as
        # read), no pickling of values; the stage process turns it into columns (zero-copy for
        # numbers and tensors), in parallel.
        payload = (data.schema, data.serialize())
        for stage in self.graph.sources:
            buf = frames.pack(
                Kind.ITEMS, uids, payload, flags=flags | frames.ARROW, arena=self.arena
            )
            self.backlog[stage].append(frames.Frame(buf, uids, flags, frames.header(buf).segment))

    def _enqueue(self, stage: int, uids: np.ndarray, chunk: Columns, flags: int = 0) -> None:
        """Pack rows for `stage` (large buffers into shared memory) and queue them."""
        buf = frames.pack(Kind.ITEMS, uids, chunk, flags=flags, arena=self.arena)
        self.backlog[stage].append(frames.Frame(buf, uids, flags, frames.header(buf).segment))

    def _read(self, buf: bytes, segment: str) -> Any:
        """A frame's payload, copied out of its shared memory (which goes back at once)."""
        try:
            return frames.payload(buf, arena=self.arena, copy=True)
        finally:
            if segment:
                self.segments.done(segment)

    def _gathers_after(self, stage: int) -> bool:
        """Is the end of `stage` where the items of a fan-out come back together?"""
        if self.fanout_stage is None or stage < self.fanout_stage:
            return False
        return stage + 1 == (self.fanin_stage if self.fanin_stage is not None else self.stages)

    def _gather(self, uids: np.ndarray, chunk: Columns) -> None:
        for uid, value in zip(uids.tolist(), to_rows(chunk), strict=True):
            family = self.families.gather(uid, value)
            if family is not None:
                self._complete(family.parent, family.results, family.flags)

    def _complete(self, parent: int, results: list[Any], flags: int) -> None:
        """A fanned-out item has all its parts: on to the fan-in stage, or out."""
        uids = np.asarray([parent], dtype=np.int64)
        chunk = from_rows([results])
        if self.fanin_stage is not None:
            self._enqueue(self.fanin_stage, uids, chunk, flags)
        else:
            self.rows.release(uids)
            self.on_results(uids, chunk)
