"""The `llm` stage and its transformers engine on a tiny model built here (a Llama-shaped model
from a config, a tokenizer trained in the test, saved in Hugging Face format and loaded by the
real loading path): greedy text as `model.generate` makes it, per-row sampling, chats, rows
the model cannot take as error rows, and sequences admitted as others finish."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from ebb.common.errors import SpecError
from ebb.common.job import LLMSpec, SamplingSpec, StageSpec
from ebb.worker.llm.batch import padded_peak
from ebb.worker.llm.engine import Generation, GenerationRequest, Sampling
from ebb.worker.llm.hf import TransformersEngine
from ebb.worker.pipeline.front import Pipeline, PipelineConfig

from ..llm_model import build_sliding_llm, build_tiny_llm, corpus


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny")


def _prompts(n: int, seed: int = 1) -> list[str]:
    return corpus(n, seed=seed)


def _greedy(engine: TransformersEngine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """What `model.generate` makes of the prompt alone: the reference."""
    out = engine.model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones((1, len(prompt_ids)), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=sorted(engine.eos),
        pad_token_id=engine.tokenizer.pad_token_id,
    )[0, len(prompt_ids) :].tolist()
    return [t for t in out if t not in engine.eos]


def test_greedy_text_is_what_generate_makes_of_each_prompt_alone(tiny_llm: Path) -> None:
    engine = TransformersEngine(str(tiny_llm), max_in_flight=4)
    prompts = _prompts(24)
    lengths = [1 + (7 * i) % 23 for i in range(len(prompts))]
    requests = [
        GenerationRequest(
            key=i, prompt_ids=engine.encode(p), sampling=Sampling(max_tokens=lengths[i])
        )
        for i, p in enumerate(prompts)
    ]
    got = {g.key: g for g in engine.generate(requests)}
    assert sorted(got) == list(range(len(prompts)))
    for r in requests:
        assert got[r.key].token_ids == _greedy(engine, r.prompt_ids, lengths[r.key]), r.key
        assert got[r.key].text == engine.tokenizer.decode(
            got[r.key].token_ids, skip_special_tokens=True
        )
        expected = "length" if len(got[r.key].token_ids) == lengths[r.key] else "stop"
        assert got[r.key].finish_reason == expected


def test_a_finished_sequence_s_place_is_taken_before_the_next_step(tiny_llm: Path) -> None:
    """Output lengths from 1 to 30: while requests wait, every decoding step runs with every
    place taken. A static batch would run its longest answer's steps with the others idle."""
    engine = TransformersEngine(str(tiny_llm), max_in_flight=4)
    prompts = _prompts(20, seed=2)
    requests = [
        GenerationRequest(
            key=i, prompt_ids=engine.encode(p), sampling=Sampling(max_tokens=1 + (11 * i) % 30)
        )
        for i, p in enumerate(prompts)
    ]
    assert len(list(engine.generate(requests))) == len(requests)
    stats = engine.stats
    assert stats.steps > 0
    assert len(stats.recent) == stats.steps
    waited = [s for s in stats.recent if s.waiting > 0]
    assert waited, "no step ran while requests waited: the test shows nothing"
    assert [s.in_flight for s in waited] == [4] * len(waited)
    # Each admission came at the step of a retirement (or at the start), never later.
    retire_steps = {step for step, _ in stats.retired} | {0}
    assert {step for step, _ in stats.admitted} <= retire_steps


def test_kv_tokens_bound_what_is_in_flight_together(tiny_llm: Path) -> None:
    engine = TransformersEngine(str(tiny_llm), max_in_flight=8, kv_tokens=60)
    requests = [
        GenerationRequest(key=i, prompt_ids=engine.encode(p), sampling=Sampling(max_tokens=20))
        for i, p in enumerate(_prompts(12, seed=3))
    ]
    needs = {r.key: len(r.prompt_ids) + 20 for r in requests}
    assert len(list(engine.generate(requests))) == len(requests)
    steps = engine.stats.recent
    assert max(s.in_flight for s in steps) < 8  # the token budget, not the places, bounded it
    assert all(s.cache_slots <= s.held_tokens <= 60 for s in steps)
    assert sum(needs.values()) > 60


def test_kv_tokens_bound_the_padded_cache_itself(tiny_llm: Path) -> None:
    """Spread answers beside a long one: every row of a left-padded cache is as long as the
    longest, so the cache holds rows x the longest, far more than the rows' own tokens. The
    slots its keys really take stay within `kv_tokens` at every step."""
    engine = TransformersEngine(str(tiny_llm), max_in_flight=16, kv_tokens=300)
    requests = [
        GenerationRequest(
            key=i, prompt_ids=engine.encode(p)[:8], sampling=Sampling(max_tokens=2 + (13 * i) % 60)
        )
        for i, p in enumerate(_prompts(32, seed=5))
    ]
    got = {g.key: g for g in engine.generate(requests)}
    assert sorted(got) == [r.key for r in requests]
    steps = engine.stats.recent
    assert max(s.in_flight for s in steps) > 2  # the bound let rows run together
    assert max(s.cache_slots for s in steps) <= 300
    for r in requests:  # and the text is each prompt's own
        assert got[r.key].token_ids == _greedy(engine, r.prompt_ids, r.sampling.max_tokens)


def test_padded_peak_is_the_most_a_padded_cache_of_the_rows_holds() -> None:
    # One row: its whole length. Two rows, the long one finishing last: both padded to the
    # long one's length until the short one ends (2 x 12), then the long one alone (30).
    assert padded_peak([(10, 30)]) == 30
    assert padded_peak([(10, 30), (2, 6)]) == 30
    assert padded_peak([(20, 30), (2, 6)]) == 2 * 24
    # Simulated step by step: the cache is (rows running) x (the longest of them).
    rows = [(7, 40), (3, 9), (12, 15), (1, 33), (5, 5)]
    slots = [
        sum(1 for length, need in rows if length + t <= need)
        * max(length + t for length, need in rows if length + t <= need)
        for t in range(40)
        if any(length + t <= need for length, need in rows)
    ]
    assert padded_peak(rows) == max(slots)


def test_sampled_text_depends_on_the_row_s_seed_alone(tiny_llm: Path) -> None:
    engine = TransformersEngine(str(tiny_llm), max_in_flight=3)
    prompts = _prompts(6, seed=4)

    def run(seeds: list[int], order: list[int]) -> dict[int, list[int]]:
        requests = [
            GenerationRequest(
                key=i,
                prompt_ids=engine.encode(prompts[i]),
                sampling=Sampling(max_tokens=12, temperature=1.5, top_p=0.9, seed=seeds[i]),
            )
            for i in order
        ]
        return {g.key: g.token_ids for g in engine.generate(requests)}

    first = run([10, 11, 12, 13, 14, 15], [0, 1, 2, 3, 4, 5])
    again = run([10, 11, 12, 13, 14, 15], [5, 3, 1, 0, 2, 4])
    assert again == first  # beside other rows, in another order: the same text
    other = run([20, 21, 22, 23, 24, 25], [0, 1, 2, 3, 4, 5])
    assert other != first


def _llm_stage(model: Path, **llm: Any) -> StageSpec:
    return StageSpec(name="gen", llm=LLMSpec(model=str(model), **llm), batch_size=16)


async def _run(stage: StageSpec, rows: list[dict[str, Any]]) -> list[tuple[bool, Any]]:
    """The rows through the stage in its own process: (ok, value or reason) of each."""
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[]))
    try:
        await pipeline.start()
        return list(await pipeline.run(rows))
    finally:
        await pipeline.stop()


async def test_the_stage_in_its_process_writes_text_and_refuses_rows_it_cannot_take(
    tiny_llm: Path,
) -> None:
    prompts = _prompts(10, seed=5)
    rows: list[dict[str, Any]] = [
        {"id": i, "prompt": p, "budget": 3 + i} for i, p in enumerate(prompts)
    ]
    rows.append({"id": 10, "prompt": " ".join(["river"] * 400), "budget": 4})  # too long
    rows.append({"id": 11, "prompt": [{"role": "user", "content": prompts[0]}], "budget": 5})
    rows.append({"id": 12, "prompt": 42, "budget": 4})  # neither text nor a chat
    rows.append({"id": 13, "prompt": prompts[1], "budget": 0})  # max_tokens out of range
    stage = _llm_stage(
        tiny_llm, per_row={"max_tokens": "budget"}, sampling=SamplingSpec(max_tokens=8)
    )
    outcomes = await _run(stage, rows)
    engine = TransformersEngine(str(tiny_llm))
    for row, (ok, value) in zip(rows, outcomes, strict=True):
        if row["id"] in (10, 12, 13):
            assert not ok
            continue
        assert ok, value
        prompt = row["prompt"]
        ids = engine.encode(prompt if isinstance(prompt, str) else list(prompt))
        expected = _greedy(engine, ids, row["budget"])
        assert value["output_tokens"] == len(expected)
        assert value["text"] == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert value["prompt_tokens"] == len(ids)
        assert value["finish_reason"] in ("stop", "length")
        assert set(value) == {"text", "finish_reason", "prompt_tokens", "output_tokens"}
    reasons = {row["id"]: value for row, (ok, value) in zip(rows, outcomes, strict=True) if not ok}
    assert "exceed the model's context of 256 tokens" in str(reasons[10])
    assert "text, a list of {role, content} messages, or token ids" in str(reasons[12])
    assert "max_tokens must be >= 1" in str(reasons[13])


async def test_a_stage_without_max_tokens_generates_up_to_the_rest_of_the_context(
    tiny_llm: Path,
) -> None:
    """`max_tokens: null` (the OpenAI API's omitted `max_tokens`): a row generates as far as
    its context, or `kv_tokens`, leaves after its prompt; a row's own value still wins."""
    prompts = _prompts(3, seed=9)
    rows: list[dict[str, Any]] = [
        {"id": i, "prompt": p, "budget": None} for i, p in enumerate(prompts)
    ]
    rows[2]["budget"] = 5
    stage = _llm_stage(
        tiny_llm,
        per_row={"max_tokens": "budget"},
        sampling=SamplingSpec(max_tokens=None),
        kv_tokens=96,
    )
    outcomes = await _run(stage, rows)
    engine = TransformersEngine(str(tiny_llm))
    for row, (ok, value) in zip(rows, outcomes, strict=True):
        assert ok, value
        ids = engine.encode(row["prompt"])
        room = row["budget"] or 96 - len(ids)
        expected = _greedy(engine, ids, room)
        assert value["text"] == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert value["prompt_tokens"] + value["output_tokens"] <= 96
        if value["finish_reason"] == "length":
            assert value["output_tokens"] == room


def test_an_llm_stage_is_checked_when_the_job_is_submitted(tiny_llm: Path) -> None:
    with pytest.raises(SpecError, match="exactly one of"):
        StageSpec(name="x", modelet="m:C", llm=LLMSpec(model=str(tiny_llm)))
    with pytest.raises(SpecError, match=r"per_row\.colour"):
        LLMSpec(model=str(tiny_llm), per_row={"colour": "c"})
    with pytest.raises(SpecError, match="top_p"):
        SamplingSpec(top_p=0)
    spec = _llm_stage(tiny_llm)
    assert spec.runtime_modules() == {"torch"}
    assert np.isfinite(spec.llm.sampling.temperature) if spec.llm else False


def test_importing_the_worker_imports_no_llm_library() -> None:
    """transformers and torch load when an llm stage is built, not with the worker."""
    import subprocess
    import sys

    code = (
        "import sys, ebb.worker.stage.loop, ebb.worker.llm.stage, ebb.worker.service\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_an_engine_that_dies_mid_batch_is_made_again_and_finishes_every_row(
    tiny_llm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine fails at its fifth step (as CUDA out of memory would): the stage makes it
    again and gives it the rows it had not finished; every row once, each as it would be."""
    from ebb.common import envvars, failpoints
    from ebb.worker.llm.stage import LLMStage

    monkeypatch.setenv(envvars.FAILPOINT_DIR, str(tmp_path))
    failpoints.arm(tmp_path, failpoints.WORKER_LLM_ENGINE_FAILS, when="step 5")
    stage = LLMStage(_llm_stage(tiny_llm, max_in_flight=3, sampling=SamplingSpec(max_tokens=6)))
    stage.setup()
    prompts = _prompts(8, seed=6)
    out = stage.process_columns({"prompt": np.array(prompts, dtype=object)})
    assert failpoints.fired(tmp_path, failpoints.WORKER_LLM_ENGINE_FAILS) is not None
    assert stage.engine_restarts == 1
    engine = TransformersEngine(str(tiny_llm))
    for i, p in enumerate(prompts):
        expected = _greedy(engine, engine.encode(p), 6)
        assert out["text"][i] == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert out["output_tokens"][i] == len(expected)


def test_an_engine_that_dies_every_time_fails_the_batch(
    tiny_llm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ebb.worker.llm import hf
    from ebb.worker.llm.engine import EngineError
    from ebb.worker.llm.stage import ENGINE_RESTARTS, LLMStage

    def dies(self: Any, flight: Any, batch: Any) -> None:
        raise EngineError("CUDA out of memory")

    monkeypatch.setattr(hf.TransformersEngine, "_decode", dies)
    stage = LLMStage(_llm_stage(tiny_llm, sampling=SamplingSpec(max_tokens=4)))
    stage.setup()
    with pytest.raises(EngineError, match="out of memory"):
        stage.process_columns({"prompt": np.array(_prompts(3), dtype=object)})
    assert stage.engine_restarts == ENGINE_RESTARTS


async def test_a_long_batch_that_keeps_generating_is_not_taken_for_a_hung_one(
    tiny_llm: Path,
) -> None:
    """`batch_timeout_s` counts from an llm stage's last token, not from its batch's start: a
    batch that runs for several timeouts while it generates comes through whole."""
    timeout_s = 0.3
    rows = [{"prompt": p} for p in _prompts(12, seed=13)]
    stage = replace(
        _llm_stage(tiny_llm, max_in_flight=1, sampling=SamplingSpec(max_tokens=120)),
        name="long",
    )

    def killed() -> float:
        sample = REGISTRY.get_sample_value(
            "ebb_stage_restarts_total", {"stage": "long", "reason": "timeout"}
        )
        return sample or 0.0

    before = killed()
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[], batch_timeout_s=timeout_s))
    await pipeline.start()
    try:
        started = time.monotonic()
        outcomes = await pipeline.run(rows)
        took = time.monotonic() - started
    finally:
        await pipeline.stop()
    assert took > 2 * timeout_s, "the batch ran within its timeout: this test shows nothing"
    assert killed() == before  # never taken for a hung batch
    assert all(ok for ok, _ in outcomes), [v for ok, v in outcomes if not ok][:2]
    assert all(v["output_tokens"] == 120 or v["finish_reason"] == "stop" for _, v in outcomes)


def test_the_board_counts_a_batch_s_time_from_its_last_progress() -> None:
    import multiprocessing as mp

    from ebb.worker.stage.board import BatchBoard

    board = BatchBoard(mp.get_context("spawn"), 4)
    assert board.last_progress == 0.0
    board.post(np.array([1, 2], dtype=np.int64))
    posted = board.last_progress
    assert posted == board.started
    while time.monotonic() == posted:
        pass
    board.touch()
    assert board.last_progress > posted
    assert board.started == posted  # the batch's start stands (its busy time counts from it)
    board.clear()
    assert board.last_progress == 0.0


@pytest.mark.parametrize("architecture", ["mistral", "gemma2", "gemma3"])
def test_a_sliding_window_model_generates_its_own_text(architecture: str, tmp_path: Path) -> None:
    """Mistral's and Gemma's layers attend to their last 16 tokens only (Gemma 2 every other
    layer); rows of up to 45 tokens, decoding beside others, padded and joined: each row's text
    is what `model.generate` makes of it alone, past the window too."""
    model = build_sliding_llm(tmp_path / architecture, architecture, window=16)
    engine = TransformersEngine(str(model), max_in_flight=3)
    requests = [
        GenerationRequest(
            key=i, prompt_ids=engine.encode(p)[:8], sampling=Sampling(max_tokens=12 + 5 * i)
        )
        for i, p in enumerate(_prompts(6, seed=3))
    ]
    assert max(len(r.prompt_ids) + r.sampling.max_tokens for r in requests) > 16 * 2
    got = {g.key: g.token_ids for g in engine.generate(requests)}
    for r in requests:
        assert got[r.key] == _greedy(engine, r.prompt_ids, r.sampling.max_tokens), r.key


def test_stop_strings_are_looked_for_in_the_newest_text_alone(tiny_llm: Path) -> None:
    """A long answer with a stop string it never writes: the tokens turned into text stay a
    few per step (the whole answer decoded at every step is quadratic in its length). A stop
    string it does write still ends it, wherever the token boundaries fall."""
    engine = TransformersEngine(str(tiny_llm), max_in_flight=2)
    prompt = engine.encode(_prompts(1, seed=6)[0])
    never = GenerationRequest(
        key=0, prompt_ids=prompt, sampling=Sampling(max_tokens=200, stop=("\x00never",))
    )
    (long,) = engine.generate([never])
    assert long.output_tokens == 200
    assert engine.stats.decoded_tokens <= 200 * (4 * len("\x00never") + 1) + 200
    assert engine.stats.decoded_tokens < sum(range(200)) // 2
    # Stop strings taken from the text greedy decoding writes: one inside a token, one across
    # tokens; the answer ends at the first, cut before it.
    text = engine.tokenizer.decode(_greedy(engine, prompt, 60), skip_special_tokens=True)
    for stop in (text[20:23], text[30:41]):
        engine.stats = type(engine.stats)()
        (g,) = engine.generate(
            [
                GenerationRequest(
                    key=1, prompt_ids=prompt, sampling=Sampling(max_tokens=60, stop=(stop,))
                )
            ]
        )
        assert g.finish_reason == "stop"
        assert g.text == text[: text.find(stop)], stop


def test_the_engine_s_stats_keep_the_latest_steps_alone(tiny_llm: Path) -> None:
    """An engine runs as long as its stage: its per-step record is bounded, its counts go on."""
    engine = TransformersEngine(str(tiny_llm), max_in_flight=4)
    engine.stats = type(engine.stats)(kept=25)
    requests = [
        GenerationRequest(key=i, prompt_ids=engine.encode(p), sampling=Sampling(max_tokens=6))
        for i, p in enumerate(_prompts(40, seed=7))
    ]
    made = sum(g.output_tokens for g in engine.generate(requests))
    stats = engine.stats
    assert stats.steps > 25
    assert len(stats.recent) == len(stats.admitted) == len(stats.retired) == 25
    assert [s.step for s in stats.recent] == list(range(stats.steps - 25, stats.steps))
    assert stats.output_tokens == made


def test_a_second_call_s_rows_take_the_places_the_first_call_s_free(tiny_llm: Path) -> None:
    """The stage runs two batches at once: the second batch's rows wait behind the first's and
    join as its rows finish, in the one step loop, so the engine never drains between
    batches; never more than `max_in_flight` decode together; each row's text its own."""
    engine = TransformersEngine(str(tiny_llm), max_in_flight=4)
    prompts = _prompts(16, seed=8)

    def requests(first: int) -> list[GenerationRequest]:
        return [
            GenerationRequest(
                key=first + i,
                prompt_ids=engine.encode(prompts[first + i]),
                sampling=Sampling(max_tokens=4 + (7 * i) % 20),
            )
            for i in range(8)
        ]

    one, two = requests(0), requests(8)
    first: dict[int, Generation] = {}
    second: dict[int, Generation] = {}
    submitted = threading.Event()

    def hold() -> None:  # once a row of the first call is done, the loop waits for the second
        if engine.stats.retired:
            assert submitted.wait(30)

    def run_second() -> None:
        results = engine.generate(two)
        submitted.set()
        second.update((g.key, g) for g in results)

    engine.on_progress = hold
    thread = threading.Thread(target=run_second)
    for g in engine.generate(one):
        if not first:  # the first call is under way: the second joins it
            thread.start()
        first[g.key] = g
    thread.join(timeout=60)
    assert sorted(first) == [r.key for r in one] and sorted(second) == [r.key for r in two]
    for r in one + two:
        got = (first | second)[r.key]
        assert got.token_ids == _greedy(engine, r.prompt_ids, r.sampling.max_tokens), r.key
    steps = engine.stats.recent
    assert max(s.in_flight for s in steps) <= 4
    assert any(s.calls == 2 for s in steps)  # rows of both batches decoding together
    # While rows of the second call waited, no step ran a place short.
    assert all(s.in_flight == 4 for s in steps if s.waiting > 0)
    first_of_two = min(step for step, key in engine.stats.admitted if key >= 8)
    last_of_one = max(step for step, key in engine.stats.retired if key < 8)
    assert first_of_two < last_of_one
