"""Metrics over a job's rows (sums, means, AUC, log loss, histograms), each row counted once.

A stage's spec names metrics over its output columns (`MetricSpec`). Computing one takes
three steps, each a pure function of plain values, so that it can be cut where the rows are:

- `row_values`: a row's input to the metric, one float64 per row (two, [label, score], for
  auc and logloss; NaN: the row has none). These travel with the rows.
- `reduce`: the partial of some rows: a small JSON-able map of ints and floats.
- `merge`: two partials into the partial of both sets of rows. It is associative and
  commutative, and `empty(spec)` is its identity, so partials merge in any grouping, in any
  order. `result` turns a partial into the metric's value.

Merging is exact, not merely close: counts are ints, a histogram's or AUC's bins hold ints,
and a sum is kept as its exact value (as a few floats whose exact sum it is, see
`ebb.common.job.exactsum`), so the partials of any split of the rows merge into the very partial of
all of them, bit for bit: a shard split, retried or speculated gives the same numbers. A sum's
result is the correctly rounded sum of every row (`math.fsum`'s), a mean the correctly
rounded quotient of that exact sum by the count.

Rows without a value (None or NaN) contribute nothing to any metric. An auc or logloss row
whose label is present but neither 0 nor 1 (False/True are fine) contributes nothing either,
and is counted in the partial's `bad_labels`.

One module past 400 lines: each kind's partial is made (`reduce`), merged and read (`result`)
by a branch of three functions, and a kind is checked only when the three are read together,
with the spec that validates its fields.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..errors import SpecError
from . import exactsum

MetricKind = Literal["sum", "count", "mean", "min", "max", "histogram", "auc", "logloss"]
Partial = dict[str, Any]
"""A metric's partial: JSON-able (ints, floats, lists of them; min/max: a float or null)."""
Floats = npt.NDArray[np.float64]

MAX_BINS = 100_000
HISTOGRAM_BINS = 10
AUC_BINS = 1000
LOGLOSS_EPS = 1e-15
"""Probabilities are clipped to [eps, 1 - eps] before their log is taken, as sklearn did."""

_ONE_COLUMN: frozenset[str] = frozenset({"sum", "mean", "min", "max", "histogram"})
_LABELLED: frozenset[str] = frozenset({"auc", "logloss"})


def _bad(name: str, problem: str) -> SpecError:
    return SpecError(name, problem)


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """One metric over the stage's output rows, computed exactly once per row whatever was
    retried, split or speculated. Rows without a value (null or NaN) count for nothing."""

    kind: MetricKind
    """sum, count, mean, min, max or histogram of `column`; auc (area under the ROC curve) or
    logloss (mean binary cross-entropy) of `score` against `label`."""
    column: str | None = None
    """The column whose value a row gives: sum, mean, min, max, histogram (required), count
    (rows with a value in it; absent: every row). One value per row."""
    label: str | None = None
    """auc, logloss (required): the column of true labels, 0 or 1 (or false/true). A row with
    another label counts for nothing (the partial's `bad_labels` counts it)."""
    score: str | None = None
    """auc, logloss (required): the column of predicted scores (logloss: probabilities of 1,
    clipped to [1e-15, 1 - 1e-15])."""
    bins: int | None = None
    """histogram: equal-width bins over `range` (default 10). auc: the scores are counted in
    this many equal-width bins over `range` (default 1000), and pairs of rows whose scores
    share a bin count as ties: the AUC is off the exact one by at most half the share of
    (positive, negative) pairs that share a bin. 1 to 100,000."""
    range: list[float] | None = None
    """histogram (required): [low, high]; values outside are counted apart (`under`,
    `over`). auc: the scores' range (default [0, 1]); a score outside falls in the first or
    last bin."""

    def __post_init__(self) -> None:
        kind = self.kind
        if kind in _LABELLED:
            for name in ("label", "score"):
                if not getattr(self, name):
                    raise _bad(name, f"{kind} needs the column of its {name}s")
            if self.column is not None:
                raise _bad("column", f"{kind} reads `label` and `score`, not `column`")
        else:
            for name in ("label", "score"):
                if getattr(self, name) is not None:
                    raise _bad(name, f"only auc and logloss have a {name} column")
            if kind in _ONE_COLUMN and not self.column:
                raise _bad("column", f"{kind} needs the column it reads")
        if kind in ("histogram", "auc"):
            default = HISTOGRAM_BINS if kind == "histogram" else AUC_BINS
            bins = default if self.bins is None else self.bins
            if not 1 <= bins <= MAX_BINS:
                raise _bad("bins", f"must lie in [1, {MAX_BINS}], got {bins}")
            object.__setattr__(self, "bins", bins)
            if self.range is None:
                if kind == "histogram":
                    raise _bad("range", "a histogram needs its [low, high]")
                object.__setattr__(self, "range", [0.0, 1.0])
            assert self.range is not None
            if len(self.range) != 2 or not all(math.isfinite(v) for v in self.range):
                raise _bad("range", f"expected [low, high], two finite numbers, got {self.range}")
            if not self.range[0] < self.range[1]:
                raise _bad("range", f"low must be below high, got {self.range}")
        else:
            if self.bins is not None:
                raise _bad("bins", "only a histogram or auc has bins")
            if self.range is not None:
                raise _bad("range", "only a histogram or auc has a range")

    @property
    def labelled(self) -> bool:
        """A row's value is a pair, [label, score] (auc, logloss)."""
        return self.kind in _LABELLED

    def columns(self) -> list[str]:
        """The columns a row's value is read from."""
        if self.kind in _LABELLED:
            assert self.label is not None and self.score is not None
            return [self.label, self.score]
        return [self.column] if self.column is not None else []

    def _bins(self) -> tuple[int, float, float]:
        assert self.bins is not None and self.range is not None  # set by __post_init__
        return self.bins, self.range[0], self.range[1]


# -- row values -----------------------------------------------------------------------------


def row_values(spec: MetricSpec, columns: Mapping[str, Any]) -> Floats:
    """The rows' inputs to `spec`, float64, NaN where a row has none: shape (n,), or (n, 2)
    [label, score] for auc and logloss. `columns`: the rows' columns by name, each 1-D, (n, 1),
    or an object column of scalars (or one-value sequences) and None.

    ValueError (naming the metric and column) when a column is missing or holds more than one
    value per row."""
    names = spec.columns()
    if not names:  # count of every row
        n = len(next(iter(columns.values()))) if columns else 0
        return np.ones(n, dtype=np.float64)
    read = [_column(spec, name, columns) for name in names]
    if len(read) == 1:
        return read[0]
    if len(read[0]) != len(read[1]):
        raise ValueError(
            f"{spec.kind} metric: columns {names[0]!r} and {names[1]!r} have "
            f"{len(read[0])} and {len(read[1])} rows"
        )
    return np.stack(read, axis=1)


def _column(spec: MetricSpec, name: str, columns: Mapping[str, Any]) -> Floats:
    where = f"{spec.kind} metric, column {name!r}"
    if name not in columns:
        have = ", ".join(sorted(map(repr, columns))) or "none"
        raise ValueError(f"{where}: no such column among the rows' (they have {have})")
    array = np.asarray(columns[name])
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise ValueError(f"{where}: one value per row expected, got rows of shape {array.shape}")
    if array.dtype.kind in "biuf":
        return array.astype(np.float64)
    if array.dtype.kind != "O":
        raise ValueError(f"{where}: expected numbers, got a column of {array.dtype}")
    return np.array([_scalar(where, v) for v in array.tolist()], dtype=np.float64)


def _scalar(where: str, value: object) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool | int | float | np.bool_ | np.integer | np.floating):
        return float(value)
    if isinstance(value, list | tuple | np.ndarray):
        flat = np.asarray(value).ravel()
        if flat.size == 1:
            return _scalar(where, flat[0].item())
        raise ValueError(f"{where}: one value per row expected, got a row of {flat.size}")
    raise ValueError(f"{where}: expected a number or null, got {type(value).__name__}")


# -- partials -------------------------------------------------------------------------------


def empty(spec: MetricSpec) -> Partial:
    """The partial of no rows: `merge`'s identity."""
    return reduce(spec, np.empty((0, 2) if spec.kind in _LABELLED else 0, dtype=np.float64))


def reduce(spec: MetricSpec, values: npt.ArrayLike) -> Partial:
    """The partial of these rows' `row_values`. Formats, by kind (n: rows with a value):

    - count: {"n"}
    - sum, mean: {"n", "sum": [floats whose exact sum is the rows' sum], "inf", "ninf"}
      (rows of +inf and -inf: counted apart, since they have no exact sum)
    - min, max: {"n", "min" or "max": a float, or null for no rows}
    - histogram: {"n" (in range), "bins": [indexes of non-empty bins], "counts", "under",
      "over"}
    - auc: {"bins": [indexes of non-empty bins], "pos", "neg" (positives and negatives in
      each), "bad_labels"}
    - logloss: {"n", "sum": [exact, as for sum], "bad_labels"}
    """
    x = np.asarray(values, dtype=np.float64)
    pairs = spec.kind in _LABELLED
    if x.ndim != (2 if pairs else 1) or (pairs and x.shape[1] != 2):
        shape = "(n, 2)" if pairs else "(n,)"
        raise ValueError(f"{spec.kind} metric: values of shape {shape} expected, got {x.shape}")
    return _reduce_pairs(spec, x) if pairs else _reduce_values(spec, x)


def _reduce_pairs(spec: MetricSpec, x: Floats) -> Partial:
    label, score = x[:, 0], x[:, 1]
    present = ~(np.isnan(label) | np.isnan(score))
    good = present & ((label == 0) | (label == 1))
    bad_labels = int(np.count_nonzero(present & ~good))
    label, score = label[good], score[good]
    if spec.kind == "auc":
        bins, lo, hi = spec._bins()
        index = _bin_index(np.clip(score, lo, hi), bins, lo, hi)
        pos = np.bincount(index[label == 1], minlength=bins)
        neg = np.bincount(index[label == 0], minlength=bins)
        (kept,) = np.nonzero(pos + neg)
        return {
            "bins": kept.tolist(),
            "pos": pos[kept].tolist(),
            "neg": neg[kept].tolist(),
            "bad_labels": bad_labels,
        }
    p = np.clip(score, LOGLOSS_EPS, 1 - LOGLOSS_EPS)
    loss = np.where(label == 1, -np.log(p), -np.log(1 - p))
    return {
        "n": len(loss),
        "sum": exactsum.as_floats(exactsum.exact_sum(loss)),
        "bad_labels": bad_labels,
    }


def _reduce_values(spec: MetricSpec, x: Floats) -> Partial:
    x = x[~np.isnan(x)]
    n = len(x)
    if spec.kind == "count":
        return {"n": n}
    if spec.kind in ("sum", "mean"):
        finite = np.isfinite(x)
        return {
            "n": n,
            "sum": exactsum.as_floats(exactsum.exact_sum(x[finite])),
            "inf": int(np.count_nonzero(x == math.inf)),
            "ninf": int(np.count_nonzero(x == -math.inf)),
        }
    if spec.kind in ("min", "max"):
        pick = np.min if spec.kind == "min" else np.max
        return {"n": n, spec.kind: float(pick(x)) if n else None}
    bins, lo, hi = spec._bins()
    inside = (x >= lo) & (x <= hi)
    counts = np.bincount(_bin_index(x[inside], bins, lo, hi), minlength=bins)
    (kept,) = np.nonzero(counts)
    return {
        "n": int(np.count_nonzero(inside)),
        "bins": kept.tolist(),
        "counts": counts[kept].tolist(),
        "under": int(np.count_nonzero(x < lo)),
        "over": int(np.count_nonzero(x > hi)),
    }


def merge(spec: MetricSpec, a: Partial, b: Partial) -> Partial:
    """The partial of the rows of `a` and of `b` (disjoint sets of rows)."""
    kind = spec.kind
    if kind == "count":
        return {"n": a["n"] + b["n"]}
    if kind in ("sum", "mean"):
        return {
            "n": a["n"] + b["n"],
            "sum": exactsum.as_floats(exactsum.units(a["sum"]) + exactsum.units(b["sum"])),
            "inf": a["inf"] + b["inf"],
            "ninf": a["ninf"] + b["ninf"],
        }
    if kind in ("min", "max"):
        both = [v for v in (a[kind], b[kind]) if v is not None]
        pick = min if kind == "min" else max
        return {"n": a["n"] + b["n"], kind: float(pick(both)) if both else None}
    if kind == "logloss":
        return {
            "n": a["n"] + b["n"],
            "sum": exactsum.as_floats(exactsum.units(a["sum"]) + exactsum.units(b["sum"])),
            "bad_labels": a["bad_labels"] + b["bad_labels"],
        }
    if kind == "auc":
        bins, pos, neg = _merge_bins(
            [a["bins"], b["bins"]], [a["pos"], b["pos"]], [a["neg"], b["neg"]]
        )
        return {
            "bins": bins,
            "pos": pos,
            "neg": neg,
            "bad_labels": a["bad_labels"] + b["bad_labels"],
        }
    bins, counts = _merge_bins([a["bins"], b["bins"]], [a["counts"], b["counts"]])
    return {
        "n": a["n"] + b["n"],
        "bins": bins,
        "counts": counts,
        "under": a["under"] + b["under"],
        "over": a["over"] + b["over"],
    }


def merge_all(spec: MetricSpec, partials: Iterable[Partial]) -> Partial:
    """The partial of every given partial's rows (`empty` of none)."""
    merged = empty(spec)
    for partial in partials:
        merged = merge(spec, merged, partial)
    return merged


def result(spec: MetricSpec, partial: Partial) -> float | int | dict[str, Any] | None:
    """The metric's value: count an int; histogram {"edges", "counts", "under", "over"};
    the others a float, or None where undefined (a mean, min, max or logloss of no rows, an
    auc without both classes, a sum or mean of both +inf and -inf)."""
    kind = spec.kind
    if kind == "count":
        return int(partial["n"])
    if kind in ("sum", "mean"):
        n, inf, ninf = partial["n"], partial["inf"], partial["ninf"]
        if inf and ninf:
            return None
        if inf or ninf:
            return math.inf if inf else -math.inf
        if kind == "mean":
            return exactsum.quotient(exactsum.units(partial["sum"]), n) if n else None
        return exactsum.quotient(exactsum.units(partial["sum"]), 1)
    if kind in ("min", "max"):
        value = partial[kind]
        return None if value is None else float(value)
    if kind == "logloss":
        n = partial["n"]
        return exactsum.quotient(exactsum.units(partial["sum"]), n) if n else None
    if kind == "auc":
        return _auc(partial["pos"], partial["neg"])
    bins, lo, hi = spec._bins()
    counts = [0] * bins
    for index, count in zip(partial["bins"], partial["counts"], strict=True):
        counts[index] = count
    return {
        "edges": [_shortest(e) for e in np.linspace(lo, hi, bins + 1).tolist()],
        "counts": counts,
        "under": partial["under"],
        "over": partial["over"],
    }


def _auc(pos: list[int], neg: list[int]) -> float | None:
    """The Mann-Whitney statistic over the bins (in ascending order): the share of (positive,
    negative) pairs where the positive scores higher, pairs in one bin counting half. The
    trapezoids under the ROC curve through the bins' corners give the same area."""
    positives, negatives = sum(pos), sum(neg)
    if not positives or not negatives:
        return None
    below = twice_wins = 0
    for p, q in zip(pos, neg, strict=True):
        twice_wins += p * (2 * below + q)
        below += q
    # Python ints, then one correctly rounded division: no order of merging changes it.
    return twice_wins / (2 * positives * negatives)


# -- named metrics: what a stage, a worker and the master hold --------------------------------


def row_values_named(
    specs: Mapping[str, MetricSpec], columns: Mapping[str, Any]
) -> dict[str, Floats]:
    """Each metric's `row_values` by name; a ValueError names the metric."""
    out: dict[str, Floats] = {}
    for name, spec in specs.items():
        try:
            out[name] = row_values(spec, columns)
        except ValueError as e:
            raise ValueError(f"metric {name!r}: {e}") from None
    return out


def reduce_named(
    specs: Mapping[str, MetricSpec], values: Mapping[str, npt.ArrayLike]
) -> dict[str, Partial]:
    """Each metric's partial of its rows' values (`values[name]`, as `row_values` made them)."""
    out: dict[str, Partial] = {}
    for name, spec in specs.items():
        try:
            out[name] = reduce(spec, values[name])
        except KeyError:
            raise ValueError(f"metric {name!r}: no row values given for it") from None
        except ValueError as e:
            raise ValueError(f"metric {name!r}: {e}") from None
    return out


def merge_named(
    specs: Mapping[str, MetricSpec], a: Mapping[str, Partial], b: Mapping[str, Partial]
) -> dict[str, Partial]:
    """Each metric's merged partial. A metric one side lacks is `empty` there (an attempt that
    wrote no rows may carry none); a name that is not among `specs` is dropped. ValueError
    when a partial is not of its metric's format."""
    out: dict[str, Partial] = {}
    for name, spec in specs.items():
        try:
            out[name] = merge(spec, a.get(name) or empty(spec), b.get(name) or empty(spec))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"metric {name!r}: a partial not of a {spec.kind}: {e!r}") from None
    return out


def results_named(
    specs: Mapping[str, MetricSpec], partials: Mapping[str, Partial]
) -> dict[str, Any]:
    """Each metric's `result` (of `empty` when `partials` lacks it)."""
    return {name: result(spec, partials.get(name) or empty(spec)) for name, spec in specs.items()}


# -- bins -----------------------------------------------------------------------------------


def _bin_index(x: Floats, bins: int, lo: float, hi: float) -> npt.NDArray[np.intp]:
    """The bin of each value in [lo, hi], as `np.histogram` puts it: bin i holds
    edges[i] <= x < edges[i + 1], the last one its high edge too (edges: np.linspace)."""
    edges = np.linspace(lo, hi, bins + 1)
    index = ((x - lo) / (hi - lo) * bins).astype(np.intp)
    index[index == bins] -= 1
    # Rounding can put a value next to its bin; the edges decide, as np.histogram's do.
    index[x < edges[index]] -= 1
    index[(x >= edges[index + 1]) & (index != bins - 1)] += 1
    return index


def _merge_bins(indexes: list[list[int]], *counts: list[list[int]]) -> tuple[list[int], ...]:
    """Sparse bins merged: the union of their indexes, ascending, each series' counts added."""
    merged: dict[int, list[int]] = {}
    for side, side_indexes in enumerate(indexes):
        for at, index in enumerate(side_indexes):
            slot = merged.setdefault(index, [0] * len(counts))
            for series, values in enumerate(counts):
                slot[series] += values[side][at]
    order = sorted(merged)
    return (order, *([merged[i][s] for i in order] for s in range(len(counts))))


def _shortest(edge: float) -> float:
    """An edge as people write it: 0.3, not the 0.30000000000000004 that linspace's arithmetic
    leaves (15 significant digits round that away, and change no edge a person would type).
    The bins are cut at linspace's own edges all the same."""
    return float(f"{edge:.15g}")
