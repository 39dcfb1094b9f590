"""Built-in modelets for the common ends of a pipeline: name them as
`ebb.worker.modelets:<Name>`."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..chunks.columns import VALUE, Columns, is_plain
from .api import Modelet


def _matrix(column: np.ndarray, dtype: np.dtype[Any] | None = None) -> np.ndarray:
    """A column as a 2-D array [rows, values] (a column of per-row arrays is stacked)."""
    if column.dtype == object:
        column = np.stack([np.atleast_1d(np.asarray(v, dtype=dtype)) for v in column])
    return column.reshape(len(column), -1).astype(dtype or column.dtype, copy=False)


class Features(Modelet):
    """Row map -> one feature vector: the named columns (scalars or vectors), concatenated."""

    def __init__(self, columns: list[str], dtype: str = "float32") -> None:
        if not columns:
            raise ValueError("Features needs at least one column")
        self.columns = list(columns)
        self.dtype = np.dtype(dtype)

    def process(self, item: Any) -> Any:
        parts = [np.atleast_1d(np.asarray(item[c], dtype=self.dtype)) for c in self.columns]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def process_batch(self, items: list[Any]) -> list[Any]:
        return [self.process(item) for item in items]

    def process_columns(self, batch: Columns) -> Columns:
        parts = [_matrix(batch[c], self.dtype) for c in self.columns]
        return {VALUE: parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)}


class TopClass(Modelet):
    """Scores (logits or probabilities) -> {"label", "score"} of the best class.

    labels: class names by index (the label is the index when absent).
    softmax: turn logits into probabilities first.
    field: take the scores from this key of a map item (a model with several outputs).
    """

    def __init__(
        self, labels: list[str] | None = None, softmax: bool = True, field: str | None = None
    ) -> None:
        self.labels = labels
        self.softmax = softmax
        self.field = field

    def process_batch(self, items: list[Any]) -> list[Any]:
        scores = np.stack([np.asarray(i[self.field] if self.field else i) for i in items])
        scores = scores.reshape(len(items), -1).astype(np.float64)
        if self.softmax:
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            scores /= scores.sum(axis=1, keepdims=True)
        best = scores.argmax(axis=1)
        out = []
        for i, k in enumerate(best.tolist()):
            label: Any = self.labels[k] if self.labels else k
            out.append({"label": label, "score": float(scores[i, k])})
        return out

    def process_columns(self, batch: Columns) -> Columns:
        if self.field is not None:
            column = batch[self.field]
        elif is_plain(batch):
            column = batch[VALUE]
        else:
            raise TypeError(f"rows are maps of {list(batch)}: name the scores' `field`")
        scores = _matrix(column).astype(np.float64)
        if self.softmax:
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            scores /= scores.sum(axis=1, keepdims=True)
        best = scores.argmax(axis=1)
        score = scores[np.arange(len(best)), best]
        labels = np.asarray(self.labels, dtype=object)[best] if self.labels else best
        return {"label": labels, "score": score}


class Identity(Modelet):
    """Passes items through unchanged."""

    def process_batch(self, items: list[Any]) -> list[Any]:
        return items

    def process_columns(self, batch: Columns) -> Columns:
        return batch


class Metrics(Identity):
    """Passes rows through: a stage for its `metrics` (see the job spec), over the columns of
    the rows that reach it; after a join, over every branch's columns (an evaluation of
    several models on one read)."""
