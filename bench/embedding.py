"""Benchmark 9: text embedding, a BERT-shaped encoder on variable-length text.

Workload: the job most teams run first. Each row is a text of 4 to 120 words (a long-tailed
mix); a CPU stage tokenizes it (a hashing tokenizer, 3 processes), the encoder stage (a
TorchScript BERT-shaped transformer: MiniLM's shape, 6 layers of width 384, on a GPU in fp16;
a 2-layer, width-128 one on the CPU) embeds it, mean-pooled over its tokens. Batches are cut by
a token budget over rows sorted by length (`batch_tokens`), so padding stays small.

- encoder alone: the model on token ids already on the device, sorted and padded the same
  way: the ceiling no pipeline can beat;
- plain loop: one process: read, tokenize, pad, encode, batch after batch (no overlap of
  tokenizing with the model);
- Ebb, 1 worker: the job, whole (submission to manifest) and in its steady state; on a GPU
  the device's busy share is sampled (pynvml) while the job runs.
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.common.job import parse_job

from .common import (
    BENCH_DIR,
    Context,
    GpuSampler,
    Rate,
    Section,
    interleaved_rates,
    job_rate,
    median,
    rates_table,
)
from .modelets import HashTokenize

WORDS = [f"w{i}" for i in range(20_000)]
CEILING = "encoder alone (ceiling)"


def write_corpus(folder: Path, *, rows: int, files: int = 4, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    per_file = -(-rows // files)
    for f in range(files):
        n = min(per_file, rows - f * per_file)
        lengths = np.clip(rng.lognormal(mean=3.0, sigma=0.7, size=n).astype(int), 4, 120)
        words = rng.integers(0, len(WORDS), size=int(lengths.sum()))
        texts, at = [], 0
        for length in lengths.tolist():
            texts.append(" ".join(WORDS[w] for w in words[at : at + length].tolist()))
            at += length
        ids = np.arange(f * per_file, f * per_file + n)
        pq.write_table(pa.table({"id": ids, "text": texts}), folder / f"part-{f:03d}.parquet")
    return folder


def write_encoder(path: Path, *, layers: int, width: int, heads: int) -> Path:
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(30_522, width)
            self.position = torch.nn.Embedding(512, width)
            layer = torch.nn.TransformerEncoderLayer(
                width, heads, 4 * width, batch_first=True, activation="gelu"
            )
            self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = self.embed(input_ids) + self.position(positions)[None]
            x = self.layers(x, src_key_padding_mask=attention_mask == 0)
            mask = attention_mask.unsqueeze(-1).to(x.dtype)
            pooled: torch.Tensor = (x * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            return pooled

    from ebb.worker.modelets.runtimes import warm_up_extra_files

    torch.manual_seed(0)
    example = {
        name: torch.ones(32, 64, dtype=torch.int64) for name in ("input_ids", "attention_mask")
    }
    torch.jit.save(
        torch.jit.script(Encoder().eval()), str(path), _extra_files=warm_up_extra_files(example)
    )
    return path


def _batches(
    ids: list[np.ndarray], budget: int, max_rows: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Padded (ids, mask) batches of rows sorted by length, within the token budget."""
    order = np.argsort([-len(r) for r in ids], kind="stable")
    out, start = [], 0
    while start < len(order):
        longest = len(ids[order[start]])
        take = order[start : start + max(1, min(max_rows, budget // longest))]
        block = np.zeros((len(take), longest), dtype=np.int64)
        for row, i in enumerate(take.tolist()):
            block[row, : len(ids[i])] = ids[i]
        out.append((block, (block != 0).astype(np.int64)))
        start += len(take)
    return out


def _encode(model: Any, device: str, dtype: Any, ids: np.ndarray, mask: np.ndarray) -> None:
    import torch

    with (
        torch.inference_mode(),
        torch.autocast(device.split(":", maxsplit=1)[0], dtype, enabled=device != "cpu"),
    ):
        model(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device))


def encoder_alone(data: Path, model_path: Path, *, device: str, budget: int) -> float:
    """The ceiling: rows/s of the model on batches already tokenized, padded and on the device."""
    import torch

    texts = pa.concat_tables(pq.read_table(p) for p in sorted(data.glob("*.parquet"))).column(
        "text"
    )
    tokens = HashTokenize().process_columns({"text": np.asarray(texts.to_pylist(), dtype=object)})
    batches = _batches(list(tokens["input_ids"]), budget, 1_024)
    model = torch.jit.load(str(model_path), map_location=device)  # type: ignore[no-untyped-call]
    if device != "cpu":
        model = model.half()
    on_device = [
        (torch.from_numpy(i).to(device), torch.from_numpy(m).to(device)) for i, m in batches
    ]
    started = time.perf_counter()
    with torch.inference_mode():
        for i, m in on_device:
            model(i, m)
    if device != "cpu":
        torch.cuda.synchronize()
    return len(texts) / (time.perf_counter() - started)


def plain_loop(data: Path, model_path: Path, *, device: str, budget: int) -> float:
    """One process, one step after the other, file by file, 8,192 rows at a time."""
    import torch

    started = time.perf_counter()
    model = torch.jit.load(str(model_path), map_location=device)  # type: ignore[no-untyped-call]
    if device != "cpu":
        model = model.half()
    tokenizer = HashTokenize()
    rows = 0
    for path in sorted(data.glob("*.parquet")):
        for b in pq.ParquetFile(path).iter_batches(batch_size=8_192, columns=["text"]):
            texts = np.asarray(b.column("text").to_pylist(), dtype=object)
            tokens = tokenizer.process_columns({"text": texts})
            with torch.inference_mode():
                for ids, mask in _batches(list(tokens["input_ids"]), budget, 1_024):
                    model(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)).cpu()
            rows += len(texts)
    if device != "cpu":
        torch.cuda.synchronize()
    return rows / (time.perf_counter() - started)


def job(
    data: Path, model: Path, out: Path, *, device: str, budget: int, rows_per_shard: int
) -> dict[str, Any]:
    encoder: dict[str, Any] = {
        "name": "encoder",
        "model": str(model),
        "device": device,
        "batch_size": 1_024,
        "batch_tokens": budget,
        "length_column": "input_ids",
        "batch_wait_s": 0.05,
    }
    if device != "cpu":
        encoder["dtype"] = "float16"
    return {
        "name": "embedding",
        "input": {
            "uri": str(data),
            "format": "parquet",
            "columns": ["text"],
            "rows_per_shard": rows_per_shard,
        },
        "pipeline": {
            "code_paths": [str(BENCH_DIR.parent)],
            "stages": [
                {
                    "name": "tokenize",
                    "modelet": "bench.modelets:HashTokenize",
                    "batch_size": 1_024,
                    "workers": 3,
                },
                encoder,
            ],
        },
        "output": {"uri": str(out), "carryover": ["id"]},
        "resources": {"min_workers": 1, "max_workers": 1},
    }


def _ebb(
    ctx: Context,
    data: Path,
    model: Path,
    device: str,
    budget: int,
    rows_per_shard: int,
    busy: list[float],
) -> Rate:
    out = ctx.dir("embedding-out") / f"ebb-{time.monotonic_ns()}"
    spec = parse_job(
        job(data, model, out, device=device, budget=budget, rows_per_shard=rows_per_shard)
    )
    if device == "cpu":
        rate: Rate = asyncio.run(job_rate(ctx, "embedding", spec, out, max_workers=1))
        return rate
    with GpuSampler() as sampler:
        rate = asyncio.run(job_rate(ctx, "embedding", spec, out, max_workers=1))
    # The busy share while rows flowed: from the first sample that saw the GPU working.
    working = sampler.samples[next((i for i, s in enumerate(sampler.samples) if s > 0), 0) :]
    busy.append(float(np.mean(working)) if working else 0.0)
    return rate


def _value(fn: Any) -> Rate:
    value = float(fn())
    return Rate(value, value)


def run(ctx: Context) -> Section:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        rows = ctx.size(1_200_000, 200_000)
        shape = {"layers": 6, "width": 384, "heads": 12}
        budget = 65_536
    else:
        rows = ctx.size(60_000, 12_000)
        shape = {"layers": 2, "width": 128, "heads": 4}
        budget = 16_384
    data = write_corpus(ctx.dir("embedding-data"), rows=rows)
    model = write_encoder(ctx.dir("models") / "encoder.pt", **shape)
    busy: list[float] = []
    variants = {
        CEILING: functools.partial(
            _value, functools.partial(encoder_alone, data, model, device=device, budget=budget)
        ),
        "plain loop": functools.partial(
            _value, functools.partial(plain_loop, data, model, device=device, budget=budget)
        ),
        "Ebb, 1 worker": functools.partial(
            _ebb, ctx, data, model, device, budget, max(rows // 40, 1), busy
        ),
    }
    whole, steady = interleaved_rates(variants, ctx)
    ceiling = median(whole[CEILING])
    gpu_name = torch.cuda.get_device_name(0) if device == "cuda" else "no GPU"
    notes = [
        f"{rows:,} rows on {device} ({gpu_name}); "
        f"encoder {shape['layers']} layers of width {shape['width']}"
        + (" in fp16" if device == "cuda" else " in fp32")
        + f"; token budget {budget:,} per batch; 40 shards."
    ]
    if busy:
        notes.append(f"GPU busy while Ebb's job ran: {median(busy):.0%} (pynvml, every 100 ms).")
    return Section(
        title="9. Text embedding: a BERT-shaped encoder on text of varied length",
        intro=__doc__ or "",
        tables=[rates_table(whole, steady, base=CEILING, against="of the ceiling")],
        slug="embedding",
        plot={"kind": "bars", "values": dict(whole), "unit": "rows/s (whole job)"},
        summary={
            "rows": rows,
            "device": device,
            "ceiling": ceiling,
            "ebb": median(whole["Ebb, 1 worker"]),
        },
        notes=notes,
    )
