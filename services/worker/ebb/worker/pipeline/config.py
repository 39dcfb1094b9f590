"""The pipeline's configuration and errors (shared by the router and its asyncio front)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ebb.common.job import StageSpec

from .elastic import ElasticSettings


class PipelineError(Exception):
    """The pipeline cannot serve rows any more."""


class PipelineSetupError(PipelineError):
    """The pipeline never started: a stage failed its set-up (bad modelet, a model file that
    would not load, an import error, a device that would not open), its processes kept dying
    while starting, or the stages were not ready in time. Every shard would fail the same way
    here; whether it would elsewhere, only other workers can tell."""


class PipelineBroken(PipelineError):
    """The pipeline started, then stopped working: the router failed (a fork server lost
    again and again, say), or processes replacing dead ones kept failing to start (a GPU
    still holding the memory of the process that died). Not the shard's fault, nor the job's:
    a fresh worker may well do better."""


_MIN_FRAME_ROWS = 256


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    stages: list[StageSpec]
    code_paths: list[str] = field(default_factory=list)
    batch_timeout_s: float = 300.0
    """A batch running longer gets its process killed; its rows are retried once, alone."""
    memory_limit_bytes: int | None = None
    """A stage process above this RSS is recycled between batches."""
    max_inflight: int = 0
    """Rows inside the pipeline at most (0: enough to keep every stage process busy)."""
    max_item_crashes: int = 2
    """A row whose batch's process dies this many times becomes an error."""
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    """How the elastic scheduler decides (used when any stage has min_workers < max_workers)."""
    start_timeout_s: float = 300.0
    cpus: float | None = None
    """The worker's CPU budget in cores (cpus.detect, when None)."""
    gpus: tuple[str, ...] | None = None
    """The worker's GPUs, as CUDA_VISIBLE_DEVICES names them (None: nothing says)."""

    def inflight_limit(self) -> int:
        if self.max_inflight:
            return self.max_inflight
        # Each stage process's batch and the next; an llm stage's batches at once and the next.
        busy = sum(
            (s.llm.concurrent_batches + 1 if s.llm is not None else 2)
            * (s.max_workers or s.workers)
            * s.rows_per_batch
            for s in self.stages
        )
        return max(busy + 2 * self.frame_size(), 4 * self.frame_size())

    def frame_size(self) -> int:
        """Rows per chunk handed to the first stage(s): its batch, so that a chunk is a batch
        (no re-cutting), but no fewer than 256 (the router's cost is per chunk: chunks of a
        default batch of 32 rows made it the bottleneck of a light model, at half the rate
        of chunks of 256), nor more than 4096, which keeps a chunk's memory modest."""
        return max(_MIN_FRAME_ROWS, min(4096, self.stages[0].rows_per_batch))
