"""Benchmark 16: LLM generation, output tokens per second.

The `llm` stage's transformers engine against a static-batch loop and transformers' own
continuous batching.

Workload: 128 prompts to a 4-layer Llama-shaped model (hidden 256, built from a config with a
tokenizer trained here; tests/llm_model.py), greedy. Two shapes: **spread**, as evaluations
and synthetic data look (most prompts short and most answers short, a long tail of both:
prompts of 8 to 32 tokens and answers of 4 to 32 for four rows in five, prompts to 200 and
answers to 160 for the rest), and **equal** (every prompt 24 tokens, every answer 48), the
bound. A row's answer is as long as its own `max_tokens` (a random model seldom ends sooner).
Output tokens counted are the tokens rows asked for, nothing more.

- static batches: batches of 32 prompts in order, left-padded, one `model.generate` each to
  the batch's longest `max_tokens`, every row cut to its own: what a plain loop does.
- transformers continuous batching: the model's own manager (`init_continuous_batching`,
  paged attention), every request with its own `max_new_tokens`, in one process.
- Ebb engine: the `llm` stage's engine (ebb.worker.llm.hf) in one process, 32 in flight.
- Ebb llm stage: the same through a pipeline: the stage in a process of its own, rows in and
  out as columns.
- Ebb llm stage, transformers serve: the stage with `engine: server`, a `transformers serve
  --continuous-batching` it starts and feeds over loopback (how vLLM and SGLang run under Ebb).
- Ray Data: `map_batches` over the static loop's `model.generate` in batches of 32, one actor
  (bench/llm_peers.py, in a venv of its own; its actor's start and model load are counted).

A third table runs the spread prompts as whole jobs (`ebb run`'s embedded stack, prompts in
JSONL, 16 shards) with 1 worker and with 2 on the same two cores.

Each variant runs the same prompts, interleaved with the others, `repeats` times.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .common import REPO, Context, Section, ebb_stack, interleaved, median, run_job, spread, table

RAY_PYTHON = Path(os.environ.get("EBB_BENCH_RAY_PYTHON", REPO / ".venv-ray" / "bin" / "python"))
SERVE = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")

PROMPTS = 128
BATCH = 32


def _workload(
    tokenizer: Any, shape: str, n: int, seed: int = 0, *, cap: int = 1 << 30
) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per row; `cap` bounds both (a smoke run's)."""
    rng = random.Random(seed)
    vocab = [t for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids]
    rows = []
    for _ in range(n):
        if shape == "equal":
            length, answer = 24, 48
        elif rng.random() < 0.8:
            length, answer = rng.randint(8, 32), rng.randint(4, 32)
        else:
            length, answer = rng.randint(33, 200), rng.randint(33, 160)
        length, answer = min(length, cap), min(answer, cap)
        rows.append(([rng.choice(vocab) for _ in range(length)], answer))
    return rows


def _static(
    model: Any, rows: list[tuple[list[int], int]], pad: int, eos: set[int], *, batch: int = BATCH
) -> int:
    useful = 0
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        longest = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), longest), dtype=torch.long)
        for i, (p, _) in enumerate(chunk):
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(m for _, m in chunk),
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=sorted(eos),
            )
        for i, (_, m) in enumerate(chunk):
            tokens = out[i, longest : longest + m].tolist()
            useful += next((k for k, t in enumerate(tokens) if t in eos), len(tokens))
    return useful


def _transformers_cb(model: Any, rows: list[tuple[list[int], int]], eos: set[int]) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(  # type: ignore[no-untyped-call]  # untyped upstream
        do_sample=False, max_new_tokens=max(m for _, m in rows), eos_token_id=sorted(eos)
    )
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        for k, (p, m) in enumerate(rows):
            manager.add_request(p, request_id=str(k), max_new_tokens=m, eos_token_id=sorted(eos))
        useful = finished = 0
        while finished < len(rows):
            result = manager.get_result(timeout=10)
            if result is not None and result.is_finished():
                finished += 1
                useful += len([t for t in result.generated_tokens if t not in eos])
    finally:
        manager.stop(block=True)
    return useful


def _engine(engine: Any, rows: list[tuple[list[int], int]]) -> int:
    from ebb.worker.llm.engine import GenerationRequest, Sampling

    requests = [
        GenerationRequest(key=k, prompt_ids=p, sampling=Sampling(max_tokens=m))
        for k, (p, m) in enumerate(rows)
    ]
    return sum(len(g.token_ids) for g in engine.generate(requests))


async def _stage(
    model_dir: Path,
    rows: list[tuple[list[int], int]],
    *,
    served: Any = None,
    device: str = "cpu",
    in_flight: int = BATCH,
) -> tuple[int, float]:
    """Tokens made and the seconds they took, the stage's start-up and a first run of the same
    rows left out (the other variants are timed after an untimed run too: torch's first calls
    at each new shape are slow, on a CPU and more so on a GPU). The prompts go in as their
    token ids, as a `tokenize_only` stage hands them on: the same prompts as the others'.
    `served`: the tokenizer, to run the stage with a `transformers serve`, which takes text
    prompts only (vLLM and SGLang take ids too)."""
    from ebb.common.job import LLMSpec, StageSpec
    from ebb.worker.pipeline.front import Pipeline, PipelineConfig

    server: dict[str, Any] = {}
    if served:
        command = [SERVE, "serve", "{model}", "--port", "{port}", "--continuous-batching"]
        server = {"engine": "server", "command": command, "prompt_as": "text"}
    stage = StageSpec(
        name="gen",
        llm=LLMSpec(
            model=str(model_dir), per_row={"max_tokens": "m"}, max_in_flight=in_flight, **server
        ),
        batch_size=len(rows),
        batch_wait_s=0.5,
        device=device,
    )
    items = [{"prompt": served.decode(p) if served else p, "m": m} for p, m in rows]
    pipeline = Pipeline(PipelineConfig(stages=[stage], code_paths=[]))
    await pipeline.start()
    try:
        await pipeline.run(items)  # the stage's process started, and warm at these shapes
        started = time.perf_counter()
        outcomes = await pipeline.run(items)
        seconds = time.perf_counter() - started
    finally:
        await pipeline.stop()
    failed = [v for ok, v in outcomes if not ok]
    if failed:  # counted as making nothing, and said: a rate is no place to hide errors
        print(f"  {len(failed)} rows failed, the first: {failed[0]}", file=sys.stderr)
    return sum(int(v["output_tokens"]) for ok, v in outcomes if ok), seconds


def _ray(ctx: Context, model_dir: Path, rows: list[tuple[list[int], int]]) -> float:
    """Ray Data's output tokens/s (bench/llm_peers.py in Ray's venv)."""
    listed = ctx.dir("llm") / f"rows-{time.monotonic_ns()}.json"
    listed.write_text(json.dumps(rows))
    peers = str(Path(__file__).with_name("llm_peers.py"))
    done = subprocess.run(
        [str(RAY_PYTHON), peers, str(model_dir), str(listed)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["tokens"]) / float(result["seconds"])


async def _job(
    ctx: Context, model_dir: Path, tokenizer: Any, rows: list[tuple[list[int], int]], workers: int
) -> float:
    """Output tokens/s of the prompts as a whole job on the embedded stack, submit to end."""
    from ebb.common.job import parse_job

    folder = ctx.dir("llm") / f"job-{time.monotonic_ns()}"
    folder.mkdir()
    (folder / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": tokenizer.decode(p), "m": m}) + "\n" for p, m in rows)
    )
    spec = parse_job(
        {
            "name": "llm-bench",
            "input": {"uri": str(folder / "prompts.jsonl"), "rows_per_shard": len(rows) // 16},
            "pipeline": {
                "stages": [
                    {
                        "name": "gen",
                        "llm": {
                            "model": str(model_dir),
                            "per_row": {"max_tokens": "m"},
                            "max_in_flight": BATCH,
                        },
                        "batch_size": 4 * BATCH,
                        "metrics": {"tokens": {"kind": "sum", "column": "output_tokens"}},
                    }
                ]
            },
            "output": {"uri": str(folder / "out")},
            "resources": {"max_workers": workers},
        }
    )
    async with ebb_stack(ctx, "llm", max_workers=workers) as (_, client):
        final, seconds = await run_job(client, spec)
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"benchmark job failed: {final.reason}")
    shutil.rmtree(folder, ignore_errors=True)
    return float(final.metrics["tokens"]) / seconds


def run(ctx: Context) -> Section:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ebb.worker.llm.hf import TransformersEngine
    from tests.llm_model import build_tiny_llm

    hidden, layers = (64, 2) if ctx.smoke else (256, 4)
    model_dir = build_tiny_llm(
        ctx.dir("llm") / "model", layers=layers, hidden=hidden, vocab=2000, context=512
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    engine = TransformersEngine(str(model_dir), max_in_flight=BATCH)
    eos = engine.eos
    n = ctx.size(PROMPTS, 64)
    tables, summary = [], {}
    for shape in ("spread", "equal"):
        rows = _workload(tokenizer, shape, n, cap=8 if ctx.smoke else 1 << 30)

        def rate(count: Any) -> Any:
            def measure() -> float:
                started = time.perf_counter()
                tokens: int = count()
                return tokens / (time.perf_counter() - started)

            return measure

        def stage_rate(rows: list[tuple[list[int], int]] = rows, served: Any = None) -> float:
            tokens, seconds = asyncio.run(_stage(model_dir, rows, served=served))
            return tokens / seconds

        variants = {
            "static batches (generate)": rate(
                lambda rows=rows: _static(model, rows, tokenizer.pad_token_id, eos)
            ),
            "transformers continuous batching": rate(
                lambda rows=rows: _transformers_cb(model, rows, eos)
            ),
            "Ebb engine": rate(lambda rows=rows: _engine(engine, rows)),
            "Ebb llm stage": stage_rate,
        }
        if not ctx.smoke:  # a server's start and Ray's take longer than a smoke run has
            variants["Ebb llm stage, transformers serve"] = lambda rows=rows: stage_rate(
                rows, served=tokenizer
            )
            if RAY_PYTHON.exists():
                variants["Ray Data map_batches"] = lambda rows=rows: _ray(ctx, model_dir, rows)
        # One untimed run of each first: torch's first calls at new shapes are slow.
        for name, warm_up in variants.items():
            if not name.startswith(("Ebb llm stage", "Ray")) and not ctx.smoke:
                warm_up()
        ctx.log(f"  {shape}: {n} prompts")
        results = interleaved(variants, ctx.repeats, ctx.log)
        base = median(results["static batches (generate)"])
        tables.append(
            f"**{shape}**\n\n"
            + table(
                ["variant", "output tokens/s", "vs static batches"],
                [[k, spread(v), f"{median(v) / base:.2f}x"] for k, v in results.items()],
            )
        )
        for k, v in results.items():
            summary[f"{shape}: {k}"] = median(v)
    notes = [
        f"{n} prompts, a {layers}-layer model of hidden size {hidden}, on the CPU, "
        "torch's default threads; the stage's process gets the cores its worker has."
    ]
    if not RAY_PYTHON.exists():
        notes.append(f"Ray Data not measured: no {RAY_PYTHON} (the `bench` extra in a venv).")
    if not ctx.smoke:
        spread_rows = _workload(tokenizer, "spread", n)

        def job_rate(workers: int) -> Callable[[], float]:
            return lambda: asyncio.run(_job(ctx, model_dir, tokenizer, spread_rows, workers))

        jobs = interleaved(
            {"1 worker": job_rate(1), "2 workers": job_rate(2)}, ctx.repeats, ctx.log
        )
        one = median(jobs["1 worker"])
        tables.append(
            "**spread, whole jobs** (submit to end)\n\n"
            + table(
                ["workers", "output tokens/s", "vs 1 worker"],
                [[k, spread(v), f"{median(v) / one:.2f}x"] for k, v in jobs.items()],
            )
        )
        for k, v in jobs.items():
            summary[f"job: {k}"] = median(v)
    return Section(
        title="16. LLM generation: continuous feeding against static batches",
        intro=__doc__ or "",
        tables=tables,
        slug="llm",
        summary=summary,
        notes=notes,
    )
