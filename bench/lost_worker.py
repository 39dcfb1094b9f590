"""A lost worker: how soon the shards of a worker killed from outside can be worked on again.

python -m bench.lost_worker                  5 repeats, the table on stdout
python -m bench.lost_worker --repeats 3 --out /tmp/lost-worker.md
python -m bench.lost_worker --doc docs/reliability.md   its section there (kept by the campaign)

The embedded stack as `ebb run` starts it (nats-server, a shard master, the controller and its
two workers, each its own process). Each repeat submits a fresh job of four shards that take
several seconds each, at the default fault settings (lease_s 60, max_attempts 3) but for one:
speculation is off. Each worker holds two shards at once (it computes one and reads the next),
so once both workers hold their two no shard is left in the queue. Then the worker holding the
most is SIGKILLed (killed from outside: the controller relaunches it), and the master's status,
leases included, is read every 50 ms. For each shard the dead worker held:

- released:     from the kill until the dead worker's lease on it has ended (the shard can
                be leased again)
- leased again: from the kill until a new attempt of it is leased to a worker

Where nobody tells the master that a worker ended, its shards wait for their leases to run
out: up to lease_s after the dead worker last renewed. Why speculation is off: with the queue
empty, an idle worker re-leases a long-running shard speculatively (once it has run 1.5 times
the usual shard time), which would rescue the lost shard at a job's tail; in the middle of a
job there is work in the queue and no speculation, and the lost shard waits for its lease.
A queue to wait in would add its own length to "leased again"; no queue and no speculation is
that middle of a job, with nothing but the lost worker's own path in the figure.

Only the master's status API is used, so that this runs against older commits as well (a
"before" figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common.errors import BusError, RemoteError
from ebb.common.job import FaultPolicy, parse_job
from ebb.common.messaging.messages import JobStatus

from .common import REPO, machine, median, table
from .docblock import DocBlock

WORKERS = 2
SHARDS = 4
"""Two per worker (the worker's default of two shards in flight): no shard left in the queue."""
ROWS_PER_SHARD = 500
MS_PER_ROW = 10.0
"""5 s of work per shard (bench.modelets:Work waits, it does not compute)."""
POLL_S = 0.05
SETTLE_TIMEOUT_S = 120.0
"""How long a repeat may wait for both workers to hold their shards."""


@dataclass
class Lost:
    """One shard the killed worker held, and when it came back."""

    shard: int
    attempt: int
    released_s: float | None = None
    leased_again_s: float | None = None


@dataclass
class Repeat:
    worker: str
    lost: list[Lost] = field(default_factory=list)


def job_spec(data: Path, out: Path, *, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "input": {"uri": str(data), "format": "parquet", "rows_per_shard": ROWS_PER_SHARD},
        "pipeline": {
            "code_paths": [str(REPO)],
            "stages": [
                {
                    "name": "work",
                    "modelet": "bench.modelets:Work",
                    "params": {"ms_per_row": MS_PER_ROW},
                    "batch_size": 50,
                }
            ],
        },
        "output": {"uri": str(out), "carryover": ["id"]},
        "resources": {"min_workers": WORKERS, "max_workers": WORKERS},
        # lease_s and max_attempts as they come; see the docstring for speculation.
        "fault": {"speculative": False},
    }


def _worker_processes(stack: LocalStack) -> dict[str, psutil.Process]:
    """The controller's worker processes, by worker id."""
    controller = stack.processes.get("controller")
    if controller is None or controller.returncode is not None:
        return {}
    found = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(controller.pid).children():
            try:
                command = child.cmdline()
            except psutil.Error:
                continue
            if "ebb.worker" in command and "--id" in command:
                found[command[command.index("--id") + 1]] = child
    return found


async def _status(client: EbbClient, job: str) -> JobStatus | None:
    try:
        return (await client.master.status(job, include_leases=True)).jobs[0]
    except (BusError, RemoteError, IndexError):
        return None


async def _settled(
    client: EbbClient, stack: LocalStack, job: str
) -> tuple[psutil.Process, str, dict[int, int]]:
    """Once every shard is leased (none waits in the queue): the worker holding the most, its
    process, and the shards it holds (shard -> attempt)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT_S
    while loop.time() < deadline:
        status = await _status(client, job)
        if status is not None and status.state in ("FAILED", "CANCELLED", "SUCCEEDED"):
            raise RuntimeError(f"job {job} ended ({status.state}) before it could be hurt")
        if status is not None and status.shards_total and status.shards.get("TODO", 0) == 0:
            held: dict[str, dict[int, int]] = {}
            for lease in status.leases:
                held.setdefault(lease.worker, {})[lease.shard] = lease.attempt
            processes = _worker_processes(stack)
            # Most shards first; a tie goes either way.
            ranked = sorted(
                (w for w in held if w in processes),
                key=lambda w: (-len(held[w]), random.random()),
            )
            if ranked:
                return processes[ranked[0]], ranked[0], held[ranked[0]]
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"the shards of job {job} were not all leased in {SETTLE_TIMEOUT_S:g}s")


async def one_repeat(
    client: EbbClient, stack: LocalStack, data: Path, out: Path, *, name: str, timeout_s: float
) -> Repeat:
    job = await client.submit(parse_job(job_spec(data, out, name=name)))
    try:
        process, worker, held = await _settled(client, stack, job)
        process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        repeat = Repeat(worker, [Lost(shard, attempt) for shard, attempt in sorted(held.items())])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline and any(x.leased_again_s is None for x in repeat.lost):
            status = await _status(client, job)
            seen = time.monotonic() - killed
            if status is not None:
                leases = {(ls.shard, ls.attempt, ls.worker) for ls in status.leases}
                for x in repeat.lost:
                    if x.released_s is None and (x.shard, x.attempt, worker) not in leases:
                        x.released_s = seen
                    if x.leased_again_s is None and any(
                        s == x.shard and a > x.attempt for s, a, _ in leases
                    ):
                        x.leased_again_s = seen
            await asyncio.sleep(POLL_S)
        return repeat
    finally:
        with contextlib.suppress(BusError, RemoteError, TimeoutError):
            await client.cancel(job, "the benchmark has measured what it came for")
            await asyncio.wait_for(client.wait(job, poll_s=0.2), 60)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _summary(values: list[float | None]) -> tuple[str, str]:
    """(median, max) of the values found, with how many were not."""
    found = [v for v in values if v is not None]
    missing = len(values) - len(found)
    tail = f" ({missing} not within the wait)" if missing else ""
    if not found:
        return "-" + tail, "-"
    return f"{median(found):.2f} s{tail}", f"{max(found):.2f} s"


BLOCK = DocBlock("lost-worker", "## A lost worker: kill to the next lease of its shards")
BEFORE = (
    "Before the controller told the master of a worker's end (commit 3b0e332, the same bench, "
    "`--repeats 3`), the shards waited for their leases to run out: 6 shards lost, kill -> "
    "released median 58.09 s (max 59.96 s), kill -> leased again median 58.58 s (max 60.37 s)."
)
"""The figure this bench gave on the commit before the change it measures (recorded: the
bench cannot run older code in the same run)."""


def report(repeats: list[Repeat], *, command: str, timeout_s: float) -> str:
    lost = [x for r in repeats for x in r.lost]
    released = _summary([x.released_s for x in lost])
    leased = _summary([x.leased_again_s for x in lost])
    lease_s = FaultPolicy().lease_s
    lines = [
        f"Command: `{command}` at commit {_commit()}  ",
        f"Machine: {machine()}  ",
        f"{len(repeats)} repeats, each a fresh job of {SHARDS} shards of {ROWS_PER_SHARD} rows "
        f"({ROWS_PER_SHARD * MS_PER_ROW / 1000:g} s of work each) on {WORKERS} workers, "
        f"lease_s {lease_s:g} (the default), speculation off; one worker SIGKILLed while it "
        f"held shards, the master's leases read every {POLL_S * 1000:.0f} ms "
        f"(a wait of {timeout_s:g} s at most).",
        "",
        table(
            [
                "shards lost",
                "kill -> released, median",
                "max",
                "kill -> leased again, median",
                "max",
            ],
            [[len(lost), released[0], released[1], leased[0], leased[1]]],
        ),
        "",
        table(
            ["repeat", "worker killed", "shard (attempt)", "released s", "leased again s"],
            [
                [
                    n + 1,
                    r.worker,
                    f"{x.shard} ({x.attempt})",
                    _seconds(x.released_s),
                    _seconds(x.leased_again_s),
                ]
                for n, r in enumerate(repeats)
                for x in r.lost
            ],
        ),
        "",
        BEFORE,
    ]
    return "\n".join(lines) + "\n"


async def measure(
    workdir: Path, *, repeats: int, timeout_s: float, log: Any = print
) -> list[Repeat]:
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table({"id": np.arange(SHARDS * ROWS_PER_SHARD)}),
        data / "rows.parquet",
        row_group_size=ROWS_PER_SHARD,
    )
    stack = LocalStack(
        StackConfig(
            state_dir=workdir / "state",
            data_roots=[str(workdir), str(REPO)],
            max_workers=WORKERS,
            worker_grace_s=5.0,
            log_level="WARNING",
        )
    )
    await stack.start()
    supervisor = asyncio.create_task(stack.supervise())
    results = []
    try:
        async with await EbbClient.connect(stack.nats_config) as client:
            for n in range(repeats):
                repeat = await one_repeat(
                    client,
                    stack,
                    data,
                    workdir / f"out-{n}",
                    name=f"lost-worker-{n}",
                    timeout_s=timeout_s,
                )
                shown = ", ".join(
                    f"shard {x.shard}: released {_seconds(x.released_s)} s, "
                    f"leased again {_seconds(x.leased_again_s)} s"
                    for x in repeat.lost
                )
                log(f"repeat {n + 1}/{repeats}: killed {repeat.worker}; {shown}")
                results.append(repeat)
    finally:
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
        await stack.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.lost_worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--timeout",
        type=float,
        default=2 * FaultPolicy().lease_s + 30,
        help="seconds a repeat waits for the lost shards to be leased again",
    )
    p.add_argument("--out", default=None, help="write the markdown here too")
    p.add_argument("--doc", default=None, help="put it in this report, as its section")
    p.add_argument("--workdir", default=None, help="kept afterwards (default: a temporary one)")
    args = p.parse_args(argv)
    # SIGTERM as Ctrl-C: the stack is stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ebb-lost-worker-"))
    try:
        repeats = asyncio.run(measure(workdir, repeats=args.repeats, timeout_s=args.timeout))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    command = "python -m bench.lost_worker " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(repeats, command=command.strip(), timeout_s=args.timeout)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.doc:
        BLOCK.write(Path(args.doc), BLOCK.wrap(text), title="# Reliability")
    return 0


if __name__ == "__main__":
    sys.exit(main())
