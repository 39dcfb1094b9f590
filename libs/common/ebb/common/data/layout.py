"""What an output root holds, and where: the records (`_job.json`, commit records, the
manifest) and the paths of data files, commit records and claims. The protocol that writes
them is in ebb.common.data.output."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DATA_DIR = "data"
COMMITS_DIR = "_commits"
MANIFEST = "_manifest.json"
METRICS = "_metrics.json"
TIERS_DIR = "_tiers"
"""Under the output root: each tier but the last commits its output here, in a folder of its
own (`tier_root`), for the next tier to read. Readers of the output pass over it (a leading
underscore, as pyarrow's datasets and Spark do), and the master removes it when the job
succeeds. A job that fails or is cancelled keeps it, for its resume: its commit records hold
the root for that job as the output's own do."""
"""Beside the manifest: the values of the job's metrics over exactly its rows."""
OWNER = "_job.json"
"""Names the job that owns the output root; created exclusively when the job is accepted."""
CLAIMS_DIR = "_claims"


@dataclass(frozen=True, kw_only=True)
class OutputOwner:
    """The record in `_job.json`: which job owns the root, what it computes, how it ended."""

    job: str
    claimed_at: float = 0.0
    generation: int = 0
    """0 for the root's first owner; each job that takes it over after one that let go of it
    counts one more."""
    took_over_from: str = ""
    """The job that let go of the root before this one took it over, or whose output this one
    replaced (`replaced`)."""
    replaced: bool = False
    """This job took the root over from one that ended FAILED or CANCELLED with output in
    it, on purpose (`ebb run --replace`): that output was removed."""
    removing: bool = False
    """The replaced job's output is still being removed: whoever claims the root (this job,
    submitted again after a crash) finishes removing it before any shard runs."""
    output_fields: dict[str, Any] | None = None
    """What decides the job's rows (JobSpec.output_fields); None in a record written before
    they were kept, which has `spec_digest` only."""
    output_digest: str = ""
    spec_digest: str = ""
    """Older records: JobSpec.whole_sections_digest of the spec the job was submitted with."""
    state: str = ""
    """How the job ended (SUCCEEDED, FAILED, CANCELLED); "" while it runs, or if its master
    stopped before it could say."""
    shards_done: int = 0
    shards_total: int = 0
    rows_done: int = 0
    released: bool = False
    """The job ended with nothing committed: it owns nothing, and another job may take the
    root over."""


ERRORS_KEPT = 5
"""Row errors kept by message in a commit record, a shard's and a job's, the most common."""
ERROR_CHARS = 300
"""A row error's message, as kept there, at most (the row's `_error` keeps it whole)."""


def most_common_errors(counts: Mapping[str, int], *, kept: int = ERRORS_KEPT) -> dict[str, int]:
    """The `kept` most common messages of `counts`, each cut to ERROR_CHARS (messages equal
    once cut are counted together), most common first."""
    cut: dict[str, int] = {}
    for message, n in counts.items():
        short = message if len(message) <= ERROR_CHARS else message[: ERROR_CHARS - 1] + "…"
        cut[short] = cut.get(short, 0) + n
    ranked = sorted(cut.items(), key=lambda item: (-item[1], item[0]))
    return dict(ranked[:kept])


def claim_path(generation: int) -> str:
    return f"{CLAIMS_DIR}/generation={generation}.json"


@dataclass(frozen=True, kw_only=True)
class OutputFile:
    path: str
    """Relative to the output root."""
    rows: int
    error_rows: int = 0
    bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class CommitRecord:
    job: str
    shard: int
    attempt: int
    files: list[OutputFile]
    worker: str = ""
    committed_at: float = 0.0
    split_at: int = 0
    """0: the attempt computed the whole shard. Otherwise it stopped (its worker had to go, or
    the master asked for the rest to run elsewhere) after the shard's first `split_at` rows,
    and these files are those rows: a part of the shard. The master makes the rest a shard of
    its own (`ebb.common.messaging.messages.rest_of`)."""
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The partials of the job's metrics (`ebb.common.job.accumulators`) over exactly the rows of
    these files, by metric: the master merges those of the attempts that won their shards."""
    row_errors: dict[str, int] = field(default_factory=dict)
    """The most common errors of these files' error rows, by message, with their counts
    (`most_common_errors`): what a job's summary quotes."""
    generation: dict[str, dict[str, Any]] = field(default_factory=dict)
    """By `llm` stage: what generated these files' text (the model's path and the SHA-256 of
    its files, the engine and its version, the sampling, the structured output;
    `ebb.worker.llm.provenance`). Empty for a job without one."""

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def error_rows(self) -> int:
        return sum(f.error_rows for f in self.files)


@dataclass(frozen=True, kw_only=True)
class ManifestFile:
    path: str
    shard: int
    attempt: int
    rows: int
    error_rows: int = 0


@dataclass(frozen=True, kw_only=True)
class QuarantinedShard:
    """A shard no attempt could finish (its rows are in no file): where it is, and why."""

    shard: int
    path: str
    rows: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    job: str
    files: list[ManifestFile]
    rows: int
    error_rows: int
    shards: int
    quarantined_shards: list[int] = field(default_factory=list)
    quarantined: list[QuarantinedShard] = field(default_factory=list)
    """The quarantined shards with their input and their last error (within the job's
    error threshold, or the job would have failed)."""
    created_at: float = 0.0


def shard_dir(shard: int) -> str:
    return f"{DATA_DIR}/shard={shard:05d}"


def attempt_dir(shard: int, attempt: int) -> str:
    return f"{shard_dir(shard)}/attempt={attempt}"


def commit_path(shard: int) -> str:
    return f"{COMMITS_DIR}/shard={shard:05d}.json"


def tier_root(output_uri: str, tier: str) -> str:
    """The root the shards of `tier` (a tier before the last) commit their output to."""
    return f"{output_uri.rstrip('/')}/{TIERS_DIR}/{tier}"
