"""`ebb demo`: a sample dataset, a small real ONNX model, a user modelet and a job spec.

Everything is generated here, from a seed: nothing is downloaded.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.parquet as pq
from onnx import TensorProto, helper, numpy_helper

FEATURES = 16
CLASSES = ["bronze", "silver", "gold", "platinum"]


def mlp_onnx(
    path: str | Path, *, inputs: int, hidden: int, outputs: int, seed: int = 0, layers: int = 1
) -> Path:
    """Write an MLP classifier (Gemm + ReLU layers, logits out) as an ONNX file.

    Input `x` is float32 [N, inputs]; output `logits` is float32 [N, outputs].
    """
    rng = np.random.default_rng(seed)
    nodes = []
    initializers = []
    width, current = inputs, "x"
    for i in range(layers + 1):
        last = i == layers
        out_width = outputs if last else hidden
        w = (rng.standard_normal((width, out_width)) / np.sqrt(width)).astype(np.float32)
        b = (0.1 * rng.standard_normal(out_width)).astype(np.float32)
        initializers += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        gemm_out = "logits" if last else f"g{i}"
        nodes.append(helper.make_node("Gemm", [current, f"w{i}", f"b{i}"], [gemm_out]))
        if not last:
            nodes.append(helper.make_node("Relu", [gemm_out], [f"r{i}"]))
            current = f"r{i}"
        width = out_width
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", inputs])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", outputs])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime still in use
    onnx.checker.check_model(model)
    out = Path(path)
    onnx.save(model, str(out))
    return out


def feature_table(
    rows: int, *, features: int = FEATURES, seed: int = 0, start_id: int = 0
) -> pa.Table:
    """`id` (int64), `customer` (string), `features` (fixed-size list of float32)."""
    rng = np.random.default_rng(seed)
    values = rng.normal(loc=2.0, scale=3.0, size=(rows, features)).astype(np.float32)
    ids = np.arange(start_id, start_id + rows, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "customer": pa.array([f"customer-{i:07d}" for i in ids]),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), features),
        }
    )


DEMO_MODELETS = '''\
"""The demo's own modelet: a user class, named in job.yaml as demo_modelets:Standardize."""

import numpy as np


class Standardize:
    """Row -> the standardised feature vector the model was trained on."""

    def __init__(self, mean: float, std: float) -> None:
        self.mean = np.float32(mean)
        self.std = np.float32(std)

    def process_columns(self, batch):
        # A batch of rows as columns: "features" is one float32 array of [rows, 16].
        return {"features": (batch["features"] - self.mean) / self.std}
'''


def write_demo(folder: str | Path, *, rows: int = 100_000, files: int = 4, seed: int = 0) -> Path:
    """Write the demo into `folder`; returns the job file's path."""
    root = Path(folder)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    for f in range(files):
        start = f * per_file
        n = min(per_file, rows - start)
        if n <= 0:
            break
        table = feature_table(n, seed=seed + f, start_id=start)
        pq.write_table(table, data / f"part-{f:03d}.parquet", row_group_size=5_000)
    mlp_onnx(root / "model.onnx", inputs=FEATURES, hidden=64, outputs=len(CLASSES), seed=seed)
    (root / "demo_modelets.py").write_text(DEMO_MODELETS)
    job = root / "job.yaml"
    job.write_text(
        textwrap.dedent(
            f"""\
            # An Ebb job: score every customer with a small ONNX classifier.
            name: demo-scoring
            input:
              uri: data/               # every Parquet file under it
              format: parquet
              columns: [features]      # what the pipeline sees, per row
              rows_per_shard: 10000
            pipeline:
              code_paths: [.]          # where demo_modelets.py lives
              stages:
                - name: preprocess
                  modelet: demo_modelets:Standardize
                  params: {{mean: 2.0, std: 3.0}}
                  batch_size: 256
                - name: model
                  model: model.onnx
                  batch_size: 512
                  batch_wait_s: 0.005
                - name: postprocess
                  modelet: ebb.worker.modelets:TopClass
                  params: {{labels: {CLASSES}}}
                  batch_size: 512
            output:
              uri: out/
              carryover: [id, customer]
            resources:
              min_workers: 1
              max_workers: 2
            fault:
              lease_s: 30
              max_attempts: 3
              max_error_fraction: 0.01
            """
        )
    )
    return job
