"""Shared test helpers: waiting on conditions, datasets, models, job specs, reading outputs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from ebb.client.demo import feature_table, mlp_onnx
from ebb.client.stack import LocalStack, StackConfig
from ebb.common.data.layout import COMMITS_DIR, MANIFEST

ASSETS = Path(__file__).parent / "assets"
FEATURES = 8
CLASSES = 4


def command_line(process: psutil.Process) -> str:
    """`process`'s command line; "" once it has ended (a zombie not yet reaped raises on
    `cmdline()`, as a process gone does)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until(
    probe: Callable[[], Any],
    *,
    timeout: float = 60.0,
    interval: float = 0.05,
    what: str = "condition",
) -> Any:
    """Poll `probe` until it returns something truthy; fail the test after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        result = probe()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        last = result
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def write_dataset(
    folder: Path, *, rows: int, files: int = 1, row_group_size: int = 2_000, seed: int = 1
) -> Path:
    """Parquet files with `id`, `customer` and an 8-wide `features` vector."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    for f in range(files):
        start = f * per_file
        n = min(per_file, rows - start)
        table = feature_table(n, features=FEATURES, seed=seed + f, start_id=start)
        pq.write_table(table, folder / f"part-{f:03d}.parquet", row_group_size=row_group_size)
    return folder


def write_model(path: Path, *, seed: int = 3) -> Path:
    return mlp_onnx(path, inputs=FEATURES, hidden=16, outputs=CLASSES, seed=seed)


def job_spec(
    tmp: Path,
    *,
    name: str = "test-job",
    rows_per_shard: int = 2_000,
    stages: list[dict[str, Any]] | None = None,
    workers: tuple[int, int] = (1, 1),
    fault: dict[str, Any] | None = None,
    input_uri: str | None = None,
    output_uri: str | None = None,
    carryover: list[str] | None = None,
) -> dict[str, Any]:
    """A job map over `tmp/data` with the ONNX model at `tmp/model.onnx` (standard pipeline:
    features -> model -> top class), written out as `tmp/job.yaml` too."""
    if stages is None:
        stages = [
            {
                "name": "preprocess",
                "modelet": "ebb.worker.modelets:Features",
                "params": {"columns": ["features"]},
                "batch_size": 128,
            },
            {"name": "model", "model": str(tmp / "model.onnx"), "batch_size": 256},
            {"name": "postprocess", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 256},
        ]
    spec: dict[str, Any] = {
        "name": name,
        "input": {
            "uri": input_uri or str(tmp / "data"),
            "format": "parquet",
            "columns": ["id", "features"],
            "rows_per_shard": rows_per_shard,
        },
        "pipeline": {"stages": stages, "code_paths": [str(ASSETS)]},
        "output": {
            "uri": output_uri or str(tmp / "out"),
            "carryover": carryover if carryover is not None else ["id", "customer"],
        },
        "resources": {"min_workers": workers[0], "max_workers": workers[1]},
        "fault": {"lease_s": 10, **(fault or {})},
    }
    (tmp / "job.yaml").write_text(yaml.safe_dump(spec))
    return spec


def read_output(out: Path) -> tuple[pa.Table, dict[str, Any]]:
    """The job's output as the manifest lists it, and the manifest."""
    manifest = json.loads((out / MANIFEST).read_text())
    tables = [pq.read_table(out / f["path"]) for f in manifest["files"]]
    return pa.concat_tables(tables, promote_options="default"), manifest


def committed_files(out: Path) -> set[str]:
    files: set[str] = set()
    for record in (out / COMMITS_DIR).glob("*.json"):
        files |= {f["path"] for f in json.loads(record.read_text())["files"]}
    return files


def reference_predictions(data: Path, model: Path) -> dict[int, tuple[int, float]]:
    """id -> (class, probability) computed directly with onnxruntime, no Ebb involved."""
    table = pa.concat_tables(pq.read_table(p) for p in sorted(data.glob("*.parquet")))
    ids = table.column("id").to_numpy()
    x = np.stack(list(table.column("features").to_numpy(zero_copy_only=False))).astype(np.float32)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"x": x})[0].astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    best = probs.argmax(axis=1)
    return {
        int(i): (int(k), float(probs[n, k])) for n, (i, k) in enumerate(zip(ids, best, strict=True))
    }


@contextlib.asynccontextmanager
async def embedded_stack(tmp: Path, prefix: str, *, max_workers: int) -> AsyncIterator[LocalStack]:
    """The embedded stack over `tmp` (and the test assets), started; stopped on the way out,
    and then checked: every service, worker and client kept within its NATS permissions."""
    stack = LocalStack(
        StackConfig(
            state_dir=tmp / "state",
            data_roots=[str(tmp), str(ASSETS)],
            max_workers=max_workers,
            worker_grace_s=10,
            prefix=prefix,
        )
    )
    await stack.start()
    try:
        yield stack
    finally:
        await stack.stop()
    assert stack.nats.violations == [], stack.nats.violations
