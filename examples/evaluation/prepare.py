"""Make what `job.yaml` reads: a click log (`data/`) and two rankers trained on another part of
it, `ranker_a.onnx` (a logistic regression) and `ranker_b.pt` (a small MLP, TorchScript).

    python prepare.py [--rows N] [--dir DIR]

The log is synthetic: each row is a user-item pair's 16 features and whether it was clicked,
drawn from a model with interactions that a linear ranker cannot see and the MLP can: the job
should score B above A, on one read of the log.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
FEATURES = 16
FILES = 4


def click_log(rows: int, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features and clicks: the click's log-odds are linear in the features plus two
    interactions and a threshold effect."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    truth = np.random.default_rng(7).normal(size=FEATURES) * 0.4
    logit = x @ truth + 1.2 * x[:, 0] * x[:, 1] - 1.0 * np.abs(x[:, 2]) + 0.6
    clicked = rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))
    return x, clicked.astype(np.int64)


def write_log(folder: Path, rows: int) -> None:
    """The log as a tool writes it: Parquet files with pyarrow's default row groups."""
    folder.mkdir(parents=True, exist_ok=True)
    x, clicked = click_log(rows, seed=1)
    per_file = -(-rows // FILES)
    for f in range(FILES):
        part = slice(f * per_file, min(rows, (f + 1) * per_file))
        n = len(clicked[part])
        table = pa.table(
            {
                "id": pa.array(np.arange(part.start, part.start + n, dtype=np.int64)),
                "features": pa.FixedSizeListArray.from_arrays(
                    pa.array(x[part].reshape(-1)), FEATURES
                ),
                "clicked": pa.array(clicked[part]),
            }
        )
        pq.write_table(table, folder / f"part-{f}.parquet")


def train_logistic(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """A logistic regression by Newton's method (a few steps converge)."""
    a = np.hstack([x, np.ones((len(x), 1))]).astype(np.float64)
    w = np.zeros(a.shape[1])
    for _ in range(8):
        p = 1.0 / (1.0 + np.exp(-(a @ w)))
        hessian = (a * (p * (1 - p))[:, None]).T @ a + 1e-6 * np.eye(a.shape[1])
        w -= np.linalg.solve(hessian, a.T @ (p - y))
    return w[:-1], float(w[-1])


def export_logistic(path: Path, weights: np.ndarray, bias: float) -> Path:
    """probability = sigmoid(features . weights + bias), one float per row."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "w"], ["z"]),
            helper.make_node("Add", ["z", "b"], ["logit"]),
            helper.make_node("Sigmoid", ["logit"], ["p"]),
            helper.make_node("Squeeze", ["p", "axis"], ["probability"]),
        ],
        "ranker_a",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["n", FEATURES])],
        [helper.make_tensor_value_info("probability", TensorProto.FLOAT, ["n"])],
        initializer=[
            numpy_helper.from_array(weights.astype(np.float32).reshape(FEATURES, 1), "w"),
            numpy_helper.from_array(np.asarray([bias], dtype=np.float32), "b"),
            numpy_helper.from_array(np.asarray([1], dtype=np.int64), "axis"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


class Ranker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.layers(features)).squeeze(-1)


def train_mlp(x: np.ndarray, y: np.ndarray, *, epochs: int = 8) -> Ranker:
    torch.manual_seed(0)
    model = Ranker()
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    features, labels = torch.from_numpy(x), torch.from_numpy(y.astype(np.float32))
    for _ in range(epochs):
        for batch in torch.randperm(len(x)).split(512):
            optimiser.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy(model(features[batch]), labels[batch])
            loss.backward()
            optimiser.step()
    return model.eval()


def prepare(folder: Path, rows: int, *, train_rows: int = 40_000) -> None:
    write_log(folder / "data", rows)
    x, y = click_log(train_rows, seed=2)  # another day's log: the rankers never saw the job's
    export_logistic(folder / "ranker_a.onnx", *train_logistic(x, y))
    torch.jit.script(train_mlp(x, y)).save(str(folder / "ranker_b.pt"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the click log")
    parser.add_argument("--dir", type=Path, default=HERE, help="where data/ and the models go")
    args = parser.parse_args(argv)
    prepare(args.dir, args.rows)
    print(f"{args.rows:,} rows in {args.dir / 'data'}; rankers ranker_a.onnx, ranker_b.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
