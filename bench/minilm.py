"""Benchmark 10: all-MiniLM-L6-v2 embeddings against what users would run instead.

Workload: `examples/embeddings`, on a sample of its corpus (docstrings and documentation of the
installed packages, 16 to 2,000 characters, cut at 256 tokens). The same texts, the same
machine, one run each, every system as a command of its own:

- sentence-transformers: `SentenceTransformer.encode` of the packaged model in one process,
  file by file (its own length sorting, batches of 32); tokenizing and the model take turns;
- Ray Data: `read_parquet -> map_batches` (an actor pool of one actor with 0.5 CPU, whose
  torch uses every core; `encode` on batches of 256) `-> write_parquet`, in a venv of its own
  (the `bench` extra: `ray[data]`);
- Ebb: `ebb run` of the example's job (embedded stack, 1 worker: a tokenize process, the
  scripted encoder in a model stage cut by a 4,096-token budget over length-sorted rows).

Rows/s and tokens/s (real tokens, padding not counted) are over the command's whole life:
start-up, model load, reading and writing included. Peak memory is the largest sum of the
resident memory of the command's process tree (sampled every 0.2 s). Time to first output is
from the start of the command to the first output file on disk.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq

from .common import REPO, Context, Section, table

EXAMPLE = REPO / "examples" / "embeddings"
RAY_PYTHON = Path(os.environ.get("EBB_BENCH_RAY_PYTHON", REPO / ".venv-ray" / "bin" / "python"))


def peak_rss(process: subprocess.Popen[bytes], stop: threading.Event, peak: list[int]) -> None:
    """The largest total RSS of `process` and its descendants until `stop`."""
    try:
        root = psutil.Process(process.pid)
    except psutil.NoSuchProcess:
        return
    while not stop.wait(0.2):
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    continue
        except psutil.NoSuchProcess:
            return
        peak[0] = max(peak[0], total)


def measure(command: list[str], out: Path, *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `command`; seconds, peak memory and time to its first output file."""
    started_wall, started = time.time(), time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=peak_rss, args=(process, stop, peak), daemon=True)
    sampler.start()
    output, _ = process.communicate()
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed:\n{output.decode()[-3000:]}")
    files = [p for p in out.rglob("*.parquet") if "_commits" not in p.parts]
    first = min(p.stat().st_mtime for p in files) - started_wall
    return {"seconds": seconds, "peak_gb": peak[0] / 2**30, "first_s": first}


def prepare(ctx: Context, rows: int) -> tuple[Path, Path, int, int]:
    """The corpus sample and the scripted encoder (kept in the workdir: building the corpus
    parses every installed package); the sample's rows and tokens."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        corpus = importlib.import_module("corpus")
        minilm = importlib.import_module("minilm")
    finally:
        sys.path.remove(str(EXAMPLE))
    whole = ctx.workdir / "minilm-corpus"
    if not whole.exists():
        # The smoke run takes its texts from Ebb's own code: every installed package is minutes.
        roots = [REPO / "libs", REPO / "services"] if ctx.smoke else None
        ctx.log(f"  corpus: {corpus.build(whole, roots=roots):,} rows")
    folder = ctx.dir(f"minilm-{rows}")
    data, model = folder / "data", folder / "minilm-l6-v2.pt"
    if not data.exists():
        # The corpus is in hash order already: its first rows are a fair sample.
        sample = pq.read_table(whole).slice(0, rows)
        data.mkdir()
        per_file = -(-rows // 8)
        for f in range(8):
            pq.write_table(sample.slice(f * per_file, per_file), data / f"part-{f:03d}.parquet")
    if not model.exists():
        minilm.export_torchscript(model)
    texts = pq.read_table(data, columns=["text"]).column("text").to_pylist()
    tokenizer = minilm.load_tokenizer()
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts))
    return data, model, len(texts), tokens


def ebb_job(data: Path, model: Path, out: Path, rows: int) -> Path:
    text = (EXAMPLE / "job.yaml").read_text()
    spec = text.replace("uri: data/", f"uri: {data}").replace("uri: out/", f"uri: {out}")
    spec = spec.replace("model: minilm-l6-v2.pt", f"model: {model}")
    spec = spec.replace("code_paths: [.]", f"code_paths: [{EXAMPLE}]")
    spec = spec.replace("rows_per_shard: 5000", f"rows_per_shard: {max(rows // 8, 1)}")
    path = out.parent / f"{out.name}.yaml"
    path.write_text(spec)
    return path


def run(ctx: Context) -> Section:
    data, model, rows, tokens = prepare(ctx, ctx.size(2_000, 600))
    runs = ctx.dir("minilm-runs")
    python = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable
    peers = str(REPO / "bench" / "minilm_peers.py")
    results: dict[str, dict[str, Any]] = {}
    out = runs / f"st-{time.monotonic_ns()}"
    results["sentence-transformers"] = measure([python, peers, "st", str(data), str(out)], out)
    out = runs / f"ebb-{time.monotonic_ns()}"
    job = ebb_job(data, model, out, rows)
    ebb = str(Path(sys.executable).parent / "ebb")
    results["Ebb, 1 worker"] = measure(
        [ebb, "run", str(job), "--data-root", str(ctx.workdir), "--data-root", str(REPO)], out
    )
    if RAY_PYTHON.exists() and not ctx.smoke:
        out = runs / f"ray-{time.monotonic_ns()}"
        results["Ray Data"] = measure([str(RAY_PYTHON), peers, "ray", str(data), str(out)], out)
    for name, r in results.items():
        ctx.log(f"  {name}: {json.dumps(r)}")
    st = results["sentence-transformers"]["seconds"]
    body = [
        [
            name,
            f"{rows / r['seconds']:,.1f}",
            f"{tokens / r['seconds']:,.0f}",
            f"{r['peak_gb']:.2f}",
            f"{r['first_s']:.1f}",
            f"{st / r['seconds']:.2f}",
        ]
        for name, r in results.items()
    ]
    notes = [
        f"{rows:,} rows, {tokens:,} tokens ({tokens / rows:.0f} a row) on cpu, fp32; one run "
        "of each. Targets: Ebb >= 1.3x sentence-transformers and >= 3x Ray Data."
    ]
    if "Ray Data" in results:
        ebb, ray = results["Ebb, 1 worker"]["seconds"], results["Ray Data"]["seconds"]
        notes.append(f"Ebb against Ray Data: {ray / ebb:.2f}x the rows/s.")
    notes.append(
        "On the CPU only: the job runs on a GPU with `device: cuda`, `dtype: float16` on its "
        "embed stage, not measured here."
    )
    if "Ray Data" not in results:
        notes.append(f"Ray Data not measured: no {RAY_PYTHON} (the `bench` extra in a venv).")
    return Section(
        title="10. MiniLM embeddings against sentence-transformers and Ray Data",
        intro=__doc__ or "",
        tables=[
            table(
                [
                    "system",
                    "rows/s",
                    "tokens/s",
                    "peak memory (GiB)",
                    "first output (s)",
                    "vs sentence-transformers",
                ],
                body,
            )
        ],
        slug="minilm",
        summary={name: rows / r["seconds"] for name, r in results.items()},
        notes=notes,
    )
