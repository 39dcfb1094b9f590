"""The chaos campaign: seeded runs of a real job on the local stack, hurt at random times.

python -m bench.chaos --seeds 20             runs seeds 0..19, writes docs/reliability.md
python -m bench.chaos --seeds 3 --rows 6000 --out /tmp/reliability.md

Each run starts the embedded stack as `ebb run` does (nats-server, two shard masters, the
controller and its workers, every one its own process), submits a job over a fresh dataset,
and injects faults one after another at random moments (the seed decides which, and when):

- worker_kill   SIGKILL of a worker process that holds a lease
- stage_kill    SIGKILL of one stage process of such a worker
- worker_stop   SIGSTOP of such a worker past its lease, then SIGCONT: a zombie, to be fenced
- master_kill   SIGKILL of the leading shard master: the standby takes over
- nats_restart  SIGKILL of nats-server, down 1-4 s, then started again on the same store
- stage_hang    a stage process hangs in a batch: the batch timeout kills and restarts it
- input_vanish  an input file disappears (moved aside) until the job has FAILED on it (its
                shards quarantined), then comes back: the job is resumed (`resume`)
- commit_kill   SIGKILL of a worker exactly between writing a shard's commit record and
                telling the master (a failpoint, ebb.common.failpoints)
- master_commit_kill  SIGKILL of the leading master exactly between recording a shard DONE
                and replying to the worker (a failpoint); the standby takes over
- disk_full     the output disk (a tmpfs of its own) filled to the last byte for 2-6 s
- slow_disk     every write to the output disk (a FUSE passthrough, bench/slowfs.py) takes
                50-300 ms for 4-10 s

disk_full needs root (to mount the tmpfs), slow_disk /dev/fuse, libfuse 2 and fusepy; a run
without them does not choose those faults, and the report says so.

After each fault the campaign waits for the job to recover before the next. Recovery time:
for a fault aimed at a worker, until every shard that worker held is committed (by anyone);
for input_vanish, from the `resume` request until one more shard is DONE; for the others, from
the kill (the restart, for NATS; the hang, for a stage; the disk's return to free space or
full speed) until the master has recorded one more shard DONE.

When the job ends: a FAILED job is resumed (`resume`) and followed to its end. Then every
input id must be in the output exactly once (as a result, or as an error row), the job's
counters must agree with the manifest and the files, and the manifest must list exactly the
committed files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from ebb.client.demo import feature_table, mlp_onnx
from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common import envvars, failpoints, schema
from ebb.common.api import MasterClient
from ebb.common.bus import Backoff, connect
from ebb.common.errors import BusError, RemoteError
from ebb.common.messages import JobStatus
from ebb.common.output import COMMITS_DIR, MANIFEST
from ebb.common.spec import parse_job
from ebb.common.subjects import Subjects
from ebb.shard_master.store import ShardRecord, shard_key

from . import slowfs, soak

REPO = Path(__file__).resolve().parent.parent
FAULTS = (
    "worker_kill",
    "stage_kill",
    "worker_stop",
    "master_kill",
    "nats_restart",
    "stage_hang",
    "commit_kill",
    "master_commit_kill",
    "disk_full",
    "slow_disk",
    "input_vanish",
)
VANISH_P = 0.3
"""The share of runs that begin with input_vanish (a job that fails, to be resumed)."""
VANISHING = "part-1.parquet"
"""The input file input_vanish takes away (the second half of the rows: shards not done yet)."""
LEASE_S = 4.0
LEADER_TTL_S = 3.0
BATCH_TIMEOUT_S = 4.0
RECOVERY_TIMEOUT_S = 90.0
DISK_MB = 256
"""The output disk's size: the output of a run is a few MB; the rest is what disk_full fills."""
BALLAST = ".ballast"


@dataclass
class Injection:
    kind: str
    at_s: float
    """Seconds after the job was submitted."""
    recovery_s: float | None
    """None: the job ended (or the wait timed out) before it recovered."""
    note: str = ""


@dataclass
class RunResult:
    seed: int
    rows: int
    first_state: str = ""
    first_reason: str = ""
    resumed: bool = False
    final_state: str = ""
    lost: int = 0
    duplicated: int = 0
    error_rows: int = 0
    counters_agree: bool = False
    problems: list[str] = field(default_factory=list)
    injections: list[Injection] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.final_state == "SUCCEEDED" and not self.problems


# -- the job ---------------------------------------------------------------------------------


def write_job(folder: Path, *, rows: int, rows_per_shard: int, seed: int) -> dict[str, Any]:
    """A dataset (two Parquet files), an ONNX MLP, and the job over them."""
    data = folder / "data"
    data.mkdir(parents=True)
    half = rows // 2
    for i, (start, n) in enumerate(((0, half), (half, rows - half))):
        table = feature_table(n, features=8, seed=seed + i, start_id=start)
        pq.write_table(table, data / f"part-{i}.parquet", row_group_size=rows_per_shard)
    model = mlp_onnx(folder / "model.onnx", inputs=8, hidden=16, outputs=4, seed=3)
    (folder / "hang").mkdir()
    return {
        "name": f"chaos-{seed}",
        "input": {
            "uri": str(data),
            "format": "parquet",
            "columns": ["id", "features"],
            "rows_per_shard": rows_per_shard,
        },
        "pipeline": {
            "code_paths": [str(REPO)],
            "stages": [
                {
                    "name": "prep",
                    "modelet": "bench.modelets:ChaosFeatures",
                    "params": {"seconds_per_batch": 0.1, "hang_dir": str(folder / "hang")},
                    "batch_size": 100,
                },
                {"name": "model", "model": str(model), "threads": 1, "batch_size": 256},
                {"name": "top", "modelet": "ebb.worker.modelets:TopClass", "batch_size": 256},
            ],
        },
        "output": {"uri": str(folder / "out"), "carryover": ["id"]},
        "resources": {"min_workers": 2, "max_workers": 2},
        "fault": {
            "lease_s": LEASE_S,
            "max_attempts": 10,
            "batch_timeout_s": BATCH_TIMEOUT_S,
        },
    }


# -- looking at the stack --------------------------------------------------------------------


def _workers(stack: LocalStack) -> list[psutil.Process]:
    controller = stack.processes.get("controller")
    if controller is None or controller.returncode is not None:
        return []
    try:
        children = psutil.Process(controller.pid).children()
    except psutil.NoSuchProcess:
        return []
    return [p for p in children if _cmdline_has(p, "ebb.worker")]


def _cmdline_has(p: psutil.Process, word: str) -> bool:
    try:
        return word in p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _worker_id(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return ""
    return cmd[cmd.index("--id") + 1] if "--id" in cmd else ""


def _stages(worker: psutil.Process) -> list[psutil.Process]:
    try:
        kids = worker.children()
    except psutil.NoSuchProcess:
        return []
    return [k for k in kids if not _cmdline_has(k, "from multiprocessing.resource_tracker")]


def committed(out: Path) -> set[int]:
    folder = out / COMMITS_DIR
    if not folder.exists():
        return set()
    return {int(p.stem.split("=")[1]) for p in folder.glob("shard=*.json")}


async def _leases(client: EbbClient, job: str) -> dict[str, set[int]]:
    """Worker id -> shards it holds now."""
    try:
        status = (await client.master.status(job, include_leases=True)).jobs[0]
    except (BusError, RemoteError, IndexError):
        return {}
    held: dict[str, set[int]] = {}
    for lease in status.leases:
        held.setdefault(lease.worker, set()).add(lease.shard)
    return held


async def _leader(stack: LocalStack) -> str:
    """The process name of the leading master, read from the leader key."""
    nc = await connect(stack.nats_config_for("master"), name="chaos-probe")
    try:
        kv = await nc.jetstream().key_value(Subjects(stack.config.prefix).leader_bucket)
        entry = await kv.get("master")
        holder = (entry.value or b"").decode().split(" ", 1)[0]  # "id nonce"
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return "master" if holder == "embedded" else holder.removeprefix("embedded-")


async def _until(probe: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        result = probe()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return True
        await asyncio.sleep(interval_s)
    return False


# -- the output disk -------------------------------------------------------------------------


def unavailable() -> dict[str, str]:
    """Faults this machine cannot inject, and why."""
    missing = {}
    if os.geteuid() != 0:
        missing["disk_full"] = "mounting a tmpfs needs root"
    why = slowfs.available()
    if why is not None:
        missing["slow_disk"] = why
    return missing


@dataclass
class OutputDisk:
    """The output root of one run: a tmpfs of its own (disk_full fills it), seen through a
    FUSE passthrough that can be made slow (slow_disk), each where the machine allows it."""

    out: Path
    backing: Path
    """Where the files really are: what disk_full fills."""
    control: Path | None = None
    """The slow disk's delay file; None: no slow disk."""
    tmpfs: bool = False
    fuse: subprocess.Popen[bytes] | None = None

    @classmethod
    def mount(cls, folder: Path, missing: dict[str, str]) -> OutputDisk:
        out = folder / "out"
        out.mkdir()
        slow = "slow_disk" not in missing
        disk = cls(out=out, backing=folder / "disk" if slow else out)
        disk.backing.mkdir(exist_ok=True)
        if "disk_full" not in missing:
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk.backing)],
                capture_output=True,
                check=False,
            )
            disk.tmpfs = mounted.returncode == 0
        if slow:
            disk.control = folder / "slowness"
            disk.control.write_text("0")
            command = [sys.executable, "-m", "bench.slowfs", str(disk.backing), str(out)]
            with (folder / "slowfs.log").open("wb") as log:  # the child keeps its own copy
                disk.fuse = subprocess.Popen(
                    [*command, "--control", str(disk.control)],
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            deadline = time.monotonic() + 15
            while not os.path.ismount(out):
                if disk.fuse.poll() is not None or time.monotonic() > deadline:
                    disk.unmount()
                    raise RuntimeError(f"the slow disk did not mount: see {folder}/slowfs.log")
                time.sleep(0.05)
        return disk

    def fill(self) -> int:
        """Take every free byte of the disk; the bytes taken."""
        free = shutil.disk_usage(self.backing).free
        # ENOSPC at the very end is what "full" means.
        with (self.backing / BALLAST).open("wb") as f, contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, free)
        return free

    def empty(self) -> None:
        (self.backing / BALLAST).unlink(missing_ok=True)

    def slow(self, seconds_per_write: float) -> None:
        assert self.control is not None
        self.control.write_text(f"{seconds_per_write:.3f}")

    def unmount(self) -> None:
        if self.fuse is not None:
            for flags in ("-u", "-uz"):
                if (
                    subprocess.run(["fusermount", flags, str(self.out)], check=False).returncode
                    == 0
                ):
                    break
            try:
                self.fuse.wait(10)
            except subprocess.TimeoutExpired:
                self.fuse.kill()
                self.fuse.wait()
            self.fuse = None
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.backing)], check=False)
            self.tmpfs = False


# -- the faults ------------------------------------------------------------------------------


class Injector:
    def __init__(
        self,
        stack: LocalStack,
        client: EbbClient,
        job: str,
        disk: OutputDisk,
        folder: Path,
    ) -> None:
        self.stack = stack
        self.client = client
        self.job = job
        self.disk = disk
        self.out = disk.out
        self.folder = folder
        self.hang_dir = folder / "hang"
        self.failpoints = folder / "failpoints"
        self.subjects = Subjects(stack.config.prefix)
        self._shards: tuple[NATS, KeyValue] | None = None
        self.ended = asyncio.Event()
        self.probe = MasterClient(client.nc, client.config, backoff=Backoff(attempts=1))

    async def _victim(self, rng: random.Random) -> tuple[psutil.Process, set[int]] | None:
        """A worker holding a lease, and the shards it holds."""
        for _ in range(100):
            held = await _leases(self.client, self.job)
            by_id = {_worker_id(p): p for p in _workers(self.stack)}
            choices = sorted(w for w in held if w in by_id)
            if choices:
                chosen = rng.choice(choices)
                return by_id[chosen], held[chosen]
            if self.ended.is_set():
                return None
            await asyncio.sleep(0.1)
        return None

    async def _shards_done(self, shards: set[int]) -> float | None:
        started = time.monotonic()
        if await _until(lambda: shards <= committed(self.out), RECOVERY_TIMEOUT_S):
            return time.monotonic() - started
        return None

    async def _recorded_done(self, shard: int) -> bool:
        """Whether the master's record of `shard` (in KV, what every master reads) is DONE."""
        if self._shards is None:
            nc = await connect(self.stack.nats_config_for("master"), name="chaos-shards")
            self._shards = (nc, await nc.jetstream().key_value(self.subjects.shards_bucket))
        try:
            entry = await self._shards[1].get(shard_key(self.job, shard))
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return False
        return entry.value is not None and schema.decode(ShardRecord, entry.value).state == "DONE"

    async def close(self) -> None:
        if self._shards is not None:
            with contextlib.suppress(Exception):
                await self._shards[0].close()

    async def done_count(self) -> int:
        """Shards DONE as the master says, -1 while no master answers."""
        try:
            return (await self.probe.job(self.job)).shards.get("DONE", 0)
        except (BusError, RemoteError):
            return -1

    async def next_done(self, before: int, started: float) -> float | None:
        """Seconds from `started` until the master has recorded one more shard DONE."""

        async def progressed() -> bool:
            return self.ended.is_set() or await self.done_count() > before

        await _until(progressed, RECOVERY_TIMEOUT_S, interval_s=0.2)
        if self.ended.is_set() and await self.done_count() <= before:
            return None
        return time.monotonic() - started

    async def inject(self, kind: str, rng: random.Random) -> tuple[float | None, str]:
        """Inject one fault; (recovery seconds or None, a note)."""
        if kind in ("worker_kill", "stage_kill", "worker_stop"):
            found = await self._victim(rng)
            if found is None:
                return None, "no worker held a lease"
            worker, shards = found
            if kind == "worker_kill":
                worker.send_signal(signal.SIGKILL)
                note = f"pid {worker.pid}, shards {sorted(shards)}"
            elif kind == "stage_kill":
                stages = _stages(worker)
                if not stages:
                    return None, "no stage process"
                victim = rng.choice(stages)
                victim.send_signal(signal.SIGKILL)
                note = f"stage pid {victim.pid} of worker {worker.pid}"
            else:
                worker.send_signal(signal.SIGSTOP)
                stopped = LEASE_S + 2.0
                await asyncio.sleep(stopped)
                with contextlib.suppress(psutil.NoSuchProcess):
                    worker.send_signal(signal.SIGCONT)
                note = f"pid {worker.pid} stopped {stopped:.0f}s, shards {sorted(shards)}"
            return await self._shards_done(shards), note
        before = await self.done_count()
        if kind == "master_kill":
            leader = await _leader(self.stack)
            self.stack.held.add(leader)
            try:
                await self.stack.kill(leader)
                started = time.monotonic()
                recovery = await self.next_done(before, started)
            finally:
                await self.stack.restart(leader)
                self.stack.held.discard(leader)
            return recovery, f"killed {leader}"
        if kind == "nats_restart":
            outage = rng.uniform(1.0, 4.0)
            self.stack.held.add("nats")
            try:
                await asyncio.to_thread(self.stack.nats.kill)
                await asyncio.sleep(outage)
                await asyncio.to_thread(self.stack.nats.start)
            finally:
                self.stack.held.discard("nats")
            return await self.next_done(before, time.monotonic()), f"down {outage:.1f}s"
        if kind == "input_vanish":
            # The file's shards fail to read, are quarantined, and the job fails on them:
            # the failure this fault is for. The file comes back once the job has ended.
            target = self.folder / "data" / VANISHING
            aside = self.folder / f"{VANISHING}.aside"
            target.rename(aside)
            try:
                await _until(self.ended.is_set, 30.0)
            finally:
                aside.rename(target)
            if not self.ended.is_set():
                return None, "no shard of the file was left to fail"
            return None, "the job failed on it"  # the run resumes it, and times that
        if kind in ("commit_kill", "master_commit_kill"):
            point = (
                failpoints.WORKER_AFTER_COMMIT_RECORD
                if kind == "commit_kill"
                else failpoints.MASTER_AFTER_RECORDING_DONE
            )
            if kind == "master_commit_kill":
                # Until we know which master dies, none is restarted by the supervisor: the
                # one that dies is restarted here, once the job has recovered without it.
                self.stack.held.update(self.stack.masters)
            failpoints.arm(self.failpoints, point)
            # The DONE count just before the kill: the master's own, for master_commit_kill
            # (the shard it recorded at the failpoint is in what the next master counts).
            last = before
            deadline = time.monotonic() + 30
            while (pid := failpoints.fired(self.failpoints, point)) is None:
                if time.monotonic() > deadline or self.ended.is_set():
                    (self.failpoints / point).unlink(missing_ok=True)
                    self.stack.held.difference_update(self.stack.masters)
                    return None, "no commit came by"
                last = max(last, await self.done_count())
                await asyncio.sleep(0.05)
            started = time.monotonic()
            shard = int(failpoints.detail(self.failpoints, point, pid))
            for fired in self.failpoints.glob(f"{point}.fired-*"):
                fired.unlink()  # ready to fire again, later in the run
            before = last
            if kind == "commit_kill":
                # Its record stands, unreported: recovered once the master has it DONE (the
                # lease expires, and the shard's next holder finds the record and reports it).
                recovery = None
                if await _until(lambda: self._recorded_done(shard), RECOVERY_TIMEOUT_S, 0.2):
                    recovery = time.monotonic() - started
                return recovery, f"worker pid {pid}, shard {shard}"
            (name,) = [n for n, p in self.stack.processes.items() if p.pid == pid]
            self.stack.held.difference_update(set(self.stack.masters) - {name})
            try:
                await _until(lambda: self.stack.processes[name].returncode is not None, 10)
                recovery = await self.next_done(before, started)
            finally:
                await self.stack.restart(name)
                self.stack.held.discard(name)
            return recovery, f"{name}, pid {pid}, shard {shard}"
        if kind == "disk_full":
            held = rng.uniform(2.0, 6.0)
            taken = await asyncio.to_thread(self.disk.fill)
            try:
                await _sleep_unless(self.ended, held)
            finally:
                self.disk.empty()
            note = f"{taken / 2**20:.0f} MiB taken for {held:.1f}s"
            return await self.next_done(await self.done_count(), time.monotonic()), note
        if kind == "slow_disk":
            delay, held = rng.uniform(0.05, 0.3), rng.uniform(4.0, 10.0)
            self.disk.slow(delay)
            try:
                await _sleep_unless(self.ended, held)
            finally:
                self.disk.slow(0)
            note = f"{delay * 1000:.0f} ms a write for {held:.1f}s"
            return await self.next_done(await self.done_count(), time.monotonic()), note
        if kind == "stage_hang":
            (self.hang_dir / "hang").write_text("")
            taken = await _until(lambda: not (self.hang_dir / "hang").exists(), 30)
            if not taken:
                (self.hang_dir / "hang").unlink(missing_ok=True)
                return None, "no stage took the hang"
            return await self.next_done(await self.done_count(), time.monotonic()), "one batch hung"
        raise ValueError(f"unknown fault {kind}")


# -- one run ---------------------------------------------------------------------------------


async def run_one(
    seed: int,
    workdir: Path,
    *,
    rows: int,
    rows_per_shard: int,
    faults: int,
    log: Callable[[str], None],
    kinds: tuple[str, ...] = FAULTS,
) -> RunResult:
    rng = random.Random(seed)
    folder = workdir / f"seed-{seed}"
    shutil.rmtree(folder, ignore_errors=True)
    spec = parse_job(write_job(folder, rows=rows, rows_per_shard=rows_per_shard, seed=seed))
    result = RunResult(seed=seed, rows=rows)
    stack = LocalStack(
        StackConfig(
            state_dir=folder / "state",
            data_roots=[str(folder), str(REPO)],
            max_workers=2,
            worker_grace_s=5.0,
            standby_masters=1,
        )
    )
    missing = unavailable()
    disk = OutputDisk.mount(folder, missing)
    (folder / "failpoints").mkdir()
    started = time.monotonic()
    await stack.start()
    supervisor = asyncio.create_task(stack.supervise())
    injector: Injector | None = None
    try:
        async with await EbbClient.connect(stack.nats_config) as client:
            job = await client.submit(spec)
            injector = Injector(stack, client, job, disk, folder)
            waiting = _follow(client, job, injector)
            choices = [k for k in kinds if k != "input_vanish" and k not in missing]
            chosen = [rng.choice(choices) for _ in range(faults)] if choices else []
            # Early, while the file still has shards to do.
            if "input_vanish" in kinds and rng.random() < VANISH_P:
                chosen.insert(0, "input_vanish")
            for kind in chosen:
                await _sleep_unless(injector.ended, rng.uniform(0.5, 4.0))
                if injector.ended.is_set():
                    break
                at = time.monotonic() - started
                recovery, note = await injector.inject(kind, rng)
                if note.startswith("no "):
                    log(f"  seed {seed}: {kind} not injected ({note})")
                    continue
                if kind == "input_vanish":
                    # The job FAILED, as this fault means it to: resume it, and go on.
                    first = await waiting
                    result.first_state, result.first_reason = first.state, first.reason
                    if VANISHING not in first.reason:
                        result.problems.append(f"failed for another reason: {first.reason}")
                    before = await injector.done_count()
                    resumed_at = time.monotonic()
                    await client.resume(job)
                    result.resumed = True
                    injector.ended.clear()
                    waiting = _follow(client, job, injector)
                    recovery = await injector.next_done(before, resumed_at)
                result.injections.append(Injection(kind, at, recovery, note))
                shown = "-" if recovery is None else f"{recovery:.1f}s"
                log(f"  seed {seed}: {kind} at {at:.1f}s ({note}), recovered in {shown}")
            final = await waiting
            if not result.first_state:
                result.first_state, result.first_reason = final.state, final.reason
            if final.state in ("FAILED", "CANCELLED"):
                filled = any(i.kind == "disk_full" for i in result.injections)
                if not (filled and "No space left on device" in final.reason):
                    result.problems.append(f"failed for a reason not injected: {final.reason}")
                result.resumed = True
                await client.resume(job)
                final = await _wait(client, job)
            result.final_state = final.state
            if final.state == "SUCCEEDED":
                _verify(result, final, disk.out, rows)
            else:
                result.problems.append(f"ended {final.state}: {final.reason}")
    finally:
        if injector is not None:
            await injector.close()
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
        await stack.stop()
        if result.problems:  # the evidence outlives the run's disk
            shutil.copytree(disk.out, folder / "out-kept", dirs_exist_ok=True)
        disk.unmount()
    result.seconds = time.monotonic() - started
    return result


def _follow(client: EbbClient, job: str, injector: Injector) -> asyncio.Task[JobStatus]:
    """A task that waits for the job to end, and tells the injector when it has."""
    task = asyncio.create_task(_wait(client, job))
    task.add_done_callback(lambda _: injector.ended.set())
    return task


async def _wait(client: EbbClient, job: str) -> JobStatus:
    """Until the job ends, through master and NATS outages (the client reconnects)."""
    while True:
        try:
            return await client.wait(job, poll_s=0.3)
        except (BusError, RemoteError):
            await asyncio.sleep(0.5)


async def _sleep_unless(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


def _verify(result: RunResult, final: JobStatus, out: Path, rows: int) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    tables = [pq.read_table(out / f["path"]) for f in manifest["files"]]
    table = pa.concat_tables(tables, promote_options="default")
    ids = table.column("id").to_pylist()
    unique = set(ids)
    result.lost = len(set(range(rows)) - unique)
    result.duplicated = len(ids) - len(unique)
    errors = 0
    if "_error" in table.column_names:
        errors = len(table.column("_error").drop_null())
    result.error_rows = errors
    commits = [json.loads(p.read_text()) for p in (out / COMMITS_DIR).glob("*.json")]
    committed_files = {f["path"] for c in commits for f in c["files"]}
    checks = {
        "rows_done == manifest rows == rows read": final.rows_done
        == manifest["rows"]
        == table.num_rows,
        "error_rows == manifest == _error column": final.error_rows
        == manifest["error_rows"]
        == errors,
        "manifest files == committed files": {f["path"] for f in manifest["files"]}
        == committed_files,
        "per-file rows agree": all(
            pq.ParquetFile(out / f["path"]).metadata.num_rows == f["rows"]
            for f in manifest["files"]
        ),
    }
    result.counters_agree = all(checks.values())
    result.problems += [name for name, ok in checks.items() if not ok]
    if result.lost:
        result.problems.append(f"{result.lost} ids lost")
    if result.duplicated:
        result.problems.append(f"{result.duplicated} ids duplicated")


# -- the campaign ----------------------------------------------------------------------------


async def campaign(
    seeds: list[int],
    workdir: Path,
    *,
    rows: int,
    rows_per_shard: int,
    faults: int,
    log: Callable[[str], None],
    on_result: Callable[[list[RunResult]], None] | None = None,
    kinds: tuple[str, ...] = FAULTS,
) -> list[RunResult]:
    """Run each seed in turn; `on_result` sees the results so far after each run."""
    results = []
    for seed in seeds:
        # The masters read their leader TTL, and every process its failpoints, from the
        # environment the stack hands down.
        settings = {
            envvars.LEADER_TTL_S: str(LEADER_TTL_S),
            envvars.FAILPOINT_DIR: str(workdir / f"seed-{seed}" / "failpoints"),
        }
        saved = {name: os.environ.get(name) for name in settings}
        os.environ.update(settings)
        try:
            result = await run_one(
                seed,
                workdir,
                rows=rows,
                rows_per_shard=rows_per_shard,
                faults=faults,
                log=log,
                kinds=kinds,
            )
        except Exception as e:  # the campaign's own fault: recorded, and the next seed runs
            log(traceback.format_exc())
            result = RunResult(seed=seed, rows=rows, problems=[f"the campaign failed: {e!r}"])
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        log(
            f"seed {seed}: {result.first_state}"
            + (f" -> resumed -> {result.final_state}" if result.resumed else "")
            + f" in {result.seconds:.0f}s; lost {result.lost}, duplicated {result.duplicated}"
            + (f"; PROBLEMS: {result.problems}" if result.problems else "")
        )
        results.append(result)
        if on_result is not None:
            on_result(results)
        if result.ok:
            shutil.rmtree(workdir / f"seed-{seed}", ignore_errors=True)
    return results


def report(
    results: list[RunResult], *, command: str, machine: str, planned: int | None = None
) -> str:
    runs = f"{len(results)} runs" + (f" of {planned} planned" if planned else "")
    lines = [
        "# Reliability: the chaos campaign",
        "",
        "Produced by `bench/chaos.py` (its docstring says what each fault is and how recovery is",
        "timed). Each run: the embedded stack as separate processes (nats-server, two shard",
        "masters, the controller, two workers with three stage processes each), one job of",
        f"{results[0].rows:,} rows, faults injected one after another at random moments; then",
        "every input id is checked to be in the output exactly once and the counters to agree",
        "with the files.",
        "",
        f"Command: `{command}` ({runs})  ",
        f"Machine: {machine}",
        "",
        "## Totals",
        "",
    ]
    failed_first = [r for r in results if r.first_state != "SUCCEEDED"]
    lines += [
        "| runs | succeeded at once | failed, then finished by resume | ended badly "
        "| rows lost | rows duplicated | counters disagree |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(results)} | {len(results) - len(failed_first)} "
        f"| {sum(1 for r in failed_first if r.final_state == 'SUCCEEDED')} "
        f"| {sum(1 for r in results if r.final_state != 'SUCCEEDED')} "
        f"| {sum(r.lost for r in results)} | {sum(r.duplicated for r in results)} "
        f"| {sum(1 for r in results if r.final_state == 'SUCCEEDED' and not r.counters_agree)} |",
        "",
        "## Per fault",
        "",
        "| fault | injected | recovered | recovery median | recovery max |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in FAULTS:
        done = [i for r in results for i in r.injections if i.kind == kind]
        times = [i.recovery_s for i in done if i.recovery_s is not None]
        median = f"{statistics.median(times):.1f} s" if times else "-"
        worst = f"{max(times):.1f} s" if times else "-"
        lines.append(f"| {kind} | {len(done)} | {len(times)} | {median} | {worst} |")
    lines += [
        "",
        "An injection counts as recovered when the work it hit was committed again (for the",
        "master, NATS, a hung stage and a resume: when the master recorded one more shard DONE",
        f"after it) within {RECOVERY_TIMEOUT_S:.0f} s; one not recovered is one the job",
        "finished before, or one that still waited when the timeout came.",
        "",
        "commit_kill and master_commit_kill are aimed (ebb.common.failpoints) at the two",
        "narrowest windows of exactly-once: a worker's commit record written but the master not",
        "told, and a shard recorded DONE but the worker not answered.",
        *(
            f"Not injected on this machine: {kind} ({why})."
            for kind, why in sorted(unavailable().items())
        ),
        "The 10,000,000-row soak is below (`python -m bench.soak`).",
        "",
        "## Runs",
        "",
        "| seed | first end | final | seconds | faults (recovery s) | problems |",
        "|---:|---|---|---:|---|---|",
    ]
    for r in results:
        faults = ", ".join(
            f"{i.kind} ({'-' if i.recovery_s is None else f'{i.recovery_s:.1f}'})"
            for i in r.injections
        )
        first = r.first_state + (f": {r.first_reason[:80]}" if r.first_reason else "")
        lines.append(
            f"| {r.seed} | {first} | {r.final_state} | {r.seconds:.0f} | {faults} "
            f"| {'; '.join(r.problems) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    p.add_argument("--seeds", type=int, default=20, help="run seeds 0..N-1")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--rows", type=int, default=30_000)
    p.add_argument("--rows-per-shard", type=int, default=1_000)
    p.add_argument("--faults", type=int, default=3, help="faults injected per run")
    p.add_argument(
        "--kinds",
        default=",".join(FAULTS),
        help="the faults to choose from, comma-separated (default: all)",
    )
    p.add_argument("--out", default=str(REPO / "docs" / "reliability.md"))
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    from .common import machine

    # SIGTERM as Ctrl-C: the run in progress stops its stack on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if unknown := sorted(set(kinds) - set(FAULTS)):
        p.error(f"unknown faults {unknown}; there are {', '.join(FAULTS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ebb-chaos-"))
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    command = "python -m bench.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    host = machine()

    def write(results: list[RunResult]) -> None:
        # After every run: a campaign cut short still leaves its report.
        text = report(results, command=command.strip(), machine=host, planned=len(seeds))
        out = Path(args.out)
        kept = soak.soak_block(out.read_text()) if out.exists() else None
        out.write_text(soak.with_soak(text, kept) if kept else text)

    results = asyncio.run(
        campaign(
            seeds,
            workdir,
            rows=args.rows,
            rows_per_shard=args.rows_per_shard,
            faults=args.faults,
            log=lambda line: print(line, flush=True),
            on_result=write,
            kinds=kinds,
        )
    )
    print(f"report written to {args.out}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
