"""Shards sized for the fleet: how many rows a shard gets when the job does not say.

Without `rows_per_shard`, a shard gets `fleet_shard_rows` rows: at least `SHARDS_PER_WORKER`
shards for each of the job's workers, so that each has work from the start and the tail is
short, and at most `AUTO_MAX_ROWS` (minutes of work at the rates of
common models), so that the master's work per row stays small however many rows there are.
Not fewer than `least_rows(spec)`: `AUTO_MIN_ROWS`, or `GENERATION_MIN_ROWS` for a job that
generates text, whose rows each cost an engine tens of tokens.
Parquet is cut into its row groups, packed into such shards (`pack`); text is cut by the
rows that its files' sizes and the first file's lines promise. Big shards are safe: a worker
that must go commits the rows it has done (a split), and a straggler's rest goes elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ebb.common.job import JobSpec
from ebb.common.messaging.messages import ShardSpec

AUTO_MIN_ROWS = 1_000
"""Fewest rows of a shard sized for the fleet: below, a shard costs the master more than its
rows cost a worker."""
AUTO_MAX_ROWS = 1_048_576
"""Most rows of a shard sized for the fleet: a row group as pyarrow writes by default."""
GENERATION_MIN_ROWS = 256
"""Fewest rows of a shard sized for the fleet when the job generates text (an `llm` stage
that is not `tokenize_only`): one of its rows is a whole answer of the engine's, and a shard of
AUTO_MIN_ROWS rows left a job of 1,536 prompts one shard for two workers. An engine's batch
(`max_in_flight`, 256 unless set) a shard, at least: the stage feeds the next shard's rows to
the engine while one finishes, so smaller shards would only cost the master."""
SHARDS_PER_WORKER = 4


def least_rows(spec: JobSpec) -> int:
    """The fewest rows of a shard sized for the fleet, for this job."""
    generates = any(s.llm is not None and not s.llm.tokenize_only for s in spec.pipeline.stages)
    return GENERATION_MIN_ROWS if generates else AUTO_MIN_ROWS


def fleet_shard_rows(total_rows: int, workers: int, *, least: int = AUTO_MIN_ROWS) -> int:
    """Rows a shard of a job of `total_rows` rows on `workers` workers: SHARDS_PER_WORKER
    shards for each worker, within [least, AUTO_MAX_ROWS] (`least_rows`)."""
    per_shard = -(-total_rows // max(1, workers * SHARDS_PER_WORKER))
    return max(least, min(AUTO_MAX_ROWS, per_shard))


def pack(pieces: Sequence[ShardSpec], rows_per_shard: int) -> list[ShardSpec]:
    """Adjacent pieces of one file joined into shards of at most `rows_per_shard` rows (a
    piece larger than that stays a shard of its own). Parquet pieces join their row groups;
    text pieces, byte ranges that meet."""
    shards: list[ShardSpec] = []
    for piece in pieces:
        last = shards[-1] if shards else None
        joins = (
            last is not None
            and last.path == piece.path
            and last.rows + piece.rows <= rows_per_shard
            and (piece.format == "parquet" or last.byte_end == piece.byte_start)
        )
        if last is not None and joins:
            shards[-1] = replace(
                last,
                rows=last.rows + piece.rows,
                row_groups=[*last.row_groups, *piece.row_groups],
                byte_end=piece.byte_end,
            )
        else:
            shards.append(piece)
    return shards


def few_shards_advice(
    shards: Sequence[ShardSpec], workers: int, *, rows_per_shard: int | None, split_tail: bool
) -> str:
    """What to change when the input makes fewer shards than the job's workers (some have
    nothing to do from the start); "" when it makes enough. Parquet is cut only between row
    groups when planned: a file of one group is one shard whatever `rows_per_shard` says.
    With `split_tail` a running Parquet shard is split for idle workers (its rest cut in two),
    so they wait only for its first rows, and decode part of its group again."""
    if len(shards) >= workers or not shards:
        return ""
    idle = workers - len(shards)
    total = sum(s.rows for s in shards)
    each = max(1, -(-total // workers))
    parquet = all(s.format == "parquet" for s in shards)
    one = idle == 1
    waits = (
        f"{'waits' if one else 'wait'} until a running shard is split for {'it' if one else 'them'}"
        if parquet and split_tail
        else "will have nothing to do"
    )
    said = (
        f"the input makes {len(shards)} shard{'s' if len(shards) > 1 else ''} for up to "
        f"{workers} workers: {idle} {waits}"
    )
    if parquet:
        groups = sum(len(s.row_groups) for s in shards)
        if groups > len(shards):  # groups were packed together: smaller shards can be had
            return f"{said}. Set input.rows_per_shard to {each:,} or less"
        largest = max(s.rows for s in shards)
        start = "for every worker to start at once" if split_tail else "for every worker"
        return (
            f"{said}. Its Parquet files hold {groups} row group{'s' if groups > 1 else ''} "
            f"(the largest of {largest:,} rows), and a row group is not cut before the job "
            f"starts: {start}, write the files with row groups of {each:,} rows or less "
            f"(pyarrow: pq.write_table(table, path, row_group_size={each}))"
        )
    now = f" (now {rows_per_shard:,})" if rows_per_shard else ""
    return f"{said}. Set input.rows_per_shard to {each:,} or less{now}"
