"""The chaos campaign: seeded runs of a real job on the local stack, hurt at random times.

python -m bench.chaos --seeds 20             runs seeds 0..19, writes docs/reliability.md
python -m bench.chaos --seeds 3 --rows 6000 --out /tmp/reliability.md
python -m bench.chaos --seeds 2 --kinds churn,flaky_node,worker_storm --out /tmp/r.md

Each run starts the embedded stack as `ebb run` does (nats-server, two shard masters, the
controller and its workers, every one its own process), submits a job over a fresh dataset,
and injects faults one after another at random moments (the seed decides which, and when).
The job runs at the default fault settings (lease_s, max_attempts), as a user's would, unless
--lease-s or --max-attempts say otherwise: a setting that forgave more than the default would
hide a healthy shard quarantined by faults not its own.

- worker_kill   SIGKILL of a worker process that holds a lease
- stage_kill    SIGKILL of one stage process of such a worker
- worker_stop   SIGSTOP of such a worker for 5 s past the job's lease, then SIGCONT: a zombie,
                to be fenced. Nobody sees a stopped worker end, so its shards wait for their
                leases to run out (or for speculation, at the job's tail): the one fault that
                waits out a lease. The stop ends early if the job ends first.
- master_kill   SIGKILL of the leading shard master: the standby takes over
- nats_restart  SIGKILL of nats-server, down 1-4 s, then started again on the same store
- stage_hang    a stage process hangs in a batch: the batch timeout kills and restarts it
- input_vanish  an input file disappears (moved aside) until the job has FAILED on it (its
                shards quarantined), then comes back: the job is resumed (`resume`). The one
                fault that is the job's own: every other must not fail the job.
- commit_kill   SIGKILL of a worker exactly between writing a shard's commit record and
                telling the master (a failpoint, ebb.common.failpoints)
- master_commit_kill  SIGKILL of the leading master exactly between recording a shard DONE
                and replying to the worker (a failpoint); the standby takes over
- disk_full     the output disk (a tmpfs of its own) filled to the last byte for 2-6 s
- slow_disk     every write to the output disk (a FUSE passthrough, bench/slowfs.py) takes
                50-300 ms for 4-10 s
- churn         a random worker of the job SIGKILLed about every second for 5-15 s (spot
                capacity coming and going); the controller relaunches each
- flaky_node    the next worker to start its pipeline fails its setup, once (a node whose
                device would not open: bench/chaos_modelets.py). A worker holding a lease is
                SIGKILLed so that one starts.
- worker_storm  every worker of the job SIGKILLed at once, two or three times 2-5 s apart (a
                node pool lost)
- drain         SIGTERM of a worker holding a lease with rows done (a node drained, a spot
                notice): with the stack's short grace it commits the rows it has done as a part
                of the shard, and the rest is a shard of its own
- split_kill    a drain of a worker of the first stage, that stage slowed meanwhile so that
                its shards cannot finish within the drain's wait, with the leading master
                SIGKILLed exactly between writing the part's DONE and creating its rest's
                record (a failpoint); the standby creates the rest
- successor_kill  SIGKILL of the leading master exactly between a DONE that names a new shard
                (a hand-off to the next tier, a split's rest) and that shard's record
- kv_answer_lost  the leading master's next write of a DONE lands in KV and its answer is lost
                (a failpoint): the master steps down, loads KV again and leads on

Each run's job is of one of two shapes, by the seed: one tier, or two (the features in a tier
`cpu`, the model and the top class in a tier `infer`, each with a worker), and computes metrics
(a count on the first stage; a count, a mean and a histogram on the last). With --llm it also
generates text: an `llm` stage on a branch from the input (a tiny model built for the run,
4 to 16 tokens a row) whose tokens are a metric, so that a worker or stage process killed
mid-generation is checked as any other (in one tier: the branch reads the input's prompts).

disk_full needs root (to mount the tmpfs), slow_disk /dev/fuse, libfuse 2 and fusepy; a run
without them does not choose those faults, and the report says so.

After each fault the campaign waits for the job to recover before the next. Recovery time:
for a fault aimed at workers, until every shard those workers held is committed (by anyone),
from the kill (worker_stop: from the stop; churn and worker_storm: from the last kill; if they
held no shard, until one more shard is DONE); for flaky_node, from the failed setup until one
more shard is DONE and the shards of the worker it killed are committed; for input_vanish,
from the `resume` request until one more shard is DONE; for the others, from the kill (the
restart, for NATS; the hang, for a stage; the disk's return to free space or full speed) until
the master has recorded one more shard DONE. The wait lasts at most the job's lease plus
RECOVERY_MARGIN_S.

When the job ends: a FAILED job is resumed (`resume`) and followed to its end; unless it failed
on the input that vanished, it failed by a fault not its own, and the run says so. Then every
input id must be in the output exactly once (as a result, or as an error row), the job's
counters must agree with the manifest and the files, the manifest must list exactly the
committed files, and the job's metrics (`_metrics.json` and its status) must equal the same
metrics computed again from the output files' rows without error. Once the stack has stopped,
no process of the run (each carries the run's failpoint folder in its environment) may be left.
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
import pyarrow.compute as pc
import pyarrow.parquet as pq
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from ebb.client.demo import feature_table, mlp_onnx
from ebb.client.sdk import EbbClient
from ebb.client.stack import LocalStack, StackConfig
from ebb.common import envvars, failpoints, schema
from ebb.common.data.layout import COMMITS_DIR, MANIFEST, TIERS_DIR
from ebb.common.data.layout import METRICS as METRICS_FILE
from ebb.common.errors import BusError, RemoteError
from ebb.common.job import FaultPolicy, accumulators, parse_job
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.bus import Backoff, connect
from ebb.common.messaging.messages import JobStatus
from ebb.common.messaging.subjects import Subjects
from ebb.shard_master.table.records import ShardRecord, shard_key

from . import docblock, lost_worker, slowfs, soak
from .chaos_modelets import FLAKY_MARKER, TAKEN_PREFIX, arm_flaky, taken_by
from .modelets import SLOW_MARKER

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
    "churn",
    "flaky_node",
    "worker_storm",
    "drain",
    "split_kill",
    "successor_kill",
    "kv_answer_lost",
)
VANISH_P = 0.3
"""The share of runs that begin with input_vanish (a job that fails, to be resumed)."""
VANISHING = "part-1.parquet"
"""The input file input_vanish takes away (the second half of the rows: shards not done yet)."""
LEADER_TTL_S = 3.0
BATCH_TIMEOUT_S = 4.0
RECOVERY_MARGIN_S = 60.0
"""How long past the job's lease the campaign waits for a fault's recovery: a worker that nobody
sees end (stopped) gives its shards back when its lease runs out."""
STOP_PAST_LEASE_S = 5.0
"""worker_stop stops a worker this long past the job's lease."""
CHURN_S = (5.0, 15.0)
"""How long churn lasts (a kill about every second)."""
STORM_WAVES = (2, 3)
STORM_GAP_S = (2.0, 5.0)
FLAKY_TIMEOUT_S = 60.0
"""How long flaky_node waits for a new worker to start its pipeline (and fail)."""
DISK_MB = 256
"""The output disk's size: the output of a run is a few MB; the rest is what disk_full fills."""
BALLAST = ".ballast"
TIERED_P = 0.5
"""The share of runs whose job is in two tiers."""
FIRST_TIER = "cpu"
"""The tier of the first stage (the features) in a job of two tiers."""
LEFT_BEHIND_WAIT_S = 15.0
"""How long a process of a stopped stack may take to end before it counts as left behind."""


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
    foreign_failure: str = ""
    """Why the job failed by a fault not its own (anything but the input that vanished)."""
    lease_s: float = 0.0
    """The job's lease."""
    max_attempts: int = 0
    """The job's max_attempts."""
    tiered: bool = False
    """The job ran in two tiers."""
    lost: int = 0
    duplicated: int = 0
    error_rows: int = 0
    counters_agree: bool = False
    metrics_agree: bool = False
    """The job's metrics equal those computed again from its output."""
    left_behind: int = 0
    """Processes of the run still alive once its stack had stopped (killed then)."""
    problems: list[str] = field(default_factory=list)
    injections: list[Injection] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.final_state == "SUCCEEDED" and not self.problems

    @property
    def failed_by_another(self) -> bool:
        """The job failed by a fault not its own."""
        return bool(self.foreign_failure)


# -- the job ---------------------------------------------------------------------------------


def write_job(
    folder: Path,
    *,
    rows: int,
    rows_per_shard: int,
    seed: int,
    lease_s: float | None = None,
    max_attempts: int | None = None,
    tiered: bool = False,
    generating: bool = False,
) -> dict[str, Any]:
    """A dataset (two Parquet files), an ONNX MLP, and the job over them, at the default
    fault settings but for those given (None: the default); in two tiers if `tiered`; with
    an `llm` stage beside the others if `generating` (a branch from the input: text from each
    row's prompt by a tiny model built here, its tokens a metric)."""
    data = folder / "data"
    data.mkdir(parents=True)
    half = rows // 2
    for i, (start, n) in enumerate(((0, half), (half, rows - half))):
        table = feature_table(n, features=8, seed=seed + i, start_id=start)
        if generating:
            table = _with_prompts(table, seed=seed + i)
        pq.write_table(table, data / f"part-{i}.parquet", row_group_size=rows_per_shard)
    model = mlp_onnx(folder / "model.onnx", inputs=8, hidden=16, outputs=4, seed=3)
    (folder / "hang").mkdir()
    (folder / "flaky").mkdir()
    fault: dict[str, Any] = {"batch_timeout_s": BATCH_TIMEOUT_S}
    if lease_s is not None:
        fault["lease_s"] = lease_s
    if max_attempts is not None:
        fault["max_attempts"] = max_attempts
    job: dict[str, Any] = {
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
                    "metrics": {"rows_prep": {"kind": "count"}},
                },
                {"name": "model", "model": str(model), "threads": 1, "batch_size": 256},
                {
                    "name": "top",
                    # TopClass, whose setup fails once when flaky_node arms the folder.
                    "modelet": "bench.chaos_modelets:FlakyTopClass",
                    "params": {"flaky_dir": str(folder / "flaky")},
                    "batch_size": 256,
                    "metrics": METRICS,
                },
            ],
        },
        "output": {"uri": str(folder / "out"), "carryover": ["id"]},
        "resources": {"min_workers": 2, "max_workers": 2},
        "fault": fault,
    }
    if generating:
        from tests.llm_model import build_tiny_llm

        job["input"]["columns"] += ["prompt", "budget"]
        job["pipeline"]["stages"].append(
            {
                "name": "gen",
                "after": [],
                "llm": {
                    "model": str(build_tiny_llm(folder / "llm")),
                    "per_row": {"max_tokens": "budget"},
                    "max_in_flight": 8,
                },
                "batch_size": 64,
                "metrics": {"output_tokens": {"kind": "sum", "column": "output_tokens"}},
            }
        )
    if tiered:
        each = {"min_workers": 1, "max_workers": 1}
        job["tiers"] = [
            {"name": FIRST_TIER, "stages": ["prep"], "resources": each},
            {"name": "infer", "stages": ["model", "top"], "resources": each},
        ]
    return job


def _with_prompts(table: pa.Table, *, seed: int) -> pa.Table:
    """The table with a prompt per row and the tokens it may generate (4 to 16)."""
    from tests.llm_model import corpus

    n = table.num_rows
    rng = random.Random(seed)
    table = table.append_column("prompt", pa.array(corpus(n, seed=seed), pa.string()))
    return table.append_column("budget", pa.array([rng.randint(4, 16) for _ in range(n)]))


METRICS: dict[str, Any] = {
    "rows": {"kind": "count"},
    "mean_score": {"kind": "mean", "column": "score"},
    "score_hist": {"kind": "histogram", "column": "score", "range": [0, 1], "bins": 10},
}
"""The last stage's metrics (the first stage counts its rows as `rows_prep`)."""


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


def _worker_option(p: psutil.Process, option: str) -> str:
    """The value of a worker's command-line `option`, "" without it (or a process gone)."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return ""
    return cmd[cmd.index(option) + 1] if option in cmd else ""


def _worker_id(p: psutil.Process) -> str:
    return _worker_option(p, "--id")


def _worker_tier(p: psutil.Process) -> str:
    """The tier a worker serves, "" for a job without tiers."""
    return _worker_option(p, "--tier")


def _stages(worker: psutil.Process) -> list[psutil.Process]:
    try:
        kids = worker.children()
    except psutil.NoSuchProcess:
        return []
    return [k for k in kids if not _cmdline_has(k, "from multiprocessing.resource_tracker")]


def committed(out: Path) -> set[int]:
    """The shards with a commit record in the output, or in a tier's folder under `_tiers`
    (shard indexes are the job's, across its tiers)."""
    folders = [out / COMMITS_DIR, *sorted((out / TIERS_DIR).glob(f"*/{COMMITS_DIR}"))]
    return {
        int(p.stem.split("=")[1])
        for folder in folders
        if folder.exists()
        for p in folder.glob("shard=*.json")
    }


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
        *,
        lease_s: float,
    ) -> None:
        self.stack = stack
        self.client = client
        self.job = job
        self.disk = disk
        self.out = disk.out
        self.folder = folder
        self.hang_dir = folder / "hang"
        self.flaky_dir = folder / "flaky"
        self.lease_s = lease_s
        self.recovery_timeout_s = lease_s + RECOVERY_MARGIN_S
        self.failpoints = folder / "failpoints"
        self.subjects = Subjects(stack.config.prefix)
        self._shards: tuple[NATS, KeyValue] | None = None
        self._committed: set[int] = set()
        self.ended = asyncio.Event()
        self.probe = MasterClient(client.nc, client.config, backoff=Backoff(attempts=1))

    async def _drain_first_tier(self, rng: random.Random) -> psutil.Process | None:
        """SIGTERM to a worker of the first stage's tier holding a lease (the stage a
        split_kill slows); the worker, or None if none held one."""
        found = await self._victim(rng, tiers=("", FIRST_TIER))
        if found is None:
            return None
        with contextlib.suppress(psutil.NoSuchProcess):
            found[0].send_signal(signal.SIGTERM)
        return found[0]

    async def _victim(
        self, rng: random.Random, *, tiers: tuple[str, ...] | None = None
    ) -> tuple[psutil.Process, set[int]] | None:
        """A worker holding a lease (of one of `tiers`, "" for a job without tiers, if
        given), and the shards it holds."""
        for _ in range(100):
            held = await _leases(self.client, self.job)
            by_id = {
                _worker_id(p): p
                for p in _workers(self.stack)
                if tiers is None or _worker_tier(p) in tiers
            }
            choices = sorted(w for w in held if w in by_id)
            if choices:
                chosen = rng.choice(choices)
                return by_id[chosen], held[chosen]
            if self.ended.is_set():
                return None
            await asyncio.sleep(0.1)
        return None

    async def _shards_done(self, shards: set[int], since: float) -> float | None:
        """Seconds from `since` (monotonic) until every one of `shards` is committed; None if
        the job ends without them, or the wait times out."""

        def done() -> bool:
            return shards <= self.committed() or self.ended.is_set()

        await _until(done, self.recovery_timeout_s - (time.monotonic() - since))
        if shards <= self.committed():
            return time.monotonic() - since
        return None

    def committed(self) -> set[int]:
        """Every shard seen committed so far: a tier's commit records go with the job's
        success, and a shard committed then is committed all the same."""
        self._committed |= committed(self.out)
        return self._committed

    async def _lost_done(self, shards: set[int], since: float) -> float | None:
        """As `_shards_done`; for workers that held no shard, until one more is DONE."""
        if shards:
            return await self._shards_done(shards, since)
        return await self.next_done(await self.done_count(), since)

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

        await _until(progressed, self.recovery_timeout_s, interval_s=0.2)
        if self.ended.is_set() and await self.done_count() <= before:
            return None
        return time.monotonic() - started

    async def _stop(self, worker: psutil.Process, shards: set[int]) -> tuple[float | None, str]:
        """SIGSTOP past the lease, then SIGCONT: timed from the stop, as the shards can be
        committed by others while it lasts (once the lease ran out, or by speculation)."""
        worker.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        recovery = asyncio.create_task(self._shards_done(shards, stopped))
        try:
            try:
                await _sleep_unless(self.ended, self.lease_s + STOP_PAST_LEASE_S)
            finally:
                with contextlib.suppress(psutil.NoSuchProcess):
                    worker.send_signal(signal.SIGCONT)
            seconds = time.monotonic() - stopped
            ended = " (the job ended first)" if self.ended.is_set() else ""
            note = f"pid {worker.pid} stopped {seconds:.0f}s{ended}, shards {sorted(shards)}"
            return await recovery, note
        finally:
            if not recovery.done():
                recovery.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await recovery

    async def _kill_workers(self, victims: list[psutil.Process]) -> set[int]:
        """SIGKILL `victims` (workers of the job); the shards they held."""
        held = await _leases(self.client, self.job)
        shards: set[int] = set()
        for victim in victims:
            shards |= held.get(_worker_id(victim), set())
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.send_signal(signal.SIGKILL)
        return shards

    async def _churn(self, rng: random.Random) -> tuple[float | None, str]:
        """A random worker SIGKILLed about every second for a while. `rng` is the fault's own:
        how many kills fit in depends on timing, and the seed's later choices must not."""
        lasts = rng.uniform(*CHURN_S)
        loop = asyncio.get_running_loop()
        end = loop.time() + lasts
        shards: set[int] = set()
        kills = 0
        last = time.monotonic()
        while loop.time() < end and not self.ended.is_set():
            workers = sorted(_workers(self.stack), key=lambda p: p.pid)
            if workers:
                shards |= await self._kill_workers([rng.choice(workers)])
                last = time.monotonic()
                kills += 1
            await _sleep_unless(self.ended, rng.uniform(0.7, 1.3))
        if not kills:
            return None, "no worker to kill"
        note = f"{kills} kills over {lasts:.0f}s, shards {sorted(shards)}"
        return await self._lost_done(shards, last), note

    async def _storm(self, rng: random.Random) -> tuple[float | None, str]:
        """Every worker of the job SIGKILLed at once, a few times a few seconds apart."""
        waves = rng.randint(*STORM_WAVES)
        gaps = [rng.uniform(*STORM_GAP_S) for _ in range(waves - 1)]
        shards: set[int] = set()
        killed: list[int] = []
        last = time.monotonic()
        for n in range(waves):
            if self.ended.is_set():
                break
            workers = _workers(self.stack)
            shards |= await self._kill_workers(workers)
            last = time.monotonic()
            killed.append(len(workers))
            if n < len(gaps):
                await _sleep_unless(self.ended, gaps[n])
        if not any(killed):
            return None, "no worker to kill"
        note = f"waves of {'+'.join(map(str, killed))} workers, shards {sorted(shards)}"
        return await self._lost_done(shards, last), note

    async def _flaky(self, rng: random.Random) -> tuple[float | None, str]:
        """Arm a failed setup for the next worker to start its pipeline, and make one start
        (a worker holding a lease is SIGKILLed: the controller relaunches it)."""
        found = await self._victim(rng)
        if found is None:
            return None, "no worker held a lease"
        worker, shards = found
        arm_flaky(self.flaky_dir, spared=[p.pid for p in _workers(self.stack)])
        worker.send_signal(signal.SIGKILL)
        if not await _until(
            lambda: self.ended.is_set() or taken_by(self.flaky_dir) is not None, FLAKY_TIMEOUT_S
        ):
            (self.flaky_dir / FLAKY_MARKER).unlink(missing_ok=True)
            # Recorded (a worker was killed), not recovered.
            return None, f"killed pid {worker.pid}; none started in {FLAKY_TIMEOUT_S:.0f}s"
        failed = time.monotonic()
        before = await self.done_count()
        taker = taken_by(self.flaky_dir)
        if taker is None:  # the job ended first
            (self.flaky_dir / FLAKY_MARKER).unlink(missing_ok=True)
            return None, f"killed pid {worker.pid}; the job ended before a worker started"
        for path in self.flaky_dir.glob(f"{TAKEN_PREFIX}*"):
            path.unlink()  # ready to fire again, later in the run
        note = f"killed pid {worker.pid} (shards {sorted(shards)}); stage pid {taker} failed"
        # One more shard DONE after the failure, and the killed worker's shards committed:
        # the first alone would count a job that the failure is about to fail as recovered.
        if await self.next_done(before, failed) is None:
            return None, note
        return await self._shards_done(shards, failed), note

    async def inject(self, kind: str, rng: random.Random) -> tuple[float | None, str]:
        """Inject one fault; (recovery seconds or None, a note)."""
        if kind in ("worker_kill", "stage_kill", "worker_stop"):
            found = await self._victim(rng)
            if found is None:
                return None, "no worker held a lease"
            worker, shards = found
            if kind == "worker_kill":
                worker.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                note = f"pid {worker.pid}, shards {sorted(shards)}"
                return await self._shards_done(shards, killed), note
            if kind == "stage_kill":
                stages = _stages(worker)
                if not stages:
                    return None, "no stage process"
                victim = rng.choice(stages)
                victim.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                note = f"stage pid {victim.pid} of worker {worker.pid}"
                return await self._shards_done(shards, killed), note
            return await self._stop(worker, shards)
        if kind == "churn":
            return await self._churn(random.Random(rng.random()))
        if kind == "worker_storm":
            return await self._storm(rng)
        if kind == "flaky_node":
            return await self._flaky(rng)
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
        if kind == "drain":
            found = await self._victim(rng)
            if found is None:
                return None, "no worker held a lease"
            worker, shards = found
            worker.send_signal(signal.SIGTERM)
            drained = time.monotonic()
            note = f"pid {worker.pid}, shards {sorted(shards)}"
            return await self._shards_done(shards, drained), note
        if kind == "kv_answer_lost":
            point = failpoints.MASTER_KV_ANSWER_LOST
            failpoints.arm(self.failpoints, point, when=" DONE")
            took = await _until(lambda: failpoints.fired(self.failpoints, point), 30, 0.05)
            if not took:
                (self.failpoints / point).unlink(missing_ok=True)
                return None, "no DONE was written"
            started = time.monotonic()
            pid = failpoints.fired(self.failpoints, point)
            assert pid is not None
            what = failpoints.detail(self.failpoints, point, pid)
            for path in self.failpoints.glob(f"{point}.fired-*"):
                path.unlink()
            return await self.next_done(before, started), what
        if kind in ("commit_kill", "master_commit_kill", "split_kill", "successor_kill"):
            point, when = {
                "commit_kill": (failpoints.WORKER_AFTER_COMMIT_RECORD, ""),
                "master_commit_kill": (failpoints.MASTER_AFTER_RECORDING_DONE, ""),
                "split_kill": (failpoints.MASTER_BEFORE_SUCCESSOR, "split"),
                "successor_kill": (failpoints.MASTER_BEFORE_SUCCESSOR, ""),
            }[kind]
            if kind != "commit_kill":
                # Until we know which master dies, none is restarted by the supervisor: the
                # one that dies is restarted here, once the job has recovered without it.
                self.stack.held.update(self.stack.masters)
            failpoints.arm(self.failpoints, point, when=when)
            slow = self.hang_dir / SLOW_MARKER
            draining: psutil.Process | None = None
            if kind == "split_kill":
                # A drain, whose part the master dies recording. The first stage is slowed
                # while it runs: a shard that finished within the drain's wait (a fast
                # machine's, a few hundred rows) would leave no part, and nothing to hurt.
                slow.write_text("")
                draining = await self._drain_first_tier(rng)
                if draining is None:
                    slow.unlink(missing_ok=True)
                    (self.failpoints / point).unlink(missing_ok=True)
                    self.stack.held.difference_update(self.stack.masters)
                    return None, "no worker held a lease"
            # The DONE count just before the kill: the master's own, for master_commit_kill
            # (the shard it recorded at the failpoint is in what the next master counts).
            last = before
            deadline = time.monotonic() + 30
            while (pid := failpoints.fired(self.failpoints, point)) is None:
                if time.monotonic() > deadline or self.ended.is_set():
                    slow.unlink(missing_ok=True)
                    (self.failpoints / point).unlink(missing_ok=True)
                    self.stack.held.difference_update(self.stack.masters)
                    return None, f"no {'commit' if 'commit' in kind else 'successor'} came by"
                if draining is not None and not draining.is_running():
                    # Gone with no part (what it held had finished, or had not started):
                    # the next worker of the tier is drained in its turn.
                    draining = await self._drain_first_tier(rng)
                last = max(last, await self.done_count())
                await asyncio.sleep(0.05)
            slow.unlink(missing_ok=True)
            started = time.monotonic()
            shard = int(failpoints.detail(self.failpoints, point, pid).split()[0])
            for fired in self.failpoints.glob(f"{point}.fired-*"):
                fired.unlink()  # ready to fire again, later in the run
            before = last
            if kind == "commit_kill":
                # Its record stands, unreported: recovered once the master has it DONE (the
                # lease ends, as the controller tells the master the worker died or as it
                # expires, and the shard's next holder finds the record and reports it).
                recovery = None
                if await _until(lambda: self._recorded_done(shard), self.recovery_timeout_s, 0.2):
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
    lease_s: float | None = None,
    max_attempts: int | None = None,
    generating: bool = False,
) -> RunResult:
    rng = random.Random(seed)
    # Its own draw, so that a seed's faults are those it chose before there were shapes.
    tiered = random.Random(f"shape-{seed}").random() < TIERED_P and not generating
    folder = workdir / f"seed-{seed}"
    shutil.rmtree(folder, ignore_errors=True)
    spec = parse_job(
        write_job(
            folder,
            rows=rows,
            rows_per_shard=rows_per_shard,
            seed=seed,
            lease_s=lease_s,
            max_attempts=max_attempts,
            tiered=tiered,
            generating=generating,
        )
    )
    result = RunResult(
        seed=seed,
        rows=rows,
        lease_s=spec.fault.lease_s,
        max_attempts=spec.fault.max_attempts,
        tiered=tiered,
    )
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
            injector = Injector(stack, client, job, disk, folder, lease_s=spec.fault.lease_s)
            waiting = _follow(client, job, injector)
            # Without tiers, a successor is only ever a split's rest: split_kill aims at it.
            skip = {"input_vanish", *missing, *(() if tiered else ("successor_kill",))}
            choices = [k for k in kinds if k not in skip]
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
                        result.foreign_failure = first.reason
                        result.problems.append(f"failed by a fault not its own: {first.reason}")
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
                # Only the input that vanished is the job's own fault, and it was resumed.
                result.foreign_failure = result.foreign_failure or final.reason
                result.problems.append(f"failed by a fault not its own: {final.reason}")
                result.resumed = True
                await client.resume(job)
                final = await _wait(client, job)
            result.final_state = final.state
            if final.state == "SUCCEEDED":
                _verify(result, final, disk.out, rows)
                _verify_metrics(result, final, disk.out, spec.pipeline.all_metrics())
            else:
                result.problems.append(f"ended {final.state}: {final.reason}")
    finally:
        if injector is not None:
            await injector.close()
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
        await stack.stop()
        result.left_behind = await _left_behind(folder / "failpoints")
        if result.left_behind:
            result.problems.append(f"{result.left_behind} processes left behind")
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


def _verify_metrics(
    result: RunResult, final: JobStatus, out: Path, specs: dict[str, accumulators.MetricSpec]
) -> None:
    """The job's metrics, as written beside its manifest and as its status says them, against
    the same metrics computed again from the output's rows without error: each row's
    contribution once, none lost, none from a row that is not in the output."""
    manifest = json.loads((out / MANIFEST).read_text())
    table = pa.concat_tables(
        [pq.read_table(out / f["path"]) for f in manifest["files"]], promote_options="default"
    )
    if "_error" in table.column_names:
        table = table.filter(pc.is_null(table.column("_error")))
    read = ("score", "id", "output_tokens")
    columns = {n: table.column(n).to_numpy() for n in read if n in table.column_names}
    values = accumulators.row_values_named(specs, columns)
    expected = accumulators.results_named(specs, accumulators.reduce_named(specs, values))
    written = json.loads((out / METRICS_FILE).read_text())["metrics"]
    result.metrics_agree = written == expected == final.metrics
    if not result.metrics_agree:
        wrong = sorted(n for n in expected if written.get(n) != expected[n])
        result.problems.append(f"metrics differ from the output's: {wrong or 'status'}")


def _run_processes(failpoints_dir: Path) -> list[psutil.Process]:
    """The processes of one run, wherever they are in the process tree: every one inherits
    the run's failpoint folder in its environment (nats-server, masters, controller, workers,
    stage processes)."""
    found = []
    wanted = str(failpoints_dir)
    for p in psutil.process_iter():
        try:
            if p.environ().get(envvars.FAILPOINT_DIR) == wanted:
                found.append(p)
        except psutil.Error:
            continue
    return found


async def _left_behind(failpoints_dir: Path) -> int:
    """How many processes of the run are still alive after its stack stopped (given
    LEFT_BEHIND_WAIT_S to end); they are killed, so that the next run starts clean."""

    def alive() -> list[psutil.Process]:
        out = []
        for p in _run_processes(failpoints_dir):
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    await _until(lambda: not alive(), LEFT_BEHIND_WAIT_S, 0.2)
    left = alive()
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return len(left)


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
    lease_s: float | None = None,
    max_attempts: int | None = None,
    generating: bool = False,
) -> list[RunResult]:
    """Run each seed in turn; `on_result` sees the results so far after each run. The job's
    lease_s and max_attempts: None, the defaults; `generating`: each job with an llm stage."""
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
                lease_s=lease_s,
                max_attempts=max_attempts,
                generating=generating,
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
            + ("; FAILED BY A FAULT NOT ITS OWN" if result.failed_by_another else "")
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
    # A run the campaign could not start has no settings: the first that has them.
    lease_s = next((r.lease_s for r in results if r.lease_s), FaultPolicy().lease_s)
    max_attempts = next((r.max_attempts for r in results if r.max_attempts), 0)
    max_attempts = max_attempts or FaultPolicy().max_attempts
    defaults = (lease_s, max_attempts) == (FaultPolicy().lease_s, FaultPolicy().max_attempts)
    lines = [
        "# Reliability: the chaos campaign",
        "",
        "Produced by `bench/chaos.py` (its docstring says what each fault is and how recovery is",
        "timed). Each run: the embedded stack as separate processes (nats-server, two shard",
        "masters, the controller, two workers with three stage processes each), one job of",
        f"{results[0].rows:,} rows, in one tier or two (the seed decides: "
        f"{sum(r.tiered for r in results)} of these runs in two), computing metrics, faults",
        "injected one after another at random moments; then every input id is checked to be in",
        "the output exactly once, the counters to agree with the files, the job's metrics to",
        "equal those computed again from the output's rows, and no process of the run to be",
        "left once its stack has stopped. The job runs at "
        + ("the default fault settings" if defaults else "these fault settings")
        + f" (lease_s {lease_s:g}, max_attempts {max_attempts}).",
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
        "| failed by a fault not its own | rows lost | rows duplicated | counters disagree "
        "| metrics disagree | processes left behind |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(results)} | {len(results) - len(failed_first)} "
        f"| {sum(1 for r in failed_first if r.final_state == 'SUCCEEDED')} "
        f"| {sum(1 for r in results if r.final_state != 'SUCCEEDED')} "
        f"| {sum(1 for r in results if r.failed_by_another)} "
        f"| {sum(r.lost for r in results)} | {sum(r.duplicated for r in results)} "
        f"| {sum(1 for r in results if r.final_state == 'SUCCEEDED' and not r.counters_agree)} "
        f"| {sum(1 for r in results if r.final_state == 'SUCCEEDED' and not r.metrics_agree)} "
        f"| {sum(r.left_behind for r in results)} |",
        "",
        "Metrics disagree: runs whose `_metrics.json` (or status) differs from the metrics",
        "computed again from the output's rows without error (a row's contribution lost, or",
        "counted twice, or counted for a row the output does not hold).",
        "",
        "input_vanish is the one fault that is the job's own: it is meant to fail the job, which",
        "is then resumed. A job that failed on anything else failed by a fault not its own.",
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
        "after it; for a flaky node, both) within",
        f"{lease_s + RECOVERY_MARGIN_S:.0f} s (the lease and {RECOVERY_MARGIN_S:.0f} s); one not",
        "recovered is one the job finished before, or one that still waited when the timeout",
        "came. worker_stop is the one fault that waits out a lease (nobody sees a stopped worker",
        "end), and is timed from the stop.",
        "",
        "commit_kill and master_commit_kill are aimed (ebb.common.failpoints) at the two",
        "narrowest windows of exactly-once: a worker's commit record written but the master not",
        "told, and a shard recorded DONE but the worker not answered. split_kill and",
        "successor_kill aim at a DONE written that names a new shard (a split's rest, a",
        "hand-off to the next tier) whose own record is not yet; kv_answer_lost at a DONE that",
        "landed in KV with its answer lost (the master steps down and loads KV again).",
        "successor_kill is chosen only in runs in two tiers (without tiers a split_kill aims at",
        "the same window). A drain's grace is the stack's (1 s a worker): shorter than a shard,",
        "so a drained worker commits a part of its shard and the rest runs as a shard of its own.",
        "In a job in two tiers each tier has one worker: a worker_stop holds its whole tier until",
        "its lease runs out, and flaky_node, which arms the last stage's setup, fires only when",
        "the worker started after it is the last tier's (otherwise the job ends first: shown as",
        "not recovered, nothing having failed).",
        *(
            f"Not injected on this machine: {kind} ({why})."
            for kind, why in sorted(unavailable().items())
        ),
        "The 10,000,000-row soak is below (`python -m bench.soak`).",
        "",
        "## Runs",
        "",
        "| seed | tiers | first end | final | failed by a fault not its own | seconds "
        "| faults (recovery s) | problems |",
        "|---:|---:|---|---|---|---:|---|---|",
    ]
    for r in results:
        faults = ", ".join(
            f"{i.kind} ({'-' if i.recovery_s is None else f'{i.recovery_s:.1f}'})"
            for i in r.injections
        )
        first = r.first_state + (f": {r.first_reason[:80]}" if r.first_reason else "")
        lines.append(
            f"| {r.seed} | {2 if r.tiered else 1} | {first} | {r.final_state} "
            f"| {'yes' if r.failed_by_another else 'no'} "
            f"| {r.seconds:.0f} | {faults} "
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
    p.add_argument(
        "--lease-s", type=float, default=None, help="the job's lease (default: the default)"
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=None,
        help="the job's max_attempts (default: the default)",
    )
    p.add_argument(
        "--llm",
        action="store_true",
        help="each job also generates text (an llm stage on a branch, a tiny model)",
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
        kept = [soak.BLOCK, lost_worker.BLOCK]
        out.write_text(docblock.keep(kept, out.read_text(), text) if out.exists() else text)

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
            lease_s=args.lease_s,
            max_attempts=args.max_attempts,
            generating=args.llm,
        )
    )
    print(f"report written to {args.out}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
