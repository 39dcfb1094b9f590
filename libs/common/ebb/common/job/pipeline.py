"""The `pipeline` section of the job spec: its stages (a modelet, a model, or several models),
the models of a `models` stage, and how a tier's pipeline is cut from the whole. Each
dataclass keeps its fields' docstrings (the reference) beside the checks of their values."""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Any

from .accumulators import MetricSpec
from .fields import (
    METRIC_NAME_RE,
    MODEL_SUFFIXES,
    MODELET_RE,
    RUNTIME_MODULES,
    ModelDtype,
    Runtime,
    bad,
    positive,
)
from .llm import LLMSpec


def _runtime(model: str, runtime: Runtime | None) -> Runtime:
    """The runtime that serves a model file: the one named (checked against the file's
    suffix), or the one its suffix implies."""
    suffix = posixpath.splitext(model)[1].lower()
    inferred = MODEL_SUFFIXES.get(suffix)
    if runtime is None:
        if inferred is None:
            known = ", ".join(MODEL_SUFFIXES)
            raise bad("model", f"unknown model suffix {suffix!r} (known: {known})")
        return inferred
    if inferred is not None and inferred != runtime:
        raise bad("runtime", f"{runtime} does not match a {suffix} model file")
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
            raise bad("output", "must name a column")
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
    llm: LLMSpec | None = None
    """A generative model over a column of prompts (instead of `modelet` or `model`): see the
    `llm` section. Rows are fed to its engine continuously, not in batches: `batch_size` is
    how many rows the stage takes from the pipeline at once."""
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
    batch_size: int | None = None
    """Largest batch the stage assembles. None: 32; for an llm stage fed by a server, its
    `max_in_flight` (256 unless set), so that the server is sent as many rows as it may run
    (two batches at once: the next one's rows go as the last of one finish)."""
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

    @property
    def rows_per_batch(self) -> int:
        """`batch_size`, resolved (it is never None once the spec is made)."""
        assert self.batch_size is not None
        return self.batch_size

    def __post_init__(self) -> None:
        named = [self.modelet, self.model, self.models, self.llm]
        if sum(n is not None for n in named) != 1:
            raise bad(
                "modelet", "a stage names exactly one of `modelet`, `model`, `models` or `llm`"
            )
        if self.llm is not None and (self.fanout or self.fanin):
            raise bad("llm", "an llm stage writes one row per row: no fanout or fanin")
        if self.modelet is not None and not MODELET_RE.match(self.modelet):
            raise bad("modelet", f"expected `module:Class`, got {self.modelet!r}")
        if self.models is not None:
            if not self.models:
                raise bad("models", "needs at least one model")
            for key in ("runtime", "input", "output", "dtype"):
                if getattr(self, key) is not None:
                    raise bad(key, f"a `models` stage gives each model its own {key}")
            outputs = [m.output for m in self.models]
            twice = sorted({o for o in outputs if outputs.count(o) > 1})
            if twice:
                raise bad("models", f"each model needs an output of its own: {twice} repeat")
        if self.model is not None:
            object.__setattr__(self, "runtime", _runtime(self.model, self.runtime))
        elif self.runtime is not None:
            raise bad("runtime", "only a model stage has a runtime")
        elif self.output is not None:
            raise bad("output", "only a model stage has an output key")
        if self.fanout and self.fanin:
            raise bad("fanin", "a stage cannot both fan out and fan in")
        if self.batch_size is None:
            # An llm stage's engine runs two batches at once: a batch fills its places.
            llm = self.llm
            batch = llm.in_flight if llm is not None and llm.concurrent_batches > 1 else 32
            object.__setattr__(self, "batch_size", batch)
        positive("batch_size", self.rows_per_batch)
        if not 0 <= self.batch_wait_s < math.inf:
            raise bad("batch_wait_s", f"must be >= 0, got {self.batch_wait_s}")
        positive("workers", self.workers)
        if self.min_workers is None:
            object.__setattr__(self, "min_workers", self.workers)
        if self.max_workers is None:
            object.__setattr__(self, "max_workers", self.workers)
        assert self.min_workers is not None and self.max_workers is not None
        if not 1 <= self.min_workers <= self.workers <= self.max_workers:
            raise bad("workers", "need 1 <= min_workers <= workers <= max_workers")
        if self.threads < 0:
            raise bad("threads", f"must be >= 0, got {self.threads}")
        if self.dtype is not None and self.model is None:
            raise bad("dtype", "only a model stage has a dtype")
        if self.batch_tokens is not None:
            positive("batch_tokens", self.batch_tokens)
            if self.length_column is None:
                raise bad("length_column", "batch_tokens needs the column that gives lengths")
        elif self.length_column is not None:
            raise bad("length_column", "applies only with batch_tokens")
        if not re.match(r"^(cpu|cuda(:\d+)?)$", self.device):
            raise bad("device", f"expected cpu, cuda or cuda:N, got {self.device!r}")
        for name in self.metrics:
            if not METRIC_NAME_RE.match(name):
                raise bad(f"metrics.{name}", f"a metric name must match {METRIC_NAME_RE.pattern}")

    @property
    def serves_models(self) -> bool:
        """A runtime serves the stage (`model` or `models`), not a user modelet."""
        return self.modelet is None

    def runtime_modules(self) -> set[str]:
        """The modules that serve the stage: its runtimes', or an llm engine's."""
        if self.llm is not None:
            return {"torch"}
        return {RUNTIME_MODULES[r] for r in self.runtimes()}

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
            raise bad("stages", "a pipeline has at least one stage")
        named = [s if s.name else replace(s, name=f"stage{i}") for i, s in enumerate(self.stages)]
        names = [s.name for s in named]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise bad("stages", f"stage names must be unique: {sorted(dup)}")
        fanouts = [i for i, s in enumerate(named) if s.fanout]
        fanins = [i for i, s in enumerate(named) if s.fanin]
        if len(fanouts) > 1 or len(fanins) > 1:
            raise bad("stages", "one fan-out (and one fan-in after it) at most")
        if fanins and (not fanouts or fanins[0] <= fanouts[0]):
            raise bad(f"stages[{fanins[0]}].fanin", "a fan-in stage comes after a fan-out stage")
        owners: dict[str, str] = {}
        for i, stage in enumerate(named):
            for metric in stage.metrics:
                if metric in owners:
                    raise bad(
                        f"stages[{i}].metrics.{metric}",
                        f"stage {owners[metric]!r} has a metric of that name already",
                    )
                owners[metric] = stage.name
        object.__setattr__(self, "stages", named)
        reads = self.inputs()
        if (fanouts or fanins) and not self.is_chain():
            raise bad("stages", "a fan-out needs a chain of stages (no branches by `after`)")
        if fanouts:
            # A fan-out stage's parts are rows of their own until they are gathered: a
            # metric's values cannot follow them, nor theirs be told apart from their row's.
            gathered = fanins[0] if fanins else len(named)
            for i, stage in enumerate(named[:gathered]):
                if stage.metrics:
                    raise bad(
                        f"stages[{i}].metrics",
                        "in a pipeline that fans out, only stages from the fan-in on have metrics",
                    )
        sinks = [k for k in range(len(named)) if not any(k in r for r in reads)]
        for joined in [r for r in reads if len(r) > 1] + [sinks]:
            keys = [named[k].output for k in joined if named[k].output is not None]
            if len(set(keys)) < len(keys):
                raise bad("stages", f"stages whose rows are joined write the same key: {keys}")

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
                    raise bad(
                        f"stages[{k}].after",
                        f"{name!r} is not a stage listed before {stage.name!r}",
                    )
                if at in named:
                    raise bad(f"stages[{k}].after", f"{name!r} is named twice")
                named.append(at)
            reads.append(named)
        return reads

    def columns_read(self) -> dict[str, str]:
        """The columns of the rows as read that the stages reading those rows name (a model
        stage's `input`, each model's of a `models` stage, `length_column`, an llm stage's
        `prompt` and `per_row` columns), each with the first field that names it: what can
        be checked before a row is read. Columns a modelet reads, or that a stage reads from
        another's output, are known only as rows go through. The rows as read are the job's
        input for a whole pipeline, the rows handed on for a later tier's
        (`JobSpec.input_columns_read` says which are the input's)."""
        named: dict[str, str] = {}
        for k, (stage, reads) in enumerate(zip(self.stages, self.inputs(), strict=True)):
            if reads:
                continue
            where = f"pipeline.stages[{k}]"
            fields = [("input", stage.input), ("length_column", stage.length_column)]
            fields += [(f"models[{i}].input", m.input) for i, m in enumerate(stage.models or [])]
            if stage.llm is not None:
                fields.append(("llm.prompt", stage.llm.prompt))
                fields += [
                    (f"llm.per_row.{key}", column) for key, column in stage.llm.per_row.items()
                ]
            for field_name, column in fields:
                if column is not None:
                    named.setdefault(column, f"{where}.{field_name}")
        return named

    def is_chain(self) -> bool:
        """Every stage reads the one listed before it: the pipeline has no branch or join."""
        return all(r == ([k - 1] if k else []) for k, r in enumerate(self.inputs()))

    def all_metrics(self) -> dict[str, MetricSpec]:
        """Every stage's metrics, by name (unique across the stages)."""
        return {name: m for stage in self.stages for name, m in stage.metrics.items()}

    def runtime_modules(self) -> list[str]:
        """The model runtimes' modules the stages import (not user modelets': their imports
        may do anything, a GPU's set-up included)."""
        return sorted({m for s in self.stages for m in s.runtime_modules()})


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
