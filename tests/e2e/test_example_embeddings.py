"""examples/embeddings: Ebb's MiniLM (tokenizer modelet + scripted encoder, run by the model
stage) gives the embeddings of `SentenceTransformer.encode` on the same packaged model."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ebb.common.job import StageSpec
from ebb.worker.modelets.runtimes import TorchScriptStage

EXAMPLE = Path(__file__).resolve().parent.parent.parent / "examples" / "embeddings"

TOLERANCE = 1e-4
"""Largest difference allowed in any of the 384 components (both sides are unit vectors)."""


@pytest.fixture(scope="module")
def example() -> Any:
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield importlib.import_module("minilm"), importlib.import_module("corpus")
    finally:
        sys.path.remove(str(EXAMPLE))


def test_embeddings_equal_sentence_transformers(
    example: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    minilm, corpus = example
    import pyarrow.parquet as pq

    # A sample of the real corpus: the docstrings of this repository's own code.
    rows = corpus.build(tmp_path / "data", roots=[EXAMPLE.parent.parent / "libs"], rows=40)
    assert rows == 40
    texts = pq.read_table(tmp_path / "data").column("text").to_pylist()
    texts.append("word " * 400)  # longer than the model's 256 tokens: cut the same way

    tokenize = minilm.Tokenize()
    tokenize.setup()
    tokens = tokenize.process_columns({"text": np.asarray(texts, dtype=object)})
    stage = TorchScriptStage(
        StageSpec(name="embed", model=str(minilm.export_torchscript(tmp_path / "m.pt")))
    )
    stage.setup()
    got = next(iter(stage.process_columns(tokens).values()))

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the packaged model only, never a hub
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm.model_dir()), device="cpu")
    expected = reference.encode(texts, convert_to_numpy=True)
    assert got.shape == expected.shape == (len(texts), 384)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)
