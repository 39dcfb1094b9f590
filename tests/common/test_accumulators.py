"""Metrics merged exactly once: each kind against a direct computation over all rows, and the
partials of any split of the rows, merged in any order, equal to the partial of all of them."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ebb.common.errors import SpecError
from ebb.common.job.accumulators import (
    LOGLOSS_EPS,
    MetricSpec,
    Partial,
    empty,
    merge,
    merge_all,
    merge_named,
    reduce,
    reduce_named,
    result,
    results_named,
    row_values,
    row_values_named,
)

SPECS: dict[str, MetricSpec] = {
    "count": MetricSpec(kind="count", column="x"),
    "rows": MetricSpec(kind="count"),
    "sum": MetricSpec(kind="sum", column="x"),
    "mean": MetricSpec(kind="mean", column="x"),
    "min": MetricSpec(kind="min", column="x"),
    "max": MetricSpec(kind="max", column="x"),
    "hist": MetricSpec(kind="histogram", column="x", range=[-2.0, 3.0], bins=7),
    "auc": MetricSpec(kind="auc", label="y", score="s", bins=50),
    "logloss": MetricSpec(kind="logloss", label="y", score="s"),
}
LABELLED = {"auc", "logloss"}


def _data(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n) * 2
    x[rng.random(n) < 0.1] = np.nan
    y = (rng.random(n) < 0.4).astype(np.float64)
    s = np.clip(rng.normal(0.35 + 0.3 * y, 0.2), -0.1, 1.1)
    y[rng.random(n) < 0.05] = np.nan
    return {"x": x, "y": y, "s": s}


def _pairs(columns: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Labels and scores of the rows that count: both present."""
    y, s = columns["y"], columns["s"]
    keep = ~np.isnan(y) & ~np.isnan(s)
    return y[keep], s[keep]


def _of(name: str, columns: dict[str, np.ndarray]) -> Any:
    spec = SPECS[name]
    return result(spec, reduce(spec, row_values(spec, columns)))


# -- every kind against a direct computation ---------------------------------------------------


def test_counts_sums_means_and_extremes_against_numpy() -> None:
    columns = _data(5000)
    x = columns["x"]
    values = x[~np.isnan(x)]
    assert _of("count", columns) == len(values)
    assert _of("rows", columns) == len(x)
    # Exact: the correctly rounded sum of every row, as math.fsum gives it.
    assert _of("sum", columns) == math.fsum(values)
    exact_mean = sum(map(Fraction, values.tolist())) / len(values)
    assert _of("mean", columns) == float(exact_mean)
    assert _of("min", columns) == values.min()
    assert _of("max", columns) == values.max()


def test_a_histogram_counts_as_numpy_does() -> None:
    columns = _data(5000)
    spec = SPECS["hist"]
    x = columns["x"][~np.isnan(columns["x"])]
    x[:3] = [-2.0, 3.0, 0.5]  # both edges of the range, and an inner edge (0.5 = -2 + 5 * 3/6)
    counts, edges = np.histogram(x, bins=7, range=(-2.0, 3.0))
    got = result(spec, reduce(spec, x))
    assert got == {
        "edges": [float(f"{e:.15g}") for e in edges.tolist()],
        "counts": counts.tolist(),
        "under": int(np.count_nonzero(x < -2)),
        "over": int(np.count_nonzero(x > 3)),
    }


def _mann_whitney(y: np.ndarray, s: np.ndarray) -> Fraction:
    """Share of (positive, negative) pairs where the positive scores higher, ties half."""
    pos, neg = s[y == 1], s[y == 0]
    wins = sum(int(np.count_nonzero(p > neg)) * 2 + int(np.count_nonzero(p == neg)) for p in pos)
    return Fraction(wins, 2 * len(pos) * len(neg))


def _bin(s: np.ndarray, bins: int, lo: float, hi: float) -> np.ndarray:
    """A score's bin by the definition: edges[i] <= s < edges[i + 1], the last bin closed,
    scores outside the range in the first or last."""
    edges = np.linspace(lo, hi, bins + 1)
    index = np.searchsorted(edges, np.clip(s, lo, hi), side="right") - 1
    return np.asarray(np.minimum(index, bins - 1))


@pytest.mark.parametrize("bins", [1, 7, 50, 1000])
def test_auc_is_the_binned_mann_whitney_exactly_and_near_the_exact_one(bins: int) -> None:
    columns = _data(800, seed=bins)
    spec = MetricSpec(kind="auc", label="y", score="s", bins=bins)
    got = result(spec, reduce(spec, row_values(spec, columns)))
    y, s = _pairs(columns)
    binned = _bin(s, bins, 0.0, 1.0)
    assert got == float(_mann_whitney(y, binned.astype(np.float64)))
    # Binning turns only the pairs that share a bin into ties, each moved by half a pair at
    # most: the bound is half the share of (positive, negative) pairs in a common bin.
    pos, neg = binned[y == 1], binned[y == 0]
    shared = sum(int(np.count_nonzero(neg == b)) for b in pos)
    bound = Fraction(shared, 2 * len(pos) * len(neg))
    assert got is not None
    assert abs(Fraction(got) - _mann_whitney(y, s)) <= bound + Fraction(1, 10**12)


def test_auc_with_one_class_or_no_rows_is_undefined() -> None:
    spec = SPECS["auc"]
    assert result(spec, empty(spec)) is None
    only_positives = np.array([[1.0, 0.2], [1.0, 0.9], [True, 0.5]])
    assert result(spec, reduce(spec, only_positives)) is None
    perfect = np.array([[1.0, 0.9], [0.0, 0.1]])
    assert result(spec, reduce(spec, perfect)) == 1.0


def test_logloss_against_its_formula() -> None:
    columns = _data(3000)
    y, s = _pairs(columns)
    p = np.clip(s, LOGLOSS_EPS, 1 - LOGLOSS_EPS)
    direct = [
        -math.log(q) if label == 1 else -math.log(1 - q) for label, q in zip(y, p, strict=True)
    ]
    got = _of("logloss", columns)
    assert got == pytest.approx(math.fsum(direct) / len(direct), rel=1e-14)
    # Probabilities of exactly 0 and 1 are clipped, as sklearn clips them.
    spec = SPECS["logloss"]
    sure = reduce(spec, np.array([[1.0, 0.0], [0.0, 1.0]]))
    worst = (-math.log(LOGLOSS_EPS) - math.log(1 - (1 - LOGLOSS_EPS))) / 2
    assert result(spec, sure) == pytest.approx(worst, rel=1e-14)


def test_labels_that_are_neither_0_nor_1_count_for_nothing_but_are_counted() -> None:
    rows = np.array([[1.0, 0.8], [0.0, 0.3], [2.0, 0.9], [0.5, 0.1], [np.nan, 0.4], [1, np.nan]])
    for name in LABELLED:
        spec = SPECS[name]
        partial = reduce(spec, rows)
        assert partial["bad_labels"] == 2  # 2 and 0.5; a missing label or score is no row
        assert result(spec, partial) == result(spec, reduce(spec, rows[:2]))


def test_undefined_and_empty_results() -> None:
    assert results_named(SPECS, {}) == {
        "count": 0,
        "rows": 0,
        "sum": 0.0,
        "mean": None,
        "min": None,
        "max": None,
        "hist": {
            "edges": [float(f"{e:.15g}") for e in np.linspace(-2, 3, 8).tolist()],
            "counts": [0] * 7,
            "under": 0,
            "over": 0,
        },
        "auc": None,
        "logloss": None,
    }


def test_infinities_in_sums_and_means() -> None:
    inf = math.inf
    for kind in ("sum", "mean"):
        spec = SPECS[kind]
        assert result(spec, reduce(spec, np.array([1.0, inf]))) == inf
        assert result(spec, reduce(spec, np.array([-inf, 2.0]))) == -inf
        assert result(spec, reduce(spec, np.array([inf, -inf]))) is None
    # Finite values whose sum is beyond the largest float.
    assert result(SPECS["sum"], reduce(SPECS["sum"], np.array([1.7e308, 1.7e308]))) == inf
    assert result(SPECS["mean"], reduce(SPECS["mean"], np.array([1.7e308, 1.7e308]))) == 1.7e308


def test_sums_are_exact_where_floats_are_not() -> None:
    spec = SPECS["sum"]
    values = np.array([1e100, 1.0, -1e100, 5e-324, 2.0**-60])
    assert np.sum(values) != math.fsum(values)
    assert result(spec, reduce(spec, values)) == math.fsum(values)
    halves = [reduce(spec, values[:2]), reduce(spec, values[2:])]
    assert merge_all(spec, halves) == reduce(spec, values)


# -- merging: any split of the rows, in any order ------------------------------------------------

floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
moderate = st.floats(min_value=-1e6, max_value=1e6) | st.just(math.nan)
labels = st.sampled_from([0.0, 1.0, 1.0, 0.0, math.nan, 2.0])
scores = st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0.0, 1.0, math.nan])


@st.composite
def split_rows(draw: st.DrawFn, name: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Rows for metric `name`, and the same rows cut into pieces, the pieces shuffled."""
    n = draw(st.integers(min_value=0, max_value=60))
    if name in LABELLED:
        pairs = draw(st.lists(st.tuples(labels, scores), min_size=n, max_size=n))
        rows = np.array(pairs, dtype=np.float64).reshape(n, 2)
    else:
        values = moderate if name in ("mean", "sum") and draw(st.booleans()) else floats
        rows = np.array(draw(st.lists(values, min_size=n, max_size=n)), dtype=np.float64)
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=n), max_size=6)))
    pieces = np.split(rows, cuts)
    return rows, draw(st.permutations(pieces))


def _merge_tree(spec: MetricSpec, partials: list[Partial], data: st.DataObject) -> Partial:
    """Merge in a grouping hypothesis chooses: any two neighbours first, either way round."""
    partials = list(partials)
    while len(partials) > 1:
        i = data.draw(st.integers(min_value=0, max_value=len(partials) - 2))
        a, b = partials[i], partials[i + 1]
        partials[i : i + 2] = [merge(spec, a, b) if data.draw(st.booleans()) else merge(spec, b, a)]
    return partials[0] if partials else empty(spec)


@pytest.mark.parametrize("name", list(SPECS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_partials_of_any_split_merge_into_the_partial_of_all_rows(
    name: str, data: st.DataObject
) -> None:
    spec = SPECS[name]
    rows, pieces = data.draw(split_rows(name))
    whole = reduce(spec, rows)
    partials = [reduce(spec, piece) for piece in pieces]
    # JSON on the way, as partials travel in commit records.
    partials = [json.loads(json.dumps(p)) for p in partials]
    merged = _merge_tree(spec, partials, data)
    assert merged == whole
    assert merge(spec, empty(spec), whole) == whole == merge(spec, whole, empty(spec))
    assert json.loads(json.dumps(result(spec, merged))) == json.loads(
        json.dumps(result(spec, whole))
    )


def test_the_partial_of_no_rows_is_empty() -> None:
    for spec in SPECS.values():
        rows = np.empty((0, 2) if spec.kind in LABELLED else 0)
        assert reduce(spec, rows) == empty(spec)
        assert merge_all(spec, []) == empty(spec)


def test_partials_are_small() -> None:
    columns = _data(100_000)
    spec = MetricSpec(kind="auc", label="y", score="s")  # 1000 bins
    partial = reduce(spec, row_values(spec, columns))
    assert len(json.dumps(partial)) < 20_000
    few = reduce(spec, np.array([[1.0, 0.5], [0.0, 0.25]]))
    assert few == {"bins": [250, 500], "pos": [0, 1], "neg": [1, 0], "bad_labels": 0}
    assert reduce(SPECS["sum"], columns["x"])["sum"].__len__() <= 3


# -- row values ------------------------------------------------------------------------------


def test_row_values_of_every_column_shape() -> None:
    spec = SPECS["sum"]
    expected = np.array([1.0, np.nan, 2.5, 3.0, 4.0])
    objects = np.array([1, None, 2.5, [3.0], np.float32(4)], dtype=object)
    for column in (
        expected,
        expected.reshape(-1, 1),
        objects,
        np.array([1, np.nan, 2.5, 3, 4], dtype=np.float32),
    ):
        np.testing.assert_array_equal(row_values(spec, {"x": column}), expected)
    np.testing.assert_array_equal(row_values(spec, {"x": np.array([3, 4])}), [3.0, 4.0])
    auc = SPECS["auc"]
    got = row_values(auc, {"y": np.array([True, False]), "s": np.array([[0.9], [0.2]])})
    np.testing.assert_array_equal(got, [[1.0, 0.9], [0.0, 0.2]])
    rows = row_values(SPECS["rows"], {"anything": np.zeros(4)})
    np.testing.assert_array_equal(rows, np.ones(4))


@pytest.mark.parametrize(
    ("columns", "problem"),
    [
        ({"z": np.zeros(3)}, "'x': no such column among the rows' (they have 'z')"),
        ({"x": np.zeros((3, 2))}, "one value per row expected, got rows of shape (3, 2)"),
        ({"x": np.array([[1, 2], None], dtype=object)}, "got a row of 2"),
        ({"x": np.array(["a", "b"])}, "expected numbers"),
        ({"x": np.array(["a", None], dtype=object)}, "expected a number or null, got str"),
    ],
)
def test_bad_columns_are_named(columns: dict[str, np.ndarray], problem: str) -> None:
    with pytest.raises(ValueError, match=r"^metric 'total': sum metric, column 'x'") as e:
        row_values_named({"total": SPECS["sum"]}, columns)
    assert problem in str(e.value)


def test_bad_row_values_are_refused() -> None:
    with pytest.raises(ValueError, match=r"shape \(n, 2\) expected"):
        reduce(SPECS["auc"], np.zeros(3))
    with pytest.raises(ValueError, match=r"shape \(n,\) expected"):
        reduce(SPECS["mean"], np.zeros((3, 2)))
    with pytest.raises(ValueError, match="metric 'm': no row values"):
        reduce_named({"m": SPECS["mean"]}, {})


# -- named metrics ---------------------------------------------------------------------------


def test_named_metrics_reduce_merge_and_result() -> None:
    columns = _data(1000)
    values = row_values_named(SPECS, columns)
    first = reduce_named(SPECS, {k: v[:400] for k, v in values.items()})
    rest = reduce_named(SPECS, {k: v[400:] for k, v in values.items()})
    whole = reduce_named(SPECS, values)
    assert merge_named(SPECS, first, rest) == whole
    # A side that lacks a metric (an attempt with no rows) is empty there; others are dropped.
    assert merge_named(SPECS, whole, {"gone": {"n": 3}}) == whole
    assert results_named(SPECS, whole)["count"] == np.count_nonzero(~np.isnan(columns["x"]))
    with pytest.raises(ValueError, match="metric 'sum': a partial not of a sum"):
        merge_named(SPECS, whole, {"sum": {"n": 1}})


# -- the spec --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "path", "problem"),
    [
        ({"kind": "sum"}, "column", "sum needs the column"),
        ({"kind": "auc", "score": "s"}, "label", "auc needs the column of its labels"),
        ({"kind": "logloss", "label": "y"}, "score", "needs the column of its scores"),
        ({"kind": "auc", "label": "y", "score": "s", "column": "x"}, "column", "not `column`"),
        ({"kind": "mean", "column": "x", "label": "y"}, "label", "only auc and logloss"),
        ({"kind": "histogram", "column": "x"}, "range", "needs its [low, high]"),
        ({"kind": "histogram", "column": "x", "range": [1.0]}, "range", "two finite numbers"),
        ({"kind": "histogram", "column": "x", "range": [1.0, 1.0]}, "range", "below high"),
        (
            {"kind": "histogram", "column": "x", "range": [0.0, math.inf]},
            "range",
            "two finite numbers",
        ),
        ({"kind": "histogram", "column": "x", "range": [0, 1], "bins": 0}, "bins", "[1, 100000]"),
        ({"kind": "auc", "label": "y", "score": "s", "bins": 100_001}, "bins", "[1, 100000]"),
        ({"kind": "count", "bins": 3}, "bins", "only a histogram or auc"),
        ({"kind": "max", "column": "x", "range": [0, 1]}, "range", "only a histogram or auc"),
    ],
)
def test_bad_metric_specs_say_what(fields: dict[str, Any], path: str, problem: str) -> None:
    with pytest.raises(SpecError) as e:
        MetricSpec(**fields)
    assert e.value.path == path
    assert problem in e.value.problem


def test_defaults_by_kind() -> None:
    assert MetricSpec(kind="auc", label="y", score="s").bins == 1000
    assert MetricSpec(kind="auc", label="y", score="s").range == [0.0, 1.0]
    assert MetricSpec(kind="histogram", column="x", range=[0, 1]).bins == 10
    assert MetricSpec(kind="mean", column="x").bins is None


def test_histogram_edges_read_as_people_write_them() -> None:
    spec = MetricSpec(kind="histogram", column="x", bins=10, range=[0.0, 1.0])
    got = result(spec, reduce(spec, np.array([0.25, 0.35])))
    assert isinstance(got, dict)
    assert got["edges"] == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    assert got["counts"] == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
