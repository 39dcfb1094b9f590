"""The `llm` stage through vLLM (its CPU build, `make vllm`): a vLLM the user started
(`engine: endpoint`) and one the stage runs (`engine: server`). Greedy text equal to vLLM's own
answers for the same prompts; prompt tokens equal to the model's tokenizer's for the template
(one BOS, where the text sent again would have two); vLLM's guided decoding for a structured
stage; the stage's server SIGKILLed mid-batch, started again, every row answered once."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from typing import Any

import numpy as np
import psutil
import pytest

from ebb.common.job import LLMSpec, SamplingSpec, StageSpec, StructuredSpec
from ebb.worker.chunks.columns import ROW_ERROR
from ebb.worker.llm.prompts import PromptCodec
from ebb.worker.llm.stage import LLMStage

from ..helpers import ASSETS
from ..llm_model import corpus
from ..vllm_server import KV_CACHE_BYTES, VLLM_PYTHON, VLLMServer, vllm_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 12


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _endpoint_stage(server: VLLMServer, **llm: Any) -> LLMStage:
    stage = LLMStage(
        StageSpec(
            name="gen",
            llm=LLMSpec(
                model=str(server.model),
                engine="endpoint",
                endpoint=server.url,
                served_model=server.served_model,
                **llm,
            ),
        )
    )
    stage.setup()
    return stage


def _own_answer(server: VLLMServer, prompt: Any, max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
    """vLLM's own greedy answer and its prompt's token count: a chat through its chat API
    (its template, tokenized once), a text through its completions API."""
    body = {"max_tokens": max_tokens, "temperature": 0}
    if isinstance(prompt, str):
        reply = server.post("/completions", {"prompt": prompt, **body})
        text = reply["choices"][0]["text"]
    else:
        reply = server.post("/chat/completions", {"messages": prompt, **body})
        text = reply["choices"][0]["message"]["content"] or ""
    return text, int(reply["usage"]["prompt_tokens"])


def _column(values: list[Any]) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def test_rows_through_vllm_are_vllm_s_own_greedy_answers(vllm_server: VLLMServer) -> None:
    texts = corpus(5, seed=21)
    prompts: list[Any] = [*texts, *[_chat(t) for t in corpus(5, seed=22)]]
    stage = _endpoint_stage(
        vllm_server, max_in_flight=4, sampling=SamplingSpec(max_tokens=MAX_TOKENS)
    )
    out = stage.process_columns({"prompt": _column(prompts)})
    codec = PromptCodec(str(vllm_server.model))
    for i, prompt in enumerate(prompts):
        text, counted = _own_answer(vllm_server, prompt)
        assert out["text"][i] == text, (i, prompt)
        # One BOS: the template writes it, and nothing adds it again.
        ids = codec.encode(prompt)
        assert ids[0] == codec.tokenizer.bos_token_id and ids[1] != ids[0]
        assert out["prompt_tokens"][i] == len(ids) == counted
        assert out["output_tokens"][i] == MAX_TOKENS  # a random model rarely writes its EOS
        assert out["finish_reason"][i] == "length"
    assert not stage.engine.miscounted


def test_a_chat_sent_as_text_gets_no_second_bos(vllm_server: VLLMServer) -> None:
    chats = [_chat(t) for t in corpus(4, seed=23)]
    codec = PromptCodec(str(vllm_server.model))
    # What this guards against: the rendered chat, tokenized again as vLLM does a text.
    rendered = codec.render(chats[0])
    again = vllm_server.post("/completions", {"prompt": rendered, "max_tokens": 1})
    assert again["usage"]["prompt_tokens"] == len(codec.encode(chats[0])) + 1
    stage = _endpoint_stage(
        vllm_server, prompt_as="text", sampling=SamplingSpec(max_tokens=MAX_TOKENS)
    )
    out = stage.process_columns({"prompt": _column(chats)})
    for i, chat in enumerate(chats):
        assert out["prompt_tokens"][i] == len(codec.encode(chat))
        assert out["text"][i] == _own_answer(vllm_server, chat)[0]
    assert not stage.engine.miscounted


@pytest.mark.parametrize(
    ("structured", "valid"),
    [
        (
            StructuredSpec(
                json={
                    "type": "object",
                    "properties": {"label": {"enum": ["spam", "ham"]}, "sure": {"type": "boolean"}},
                    "required": ["label", "sure"],
                }
            ),
            lambda t: (
                json.loads(t)["label"] in ("spam", "ham") and json.loads(t)["sure"] in (True, False)
            ),
        ),
        (StructuredSpec(choice=["spam", "ham"]), lambda t: t in ("spam", "ham")),
        (StructuredSpec(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"),
    ],
    ids=["json", "choice", "regex"],
)
def test_a_structured_stage_is_guided_by_vllm(
    vllm_server: VLLMServer, structured: StructuredSpec, valid: Any
) -> None:
    prompts = [_chat(t) for t in corpus(6, seed=24)]
    stage = _endpoint_stage(
        vllm_server, structured=structured, sampling=SamplingSpec(max_tokens=60)
    )
    out = stage.process_columns({"prompt": _column(prompts)})
    # The model's weights are random: only vLLM's guided decoding makes these texts valid.
    assert ROW_ERROR not in out, out[ROW_ERROR]
    for text in out["text"]:
        assert valid(text), text


def _server_processes(stage: LLMStage) -> list[psutil.Process]:
    assert stage.server is not None and stage.server.process is not None
    root = psutil.Process(stage.server.process.pid)
    return [root, *root.children(recursive=True)]


def test_the_stage_s_vllm_killed_mid_batch_is_started_again_and_every_row_answered_once(
    vllm_server: VLLMServer,
) -> None:
    spec = StageSpec(
        name="gen",
        llm=LLMSpec(
            model=str(vllm_server.model),
            engine="server",
            command=vllm_command(),
            served_model="tiny",
            max_in_flight=2,
            sampling=SamplingSpec(max_tokens=32),
        ),
    )
    stage = LLMStage(spec)
    stage.setup()
    assert stage.server is not None
    first = _server_processes(stage)
    prompts = [_chat(t) for t in corpus(16, seed=25)]
    result: dict[str, Any] = {}
    run = threading.Thread(
        target=lambda: result.update(out=stage.process_columns({"prompt": _column(prompts)}))
    )
    run.start()
    deadline = time.monotonic() + 120
    while stage.server.log_path.read_text().count('"POST /v1/completions HTTP/1.1" 200') < 3:
        assert time.monotonic() < deadline, "the server answered nothing"
        time.sleep(0.05)
    first[0].kill()  # the API server, as the OOM killer would; its engine dies with it
    run.join(timeout=400)
    assert not run.is_alive()
    try:
        assert stage.server_starts == 2
        assert stage.engine_restarts == 1
        out = result["out"]
        assert ROW_ERROR not in out
        for i, prompt in enumerate(prompts):
            assert out["text"][i] == _own_answer(vllm_server, prompt, 32)[0]
        second = _server_processes(stage)
        assert second[0].pid != first[0].pid
    finally:
        stage.server.close()
    _, alive = psutil.wait_procs([*first, *second], timeout=30)
    assert alive == []  # the first server's engine processes went with it


def test_text_for_a_server_tokenizes_to_the_stage_s_ids(bos_llm: Any, tmp_path: Any) -> None:
    from ..llm_model import build_tiny_llm

    plain = build_tiny_llm(tmp_path / "plain")
    for model in (bos_llm, plain):
        codec = PromptCodec(str(model))
        prompts: list[Any] = [corpus(1, seed=26)[0], _chat(corpus(1, seed=27)[0])]
        for prompt in prompts:
            sent = codec.server_text(prompt)
            assert codec.tokenizer(sent)["input_ids"] == codec.encode(prompt), (model, prompt)


def _in_process(model: Any, rows: list[dict[str, Any]], **settings: Any) -> list[Any]:
    """The rows through an `engine: vllm` stage in a pipeline run by vLLM's venv's Python
    (tests/assets/vllm_stage_run.py): each row's (ok, outcome)."""
    asked = {
        "model": str(model),
        "rows": rows,
        "engine_args": {"kv_cache_memory_bytes": KV_CACHE_BYTES, "optimization_level": 0},
        "max_in_flight": 8,
        "batch_size": 6,
        **settings,
    }
    done = subprocess.run(
        [str(VLLM_PYTHON), str(ASSETS / "vllm_stage_run.py")],
        check=False,
        input=json.dumps(asked),
        capture_output=True,
        text=True,
        timeout=540,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUTCOMES ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    outcomes: list[Any] = json.loads(lines[-1].removeprefix("OUTCOMES "))
    return outcomes


def test_the_in_process_engine_gives_vllm_s_own_answers(vllm_server: VLLMServer) -> None:
    """`engine: vllm`: vLLM's engine in the stage's own process, fed by the stage's batches
    (two at once, batches of 6 rows, 8 in flight). Greedy rows: the text vLLM's server makes
    of the same token ids; prompt tokens the tokenizer's (one BOS); sampled rows: the same
    text each run (the row's own seed), and not the greedy text."""
    codec = PromptCodec(str(vllm_server.model))
    prompts: list[Any] = [*corpus(9, seed=31), *[_chat(t) for t in corpus(9, seed=32)]]
    rows = [
        {"prompt": p, "m": 4 + (5 * i) % 17, "t": 0.0 if i % 3 else 0.9}
        for i, p in enumerate(prompts)
    ]
    first = _in_process(vllm_server.model, rows)
    assert all(ok for ok, _ in first), first
    for row, (_, got) in zip(rows, first, strict=True):
        ids = codec.encode(row["prompt"])
        assert got["prompt_tokens"] == len(ids)
        assert got["output_tokens"] <= row["m"]
        if row["t"] == 0:
            reply = vllm_server.post(
                "/completions", {"prompt": ids, "max_tokens": row["m"], "temperature": 0}
            )
            assert got["text"] == reply["choices"][0]["text"], row
            assert got["finish_reason"] == reply["choices"][0]["finish_reason"]
    again = _in_process(vllm_server.model, list(reversed(rows)), max_in_flight=3)
    for row, (_, got), (_, other) in zip(rows, first, reversed(again), strict=True):
        assert other["text"] == got["text"], row  # in another order, beside other rows
    sampled = [got["text"] for row, (_, got) in zip(rows, first, strict=True) if row["t"]]
    greedy = [
        vllm_server.post(
            "/completions",
            {"prompt": codec.encode(row["prompt"]), "max_tokens": row["m"], "temperature": 0},
        )["choices"][0]["text"]
        for row in rows
        if row["t"]
    ]
    assert sampled != greedy


def test_the_in_process_engine_enforces_the_stage_s_structure(bos_llm: Any) -> None:
    """A random model, held to a choice by vLLM's structured outputs in the stage's process."""
    rows = [{"prompt": p, "m": 8, "t": 0.8} for p in corpus(6, seed=33)]
    choices = ["spam", "ham", "eggs"]
    outcomes = _in_process(bos_llm, rows, structured={"choice": choices})
    assert [ok for ok, _ in outcomes] == [True] * len(rows), outcomes
    assert all(got["text"] in choices for _, got in outcomes)


def test_the_in_process_engine_holds_each_row_to_its_own_shape(bos_llm: Any) -> None:
    """`per_row.structured` with vLLM: rows of one batch under their own choice lists and
    regexes, the stage's shape where null; one vLLM's backends cannot compile is that row's
    error alone."""
    shapes = [
        None,
        json.dumps({"choice": ["river", "stone"]}),
        json.dumps({"regex": "[0-9]{2}-[0-9]{2}"}),
        json.dumps({"regex": "(?=a)a"}),  # a lookahead: no grammar backend of vLLM's takes it
        json.dumps({"choice": ["river", "stone"]}),
        None,
    ]
    rows = [
        {"prompt": p, "m": 8, "t": 0.8, "shape": shape}
        for p, shape in zip(corpus(len(shapes), seed=34), shapes, strict=True)
    ]
    outcomes = _in_process(bos_llm, rows, structured={"choice": ["spam", "ham"]})
    assert [ok for ok, _ in outcomes] == [True, True, True, False, True, True], outcomes
    texts = [got["text"] if ok else got for ok, got in outcomes]
    assert texts[0] in ("spam", "ham") and texts[5] in ("spam", "ham")
    assert texts[1] in ("river", "stone") and texts[4] in ("river", "stone")
    assert re.fullmatch("[0-9]{2}-[0-9]{2}", texts[2]), texts[2]
    assert "structured" in texts[3] or "vLLM refused it" in texts[3], texts[3]
