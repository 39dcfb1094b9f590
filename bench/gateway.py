"""Benchmark 18: the Batch API, a batch through the gateway against the same requests as a job.

Workload: 1,024 chat requests to the 4-layer Llama-shaped model of section 16 (hidden 256), greedy,
`max_tokens` spread as section 16's answers (4 to 32 for four requests in five, to 160 for the
rest), 2 workers on the embedded stack, 16 shards: about 30 s a run.

- Ebb job: the requests as the gateway would write them (the same rows, read from the same
  Parquet layout: a row group per shard) run as a job submitted over NATS, submit to end.
- Batch API: the official `openai` client uploads the JSONL file, creates the batch and polls
  it every 0.1 s to `completed` (create to completed: validation, the job, the output and error
  files written); the upload and the download are timed apart.

Both run on one stack, interleaved, `repeats` times, each once the last one's workers have
exited. Then a batch of 100,000 requests (the same shape, about 30 MB) is uploaded and
validated, its job cancelled as soon as it starts: the gateway's resident memory is sampled
every 20 ms throughout.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml

from .common import REPO, Context, Section, ebb_stack, interleaved, median, run_job, spread, table

KEY = "sk-bench"
MODEL = "bench-chat"
WORKERS = 2


def _requests(n: int, seed: int, words: list[str]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        long = rng.random() < 0.2
        prompt = " ".join(
            rng.choices(words, k=rng.randint(30, 150) if long else rng.randint(6, 24))
        )
        max_tokens = rng.randint(33, 160) if long else rng.randint(4, 32)
        lines.append(
            {
                "custom_id": f"req-{i:06d}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                },
            }
        )
    return lines


def _config(ctx: Context, model_dir: Path, rows_per_shard: int) -> Path:
    stage = {
        "llm": {
            "model": str(model_dir),
            "max_in_flight": 32,
            "sampling": {"temperature": 0.0},  # greedy, as the workload says
        },
        "batch_size": 128,
    }
    return gateway_config(ctx, "gateway", MODEL, stage, rows_per_shard)


def gateway_config(
    ctx: Context, name: str, model: str, stage: dict[str, Any], rows_per_shard: int
) -> Path:
    """A gateway's config of one catalogue model, `WORKERS` workers a batch, one key."""
    config = {
        "root": str(ctx.dir(name) / "root"),
        "models": {
            model: {
                "stage": stage,
                "resources": {"max_workers": WORKERS},
                "rows_per_shard": rows_per_shard,
            }
        },
        "keys": [{"owner": "bench", "key": KEY}],
        "max_requests": 200_000,
        "max_file_bytes": 1024**3,
    }
    path = ctx.dir(name) / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def job_input(
    folder: Path,
    lines: list[dict[str, Any]],
    rows_per_shard: int,
    endpoint: str = "/v1/chat/completions",
    model: str = MODEL,
) -> Path:
    """The requests as the gateway writes a batch's job input: the same rows, the same
    Parquet layout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ebb.gateway.jobspec import request_schema
    from ebb.gateway.requests import validate

    rows: list[dict[str, Any]] = []
    found = validate(
        (json.dumps(line).encode() for line in lines),
        batch_id="bench",
        endpoint=endpoint,
        models={model: None},
        max_requests=len(lines),
        max_line_bytes=1 << 20,
        accept=lambda row, _model: rows.append(row),
        reject=lambda line: None,
    )
    assert found.accepted == len(lines), found
    path = folder / "requests.parquet"
    table_ = pa.Table.from_pylist(rows, schema=request_schema(endpoint))
    pq.write_table(table_, path, row_group_size=rows_per_shard)
    return path


def workers_settled(stack: Any) -> Callable[[], None]:
    """A call that returns once the last run's workers are gone: each run starts on idle
    cores."""
    controller = psutil.Process(stack.processes["controller"].pid)

    def a_worker(p: psutil.Process) -> bool:
        try:
            return "ebb.worker" in p.cmdline()
        except psutil.NoSuchProcess:  # gone, or a zombie its parent has not reaped yet
            return False

    def settled() -> None:
        deadline = time.monotonic() + 120
        while any(a_worker(p) for p in controller.children(recursive=True)):
            if time.monotonic() > deadline:
                raise RuntimeError("the last run's workers did not exit")
            time.sleep(0.1)

    return settled


class _Peak:
    """The highest resident memory of a process, sampled every 20 ms on a thread."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def run(ctx: Context) -> Section:
    sys.path.insert(0, str(REPO))
    from tests.llm_model import build_tiny_llm, corpus

    hidden, layers = (64, 2) if ctx.smoke else (256, 4)
    model_dir = build_tiny_llm(
        ctx.dir("gateway") / "model", layers=layers, hidden=hidden, vocab=2000, context=512
    )
    words = sorted({w for line in corpus(200) for w in line.split()})
    n = ctx.size(1024, 128)
    rows_per_shard = max(1, n // 16)
    lines = _requests(n, seed=5, words=words)
    if ctx.smoke:
        for line in lines:
            line["body"]["max_tokens"] = 4
    config = _config(ctx, model_dir, rows_per_shard)
    big = ctx.size(100_000, 20_000)
    measured = asyncio.run(_measure(ctx, config, model_dir, lines, rows_per_shard, big, words))
    results, phases, validation = measured
    # Each repeat's batch against the job run beside it: the ratio noise moves least.
    pairs = [b / j for b, j in zip(results["Batch API"], results["Ebb job"], strict=True)]
    tables = [
        "**Throughput** (output tokens/s; the ratio: the median of each repeat's)\n\n"
        + table(
            ["variant", "output tokens/s", "vs the job"],
            [
                ["Ebb job", spread(results["Ebb job"]), "1.00x"],
                ["Batch API", spread(results["Batch API"]), f"{median(pairs):.2f}x"],
            ],
        ),
        "**A batch's timeline** (seconds from create, medians)\n\n"
        + table(
            ["upload", "in_progress", "first request answered", "completed", "download"],
            [
                [
                    f"{median(phases[k]):.2f}"
                    for k in ("upload", "in_progress", "first", "completed", "download")
                ]
            ],
        ),
        f"**{validation['requests']:,} requests accepted and validated**\n\n"
        + table(
            ["file", "upload", "create to in_progress", "gateway RSS before", "peak", "growth"],
            [
                [
                    f"{validation['bytes'] / 2**20:.1f} MiB",
                    f"{validation['upload']:.1f} s",
                    f"{validation['validate']:.1f} s",
                    f"{validation['rss_before'] / 2**20:.0f} MiB",
                    f"{validation['rss_peak'] / 2**20:.0f} MiB",
                    f"{(validation['rss_peak'] - validation['rss_before']) / 2**20:.0f} MiB",
                ]
            ],
        ),
    ]
    summary = {f"{k} tokens/s": median(v) for k, v in results.items()}
    summary["gateway vs job"] = median(pairs)
    summary["validation RSS growth MiB"] = (
        validation["rss_peak"] - validation["rss_before"]
    ) / 2**20
    return Section(
        title="18. The Batch API: a batch through the gateway against the same job",
        intro=__doc__ or "",
        tables=tables,
        notes=[
            f"{n} requests, {rows_per_shard} per shard, {WORKERS} workers; the gateway steps a "
            "batch when its job's events say something changed (a full pass over every batch "
            "every 2 s, `ebb up`'s setting), the client polls every 0.1 s. Target: the Batch API "
            "within 5% of the job's throughput.",
            "The output file is written whole when the job ends (the API's output file is one "
            "file): the first request answered is when `request_counts.completed` first counts "
            "one, readable in the job's committed output then, in the output file at completion.",
        ],
        summary=summary,
        slug="gateway",
    )


async def _measure(
    ctx: Context,
    config: Path,
    model_dir: Path,
    lines: list[dict[str, Any]],
    rows_per_shard: int,
    big: int,
    words: list[str],
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    import openai

    from ebb.gateway.config import load_config
    from ebb.gateway.jobspec import batch_job

    catalogue = load_config(config)
    payload = "".join(json.dumps(line) + "\n" for line in lines).encode()
    phases: dict[str, list[float]] = {
        k: [] for k in ("upload", "in_progress", "first", "completed", "download")
    }
    async with ebb_stack(ctx, "gateway", max_workers=WORKERS, gateway=config) as (stack, client):
        assert stack.gateway_url is not None
        oa = openai.OpenAI(base_url=stack.gateway_url, api_key=KEY)
        loop = asyncio.get_running_loop()

        settled = workers_settled(stack)

        def job() -> float:
            settled()
            folder = ctx.dir("gateway") / f"job-{time.monotonic_ns()}"
            folder.mkdir()
            source = job_input(folder, lines, rows_per_shard)
            spec = batch_job(
                batch_id=f"bench-{time.monotonic_ns()}",
                owner="bench",
                endpoint="/v1/chat/completions",
                model=catalogue.models[MODEL],
                window=catalogue.windows["24h"],
                input_uri=str(source),
                output_uri=str(folder / "out"),
            )
            final, seconds = asyncio.run_coroutine_threadsafe(run_job(client, spec), loop).result()
            if final.state != "SUCCEEDED":
                raise RuntimeError(f"benchmark job failed: {final.reason}")
            return float(final.metrics["output_tokens"]) / seconds

        def batch() -> float:
            settled()
            started = time.perf_counter()
            uploaded = oa.files.create(file=("requests.jsonl", payload), purpose="batch")
            phases["upload"].append(time.perf_counter() - started)
            created = time.perf_counter()
            made = oa.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
            seen: dict[str, float] = {}
            while True:
                b = oa.batches.retrieve(made.id)
                now = time.perf_counter() - created
                if b.status == "in_progress":
                    seen.setdefault("in_progress", now)
                if b.request_counts is not None and b.request_counts.completed:
                    seen.setdefault("first", now)
                if b.status in ("completed", "failed", "expired", "cancelled"):
                    break
                time.sleep(0.1)
            if b.status != "completed" or b.usage is None:
                raise RuntimeError(f"benchmark batch ended {b.status}: {b.errors}")
            took = time.perf_counter() - created
            for k in ("in_progress", "first"):
                phases[k].append(seen.get(k, took))
            phases["completed"].append(took)
            fetched = time.perf_counter()
            assert b.output_file_id is not None
            oa.files.content(b.output_file_id).read()
            phases["download"].append(time.perf_counter() - fetched)
            return b.usage.output_tokens / took

        results = await asyncio.to_thread(
            interleaved, {"Ebb job": job, "Batch API": batch}, ctx.repeats, ctx.log
        )
        validation = await asyncio.to_thread(_big_batch, ctx, oa, stack, big, words)
    return results, phases, validation


def _big_batch(ctx: Context, oa: Any, stack: Any, n: int, words: list[str]) -> dict[str, float]:
    path = ctx.dir("gateway") / "big.jsonl"
    with path.open("w") as f:
        for line in _requests(n, seed=7, words=words):
            f.write(json.dumps(line) + "\n")
    gateway = stack.processes["gateway"].pid
    before = psutil.Process(gateway).memory_info().rss
    with _Peak(gateway) as peak:
        started = time.perf_counter()
        with path.open("rb") as f:
            uploaded = oa.files.create(file=f, purpose="batch")
        upload = time.perf_counter() - started
        created = time.perf_counter()
        made = oa.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while (b := oa.batches.retrieve(made.id)).status == "validating":
            time.sleep(0.05)
        validate = time.perf_counter() - created
    if b.status != "in_progress" or b.request_counts.total != n:
        raise RuntimeError(f"the big batch was not accepted: {b.status} {b.errors}")
    oa.batches.cancel(made.id)
    while oa.batches.retrieve(made.id).status != "cancelled":
        time.sleep(0.2)
    ctx.log(f"  {n} requests: validated in {validate:.1f}s, peak RSS {peak.peak / 2**20:.0f} MiB")
    return {
        "requests": n,
        "bytes": path.stat().st_size,
        "upload": upload,
        "validate": validate,
        "rss_before": before,
        "rss_peak": peak.peak,
    }
