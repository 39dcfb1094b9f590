"""Benchmark 17: LLM generation on a GPU, output tokens per second and the GPU's busy share.

The `llm` stage's transformers engine (ebb.worker.llm.hf) on the GPU against transformers'
own continuous batching (`init_continuous_batching`, paged attention) in one process on the
same prompts, and the static-batch loop of section 16 as the floor; the engine also through
the stage (its own process, handed the GPU as a worker hands it; its busy share not sampled).

Model: a Llama-shaped model of TinyLlama-1.1B's shape (22 layers of width 2048, 32 heads, 4
key-value heads, a vocabulary of 32,000), random weights in bfloat16, built from a config and
saved in Hugging Face format, loaded by its path. The prompts are section 16's two shapes
(spread and equal) over 512 rows; greedy; the output tokens counted are those rows asked for.
The GPU's busy share is pynvml's utilisation sampled every 100 ms while a variant runs.

Runs only where torch sees a GPU (`bash bench/gpu.sh`); elsewhere the section keeps its last
figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .common import Context, GpuSampler, Section, interleaved, median, spread, table
from .llm import _engine, _stage, _static, _transformers_cb, _workload

PROMPTS = 512
IN_FLIGHT = 128


def _model(path: Path, device: str, *, small: bool) -> Path:
    """TinyLlama-1.1B's shape with random weights (a 2-layer sliver of it when `small`), saved
    with section 16's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.llm_model import build_tiny_llm

    build_tiny_llm(path, layers=1, hidden=64, vocab=2000, context=4096)
    for stale in [*path.glob("*.safetensors*"), path / "config.json"]:
        stale.unlink()  # the tiny model's; its tokenizer stays
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=2 if small else 22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model: Any = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)
    # The tokenizer's own ids stand for bos, eos and pad: the model's must be the same.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    del model
    return path


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def run(ctx: Context) -> Section | None:
    if not torch.cuda.is_available():
        ctx.log("  no GPU that torch can use: section 17 keeps its last figures")
        return None
    return measure(ctx, "cuda")


def measure(ctx: Context, device: str) -> Section:
    """The section on `device` ("cpu" only to try the harness: the model is a GPU's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ebb.worker.llm.hf import TransformersEngine

    model_dir = _model(ctx.dir("llm-gpu") / "model", device, small=ctx.smoke)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(device).eval()
    engine = TransformersEngine(str(model_dir), device=device, max_in_flight=IN_FLIGHT)
    wide = TransformersEngine(str(model_dir), device=device, max_in_flight=2 * IN_FLIGHT)
    gpu = device == "cuda"
    eos = engine.eos
    n = ctx.size(PROMPTS, 128)
    busy: dict[str, list[float]] = {}
    tables, summary = [], {}
    for shape in ("spread", "equal"):
        rows = _workload(tokenizer, shape, n, cap=8 if ctx.smoke else 1 << 30)

        def rate(name: str, count: Any, shape: str = shape) -> Any:
            def once() -> float:
                sampler = GpuSampler() if gpu else contextlib.nullcontext()
                with sampler:
                    started = time.perf_counter()
                    tokens: int = count()
                    if gpu:
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - started
                samples = sampler.samples if isinstance(sampler, GpuSampler) else []
                busy.setdefault(f"{shape}: {name}", []).append(
                    float(np.mean(samples)) if samples else 0.0
                )
                return tokens / seconds

            return once

        def stage_rate(rows: list[tuple[list[int], int]] = rows, shape: str = shape) -> float:
            """The stage in a process of its own, handed the GPU as a worker hands it."""
            tokens, seconds = asyncio.run(
                _stage(model_dir, rows, device=device, in_flight=IN_FLIGHT)
            )
            busy.setdefault(f"{shape}: Ebb llm stage", []).append(float("nan"))
            return tokens / seconds

        variants = {
            "static batches (generate)": rate(
                "static batches (generate)",
                lambda rows=rows: _static(
                    model, rows, tokenizer.pad_token_id, eos, batch=IN_FLIGHT
                ),
            ),
            "transformers continuous batching": rate(
                "transformers continuous batching",
                lambda rows=rows: _transformers_cb(model, rows, eos),
            ),
            "Ebb engine": rate("Ebb engine", lambda rows=rows: _engine(engine, rows)),
            "Ebb llm stage": stage_rate,
            f"Ebb engine, {2 * IN_FLIGHT} in flight": rate(
                f"Ebb engine, {2 * IN_FLIGHT} in flight", lambda rows=rows: _engine(wide, rows)
            ),
        }
        for name, warm_up in variants.items():  # torch's first calls at new shapes are slow
            if name != "Ebb llm stage":  # it warms itself up in its own process
                warm_up()
        busy.clear()
        ctx.log(f"  {shape}: {n} prompts")
        results = interleaved(variants, ctx.repeats, ctx.log)
        base = median(results["transformers continuous batching"])
        tables.append(
            f"**{shape}**\n\n"
            + table(
                ["variant", "output tokens/s", "vs transformers continuous batching", "GPU busy"],
                [
                    [
                        k,
                        spread(v),
                        f"{median(v) / base:.2f}x",
                        _share(median(busy[f"{shape}: {k}"])),
                    ]
                    for k, v in results.items()
                ],
            )
        )
        for k, v in results.items():
            summary[f"{shape}: {k}"] = median(v)
    name = torch.cuda.get_device_name(0) if gpu else "CPU (a try of the harness)"
    return Section(
        title="17. LLM generation on a GPU: the engine against transformers' continuous batching",
        intro=__doc__ or "",
        tables=tables,
        slug="llm-gpu",
        summary=summary,
        notes=[
            f"{n} prompts on one {name}, bfloat16, torch {torch.__version__}; "
            f"the engine and the static batches at {IN_FLIGHT} sequences."
        ],
    )
