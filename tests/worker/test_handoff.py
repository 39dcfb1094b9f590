"""The hand-off between tiers: what a tier writes is what the next reads, column for column,
tensors and half floats included, from any row on, with the rows that failed before kept as
error rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ebb.common.data.layout import attempt_dir
from ebb.common.data.output import OutputStore
from ebb.common.job import OutputSpec, parse_job
from ebb.common.messaging.messages import HandoffPart, ShardSpec
from ebb.worker.attempt import repeated_mistake
from ebb.worker.chunks.columns import VALUE, from_arrow, take_rows
from ebb.worker.shardio import handoff
from ebb.worker.shardio.reader import ShardReader
from ebb.worker.shardio.writer import ERROR_COLUMN, write_attempt


def chunk(start: int, n: int) -> tuple[pa.Table, dict[str, np.ndarray], dict[int, str]]:
    """Input rows (an `id` and a `label` to carry over), results (a half-float tensor and a
    plain column named as the output's carryover is) and errors."""
    ids = np.arange(start, start + n)
    rows = pa.table({"id": ids, "label": [f"l{i}" for i in ids], "features": ids * 2.0})
    results: dict[str, np.ndarray] = {
        "pixels": (ids[:, None, None] * np.ones((n, 2, 3))).astype(np.float16),
        "id": ids * 10,  # a result may share a carryover column's name until the last tier
    }
    errors = {i: f"bad row {start + i}" for i in range(n) if (start + i) % 7 == 3}
    return rows, results, errors


def test_what_a_tier_hands_on_is_read_back_as_it_was_from_any_row(tmp_path: Path) -> None:
    output = OutputSpec(uri=str(tmp_path / "tier"), carryover=["id", "label"])
    store = OutputStore(output.uri)
    files = []
    for part, start in enumerate((0, 50)):
        rows, results, errors = chunk(start, 50)
        table, bad = handoff.handoff_table(rows, results, errors, output)
        assert bad == len(errors)
        files += write_attempt(
            store, table, shard=0, attempt=1, error_rows=bad, fmt="arrow", first_part=part
        )
    parts = [HandoffPart(path=store.url(f.path), rows=f.rows) for f in files]
    for offset in (0, 30, 50, 77):
        shard = ShardSpec(
            index=9,
            path=store.url(attempt_dir(0, 1)),
            format="arrow",
            rows=100 - offset,
            parts=parts,
            row_offset=offset,
        )
        reader = ShardReader(shard, None, chunk_rows=16)
        chunks = []
        while (data := reader.next()) is not None:
            chunks.append(handoff.read_handoff(data.table))
        assert reader.exhausted and reader.rows_read == 100 - offset
        table = pa.concat_tables(c.table for c in chunks)
        ids = list(range(offset, 100))
        assert handoff.carried(table).to_pydict() == {
            "id": ids,
            "label": [f"l{i}" for i in ids],
        }
        # The rows that go into the pipeline: those that did not fail before (attempt.py).
        good = [k for k, i in enumerate(ids) if i % 7 != 3]
        inputs = from_arrow(take_rows(handoff.pipeline_inputs(table), np.asarray(good)))
        assert set(inputs) == {"pixels", "id"}
        assert inputs["pixels"].dtype == np.float16 and inputs["pixels"].shape == (len(good), 2, 3)
        assert np.array_equal(inputs["pixels"][:, 1, 2], np.asarray(ids)[good])
        assert np.array_equal(inputs["id"], np.asarray(ids)[good] * 10)
        bad_rows: dict[int, str] = {}
        seen = 0
        for c in chunks:
            bad_rows |= {seen + i: why for i, why in c.bad_rows.items()}
            seen += c.table.num_rows
        assert bad_rows == {k: f"bad row {i}" for k, i in enumerate(ids) if i % 7 == 3}


def test_plain_results_and_no_carryover_hand_on_as_the_pipeline_holds_them() -> None:
    rows = pa.table({"x": [1.0, 2.0, 3.0]})
    results = {VALUE: np.array([0.5, 0.25, 0.125], dtype=np.float32)}
    table, bad = handoff.handoff_table(rows, results, {1: "no"}, OutputSpec(uri="unused"))
    assert bad == 1 and table.schema.names == [VALUE, ERROR_COLUMN]
    data = handoff.read_handoff(table)
    assert data.bad_rows == {1: "no"}
    assert handoff.carried(table).num_columns == 0
    assert handoff.pipeline_inputs(table).column(VALUE).to_pylist() == [0.5, None, 0.125]


def test_rows_taken_from_a_slice_of_tensors_are_those_rows() -> None:
    """Arrow takes rows of a sliced column of nested fixed-size lists wrongly (values from
    the start of the buffer): `take_rows` does not."""
    values = np.arange(50)[:, None, None] * np.ones((50, 2, 3), dtype=np.float32)
    mask = np.arange(50) % 7 == 3
    tensors = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 3), 2, mask=pa.array(mask)
    )
    table = pa.table({"t": tensors, "n": np.arange(50)}).slice(27)
    index = np.array([0, 1, 5, 22])
    batch = pa.record_batch({"t": tensors.slice(27), "n": pa.array(np.arange(50)).slice(27)})
    for taken in (take_rows(table, index), take_rows(batch, index)):
        assert taken.column("n").to_pylist() == [27, 28, 32, 49]
        rows: list[Any] = taken.column("t").to_pylist()
        assert [row[1][2] for row in rows] == [27.0, 28.0, 32.0, 49.0]
    assert take_rows(table, np.array([4])).column("t").to_pylist() == [None]  # row 31: null


def test_the_rows_metric_values_ride_the_hand_off_and_stay_out_of_the_next_pipeline() -> None:
    """A tier before the last carries each row's metric values on (a count's ones, an auc's
    label and score pairs), for the last tier to reduce over the rows it writes."""
    table, results, errors = chunk(0, 6)
    values = {
        "rows": np.ones(6),
        "auc": np.stack([np.arange(6) % 2, np.linspace(0, 1, 6)], axis=1).astype(np.float64),
    }
    out, _ = handoff.handoff_table(
        table,
        results,
        errors,
        OutputSpec(uri="x", carryover=["id"]),
        metrics=handoff.metric_columns(values),
    )
    back = handoff.metric_values(out, ["rows", "auc"])
    assert np.array_equal(back["rows"], values["rows"])
    assert back["auc"].shape == (6, 2) and np.array_equal(back["auc"], values["auc"])
    assert not any(n.startswith(handoff.METRIC) for n in handoff.pipeline_inputs(out).schema.names)


def test_a_later_tier_s_first_stage_reads_a_column_the_tier_before_made() -> None:
    """The rows a later tier reads are the hand-off, which the job's input.columns do not
    name: its workers take a first stage reading a column the tier before made (they exited
    3, the spec refused, when the input's columns were held against it)."""
    spec = parse_job(
        {
            "name": "j",
            "input": {"uri": "/d/in.parquet", "columns": ["features"]},
            "pipeline": {
                "stages": [
                    {"name": "pre", "modelet": "mine:Pre"},
                    {"name": "model", "model": "/m.onnx", "input": "x"},
                    {"name": "post", "modelet": "mine:Post"},
                ]
            },
            "output": {"uri": "/d/out"},
            "tiers": [
                {"name": "prep", "stages": ["pre"]},
                {"name": "infer", "stages": ["model", "post"]},
            ],
        }
    )
    prep, prep_ends = handoff.tier_view(spec, "prep")
    assert prep.input == spec.input and not prep_ends.reads_handoff
    infer, infer_ends = handoff.tier_view(spec, "infer")
    assert infer_ends.reads_handoff and infer.input.columns is None
    assert [s.name for s in infer.pipeline.stages] == ["model", "post"]
    assert infer.pipeline.stages[0].input == "x"
    # A mistake every row repeats there names the field by the stage's place in the job.
    errors = dict.fromkeys(range(8), "stage 'post': KeyError: 'label'")
    told = repeated_mistake(infer, errors, 8, ends=infer_ends)
    assert told.endswith("(the spec's pipeline.stages[2])"), told
