"""Benchmark 21: LLM generation through vLLM, Ebb against vLLM alone.

vLLM's CPU build (`make vllm`, .venv-vllm) serves the model of section 16 (4 layers, hidden
256, built here), started once, as a user starts one. The same prompts go to it two ways:

- vLLM alone: a plain asyncio client (aiohttp) sends every prompt's token ids to
  `/v1/completions`, at most `concurrency` at once (the best of those tried is reported), and
  nothing else runs.
- Ebb through vLLM: the prompts as a whole job (`ebb run`'s embedded stack, prompts in JSONL),
  its `llm` stage with `engine: endpoint` feeding that same server, every setting at its
  default (`max_in_flight`, `batch_size`, the shards), with 1 worker and with 2 on the same
  two cores.

Tokens/s are the server's own: its `vllm:generation_tokens_total` counter, sampled every
50 ms, from the first token to the last (steady state: the job's start and its workers'
start-up are not in it; the job's whole time is a column of its own). Two shapes, as section
16's: **spread** (four prompts in five short with short answers, a long tail of both) and
**equal** (prompts of 24 tokens, answers of 48). Greedy; a random model seldom ends before
its `max_tokens`.

`engine: server` (the stage starting vLLM itself) runs the same way once the server answers:
its start-up on this CPU is reported apart (`-O0`: no torch.compile warm-up).

In-process or a server: vLLM's offline engine (`vllm.LLM`, what an `engine: vllm` stage runs,
its engine core in the same process; bench/vllm_offline.py, loaded once; and again with the
engine core in a process of its own, vLLM's default) is given all the prompts in one
`generate` call, against the server fed by the plain client at its best concurrency,
both timed as whole calls (first request sent to last answer: the server's meter cannot see
the offline engine). The offline engine starts once the comparisons above are done, not beside
them.

Ebb with vLLM in the stage's process (once the server is stopped): four times the prompts
(1,536) as whole jobs through `engine: vllm` (the
stack and its workers run from vLLM's venv, where Ebb is installed too, as in a worker image
with vLLM), 1 and 2 workers, against the same offline engine given every prompt in one
`generate` call. Steady: tokens over the time from the first worker ready (its stage
processes started, vLLM loaded: the master is told within half a second) to the job's end,
the last shard's commit included; the start-up apart.
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

from .common import REPO, Context, Section, ebb_stack, interleaved, median, spread, table
from .llm import _workload

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROMPTS = 384
IN_STAGE_TIMES = 4
"""`engine: vllm` jobs run this many times the prompts: vLLM alone makes the 384 prompts' tokens
in 2 to 3 s here, too short a run for a job's steady state (its first batch read and sent,
its output written and committed, the master told, all inside the measure): measured so, the
jobs came to 0.56x (spread) and 0.72x (equal) of vLLM alone. A batch job is thousands of
prompts or more."""
CONCURRENCY = (32, 64, 128)
"""Requests in flight tried for vLLM alone; the best is the one compared."""


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


def _in_process(
    ctx: Context,
    server: Server,
    model_dir: Path,
    tokenizer: Any,
    n: int,
    best_concurrency: dict[str, int],
    tables: list[str],
    summary: dict[str, float],
) -> None:
    """vLLM's offline engine against the server at its best concurrency, whole calls; the
    offline engine started only now, so that it is not beside the comparisons before."""
    offline = Offline(model_dir, ctx.dir("llmvllm"))
    own_core = Offline(model_dir, ctx.dir("llmvllm"), core_process=True)
    try:
        for shape, c in best_concurrency.items():
            rows = _workload(tokenizer, shape, n, cap=1 << 30)

            def served(rows: list[tuple[list[int], int]] = rows, c: int = c) -> float:
                with TokenMeter(server.port) as meter:
                    began = time.perf_counter()
                    asyncio.run(_alone(server.url, rows, c))
                    seconds = time.perf_counter() - began
                return meter.steady()[0] / seconds

            def in_process(rows: list[tuple[list[int], int]] = rows) -> float:
                return offline.rate(rows)

            def core_apart(rows: list[tuple[list[int], int]] = rows) -> float:
                return own_core.rate(rows)

            offline.rate(rows)  # warm, as the server is
            own_core.rate(rows)
            results = interleaved(
                {
                    f"server, {c} in flight": served,
                    "in-process (`LLM.generate`), as `engine: vllm`": in_process,
                    "in-process, the engine core in a process of its own": core_apart,
                },
                ctx.repeats,
                ctx.log,
            )
            base = median(results[f"server, {c} in flight"])
            tables.append(
                f"**{shape}, vLLM in-process or a server** (whole calls; the offline engine's "
                f"start-up: {offline.load_s:.0f} s, {own_core.load_s:.0f} s with its engine "
                "core apart)\n\n"
                + table(
                    ["vLLM", "output tokens/s", "vs the server"],
                    [[k, spread(v), f"{median(v) / base:.2f}x"] for k, v in results.items()],
                )
            )
            summary[f"{shape}: vLLM in-process / server"] = (
                median(results["in-process (`LLM.generate`), as `engine: vllm`"]) / base
            )
    finally:
        offline.close()
        own_core.close()


def _ebb_in_process(
    ctx: Context,
    offline: Offline,
    model_dir: Path,
    shape: str,
    rows: list[tuple[list[int], int]],
    tables: list[str],
    summary: dict[str, float],
) -> None:
    """Whole `ebb run` jobs through `engine: vllm` (1 and 2 workers) against vLLM's offline
    engine given every prompt in one `generate` call: tokens/s from the first worker ready
    (its engine started) to the job's end, against the call's; the jobs' start-up apart."""
    jobs: dict[int, list[JobRun]] = {1: [], 2: []}

    def ebb(w: int) -> Any:
        def measure() -> float:
            job = _job_in_vllm_venv(ctx, model_dir, rows, w)
            jobs[w].append(job)
            return job.steady

        return measure

    alone = "vLLM alone, in-process (`LLM.generate`, one call)"
    results = interleaved(
        {
            alone: lambda: offline.rate(rows),
            "Ebb, `engine: vllm`, 1 worker": ebb(1),
            "Ebb, `engine: vllm`, 2 workers": ebb(2),
        },
        ctx.repeats,
        ctx.log,
    )
    base = median(results[alone])
    out = [[alone, spread(results[alone]), "1.00x", "", f"{offline.load_s:.0f} s (load)"]]
    for w, runs in jobs.items():
        name = f"Ebb, `engine: vllm`, {w} worker{'s' if w > 1 else ''}"
        out.append(
            [
                name,
                spread(results[name]),
                f"{median(results[name]) / base:.2f}x",
                spread([j.whole for j in runs]),
                f"{median([j.seconds - j.ready_seconds for j in runs]):.0f} s",
            ]
        )
        summary[f"{shape}: Ebb engine: vllm {w} worker(s) / vLLM in-process"] = (
            median(results[name]) / base
        )
    tables.append(
        f"**{shape}, Ebb with vLLM in the stage's process** (steady: from the first worker "
        "ready, its engine started, to the job's end; whole: from submit)\n\n"
        + table(
            ["variant", "output tokens/s, steady", "vs vLLM alone", "whole job", "start-up"],
            out,
        )
    )


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
    n = ctx.size(PROMPTS, 128)
    from tests.helpers import free_port

    tables: list[str] = []
    summary: dict[str, float] = {}
    notes: list[str] = []
    best_concurrency: dict[str, int] = {}
    with Server(model_dir, free_port(), ctx.dir("llmvllm") / "vllm.log") as server:
        notes.append(f"vLLM's start-up (health check answers): {server.startup_s:.0f} s.")
        for shape in ("spread", "equal"):
            rows = _workload(tokenizer, shape, n, cap=8 if ctx.smoke else 1 << 30)
            steady: dict[str, float] = {}
            whole: dict[int, list[float]] = {1: [], 2: []}

            def alone(c: int, rows: list[tuple[list[int], int]] = rows) -> Any:
                def measure() -> float:
                    with TokenMeter(server.port) as meter:
                        asyncio.run(_alone(server.url, rows, c))
                    return meter.steady()[1]

                return measure

            def ebb(
                w: int,
                rows: list[tuple[list[int], int]] = rows,
                whole: dict[int, list[float]] = whole,
            ) -> Any:
                def measure() -> float:
                    llm = _llm(server_model(ctx), "endpoint", server.url)
                    with TokenMeter(server.port) as meter:
                        job = asyncio.run(_job(ctx, llm, rows, w))
                    whole[w].append(job.whole)
                    return meter.steady()[1]

                return measure

            variants = {f"vLLM alone, {c} in flight": alone(c) for c in CONCURRENCY}
            variants["Ebb through vLLM, 1 worker"] = ebb(1)
            variants["Ebb through vLLM, 2 workers"] = ebb(2)
            alone(CONCURRENCY[0])()  # warm: the server's first batches at new shapes
            ctx.log(f"  {shape}: {n} prompts")
            results = interleaved(variants, ctx.repeats, ctx.log)
            best = max(
                (k for k in results if k.startswith("vLLM")), key=lambda k: median(results[k])
            )
            base = median(results[best])
            best_concurrency[shape] = int(best.split(", ")[1].split()[0])
            rows_out = []
            for k, v in results.items():
                rows_out.append([k, spread(v), f"{median(v) / base:.2f}x"])
                steady[k] = median(v)
            tables.append(
                f"**{shape}** (against {best})\n\n"
                + table(["variant", "output tokens/s, steady", f"vs {best}"], rows_out)
            )
            tables.append(
                f"**{shape}, whole jobs** (submit to end: the stack's and workers' start in it)"
                "\n\n"
                + table(
                    ["workers", "output tokens/s", f"vs {best}, steady"],
                    [[f"{w}", spread(v), f"{median(v) / base:.2f}x"] for w, v in whole.items()],
                )
            )
            for k, rate in steady.items():
                summary[f"{shape}: {k}"] = rate
            summary[f"{shape}: Ebb 1 worker / vLLM alone"] = (
                steady["Ebb through vLLM, 1 worker"] / base
            )
            summary[f"{shape}: Ebb 2 workers / vLLM alone"] = (
                steady["Ebb through vLLM, 2 workers"] / base
            )
        if not ctx.smoke:  # a second vLLM engine is more than the suite's smoke run needs
            _in_process(ctx, server, model_dir, tokenizer, n, best_concurrency, tables, summary)
    if not ctx.smoke:
        # Once the server is gone: nothing runs beside these but what they are compared with.
        offline = Offline(model_dir, ctx.dir("llmvllm"))
        try:
            for shape in best_concurrency:
                rows = _workload(tokenizer, shape, n * IN_STAGE_TIMES, cap=1 << 30)
                offline.rate(rows)  # warm
                _ebb_in_process(ctx, offline, model_dir, shape, rows, tables, summary)
        finally:
            offline.close()
    notes.append(
        f"{n} prompts, a {layers}-layer model of hidden size {hidden}, vLLM {'-O0'} in float32 "
        "on the CPU (it binds its engine to one core and keeps the other); Ebb's job as a user "
        "writes it: the stage's `max_in_flight`, `batch_size` and the job's shards at their "
        "defaults."
    )
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
