"""The job spec: what to read, which pipeline to run on it, where to write, with what resources
and which fault policy. It is the same map whether it arrives as YAML, JSON or msgpack.

Every field is validated on load (types by `schema.load`, values by `__post_init__`), so a bad
spec is refused with the path of the first bad field before any state changes anywhere.

One module for the whole schema, though it is long: each field's docstring here is the job
spec reference (docs/gen_spec.py renders it), and a section split from its validation or its
neighbours would let the two drift.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import re
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

from . import schema
from .accumulators import MetricSpec
from .errors import SchemaError, SpecError
from .placement import check_gpu_type, check_node_placement, check_pool
from .tiers import check_tiers

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
MODELET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
METRIC_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
TIER_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$")
"""A tier's name goes into its pods' names and labels: a short DNS label."""
InputFormat = Literal["parquet", "csv", "jsonl"]
Runtime = Literal["onnx", "torchscript"]
ModelDtype = Literal["float32", "float16", "bfloat16"]
Pool = Literal["auto", "offline", "any", "mixed", "online"]

MODEL_SUFFIXES: dict[str, Runtime] = {
    ".onnx": "onnx",
    ".pt": "torchscript",
    ".pth": "torchscript",
    ".ts": "torchscript",
    ".torchscript": "torchscript",
}
RUNTIME_MODULES: dict[Runtime, str] = {"onnx": "onnxruntime", "torchscript": "torch"}
"""The module each runtime imports: what a worker's stage processes can have imported for them,
once, before they start (see `JobSpec.runtime_modules`)."""
FORMAT_SUFFIXES: dict[str, InputFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
}


_TIMESTAMP_RE = re.compile(r"^timestamp\[(s|ms|us|ns)(?:, tz=([^\]]+))?\]$")


def arrow_type(name: str) -> Any:
    """The pyarrow DataType a type name stands for: an alias ("int64", "string", "date32") or
    the name pyarrow prints ("double", "timestamp[s, tz=UTC]"). ValueError if none."""
    import pyarrow as pa

    match = _TIMESTAMP_RE.match(name.strip())
    if match:
        return pa.timestamp(match.group(1), tz=match.group(2))
    try:
        return pa.type_for_alias(name.strip())  # type: ignore[call-overload]
    except (ValueError, KeyError):
        raise ValueError(
            f"{name!r} is not an Arrow type name (int64, double, string, ...)"
        ) from None


def _bad(name: str, problem: str) -> SpecError:
    return SpecError(name, problem)


def _positive(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise _bad(name, f"must be a finite number, got {value}")
    if value <= 0:
        raise _bad(name, f"must be > 0, got {value}")


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
    to 1,048,576 rows (Parquet: whole row groups, never cut). A worker told to go commits the
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
            raise _bad("uri", "must not be empty")
        if self.rows_per_shard is not None:
            _positive("rows_per_shard", self.rows_per_shard)
        if self.format is None:
            suffix = posixpath.splitext(self.uri.rstrip("/"))[1].lower()
            inferred = FORMAT_SUFFIXES.get(suffix)
            if inferred is None:
                raise _bad("format", f"cannot infer from {self.uri!r}; say parquet, csv or jsonl")
            object.__setattr__(self, "format", inferred)
        if self.format != "csv":
            if self.column_types:
                raise _bad("column_types", f"applies to CSV input only, not {self.format}")
            if self.newlines_in_values:
                raise _bad("newlines_in_values", f"applies to CSV input only, not {self.format}")
        for name, type_name in self.column_types.items():
            try:
                arrow_type(type_name)
            except ValueError as e:
                raise _bad(f"column_types.{name}", str(e)) from None

    @property
    def fmt(self) -> InputFormat:
        assert self.format is not None  # filled in by __post_init__
        return self.format


def _runtime(model: str, runtime: Runtime | None) -> Runtime:
    """The runtime that serves a model file: the one named (checked against the file's
    suffix), or the one its suffix implies."""
    suffix = posixpath.splitext(model)[1].lower()
    inferred = MODEL_SUFFIXES.get(suffix)
    if runtime is None:
        if inferred is None:
            known = ", ".join(MODEL_SUFFIXES)
            raise _bad("model", f"unknown model suffix {suffix!r} (known: {known})")
        return inferred
    if inferred is not None and inferred != runtime:
        raise _bad("runtime", f"{runtime} does not match a {suffix} model file")
    return runtime


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model of a `models` stage: its file, the column it reads, the column it writes."""

    model: str
    """Path or URL of an ONNX (.onnx) or TorchScript (.pt, .ts) file."""
    runtime: Runtime | None = None
    """onnx or torchscript. Inferred from the model file's suffix when absent."""
    output: str
    """The column the model's output goes under (several outputs: a map per row)."""
    input: str | None = None
    """The column the model reads; it is consumed (left out of the stage's output). None: the
    whole row, as a `model` stage without `input` reads it."""
    dtype: ModelDtype | None = None
    """The precision to run the model in, as a `model` stage's `dtype`."""

    def __post_init__(self) -> None:
        if not self.output:
            raise _bad("output", "must name a column")
        object.__setattr__(self, "runtime", _runtime(self.model, self.runtime))


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One stage of the pipeline: a user modelet class, or model files served by runtimes."""

    name: str = ""
    """Shown in logs and metrics. Defaults to `stage<N>`."""
    modelet: str | None = None
    """`module:Class`, importable in the worker (see pipeline.code_paths)."""
    model: str | None = None
    """Path or URL of an ONNX (.onnx) or TorchScript (.pt, .ts) file."""
    runtime: Runtime | None = None
    """onnx or torchscript. Inferred from the model file's suffix when absent."""
    models: list[ModelSpec] | None = None
    """Several models served by one process (instead of `model`), for models that fit one
    device together: an A/B pair, a few checkpoints. Every model runs on every batch and reads
    it as it came in (no model sees another's output); the batch comes out less the columns
    the models read as `input`, plus each model's `output` column. `threads`, `device` and
    `finite_inputs` apply to each model; a model that raises fails the batch."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the modelet's constructor."""
    input: str | None = None
    """`model` stages: feed this field of a map item to the model, instead of the item itself."""
    output: str | None = None
    """`model` stages: put the model's output under this key of the (map) item, keeping the
    item's other fields (but the `input` field, which the model consumes), instead of
    replacing the item with it."""
    fanout: bool = False
    """The stage returns a list per item; each element goes on through the next stages as an
    item of its own (a detector's crops, say). Their results come back together as a list,
    at the fan-in stage or at the end of the pipeline."""
    fanin: bool = False
    """The stage receives, per item, the list of results of its fanned-out parts."""
    after: list[str] | None = None
    """The stages whose output this stage reads, by name (stages listed before it). Stages
    that name the same stage run beside each other on the same rows: branches, each with its
    own processes and batching. A stage that names several gets each row's columns from all
    of them, joined by row; so are the stages nobody reads from, before the output is
    written. In a join a column that several inputs have is taken from the first named (a
    column passed through both branches is the same), and a result that is not a map of
    columns is named after its stage. None: the stage listed before it (the first stage: the
    rows as read), a chain as without `after`. `[]`: the rows as read (a branch straight from
    the input)."""
    batch_size: int = 32
    """Largest batch the stage assembles."""
    adaptive_batch: bool = False
    """Search, online, the batch size (up to batch_size) that costs least per item."""
    batch_wait_s: float = 0.01
    """Longest wait for a batch to fill, counted from its FIRST item."""
    workers: int = 1
    """Processes running this stage at the start."""
    min_workers: int | None = None
    """Fewest processes the elastic scheduler may leave (default: workers)."""
    max_workers: int | None = None
    """Most processes the elastic scheduler may start (default: workers: no scaling)."""
    threads: int = 0
    """Intra-op threads per process for model runtimes (0: the worker's share of the cores it
    may use, over the model stages' processes; see ebb.worker.resources.cpus)."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    dtype: ModelDtype | None = None
    """`model` stages: the precision to run in. TorchScript converts the model and its floating
    inputs at load time (outputs come back as float32); an ONNX model must have been exported
    in this precision (its inputs are checked against it)."""
    batch_tokens: int | None = None
    """Cut batches by padded size: rows x the longest row's length stays within this budget.
    Rows waiting are sorted by length (bucketed) before they are cut, so that short rows are
    not padded to long ones. Needs `length_column`."""
    length_column: str | None = None
    """With batch_tokens: the column that gives each row's length: a column of sequences
    (token ids), or a column of lengths."""
    finite_inputs: bool = True
    """Model stages: a row whose floating-point model input holds NaN or inf fails alone (an
    error row that says so) instead of giving a NaN prediction. False for a model that reads
    NaN as "missing" (tree ensembles)."""
    metrics: dict[str, MetricSpec] = field(default_factory=dict)
    """Metrics over the stage's OUTPUT columns, by name (unique in the job): each output row
    counted exactly once, whatever was retried or split, into `_metrics.json` when the job
    ends (and MLflow: see `tracking`)."""

    def __post_init__(self) -> None:
        named = [self.modelet, self.model, self.models]
        if sum(n is not None for n in named) != 1:
            raise _bad("modelet", "a stage names exactly one of `modelet`, `model` or `models`")
        if self.modelet is not None and not MODELET_RE.match(self.modelet):
            raise _bad("modelet", f"expected `module:Class`, got {self.modelet!r}")
        if self.models is not None:
            if not self.models:
                raise _bad("models", "needs at least one model")
            for key in ("runtime", "input", "output", "dtype"):
                if getattr(self, key) is not None:
                    raise _bad(key, f"a `models` stage gives each model its own {key}")
            outputs = [m.output for m in self.models]
            twice = sorted({o for o in outputs if outputs.count(o) > 1})
            if twice:
                raise _bad("models", f"each model needs an output of its own: {twice} repeat")
        if self.model is not None:
            object.__setattr__(self, "runtime", _runtime(self.model, self.runtime))
        elif self.runtime is not None:
            raise _bad("runtime", "only a model stage has a runtime")
        elif self.output is not None:
            raise _bad("output", "only a model stage has an output key")
        if self.fanout and self.fanin:
            raise _bad("fanin", "a stage cannot both fan out and fan in")
        _positive("batch_size", self.batch_size)
        if not 0 <= self.batch_wait_s < math.inf:
            raise _bad("batch_wait_s", f"must be >= 0, got {self.batch_wait_s}")
        _positive("workers", self.workers)
        if self.min_workers is None:
            object.__setattr__(self, "min_workers", self.workers)
        if self.max_workers is None:
            object.__setattr__(self, "max_workers", self.workers)
        assert self.min_workers is not None and self.max_workers is not None
        if not 1 <= self.min_workers <= self.workers <= self.max_workers:
            raise _bad("workers", "need 1 <= min_workers <= workers <= max_workers")
        if self.threads < 0:
            raise _bad("threads", f"must be >= 0, got {self.threads}")
        if self.dtype is not None and self.model is None:
            raise _bad("dtype", "only a model stage has a dtype")
        if self.batch_tokens is not None:
            _positive("batch_tokens", self.batch_tokens)
            if self.length_column is None:
                raise _bad("length_column", "batch_tokens needs the column that gives lengths")
        elif self.length_column is not None:
            raise _bad("length_column", "applies only with batch_tokens")
        if not re.match(r"^(cpu|cuda(:\d+)?)$", self.device):
            raise _bad("device", f"expected cpu, cuda or cuda:N, got {self.device!r}")
        for name in self.metrics:
            if not METRIC_NAME_RE.match(name):
                raise _bad(f"metrics.{name}", f"a metric name must match {METRIC_NAME_RE.pattern}")

    @property
    def serves_models(self) -> bool:
        """A runtime serves the stage (`model` or `models`), not a user modelet."""
        return self.modelet is None

    def runtimes(self) -> set[Runtime]:
        """The runtimes that serve the stage's models (none for a user modelet)."""
        if self.models is not None:
            return {m.runtime for m in self.models if m.runtime is not None}
        return {self.runtime} if self.runtime is not None else set()


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """The stages every row goes through, and where user modelets' code is."""

    stages: list[StageSpec]
    """Run in order: each stage's output items are the next stage's input items."""
    code_paths: list[str] = field(default_factory=list)
    """Directories put in front of sys.path in stage processes, for user modelets."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise _bad("stages", "a pipeline has at least one stage")
        named = [s if s.name else replace(s, name=f"stage{i}") for i, s in enumerate(self.stages)]
        names = [s.name for s in named]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise _bad("stages", f"stage names must be unique: {sorted(dup)}")
        fanouts = [i for i, s in enumerate(named) if s.fanout]
        fanins = [i for i, s in enumerate(named) if s.fanin]
        if len(fanouts) > 1 or len(fanins) > 1:
            raise _bad("stages", "one fan-out (and one fan-in after it) at most")
        if fanins and (not fanouts or fanins[0] <= fanouts[0]):
            raise _bad(f"stages[{fanins[0]}].fanin", "a fan-in stage comes after a fan-out stage")
        owners: dict[str, str] = {}
        for i, stage in enumerate(named):
            for metric in stage.metrics:
                if metric in owners:
                    raise _bad(
                        f"stages[{i}].metrics.{metric}",
                        f"stage {owners[metric]!r} has a metric of that name already",
                    )
                owners[metric] = stage.name
        object.__setattr__(self, "stages", named)
        reads = self.inputs()
        if (fanouts or fanins) and not self.is_chain():
            raise _bad("stages", "a fan-out needs a chain of stages (no branches by `after`)")
        if fanouts:
            # A fan-out stage's parts are rows of their own until they are gathered: a
            # metric's values cannot follow them, nor theirs be told apart from their row's.
            gathered = fanins[0] if fanins else len(named)
            for i, stage in enumerate(named[:gathered]):
                if stage.metrics:
                    raise _bad(
                        f"stages[{i}].metrics",
                        "in a pipeline that fans out, only stages from the fan-in on have metrics",
                    )
        sinks = [k for k in range(len(named)) if not any(k in r for r in reads)]
        for joined in [r for r in reads if len(r) > 1] + [sinks]:
            keys = [named[k].output for k in joined if named[k].output is not None]
            if len(set(keys)) < len(keys):
                raise _bad("stages", f"stages whose rows are joined write the same key: {keys}")

    def inputs(self) -> list[list[int]]:
        """Each stage's inputs, by index (an empty list: the rows as read)."""
        index = {s.name: k for k, s in enumerate(self.stages)}
        reads: list[list[int]] = []
        for k, stage in enumerate(self.stages):
            if stage.after is None:
                reads.append([k - 1] if k else [])
                continue
            named = []
            for name in stage.after:
                at = index.get(name)
                if at is None or at >= k:
                    raise _bad(
                        f"stages[{k}].after",
                        f"{name!r} is not a stage listed before {stage.name!r}",
                    )
                if at in named:
                    raise _bad(f"stages[{k}].after", f"{name!r} is named twice")
                named.append(at)
            reads.append(named)
        return reads

    def is_chain(self) -> bool:
        """Every stage reads the one listed before it: the pipeline has no branch or join."""
        return all(r == ([k - 1] if k else []) for k, r in enumerate(self.inputs()))

    def all_metrics(self) -> dict[str, MetricSpec]:
        """Every stage's metrics, by name (unique across the stages)."""
        return {name: m for stage in self.stages for name, m in stage.metrics.items()}

    def runtime_modules(self) -> list[str]:
        """The model runtimes' modules the stages import (not user modelets': their imports
        may do anything, a GPU's set-up included)."""
        return sorted({RUNTIME_MODULES[r] for s in self.stages for r in s.runtimes()})


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
            raise _bad("uri", "must not be empty")
        if self.max_rows_per_file is not None:
            _positive("max_rows_per_file", self.max_rows_per_file)


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
            raise _bad("min_workers", f"must be >= 0, got {self.min_workers}")
        _positive("max_workers", self.max_workers)
        if self.min_workers > self.max_workers:
            raise _bad("min_workers", f"{self.min_workers} exceeds max_workers {self.max_workers}")
        _positive("cpu", self.cpu)
        _positive("memory_gb", self.memory_gb)
        if self.gpu < 0:
            raise _bad("gpu", f"must be >= 0, got {self.gpu}")
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
            raise _bad(
                "name",
                f"{self.name!r} is not a tier name: 1 to 20 lowercase letters, digits and `-`, "
                "a letter or digit at each end",
            )
        if not self.stages:
            raise _bad("stages", "a tier runs at least one stage")
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
    """A batch running longer kills and restarts its stage process; retried once, then errors."""
    worker_memory_gb: float | None = None
    """Stage processes above this RSS are recycled between batches."""
    speculative: bool = True
    """Re-lease the oldest running shards to idle workers at the tail of the job."""
    split_tail: bool = True
    """At the tail of the job (nothing queued, a worker idle), ask the holder of the running
    shard with the most work left to commit the rows it has done and hand over the rest,
    before any shard is re-leased whole (speculation stays for holders that tell no
    progress)."""

    def worker_loss_cap(self) -> int:
        """Forgiven losses of one shard after which it is quarantined anyway."""
        return self.max_worker_losses or 5 * self.max_attempts

    def __post_init__(self) -> None:
        _positive("lease_s", self.lease_s)
        _positive("max_attempts", self.max_attempts)
        if self.max_worker_losses is not None:
            _positive("max_worker_losses", self.max_worker_losses)
        if not 0 <= self.max_error_fraction <= 1:
            raise _bad("max_error_fraction", f"must lie in [0, 1], got {self.max_error_fraction}")
        _positive("batch_timeout_s", self.batch_timeout_s)
        if self.worker_memory_gb is not None:
            _positive("worker_memory_gb", self.worker_memory_gb)


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
            raise _bad("mlflow_uri", "must not be empty (null: not logged)")
        if self.experiment is not None and not self.experiment:
            raise _bad("experiment", "must not be empty (null: the job's name)")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A job: what to read, the pipeline to run on it, where to write, with what resources
    and which fault policy."""

    name: str
    """For people: shown by `ebb status`, and the stem of the id made when `id` is empty.
    1 to 200 characters."""
    id: str = ""
    """Unique job id, sent as `Nats-Msg-Id`: resubmitting is a no-op. Assigned if empty."""
    input: InputSpec
    """What to read (the `input` section)."""
    pipeline: PipelineSpec
    """What to run on each row (the `pipeline` section)."""
    output: OutputSpec
    """Where to write (the `output` section)."""
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    """Workers and what each asks for (the `resources` section). A job with `tiers` sizes
    and places each tier's workers by the tier's own `resources`; this section is not used
    then."""
    tiers: list[TierSpec] = field(default_factory=list)
    """The pipeline's stages placed in tiers, each run by workers of its own, scaled and
    placed apart from the others' (decoding and tokenizing on CPU nodes, the model on GPU
    nodes). Each tier runs consecutive stages, in the pipeline's order; every stage is in
    one tier. Rows cross from a tier to the next only from the tier's last stage: a later
    tier's stages read the stages of their own tier, or that one alone. `[]`: every worker
    runs the whole pipeline, as `resources` says."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels every worker of the job is placed on (a Kubernetes `nodeSelector`), over
    the controller's own, label by label; a tier's `node_selector` goes over this one."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Taints of nodes every worker of the job may run on (Kubernetes tolerations, as a
    tier's `tolerations` says them), besides the controller's; a tier's add to these."""
    fault: FaultPolicy = field(default_factory=FaultPolicy)
    """Leases, retries and error budget (the `fault` section)."""
    priority: int = 0
    """Higher-priority jobs get capacity first."""
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    """Where the metrics are logged besides `_metrics.json` (the `tracking` section)."""

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 200:
            raise _bad("name", "must be 1 to 200 characters")
        if self.id and not JOB_ID_RE.match(self.id):
            raise _bad("id", f"must match {JOB_ID_RE.pattern}, got {self.id!r}")
        if self.tracking.experiment is None:
            object.__setattr__(self, "tracking", replace(self.tracking, experiment=self.name))
        if self.tiers:
            check_tiers(self.tiers, self.pipeline)
        check_node_placement(self.node_selector, self.tolerations)

    def with_id(self) -> JobSpec:
        """This spec with an id: its own, or one made from the name and a random suffix."""
        if self.id:
            return self
        stem = re.sub(r"[^A-Za-z0-9_-]+", "-", self.name).strip("-_")[:40] or "job"
        return replace(self, id=f"{stem}-{secrets.token_hex(4)}")

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = schema.dump(self)
        # A job that asks nothing of the fields added since is the map it was before they
        # existed: services of that version, which refuse a field (or a pool) they do not
        # know, read it during an upgrade.
        for key in ("tiers", "node_selector", "tolerations"):
            if not body[key]:
                del body[key]
        for resources in (body["resources"], *(t["resources"] for t in body.get("tiers", []))):
            if resources["gpu_type"] is None:
                del resources["gpu_type"]
            if resources["pool"] == "auto":
                del resources["pool"]
        return body

    def tier_names(self) -> list[str]:
        """The tiers' names in order; `[""]` for a job without tiers, run by one kind of
        worker."""
        return [t.name for t in self.tiers] if self.tiers else [""]

    def tier_index(self, name: str) -> int:
        """The place of a tier among the job's tiers (`""`: 0 for a job without tiers)."""
        names = self.tier_names()
        if name not in names:
            if not self.tiers:
                raise _bad("tiers", f"the job has no tiers, so no tier {name!r}")
            raise _bad("tiers", f"the job has no tier {name!r}; its tiers: {names}")
        return names.index(name)

    def last_tier(self) -> str:
        """The tier whose workers write the output (`""` for a job without tiers)."""
        return self.tier_names()[-1]

    def tier_resources(self, name: str) -> ResourceSpec:
        """What each worker of a tier asks for, and how many the tier may have."""
        k = self.tier_index(name)
        return self.tiers[k].resources if self.tiers else self.resources

    def tier_pipeline(self, name: str) -> PipelineSpec:
        """The pipeline a worker of a tier runs: the tier's stages, each reading the rows
        the tier before handed on (its last stage's) as the rows as read. The whole pipeline
        for a job without tiers."""
        k = self.tier_index(name)
        if not self.tiers:
            return self.pipeline
        handed = self.tiers[k - 1].stages[-1] if k else None
        return tier_pipeline(self.pipeline, self.tiers[k].stages, handed=handed)

    def output_fields(self) -> dict[str, Any]:
        """What decides the rows of the output, field by field: {path: value}, paths as a
        refusal names them (`pipeline.stages[1].model`, `pipeline.stages[0].params.mean`).

        The input section whole: its rows_per_shard (and, for CSV, newlines_in_values) decide
        where shards are cut, and committed work is found again by shard number, so a job
        carrying on in its output must cut its input the same way. Each stage's model or
        modelet with its parameters, how it is fed and what it yields; where modelet code
        comes from; the output's format and columns. Not how fast or where the rows are
        computed (STAGE_PERFORMANCE_FIELDS, resources, tiers, fault policy, priority), nor
        where the output root is or how its files are cut: those may change between runs of
        one job.
        """
        body = self._body()
        stages = [
            {k: v for k, v in stage.items() if k not in STAGE_PERFORMANCE_FIELDS}
            for stage in body["pipeline"]["stages"]
        ]
        decisive = {
            "input": body["input"],
            "pipeline": {**body["pipeline"], "stages": stages},
            "output": {k: v for k, v in body["output"].items() if k not in OUTPUT_LAYOUT_FIELDS},
        }
        flat: dict[str, Any] = {}
        _flatten(decisive, "", flat)
        # As JSON has them: what is compared with what was stored compares like with like.
        loaded: dict[str, Any] = json.loads(json.dumps(flat, sort_keys=True, default=str))
        return loaded

    def _body(self) -> dict[str, Any]:
        """`to_dict` less the stage fields of LATER_STAGE_FIELDS a stage leaves unset (None,
        or an empty map)."""
        body = self.to_dict()
        body["pipeline"]["stages"] = [
            {k: v for k, v in stage.items() if not (k in LATER_STAGE_FIELDS and v in (None, {}))}
            for stage in body["pipeline"]["stages"]
        ]
        return body

    def output_digest(self) -> str:
        """A digest of `output_fields`: equal for two specs that write the same rows."""
        return fields_digest(self.output_fields())

    def whole_sections_digest(self) -> str:
        """The digest an output root's owner record kept before `output_fields` existed: of
        the input, pipeline and output sections whole, batching and placement included."""
        body = self._body()
        decisive = {k: body[k] for k in ("input", "pipeline", "output")}
        text = json.dumps(decisive, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def tier_pipeline(pipeline: PipelineSpec, stages: list[str], *, handed: str | None) -> PipelineSpec:
    """The pipeline of `stages` (a tier's), whose rows as read are those `handed` (the tier
    before's last stage; None for the first tier) wrote: a stage that read `handed` reads
    them instead, and one that read it besides other stages reads those others alone."""
    rewired = [
        s if s.after is None else replace(s, after=[a for a in s.after if a != handed])
        for s in pipeline.stages
        if s.name in stages
    ]
    tier = PipelineSpec(stages=rewired, code_paths=list(pipeline.code_paths))
    if tier.is_chain():
        # One form for a chain, without `after`: equal to the same stages written as one.
        tier = replace(tier, stages=[replace(s, after=None) for s in tier.stages])
    return tier


STAGE_PERFORMANCE_FIELDS = frozenset(
    {
        "name",
        "batch_size",
        "adaptive_batch",
        "batch_wait_s",
        "batch_tokens",
        "length_column",
        "workers",
        "min_workers",
        "max_workers",
        "threads",
        "device",
    }
)
"""A stage's fields that decide how fast and where its rows are computed, not what they are
(a name is a label). Every other field of a stage, one added later included, counts."""
LATER_STAGE_FIELDS = frozenset({"models", "after", "metrics"})
"""Stage fields added after output roots began to keep the fields that decide their rows:
left out of those while unset, so that a spec which does not use one carries on in an output
root claimed before it came."""
OUTPUT_LAYOUT_FIELDS = frozenset({"uri", "max_rows_per_file"})
"""Where the output root is and how a shard's rows are cut into files: the manifest names
every file, so shards written either way read back as the same rows."""


def _flatten(value: Any, path: str, into: dict[str, Any]) -> None:
    """Maps become `path.key` entries, lists of maps `path[i]` ones; other values are leaves."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{path}.{key}" if path else str(key), into)
    elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
        for i, item in enumerate(value):
            _flatten(item, f"{path}[{i}]", into)
    else:
        into[path] = value


def fields_digest(fields: dict[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def differing_fields(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The paths whose values differ between two `output_fields`, in order (a path one of them
    lacks differs too: a stage added, a parameter dropped)."""
    paths = sorted(set(before) | set(now), key=_path_order)
    return [p for p in paths if p not in before or p not in now or before[p] != now[p]]


def _path_order(path: str) -> list[tuple[int, str]]:
    """`stages[10]` after `stages[9]`: list indexes by number, the rest by name."""
    return [
        (int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"\[(\d+)\]", path)
    ]


def parse_job(data: object) -> JobSpec:
    """Validate a decoded job map (from YAML, JSON or msgpack) as a JobSpec."""
    try:
        return schema.load(JobSpec, data, strict=True)
    except SpecError:
        raise
    except SchemaError as e:
        raise SpecError(e.path, e.problem) from None


def load_job_file(path: str | os.PathLike[str]) -> JobSpec:
    """Read a YAML or JSON job file; relative paths in it are taken relative to the file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError("", f"cannot read job file {p}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError("", f"{p} is not valid YAML or JSON: {e}") from None
    spec = parse_job(data)
    return resolve_paths(spec, p.resolve().parent)


def _is_url(uri: str) -> bool:
    scheme = urlsplit(uri).scheme
    return len(scheme) > 1  # a single letter is a Windows drive, not a scheme


def _resolve(uri: str, base: Path) -> str:
    if _is_url(uri):
        return uri
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    p = Path(uri).expanduser()
    return str(p if p.is_absolute() else (base / p))


def _tracking_path(uri: str) -> str | None:
    """The local path an MLflow tracking URI writes to: a folder (a path, or a file: URI) or a
    sqlite: database (`sqlite:////abs/path.db`). None for a server's (http:, databricks)."""
    if uri.startswith("sqlite:"):
        return uri.removeprefix("sqlite:///")
    if uri.startswith("file:"):
        return urlsplit(uri).path
    return None if _is_url(uri) else uri


def resolve_paths(spec: JobSpec, base: Path) -> JobSpec:
    """Make every local path in the spec absolute, relative to `base` (the job file's folder)."""
    tracking = spec.tracking
    uri = tracking.mlflow_uri
    if uri is not None and not uri.startswith("sqlite:") and _tracking_path(uri) is not None:
        # A folder; a sqlite: URI is left as written (SQLAlchemy's own syntax).
        tracking = replace(tracking, mlflow_uri=_resolve(uri, base))
    stages = [
        replace(s, model=_resolve(s.model, base)) if s.model is not None else s
        for s in spec.pipeline.stages
    ]
    stages = [
        replace(s, models=[replace(m, model=_resolve(m.model, base)) for m in s.models])
        if s.models is not None
        else s
        for s in stages
    ]
    return replace(
        spec,
        input=replace(spec.input, uri=_resolve(spec.input.uri, base)),
        pipeline=replace(
            spec.pipeline,
            stages=stages,
            code_paths=[_resolve(c, base) for c in spec.pipeline.code_paths],
        ),
        output=replace(spec.output, uri=_resolve(spec.output.uri, base)),
        tracking=tracking,
    )


def _normalise(uri: str) -> str:
    """Collapse `.` and `..` and duplicate slashes; local paths are made absolute."""
    if _is_url(uri):
        parts = urlsplit(uri)
        return f"{parts.scheme}://{parts.netloc}{posixpath.normpath('/' + parts.path)}"
    return os.path.normpath(os.path.abspath(uri))


def _under(uri: str, root: str) -> bool:
    root = _normalise(root).rstrip("/")
    return uri == root or uri.startswith(root + "/")


def check_roots(spec: JobSpec, roots: list[str]) -> None:
    """Refuse a spec whose input, output, model or code paths lie outside the allowed roots.

    Local paths are resolved through symlinks, so neither `..` nor a link can escape a root.
    """
    named = [("input.uri", spec.input.uri), ("output.uri", spec.output.uri)]
    named += [
        (f"pipeline.stages[{i}].model", s.model)
        for i, s in enumerate(spec.pipeline.stages)
        if s.model is not None
    ]
    named += [
        (f"pipeline.stages[{i}].models[{j}].model", m.model)
        for i, s in enumerate(spec.pipeline.stages)
        for j, m in enumerate(s.models or [])
    ]
    named += [(f"pipeline.code_paths[{i}]", c) for i, c in enumerate(spec.pipeline.code_paths)]
    if spec.tracking.mlflow_uri is not None:
        local = _tracking_path(spec.tracking.mlflow_uri)
        if local is not None:
            named.append(("tracking.mlflow_uri", local))
    for where, uri in named:
        if not _is_url(uri) and not os.path.isabs(uri):
            raise SpecError(where, f"{uri!r} must be absolute when submitted")
        resolved = _normalise(uri) if _is_url(uri) else os.path.realpath(uri)
        resolved_roots = [r if _is_url(r) else os.path.realpath(r) for r in roots]
        if not any(_under(resolved, r) for r in resolved_roots):
            allowed = ", ".join(dict.fromkeys(roots)) or "(none configured)"
            raise SpecError(where, f"{uri!r} lies outside the allowed data roots: {allowed}")
