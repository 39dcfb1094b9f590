"""The soak: one long job, and the memory of every process it runs on.

`python -m bench.soak [--rows 10000000]`: the demo's pipeline (standardise, a small ONNX
classifier, top class) over N rows on the embedded stack (nats-server, shard master,
controller, workers, each worker's stage processes), every process's resident memory sampled
twice a second. The peak of each kind of process is read when the job has done a tenth of its
rows and again at its end: memory that grows with the rows a job has done (a leak per row,
per batch or per shard) shows as a later peak above the earlier one. The table goes into
docs/reliability.md, between its soak markers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil
import yaml

from ebb.client.demo import write_demo
from ebb.common.job import parse_job

from .common import REPO, Context, ebb_stack, machine, table
from .docblock import DocBlock

BLOCK = DocBlock("soak", "## Soak: memory over a long job")
START, END = BLOCK.start, BLOCK.end


def kind_of(process: psutil.Process) -> str:
    """What a process of the stack is, from its command line (and its parent's)."""
    try:
        command = " ".join(process.cmdline())
        parent = process.parent()
        parent_command = " ".join(parent.cmdline()) if parent else ""
    except psutil.Error:
        return "gone"
    if "nats-server" in command:
        return "nats-server"
    if "ebb.shard_master" in command:
        return "shard master"
    if "ebb.controller" in command:
        return "controller"
    if "forkserver" in command:
        # Stage processes are forked from the fork server: they share its command line.
        return "stage process" if "forkserver" in parent_command else "stage fork server"
    if "ebb.worker" in command:
        return "worker"
    if "resource_tracker" in command:
        return "resource tracker"
    return "other"


class Sampler:
    """The largest resident set seen so far of each kind of process, and of all together."""

    def __init__(self) -> None:
        self.peak: dict[str, float] = defaultdict(float)
        self.kinds: dict[int, str] = {}

    def sample(self) -> None:
        total = 0.0
        for process in psutil.Process().children(recursive=True):
            try:
                rss = process.memory_info().rss / 2**20
            except psutil.Error:
                continue
            kind = self.kinds.get(process.pid) or kind_of(process)
            self.kinds[process.pid] = kind
            self.peak[kind] = max(self.peak[kind], rss)
            total += rss
        self.peak["all together"] = max(self.peak["all together"], total)

    def snapshot(self) -> dict[str, float]:
        return dict(self.peak)


async def soak(workdir: Path, rows: int, workers: int, rows_per_shard: int) -> dict[str, object]:
    folder = workdir / "soak"
    job_file = write_demo(folder, rows=rows, files=max(1, rows // 1_000_000))
    spec_map = yaml.safe_load(job_file.read_text())
    spec_map["input"]["rows_per_shard"] = rows_per_shard
    spec_map["resources"] = {"min_workers": workers, "max_workers": workers}
    spec_map["input"]["uri"] = str(folder / "data")
    spec_map["output"]["uri"] = str(folder / "out")
    spec_map["pipeline"]["code_paths"] = [str(folder)]
    for stage in spec_map["pipeline"]["stages"]:
        if "model" in stage:
            stage["model"] = str(folder / stage["model"])
    spec = parse_job(spec_map)
    ctx = Context(quick=False, workdir=workdir, docs=REPO / "docs", log=print)
    sampler = Sampler()
    at_tenth: dict[str, float] | None = None
    tenth_rows = 0
    async with ebb_stack(ctx, "soak", max_workers=workers) as (_, client):
        started = time.perf_counter()
        job_id = await client.submit(spec)
        last_print = 0.0
        while True:
            sampler.sample()
            status = await client.job(job_id)
            if at_tenth is None and status.rows_done >= rows // 10:
                at_tenth, tenth_rows = sampler.snapshot(), status.rows_done
            now = time.perf_counter() - started
            if now - last_print > 30:
                last_print = now
                print(f"  {now:,.0f} s: {status.rows_done:,} rows done", flush=True)
            if status.state in ("SUCCEEDED", "FAILED", "CANCELLED"):
                break
            await asyncio.sleep(0.5)  # a sampling period, not a wait for a condition
        seconds = time.perf_counter() - started
    if status.state != "SUCCEEDED":
        raise RuntimeError(f"the soak job ended {status.state}: {status.reason}")
    return {
        "rows": status.rows_done,
        "seconds": seconds,
        "tenth_rows": tenth_rows,
        "at_tenth": at_tenth or {},
        "at_end": sampler.snapshot(),
    }


def render(result: dict[str, object], workers: int, rows_per_shard: int) -> str:
    at_tenth = result["at_tenth"]
    at_end = result["at_end"]
    assert isinstance(at_tenth, dict) and isinstance(at_end, dict)
    rows = int(str(result["rows"]))
    seconds = float(str(result["seconds"]))
    tenth = int(str(result["tenth_rows"]))
    order = [
        "nats-server",
        "shard master",
        "controller",
        "worker",
        "stage fork server",
        "stage process",
        "resource tracker",
        "other",
        "all together",
    ]
    lines = []
    for kind in order:
        if kind not in at_end:
            continue
        before, after = at_tenth.get(kind, 0.0), at_end[kind]
        growth = f"{(after / before - 1) * 100:+.1f}%" if before else "n/a"
        lines.append([kind, f"{before:,.0f}", f"{after:,.0f}", growth])
    return "\n".join(
        [
            START,
            f"A {rows:,}-row job (the demo's three stages, {workers} workers, {rows_per_shard:,} "
            f"rows per shard) took {seconds:,.0f} s ({rows / seconds:,.0f} rows/s) on "
            f"{machine()}. Peak resident memory of each kind of process (the largest one of "
            "that kind), in MiB:",
            "",
            table(
                [
                    "process",
                    f"peak by {tenth:,} rows",
                    f"peak by {rows:,} rows",
                    "growth",
                ],
                lines,
            ),
            "",
            "Reproduce: `python -m bench.soak --rows " + f"{rows}`.",
            END,
        ]
    )


def write(doc: Path, block: str) -> None:
    BLOCK.write(doc, block, title="# Reliability")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rows-per-shard", type=int, default=100_000)
    p.add_argument("--out", default=str(REPO / "docs" / "reliability.md"))
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        workdir = Path(
            args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="ebb-soak-"))
        )
        result = asyncio.run(soak(workdir, args.rows, args.workers, args.rows_per_shard))
    block = render(result, args.workers, args.rows_per_shard)
    write(Path(args.out), block)
    print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
