"""Finishing a job that succeeded: the manifest of exactly the committed files."""

from __future__ import annotations

import asyncio
import logging

from ebb.common import schema
from ebb.common.data.layout import MANIFEST, TIERS_DIR, Manifest, ManifestFile, QuarantinedShard
from ebb.common.data.output import OutputStore

from ..errors import TableCorrupt
from . import jobmetrics
from .jobs import Job, Shard
from .transitions import successor_of

log = logging.getLogger(__name__)


def in_input_order(job: Job) -> list[Shard]:
    """The job's shards in the order of their rows in the input: each planned shard followed
    by the remainders split off it, so that the manifest lists a split shard's parts in order
    (a remainder's index is the next free one, after every planned shard). In a job in tiers,
    each piece done in a tier before the last stands for the pieces of the next tier that
    read it, down to the last tier's, whose files are the output.

    A successor is followed only where it was made for the shard that names it, and each
    shard is placed once: TableCorrupt otherwise (no manifest lists a file twice)."""
    placed: set[int] = set()

    def successor(origin: Shard, index: int | None) -> Shard | None:
        if index is None:
            return None
        found = job.shards[index] if index < len(job.shards) else None
        if found is None or not successor_of(origin.record, found.record):
            raise TableCorrupt(
                f"job {job.id}: shard {origin.index} names shard {index} as its successor, "
                "which was not made for it"
            )
        return found

    def pieces(first: Shard) -> list[Shard]:
        """`first`, then the pieces of its rest in order: its remainder's, then those of
        the rest's second half, if the rest was cut in two. Iterative: a shard split a
        thousand times is a chain a thousand long."""
        chain: list[Shard] = []
        todo: list[Shard] = [first]
        while todo:
            part = todo.pop()
            if part.index in placed:
                raise TableCorrupt(f"job {job.id}: shard {part.index} is reached twice")
            placed.add(part.index)
            chain.append(part)
            # Pushed last, taken first: the first half (and what it was split into) before
            # the second.
            for rest in (part.record.remainder_half, part.record.remainder):
                found = successor(part, rest.index if rest is not None else None)
                if found is not None:
                    todo.append(found)
        return chain

    def down(first: Shard) -> list[Shard]:
        ordered: list[Shard] = []
        for piece in pieces(first):
            on = successor(piece, piece.record.handoff)
            if on is not None:
                ordered += down(on)
            else:
                ordered.append(piece)
        return ordered

    ordered = [
        shard
        for planned in job.shards
        # Remainders and hand-offs are placed after the shards they come from.
        if planned.record.split_from is None and planned.record.handed_from is None
        for shard in down(planned)
    ]
    if len(placed) != len(job.shards):
        missed = sorted(set(range(len(job.shards))) - placed)
        raise TableCorrupt(f"job {job.id}: shards {missed[:5]} are named by no shard")
    return ordered


def _input_path(job: Job, shard: Shard) -> str:
    """The input file a shard's rows came from: a later tier's shard reads a hand-off, which
    goes when the job succeeds."""
    record = shard.record
    while record.handed_from is not None:
        record = job.shards[record.handed_from].record
    return record.spec.path


def build_manifest(job: Job, *, created_at: float) -> tuple[Manifest, dict[int, int]]:
    """The job's manifest, and the winning attempt of each shard that is DONE."""
    files: list[ManifestFile] = []
    winners: dict[int, int] = {}
    quarantined: list[QuarantinedShard] = []
    for shard in in_input_order(job):
        record = shard.record
        if record.state == "QUARANTINED":
            quarantined.append(
                QuarantinedShard(
                    shard=shard.index,
                    path=_input_path(job, shard),
                    rows=record.spec.rows,
                    reason=record.errors[-1] if record.errors else "",
                )
            )
            continue
        winners[shard.index] = record.done_attempt
        files += [
            ManifestFile(
                path=f.path,
                shard=shard.index,
                attempt=record.done_attempt,
                rows=f.rows,
                error_rows=f.error_rows,
            )
            for f in record.files
        ]
    manifest = Manifest(
        job=job.id,
        files=files,
        rows=job.rows_done,
        error_rows=job.error_rows,
        shards=job.shards_total,
        quarantined_shards=[q.shard for q in quarantined],
        quarantined=quarantined,
        created_at=created_at,
    )
    return manifest, winners


async def write_manifest(job: Job, output: OutputStore, *, created_at: float) -> str:
    """Write the job's manifest, then remove the attempts that lost. Returns its URL.
    `created_at`: wall-clock seconds."""
    manifest, winners = build_manifest(job, created_at=created_at)
    specs = job.spec.pipeline.all_metrics()
    if specs:
        # Before the manifest, which is what says the job's output is whole.
        described = {name: schema.dump(spec) for name, spec in specs.items()}
        await asyncio.to_thread(output.write_metrics, job.id, jobmetrics.results(job), described)
    await asyncio.to_thread(output.write_manifest, manifest)
    try:
        removed = await asyncio.to_thread(output.remove_uncommitted, winners)
        if removed:
            log.info("job %s: removed %d uncommitted attempt folders", job.id, removed)
    except OSError as e:  # garbage left behind is harmless: readers use the manifest
        log.warning("job %s: could not remove uncommitted attempts: %s", job.id, e)
    if len(job.tiers) > 1:
        # What is left of the hand-offs (those of attempts that lost, or not yet removed):
        # a job that failed or was cancelled keeps them, for a resume to read.
        try:
            await asyncio.to_thread(output.remove, TIERS_DIR)
        except OSError as e:
            log.warning("job %s: could not remove %s: %s", job.id, TIERS_DIR, e)
    return output.url(MANIFEST)


def failure_reason(job: Job, errors: int) -> str:
    """Why a job failed: its error rows over budget, or its quarantined shards."""
    parts = [
        f"{errors} failed rows exceed max_error_fraction "
        f"{job.spec.fault.max_error_fraction} of {job.record.rows_total} rows"
    ]
    quarantined = [s for s in job.shards if s.record.state == "QUARANTINED"]
    if quarantined and len(quarantined) == job.shards_total:
        parts = ["every shard was quarantined"]
    for shard in quarantined[:3]:
        last = shard.record.errors[-1] if shard.record.errors else "?"
        parts.append(f"shard {shard.index} quarantined: {last}")
    return "; ".join(parts)
