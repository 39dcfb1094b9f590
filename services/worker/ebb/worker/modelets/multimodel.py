"""A `models` stage: several model files served by one stage process, as one columnar modelet.

Scoring a dataset with an A/B pair of rankers or a few checkpoints as separate stages passes
every row through one process per model; models that fit one device together can share a
process instead, which reads each batch once. Each model is the single-model modelet of
ebb.worker.modelets.runtimes, built from a `model` stage spec derived from the stage's (its device,
threads and `finite_inputs`) and its own entry. All run on the batch as it came in, one after
another (no model sees another's output); a model that raises fails the batch, which the stage then
bisects as it does any modelet's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ebb.common.job import ModelSpec, StageSpec

from ..chunks.columns import Columns, from_rows, to_rows
from .api import Modelet
from .runtimes import ModelStage, load_runtime


def model_stage_spec(stage: StageSpec, model: ModelSpec) -> StageSpec:
    """The `model` stage spec that serves one entry of a `models` stage."""
    return replace(
        stage,
        models=None,
        model=model.model,
        runtime=model.runtime,
        input=model.input,
        output=model.output,
        dtype=model.dtype,
    )


class MultiModelStage(Modelet):
    """The models of a `models` stage, each run on every batch, their outputs side by side."""

    def __init__(self, spec: StageSpec) -> None:
        assert spec.models
        self.entries = spec.models
        self.models: list[ModelStage] = [
            load_runtime(model_stage_spec(spec, m)) for m in spec.models
        ]
        self.consumed = {m.input for m in spec.models if m.input is not None}

    def setup(self) -> None:
        for model in self.models:
            model.setup()

    def set_threads(self, threads: int) -> None:
        """Each model runs with `threads` intra-op threads: they run one after another, so each
        has the process's share of the cores while it runs."""
        for model in self.models:
            model.set_threads(threads)

    def process_batch(self, items: list[Any]) -> list[Any]:
        return to_rows(self.process_columns(from_rows(items)))

    def process_columns(self, batch: Columns) -> Columns:
        # Every model is handed the same batch: a model stage keeps the columns it does not
        # read and adds its own, so none of them sees another's output.
        results = [model.process_columns(batch) for model in self.models]
        out = {k: v for k, v in batch.items() if k not in self.consumed}
        for entry, result in zip(self.entries, results, strict=True):
            out[entry.output] = result[entry.output]
        return out
