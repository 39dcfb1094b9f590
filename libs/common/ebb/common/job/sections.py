"""The job spec's sections other than the pipeline: `input`, `output`, `resources`, a tier,
`fault`, `tracking`. Each dataclass keeps its fields' docstrings (the job spec reference,
docs/gen_spec.py renders them) beside the checks of their values (`__post_init__`)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any, Literal

from .fields import (
    FORMAT_SUFFIXES,
    TIER_NAME_RE,
    InputFormat,
    Pool,
    arrow_type,
    bad,
    positive,
)
from .placement import check_gpu_type, check_node_placement, check_pool


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """What to read, and how it is cut into shards."""

    uri: str
    """A file, a folder (every file of the format under it) or a glob; a path or fsspec URL."""
    format: InputFormat | None = None
    """parquet, csv or jsonl. Inferred from the file suffix when absent."""
    columns: list[str] | None = None
    """Columns handed to the pipeline, per row. None: every column."""
    rows_per_shard: int | None = None
    """Target rows in one shard, the unit of leasing, retry and commit. None (the default):
    sized for the fleet: four shards or more for each of the job's `max_workers`, of 1,000
    (256 for a job that generates text: an `llm` stage) to 1,048,576 rows (Parquet: whole
    row groups, never cut). A worker told to go commits the
    rows it has done and a straggler's rest moves to an idle worker (a split), so big shards
    lose nothing."""
    column_types: dict[str, str] = field(default_factory=dict)
    """CSV: Arrow types of columns by name ("int64", "double", "string", "bool",
    "timestamp[s]", "date32", ...). The shard master types the other columns from samples
    taken across the files when it plans, and stores the result here: every shard reads each
    column as the same type, and a value that is not of its column's type makes an error row."""
    newlines_in_values: bool = False
    """CSV: quoted values may hold line breaks. Planning then reads every file once, to cut
    shards where rows end."""

    def __post_init__(self) -> None:
        if not self.uri:
            raise bad("uri", "must not be empty")
        if self.rows_per_shard is not None:
            positive("rows_per_shard", self.rows_per_shard)
        if self.format is None:
            suffix = posixpath.splitext(self.uri.rstrip("/"))[1].lower()
            inferred = FORMAT_SUFFIXES.get(suffix)
            if inferred is None:
                raise bad("format", f"cannot infer from {self.uri!r}; say parquet, csv or jsonl")
            object.__setattr__(self, "format", inferred)
        if self.format != "csv":
            if self.column_types:
                raise bad("column_types", f"applies to CSV input only, not {self.format}")
            if self.newlines_in_values:
                raise bad("newlines_in_values", f"applies to CSV input only, not {self.format}")
        for name, type_name in self.column_types.items():
            try:
                arrow_type(type_name)
            except ValueError as e:
                raise bad(f"column_types.{name}", str(e)) from None

    @property
    def fmt(self) -> InputFormat:
        assert self.format is not None  # filled in by __post_init__
        return self.format


@dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """Where the results go, in which format, with which input columns beside them."""

    uri: str
    """Output root: data/, _commits/ and _manifest.json are written under it."""
    format: Literal["parquet", "jsonl", "csv"] = "parquet"
    """parquet (zstd), jsonl (one JSON object per row) or csv (with a header; columns of
    lists or maps are written as JSON text)."""
    max_rows_per_file: int | None = None
    """Most rows in one output file: a shard's output is split into parts of at most this many
    rows. None: one file per shard."""
    carryover: list[str] = field(default_factory=list)
    """Input columns copied, untouched, into the output next to the predictions."""
    prediction_column: str = "prediction"
    """Column name for the last stage's result when it is not a map of columns."""

    def __post_init__(self) -> None:
        if not self.uri:
            raise bad("uri", "must not be empty")
        if self.max_rows_per_file is not None:
            positive("max_rows_per_file", self.max_rows_per_file)


@dataclass(frozen=True, kw_only=True)
class ResourceSpec:
    """How many workers the job may have, and what each one asks of a node."""

    min_workers: int = 1
    """Workers the controller places for this job before it shares what is left among
    jobs of its priority (capacity permitting; never more than the job has shards left)."""
    max_workers: int = 1
    """Most workers the job runs at once; fewer while it has fewer shards left to do."""
    cpu: float = 1.0
    """CPU cores requested per worker (Kubernetes backend: the pod's request, and the cores
    the worker shares among its stage processes)."""
    memory_gb: float = 2.0
    """Memory requested per worker, in GiB (Kubernetes backend: the pod's request and limit;
    an OOMKilled worker's successors ask for more)."""
    gpu: int = 0
    """GPUs per worker (Kubernetes backend: `nvidia.com/gpu`)."""
    gpu_type: str | None = None
    """The GPU model workers run on, as the node label the controller's `gpu_type_label`
    names says it (NVIDIA GPU feature discovery's `nvidia.com/gpu.product`, say:
    `NVIDIA-A100-SXM4-80GB`). Needs `gpu` > 0. None: any GPU."""
    pool: Pool = "auto"
    """Kubernetes backend: the pools workers may run on. `offline`: the offline pool only.
    `any`: the offline pool first, then mixed nodes the tide has lent. `mixed`: lent mixed
    nodes first (cheap, and reclaimed when online work needs them), then the offline pool.
    `auto`: the controller decides by the job's kind: `mixed` for a job expected to finish
    soon, `any` for a long one, or one whose workers were reclaimed often. `online`: read as
    `any` (batch workers never run on online nodes). A job stored by a version before pools
    placed workers says `offline`, its default then, and is read as `any`, as it ran."""

    def __post_init__(self) -> None:
        if self.min_workers < 0:
            raise bad("min_workers", f"must be >= 0, got {self.min_workers}")
        positive("max_workers", self.max_workers)
        if self.min_workers > self.max_workers:
            raise bad("min_workers", f"{self.min_workers} exceeds max_workers {self.max_workers}")
        positive("cpu", self.cpu)
        positive("memory_gb", self.memory_gb)
        if self.gpu < 0:
            raise bad("gpu", f"must be >= 0, got {self.gpu}")
        check_pool(self.pool)
        check_gpu_type(self.gpu_type, gpu=self.gpu)


@dataclass(frozen=True, kw_only=True)
class TierSpec:
    """A run of the pipeline's stages with workers of its own, sized and placed apart from the
    other tiers' (decoding on CPU nodes, the model on GPU nodes). Its last stage's rows are
    committed per shard and handed on to the next tier, which reads them as its input."""

    name: str
    """The tier's name, in its pods' names and labels: lowercase letters, digits and `-`, 1 to
    20 characters, a letter or digit at each end."""
    stages: list[str]
    """The pipeline stages the tier runs, by name (an unnamed stage is `stage<N>`, N its place
    in the pipeline): consecutive stages, in the pipeline's order, following the tier
    before's."""
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    """The tier's workers and what each asks of a node, as the job's `resources` section
    says them for a job without tiers."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels the tier's workers are placed on (a Kubernetes `nodeSelector`), e.g.
    `nvidia.com/gpu.present: "true"`; over the job's `node_selector`, label by label."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Taints of nodes the tier's workers may run on (Kubernetes tolerations), besides the
    job's `tolerations`: maps of `key`, `operator` (Equal, the default, or Exists), `value`,
    `effect` (NoSchedule, PreferNoSchedule or NoExecute; absent: every effect) and
    `tolerationSeconds` (NoExecute only)."""

    def __post_init__(self) -> None:
        if not TIER_NAME_RE.match(self.name):
            raise bad(
                "name",
                f"{self.name!r} is not a tier name: 1 to 20 lowercase letters, digits and `-`, "
                "a letter or digit at each end",
            )
        if not self.stages:
            raise bad("stages", "a tier runs at least one stage")
        check_node_placement(self.node_selector, self.tolerations)


@dataclass(frozen=True, kw_only=True)
class FaultPolicy:
    """What a failure costs: when a shard is retried, quarantined, or fails the job."""

    lease_s: float = 60.0
    """Lease period. Workers renew at about a third of it; an expired lease is retried."""
    max_attempts: int = 3
    """Failed attempts after which a shard is quarantined: its rows raised or hung, its
    worker crashed or ran out of memory while computing it, or its lease ran out with no
    word of why. Attempts lost with a worker the cluster took (preempted, evicted, its node
    lost, killed from outside) are forgiven."""
    max_worker_losses: int | None = None
    """Forgiven losses after which a shard is quarantined all the same: a shard that takes
    down every worker that touches it in ways that look like the cluster's. None: 5 x
    max_attempts."""
    max_error_fraction: float = 0.01
    """Fraction of rows allowed to fail (error rows and quarantined shards) before the job fails."""
    batch_timeout_s: float = 300.0
    """A batch running longer kills and restarts its stage process; retried once, then errors.
    An `llm` stage's batch counts from its last progress (a decoding step, a row a server
    answered): a long batch that keeps generating runs on, one that stalls is killed."""
    worker_memory_gb: float | None = None
    """Stage processes above this RSS are recycled between batches."""
    speculative: bool = True
    """Re-lease the oldest running shards to idle workers at the tail of the job."""
    split_tail: bool = True
    """At the tail of the job (nothing queued, a worker idle), ask the holder of a running
    shard to commit the rows it has done and hand over the rest, before any shard is
    re-leased whole (speculation stays for holders that tell no progress): a straggler's rest
    moves whole to the idle worker; a Parquet shard's rest worth two workers is cut in two, a
    half each for the idle worker and the holder (so a file of one row group is computed by
    every worker)."""

    def worker_loss_cap(self) -> int:
        """Forgiven losses of one shard after which it is quarantined anyway."""
        return self.max_worker_losses or 5 * self.max_attempts

    def __post_init__(self) -> None:
        positive("lease_s", self.lease_s)
        positive("max_attempts", self.max_attempts)
        if self.max_worker_losses is not None:
            positive("max_worker_losses", self.max_worker_losses)
        if not 0 <= self.max_error_fraction <= 1:
            raise bad("max_error_fraction", f"must lie in [0, 1], got {self.max_error_fraction}")
        positive("batch_timeout_s", self.batch_timeout_s)
        if self.worker_memory_gb is not None:
            positive("worker_memory_gb", self.worker_memory_gb)


@dataclass(frozen=True, kw_only=True)
class TrackingSpec:
    """Where the job's metrics are logged besides its `_metrics.json`: an MLflow run."""

    mlflow_uri: str | None = None
    """An MLflow tracking URI: a server (`http://host:5000`, `databricks`), or a local store
    under the data roots (a folder, which MLflow 3 writes only with
    `MLFLOW_ALLOW_FILE_STORE=true` set; a `sqlite:` database, which needs the full `mlflow`
    package). Logging needs the `mlflow` extra (`pip install 'ebb[mlflow]'`) where the
    metrics are logged. None: not logged."""
    experiment: str | None = None
    """The MLflow experiment to log the run in, made if it does not exist. Default: the job's
    name."""

    def __post_init__(self) -> None:
        if self.mlflow_uri is not None and not self.mlflow_uri:
            raise bad("mlflow_uri", "must not be empty (null: not logged)")
        if self.experiment is not None and not self.experiment:
            raise bad("experiment", "must not be empty (null: the job's name)")
