"""Bad input data on the embedded stack (real processes): a Parquet row group that cannot be
decoded, NaN and inf in a model's input, an empty file. The rows or the shard at fault end as
errors that say why, the rest is output exactly once, and the error threshold decides the job."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebb.client.demo import feature_table
from ebb.client.sdk import EbbClient
from ebb.common.job import InputSpec, StageSpec, parse_job
from ebb.shard_master.errors import PlanningError
from ebb.shard_master.planning.planner import plan_shards
from ebb.worker.chunks.columns import VALUE
from ebb.worker.modelets.runtimes import load_runtime

from ..helpers import embedded_stack, job_spec, read_output, write_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROWS_PER_FILE = 2_000
NAN_ID, INF_ID = 7, 1_234
CORRUPT_GROUP = 2  # of the second file: ids 3,000 to 3,499


def write_bad_dataset(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for f in range(3):
        table = feature_table(ROWS_PER_FILE, features=8, seed=f, start_id=f * ROWS_PER_FILE)
        if f == 0:
            features = np.stack(list(table.column("features").to_numpy(zero_copy_only=False)))
            features[NAN_ID, 3] = np.nan
            features[INF_ID, 0] = np.inf
            kind = table.schema.field("features").type
            column = pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), 8)
            index = table.schema.get_field_index("features")
            table = table.set_column(index, "features", column.cast(kind))
        pq.write_table(table, folder / f"part-{f}.parquet", row_group_size=500)
    # A page header overwritten: the footer reads fine, that one row group does not.
    second = folder / "part-1.parquet"
    offset = pq.ParquetFile(second).metadata.row_group(CORRUPT_GROUP).column(0).data_page_offset
    raw = bytearray(second.read_bytes())
    raw[offset : offset + 64] = b"\xff" * 64
    second.write_bytes(bytes(raw))
    # A file with no rows (an empty partition) is no shard and no error.
    empty = feature_table(0, features=8, seed=9, start_id=0)
    pq.write_table(empty, folder / "part-9.parquet")
    return folder


@pytest.fixture
async def client(tmp_path: Path, prefix: str) -> AsyncIterator[EbbClient]:
    async with (
        embedded_stack(tmp_path, prefix, max_workers=2) as stack,
        await EbbClient.connect(stack.nats_config) as c,
    ):
        yield c


async def test_bad_rows_and_an_undecodable_row_group_fail_alone_and_the_threshold_decides(
    tmp_path: Path, client: EbbClient
) -> None:
    write_bad_dataset(tmp_path / "data")
    write_model(tmp_path / "model.onnx")
    fault = {"max_attempts": 2}
    tolerant = job_spec(tmp_path, rows_per_shard=500, workers=(2, 2), fault=fault)
    tolerant["fault"]["max_error_fraction"] = 0.1
    strict = job_spec(
        tmp_path, rows_per_shard=500, workers=(2, 2), fault=fault, output_uri=str(tmp_path / "o2")
    )
    tolerant_id = await client.submit(parse_job(tolerant).with_id())
    strict_id = await client.submit(parse_job(strict).with_id())

    final = await client.wait(tolerant_id)
    assert final.state == "SUCCEEDED", final.reason
    assert (final.shards_total, final.shards["QUARANTINED"], final.error_rows) == (12, 1, 2)
    table, manifest = read_output(tmp_path / "out")
    [lost] = manifest["quarantined"]
    assert lost["path"].endswith("part-1.parquet") and lost["rows"] == 500
    assert "cannot read shard" in lost["reason"] and "thrift" in lost["reason"]
    ids = table.column("id").to_numpy().tolist()
    unreadable = set(range(3_000, 3_500))
    assert sorted(ids) == sorted(set(range(3 * ROWS_PER_FILE)) - unreadable)
    errors = {r["id"]: r["_error"] for r in table.to_pylist() if r["_error"] is not None}
    assert sorted(errors) == [NAN_ID, INF_ID]
    assert all("holds NaN or inf" in e for e in errors.values())
    good = [r for r in table.to_pylist() if r["_error"] is None]
    assert all(np.isfinite(r["score"]) for r in good)

    # The same data, the default threshold (1% of rows): the lost row group fails the job.
    failed = await client.wait(strict_id)
    assert failed.state == "FAILED"
    assert "exceed max_error_fraction 0.01" in failed.reason
    assert "part-1.parquet" in failed.reason and "thrift" in failed.reason


def test_a_truncated_parquet_file_refuses_the_job_at_planning_naming_it(tmp_path: Path) -> None:
    """Its rows cannot even be counted: refused before anything runs, never silently short."""
    folder = tmp_path / "data"
    folder.mkdir()
    for f in range(2):
        pq.write_table(
            feature_table(100, features=8, seed=f, start_id=100 * f), folder / f"{f}.parquet"
        )
    whole = (folder / "1.parquet").read_bytes()
    (folder / "1.parquet").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(PlanningError, match=r"1\.parquet"):
        plan_shards(InputSpec(uri=str(folder), format="parquet"))


def _model_stage(tmp_path: Path, *, finite_inputs: bool) -> Any:
    stage = load_runtime(
        StageSpec(model=str(write_model(tmp_path / "m.onnx")), finite_inputs=finite_inputs)
    )
    stage.setup()
    return stage


def test_nan_or_inf_in_a_model_input_fails_the_batch_unless_allowed(tmp_path: Path) -> None:
    x = np.ones((4, 8), dtype=np.float32)
    x[2, 5] = np.nan
    x[3, 0] = -np.inf
    with pytest.raises(ValueError, match="2 of 4 rows' model input 'x' holds NaN or inf"):
        _model_stage(tmp_path, finite_inputs=True).process_columns({VALUE: x})
    # A model that reads NaN as missing gets it; this MLP answers NaN for those rows.
    out = _model_stage(tmp_path, finite_inputs=False).process_columns({VALUE: x})[VALUE]
    assert np.isfinite(out[:2]).all() and not np.isfinite(out[2:]).all(axis=1).any()
