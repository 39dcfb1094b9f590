"""Benchmark 5: start-up. `ebb run` on a tiny job, timed as a user sees it.

From the moment the command starts: until the first shard's commit record exists (the embedded
nats-server, master and controller started, the job planned, a worker spawned with its stage
processes and model loaded, one shard computed and committed), and until the command exits
(every shard done, the manifest written, the stack stopped).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ebb.client.demo import write_demo

from .common import Context, Section, median, spread, table


def _once(folder: Path) -> tuple[float, float]:
    out = folder / "out"
    started = time.perf_counter()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ebb.client.cli",
            "run",
            "job.yaml",
            "--quiet",
            "--max-workers",
            "1",
        ],
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    first = None
    while process.poll() is None:
        if first is None and any((out / "_commits").glob("*.json")):
            first = time.perf_counter() - started
        time.sleep(0.005)  # polling a file system for a timestamp: a measurement, not a test
    total = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"ebb run exited with {process.returncode}")
    return first if first is not None else total, total


def run(ctx: Context) -> Section:
    folder = ctx.dir("startup")
    job = write_demo(folder, rows=2_000, files=1)
    spec = yaml.safe_load(job.read_text())
    spec["input"]["rows_per_shard"] = 1_000
    spec["resources"] = {"min_workers": 1, "max_workers": 1}
    job.write_text(yaml.safe_dump(spec))
    firsts: list[float] = []
    ends: list[float] = []
    for r in range(ctx.repeats):
        shutil.rmtree(folder / "out", ignore_errors=True)
        first, end = _once(folder)
        firsts.append(first)
        ends.append(end)
        ctx.log(f"  run {r + 1}/{ctx.repeats}: first commit {first:.2f} s, exit {end:.2f} s")
    return Section(
        title="5. Start-up: `ebb run` on a tiny job",
        intro=__doc__ or "",
        tables=[
            table(
                ["from `ebb run` to", "seconds median (min-max)"],
                [["the first committed shard", spread(firsts)], ["the end (exit 0)", spread(ends)]],
            )
        ],
        slug="startup",
        summary={"first_commit_s": median(firsts), "end_s": median(ends)},
        notes=["2,000 rows in 2 shards, the demo's 3-stage pipeline, one worker."],
    )
