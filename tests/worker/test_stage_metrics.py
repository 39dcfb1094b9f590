"""A stage's metrics in real stage processes: each row's values come back beside its result
(never among its columns), from the stage's output or from columns the modelet gave for them
alone, carried past later stages; a metric that cannot read its column fails the rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from ebb.common.job import StageSpec
from ebb.common.job.accumulators import MetricSpec
from ebb.worker.chunks.columns import VALUE

from ..integration.test_branches import run


def counted(**kw: Any) -> StageSpec:
    return StageSpec(name="counted", modelet="ebbtest_modelets:Counted", batch_size=16, **kw)


async def test_values_of_outputs_and_hidden_columns_come_back_beside_the_rows() -> None:
    ids = np.arange(500, dtype=np.int64)
    result = await run(
        [
            counted(
                metrics={
                    "work": MetricSpec(kind="sum", column="work"),
                    "double": MetricSpec(kind="max", column="double"),
                }
            ),
            # A later stage that replaces each row whole: the values go round it.
            StageSpec(
                name="again",
                modelet="ebb.worker.modelets:Features",
                params={"columns": ["double"]},
                batch_size=7,
            ),
        ],
        {"id": ids, "x": ids.astype(np.float64)},
    )
    assert not result.errors
    assert sorted(result.metrics) == ["double", "work"]
    np.testing.assert_array_equal(result.metrics["work"], ids % 3)
    np.testing.assert_array_equal(result.metrics["double"], ids * 2)
    assert list(result.columns) == [VALUE]  # the last stage's plain result, alone


async def test_a_metric_that_cannot_read_its_column_fails_the_rows_saying_so() -> None:
    ids = np.arange(40, dtype=np.int64)
    result = await run(
        [counted(metrics={"m": MetricSpec(kind="mean", column="nowhere")})], {"id": ids}
    )
    assert sorted(result.errors) == list(range(40))
    assert all("nowhere" in m and "'counted'" in m for m in result.errors.values())
