"""Benchmark 21: LLM generation through vLLM, Ebb against vLLM alone.

vLLM's CPU build (`make vllm`, .venv-vllm) runs the model of section 16 (4 layers, hidden
256, built here). The same prompts go through it six ways, every one in one table:

- vLLM alone, as a server: started as a user starts one; a plain asyncio client (aiohttp)
  sends every prompt's token ids to `/v1/completions`, at most `concurrency` at once (the
  best of those tried is the one compared), and nothing else runs.
- vLLM alone, in-process: vLLM's offline engine (`vllm.LLM`, its engine core in the same
  process, as an `engine: vllm` stage runs it; bench/vllm_offline.py) given every prompt in
  one `generate` call; and again with its engine core in a process of its own (vLLM's
  default).
- Ebb through vLLM's server: the prompts as a whole job (`ebb run`'s embedded stack, prompts
  in JSONL), its `llm` stage with `engine: endpoint` feeding that same server, with 1 worker
  and with 2 on the same two cores.
- Ebb with vLLM in the stage's process: the same job with `engine: vllm` (the stack and its
  workers run from vLLM's venv, where Ebb is installed too, as in a worker image with vLLM),
  1 and 2 workers.

Every Ebb job is as a user writes it: the stage's `max_in_flight`, `batch_size` and the job's
shards at their defaults. Steady state, the engine's start-up apart: for the server, tokens by
its own `vllm:generation_tokens_total` counter, sampled every 50 ms, from the first token to
the last; for vLLM in-process, the `generate` call; for Ebb with vLLM in-process, from the
first worker ready (its stage processes started, vLLM loaded: the master is told within half a
second) to the job's end, the last shard's commit included. The jobs' whole time, submit to
end, is a table of its own. Two shapes, as section 16's: **spread** (four prompts in five
short with short answers, a long tail of both) and **equal** (prompts of 24 tokens, answers
of 48). Greedy; a random model seldom ends before its `max_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ebb.common.messaging.messages import JobStatus

from .common import REPO, Context, Section, ebb_stack, median, spread, table
from .llm import _workload

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROMPTS = 1_536
"""Prompts a shape: vLLM alone makes 384 prompts' tokens in 2 to 3 s here, too short a run for
a job's steady state (its first batch read and sent, its output written and committed, the
master told, all inside the measure): measured so, jobs came to 0.56x (spread) and 0.72x
(equal) of vLLM alone. A batch job is thousands of prompts or more."""
CONCURRENCY = (64, 128, 256)
"""Requests in flight tried for vLLM's server alone; the best is the one compared."""
WORKERS = (1, 2)


class TokenMeter:
    """The server's generated tokens, sampled on a thread: (when, total) at each change."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.changes: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def total(self) -> float:
        with urllib.request.urlopen(self.url, timeout=5) as reply:
            text = reply.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:generation_tokens_total")
        )

    def __enter__(self) -> TokenMeter:
        self.changes = [(time.perf_counter(), self.total())]
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.changes.append((time.perf_counter(), self.total()))

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now, total = time.perf_counter(), self.total()
            if total != self.changes[-1][1]:
                self.changes.append((now, total))

    def steady(self) -> tuple[float, float]:
        """(tokens made, seconds from the first sample that saw tokens to the last change)."""
        base = self.changes[0][1]
        moved = [(t, v) for t, v in self.changes if v != base]
        if len(moved) < 2:
            return (moved[-1][1] - base if moved else 0.0), float("nan")
        first_t, first_v = moved[0]
        last_t, last_v = moved[-1]
        # The first sample that saw tokens counts from its own time: the tokens it saw were
        # made in the 50 ms before it, so they are left out of both sides.
        return last_v - base, (last_v - first_v) / max(last_t - first_t, 1e-9)


class Offline:
    """vLLM's offline engine in a process of its own (bench/vllm_offline.py), loaded once."""

    def __init__(self, model: Path, folder: Path, *, core_process: bool = False) -> None:
        """`core_process`: vLLM's engine core in a process of its own (vLLM's default), not
        in this one (as `engine: vllm` runs it)."""
        self.folder = folder
        self.process = subprocess.Popen(
            [str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_offline.py")), str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(folder / "offline.log").open("ab"),
            text=True,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if core_process else "0"},
        )
        self.load_s = float(self._answer()["ready"])

    def _answer(self) -> dict[str, float]:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # vLLM's own log lines among the answers
            if line.startswith("ANSWER "):
                answer: dict[str, float] = json.loads(line.removeprefix("ANSWER "))
                return answer
        log = (self.folder / "offline.log").read_text()[-2000:]
        raise RuntimeError(f"vLLM's offline engine exited: {log}")

    def rate(self, rows: list[tuple[list[int], int]]) -> float:
        """Output tokens/s of one `generate` call over the rows."""
        assert self.process.stdin is not None
        path = self.folder / "offline-rows.json"
        path.write_text(json.dumps(rows))
        self.process.stdin.write(f"{path}\n")
        self.process.stdin.flush()
        answer = self._answer()
        return answer["tokens"] / answer["seconds"]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Server:
    def __init__(self, model: Path, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.argv = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            "bench",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "-O0",
            "--kv-cache-memory-bytes",
            str(2 << 30),
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Server:
        started = time.perf_counter()
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        self.startup_s = time.perf_counter() - started
        return self

    def __exit__(self, *_: object) -> None:
        assert self.process is not None
        self.process.terminate()
        self.process.wait(timeout=60)


async def _alone(url: str, rows: list[tuple[list[int], int]], concurrency: int) -> None:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt: list[int], max_tokens: int) -> None:
            body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens}
            async with (
                gate,
                session.post(url + "/completions", json={**body, "temperature": 0}) as r,
            ):
                r.raise_for_status()
                await r.read()

        await asyncio.gather(*(one(p, m) for p, m in rows))


@dataclass(frozen=True)
class JobRun:
    """One whole job: output tokens, seconds from submit to the end, and from the first worker
    ready (its stage processes and engine started, as the master was told) to the end."""

    tokens: int
    seconds: float
    ready_seconds: float

    @property
    def whole(self) -> float:
        return self.tokens / self.seconds

    @property
    def steady(self) -> float:
        return self.tokens / self.ready_seconds


def _llm(model: Path, engine: str, server_url: str = "") -> dict[str, Any]:
    """The job's llm stage: through the server (`endpoint`), or vLLM in the stage's process
    (`vllm`) started as the server is (float32, -O0, 2 GiB of KV cache)."""
    llm: dict[str, Any] = {
        "model": str(model),
        "engine": engine,
        "per_row": {"max_tokens": "m"},
    }
    if engine == "endpoint":
        llm |= {"endpoint": server_url, "served_model": "bench"}
    else:
        llm |= {
            "dtype": "float32",
            "engine_args": {"optimization_level": 0, "kv_cache_memory_bytes": 2 << 30},
        }
    return llm


async def _job(
    ctx: Context, llm: dict[str, Any], rows: list[tuple[list[int], int]], workers: int
) -> JobRun:
    """The prompts as a whole job on a fresh embedded stack, every other setting at its
    default."""
    from ebb.common.job import parse_job

    folder = ctx.dir("llmvllm") / f"job-{time.monotonic_ns()}"
    folder.mkdir()
    (folder / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "m": m}) + "\n" for p, m in rows)
    )
    spec = parse_job(
        {
            "name": "llm-vllm-bench",
            "input": {"uri": str(folder / "prompts.jsonl")},
            "pipeline": {
                "stages": [
                    {
                        "name": "gen",
                        "llm": llm,
                        "metrics": {"tokens": {"kind": "sum", "column": "output_tokens"}},
                    }
                ]
            },
            "output": {"uri": str(folder / "out")},
            "resources": {"max_workers": workers},
        }
    )
    ready_at: list[float] = []

    def seen(status: JobStatus) -> None:
        if status.workers_ready and not ready_at:
            ready_at.append(time.perf_counter())

    async with ebb_stack(ctx, "llmvllm", max_workers=workers) as (_, client):
        started = time.perf_counter()
        job_id = await client.submit(spec)
        final = await client.wait(job_id, poll_s=0.1, on_update=seen)
        ended = time.perf_counter()
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"benchmark job failed: {final.reason}")
    made = int(final.metrics["tokens"])
    wanted = sum(m for _, m in rows)
    if made != wanted:
        print(f"  the job made {made} tokens of {wanted} asked", file=sys.stderr)
    shutil.rmtree(folder, ignore_errors=True)
    return JobRun(made, ended - started, ended - (ready_at[0] if ready_at else started))


def _job_in_vllm_venv(
    ctx: Context, model: Path, rows: list[tuple[list[int], int]], workers: int
) -> JobRun:
    """`_job` with `engine: vllm`, run by vLLM's venv's Python (where vLLM and Ebb are both
    installed, as in a worker image with vLLM): the stack and its workers run from it."""
    asked = ctx.dir("llmvllm") / f"asked-{time.monotonic_ns()}.json"
    asked.write_text(
        json.dumps({"model": str(model), "rows": rows, "workers": workers, "dir": str(ctx.workdir)})
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), "-m", "bench.llm_vllm", str(asked)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    asked.unlink()
    for line in done.stdout.splitlines():
        if line.startswith("ANSWER "):
            return JobRun(**json.loads(line.removeprefix("ANSWER ")))
    raise RuntimeError(f"the engine: vllm job failed: {done.stderr[-3000:]}")


SERVER_ALONE = "vLLM alone: server, plain client"
IN_PROCESS_ALONE = "vLLM alone: in-process `LLM.generate`, one call"
CORE_APART_ALONE = "vLLM alone: `LLM.generate`, its engine core in a process of its own"


def _ebb_name(engine: str, workers: int) -> str:
    return f"Ebb, `engine: {engine}`, {workers} worker{'s' if workers > 1 else ''}"


@dataclass
class _Shape:
    """One shape's prompts and what its variants measured, round after round."""

    rows: list[tuple[list[int], int]]
    steady: dict[str, list[float]]
    jobs: dict[str, list[JobRun]]

    def record(self, name: str, value: float, log: Any) -> None:
        self.steady.setdefault(name, []).append(value)
        log(f"  {name}: {value:,.0f} tokens/s")


def _server_round(
    ctx: Context, model_dir: Path, shapes: dict[str, _Shape], startups: list[float]
) -> None:
    """One round with vLLM's server up: the plain client at each concurrency, then Ebb's jobs
    through it (`engine: endpoint`), each shape in turn; tokens/s by the server's meter."""
    from tests.helpers import free_port

    log_file = ctx.dir("llmvllm") / "vllm.log"
    with Server(model_dir, free_port(), log_file) as server:
        startups.append(server.startup_s)
        for shape_name, shape in shapes.items():
            ctx.log(f"  {shape_name}, vLLM's server:")
            rows = shape.rows
            # The smoke run goes each way once: one concurrency, one job, no warming.
            if not ctx.smoke:
                asyncio.run(_alone(server.url, rows, CONCURRENCY[0]))  # warm: new shapes
            for c in CONCURRENCY[:1] if ctx.smoke else CONCURRENCY:
                with TokenMeter(server.port) as meter:
                    asyncio.run(_alone(server.url, rows, c))
                shape.record(f"{SERVER_ALONE}, {c} in flight", meter.steady()[1], ctx.log)
            for workers in WORKERS[:1] if ctx.smoke else WORKERS:
                name = _ebb_name("endpoint", workers)
                llm = _llm(server_model(ctx), "endpoint", server.url)
                with TokenMeter(server.port) as meter:
                    job = asyncio.run(_job(ctx, llm, rows, workers))
                shape.jobs.setdefault(name, []).append(job)
                shape.record(name, meter.steady()[1], ctx.log)


def _in_process_round(
    ctx: Context, model_dir: Path, shapes: dict[str, _Shape], loads: list[float]
) -> None:
    """One round with no server: vLLM's offline engine given each shape's prompts in one
    `generate` call (loaded for the round, gone before the jobs), then Ebb's jobs with vLLM in
    the stage's process (`engine: vllm`), from the first worker ready to the job's end."""
    for name, core_apart in ((IN_PROCESS_ALONE, False), (CORE_APART_ALONE, True)):
        offline = Offline(model_dir, ctx.dir("llmvllm"), core_process=core_apart)
        try:
            if not core_apart:
                loads.append(offline.load_s)
            for shape_name, shape in shapes.items():
                ctx.log(f"  {shape_name}, {name}:")
                offline.rate(shape.rows)  # warm, as the server is
                shape.record(name, offline.rate(shape.rows), ctx.log)
        finally:
            offline.close()
    for shape in shapes.values():
        for workers in WORKERS:
            name = _ebb_name("vllm", workers)
            job = _job_in_vllm_venv(ctx, model_dir, shape.rows, workers)
            shape.jobs.setdefault(name, []).append(job)
            shape.record(name, job.steady, ctx.log)


def _tables(shape_name: str, shape: _Shape, summary: dict[str, float]) -> list[str]:
    """The shape's variants side by side, against vLLM's server at its best concurrency and
    against vLLM in-process; and Ebb's jobs whole, with their start-up."""
    served = [k for k in shape.steady if k.startswith(SERVER_ALONE)]
    best = max(served, key=lambda k: median(shape.steady[k]))
    base = median(shape.steady[best])
    in_process = shape.steady.get(IN_PROCESS_ALONE)
    headers = ["variant", "output tokens/s, steady", "vs vLLM's server alone (best)"]
    if in_process:
        headers.append("vs vLLM in-process alone")
    out = []
    for name, values in shape.steady.items():
        row = [name, spread(values), f"{median(values) / base:.2f}x"]
        if in_process:
            row.append(f"{median(values) / median(in_process):.2f}x")
        out.append(row)
        summary[f"{shape_name}: {name}"] = median(values)
    for name in shape.jobs:
        summary[f"{shape_name}: {name} / vLLM's server alone"] = median(shape.steady[name]) / base
        if in_process:
            summary[f"{shape_name}: {name} / vLLM in-process alone"] = median(
                shape.steady[name]
            ) / median(in_process)
    whole = [
        [
            name,
            spread([j.whole for j in runs]),
            f"{median([j.seconds - j.ready_seconds for j in runs]):.0f} s",
        ]
        for name, runs in shape.jobs.items()
    ]
    return [
        f"**{shape_name}** (steady; against {best.removeprefix(SERVER_ALONE + ', ')}, the "
        "server's best)\n\n" + table(headers, out),
        f"**{shape_name}, Ebb's jobs whole** (submit to end: the stack's and the workers' "
        "start-up in it)\n\n"
        + table(["variant", "output tokens/s, whole job", "start-up (submit to ready)"], whole),
    ]


def server_model(ctx: Context) -> Path:
    return ctx.dir("llmvllm") / "model"


def run(ctx: Context) -> Section:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from transformers import AutoTokenizer

    from tests.llm_model import build_tiny_llm

    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"vLLM's venv is missing ({VLLM_PYTHON}): run `make vllm`")
    hidden, layers = (128, 2) if ctx.smoke else (256, 4)
    model_dir = build_tiny_llm(
        server_model(ctx), layers=layers, hidden=hidden, vocab=2000, context=512
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n = ctx.size(PROMPTS, 256)
    cap = 8 if ctx.smoke else 1 << 30
    shapes = {
        shape: _Shape(_workload(tokenizer, shape, n, cap=cap), {}, {})
        for shape in (("spread",) if ctx.smoke else ("spread", "equal"))
    }
    startups: list[float] = []
    loads: list[float] = []
    for r in range(ctx.repeats):
        ctx.log(f"  round {r + 1}/{ctx.repeats}")
        _server_round(ctx, model_dir, shapes, startups)
        # Once the server is gone: nothing runs beside these but what they are compared
        # with. A second vLLM engine is more than the suite's smoke run needs.
        if not ctx.smoke:
            _in_process_round(ctx, model_dir, shapes, loads)
    tables: list[str] = []
    summary: dict[str, float] = {}
    for shape_name, shape in shapes.items():
        tables += _tables(shape_name, shape, summary)
    notes = [
        f"{n:,} prompts a shape, a {layers}-layer model of hidden size {hidden}, vLLM -O0 in "
        "float32 on the CPU; the server binds its engine to one core and keeps the other, the "
        "in-process engine uses both. vLLM's server's start-up (its health check answers): "
        f"{median(startups):.0f} s"
        + (f"; the in-process engine's load: {median(loads):.0f} s" if loads else "")
        + ". Ebb's jobs as a user writes them: the stage's `max_in_flight`, `batch_size` and "
        "the job's shards at their defaults. Each round starts vLLM's server, measures every "
        "variant that uses it, stops it, then measures the in-process variants; "
        f"{ctx.repeats} rounds, medians (min-max)."
    ]
    return Section(
        title="21. LLM generation through vLLM: Ebb against vLLM alone",
        intro=__doc__ or "",
        tables=tables,
        slug="llmvllm",
        summary=summary,
        notes=notes,
    )


def _main(asked_file: str) -> None:
    """`python -m bench.llm_vllm ASKED.json`, by vLLM's venv's Python: one `engine: vllm`
    job (`_job_in_vllm_venv`); prints `ANSWER {JobRun}`."""
    asked = json.loads(Path(asked_file).read_text())
    ctx = Context(quick=False, workdir=Path(asked["dir"]), docs=Path(asked["dir"]))
    rows = [(list(p), int(m)) for p, m in asked["rows"]]
    llm = _llm(Path(asked["model"]), "vllm")
    job = asyncio.run(_job(ctx, llm, rows, int(asked["workers"])))
    print("ANSWER " + json.dumps(job.__dict__), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
