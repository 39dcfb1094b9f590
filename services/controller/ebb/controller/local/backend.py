"""The local backend: workers are child processes of the controller (`ebb run`, `ebb up`).

How a worker's end reads: ebb.controller.local.exits; the pid files through which a successor
finds the workers that outlived us: ebb.controller.local.pidfiles; the machine's cores:
ebb.controller.local.cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ebb.common import envvars, host
from ebb.common.messaging.identity import WorkerSigner
from ebb.common.messaging.messages import JobStatus
from ebb.common.messaging.natsconfig import NatsConfig, nats_environment
from ebb.common.runner import GRACE_S

from ..backend import THIS_MACHINE, Capacity, Phase, WorkerInfo, job_environment
from ..groups import job_spec, tier_resources
from . import exits
from .cores import allowed_cores, least_held, machine_cores
from .pidfiles import Orphans, remove_pid_file, write_pid_file

__all__ = ["LocalBackend", "LocalConfig", "machine_cores"]

log = logging.getLogger(__name__)

_KILL_MARGIN_S = 5.0
"""A worker's own grace is this much shorter than the time it is given before SIGKILL."""


@dataclass(eq=False)
class _Child:
    id: str
    job: str
    tier: str
    """The tier of its job it runs; "" for a job without tiers."""
    process: asyncio.subprocess.Process
    started_at: float
    log_file: IO[bytes] | None
    termination_log: Path | None
    exited: asyncio.Task[int]
    """Ends when the process does (and wakes the reconciler through `changed`)."""
    cores: tuple[int, ...] = ()
    """The cores it is pinned to (LocalConfig.pin_cpus); () when it is not."""
    terminate_at: float | None = None
    kill_at: float | None = None


@dataclass(frozen=True, kw_only=True)
class LocalConfig:
    nats: NatsConfig
    max_workers: int = field(default_factory=host.core_count)
    """Workers this machine runs at once, across all jobs."""
    log_dir: str | None = None
    """Each worker's output goes to <log_dir>/<worker id>.log; None: inherit ours."""
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for workers."""
    worker_nats: NatsConfig | None = None
    """How workers connect, with their own credentials; None: as the controller does."""
    worker_signer: WorkerSigner | None = None
    """Mints each worker a credential of its own (ebb.common.messaging.identity), used instead of
    any in `worker_nats`: no worker can then act in another's name."""
    worker_grace_s: float = GRACE_S
    """Between a worker's SIGTERM and its SIGKILL (the reconciler's and the controller's
    grace). A worker is told 5 s less as its own (`EBB_SHUTDOWN_GRACE_S`, unless set), as a
    pod is told its grace less 10 s: its drain, the parts it commits included, ends before the
    kill."""
    pin_cpus: bool = False
    """Pin each worker (and so its stage processes) to cores of its own, its share of the
    machine, rather than letting the kernel move them over every core."""
    orphan_grace_s: float = 60.0
    """A worker that an earlier controller started and that outlived it (found through the
    pid files in `log_dir`) drains on its own: it is killed if it still runs after this."""


class LocalBackend:
    """Workers as child processes of this one, each given its share of this machine."""

    def __init__(self, config: LocalConfig) -> None:
        self.config = config
        self._children: dict[str, _Child] = {}
        self._orphans = Orphans(config.log_dir, grace_s=config.orphan_grace_s)
        """Workers an earlier controller started that outlived it (through `log_dir`)."""
        self.changed = asyncio.Event()
        """Set when a worker exits (see ClusterBackend.changed)."""

    async def observe(self) -> list[WorkerInfo]:
        now = asyncio.get_running_loop().time()
        out = self._orphans.observe(now)
        for child in self._children.values():
            code = child.process.returncode
            if code is None and child.kill_at is not None and now >= child.kill_at:
                log.warning("worker %s did not drain in time: killing it", child.id)
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
            if code is None:
                phase: Phase = "terminating" if child.terminate_at is not None else "running"
                out.append(
                    WorkerInfo(
                        id=child.id,
                        job=child.job,
                        phase=phase,
                        started_at=child.started_at,
                        node=THIS_MACHINE,
                        tier=child.tier,
                    )
                )
                continue
            if child.log_file is not None:
                child.log_file.close()
                child.log_file = None
            log_dir = self.config.log_dir
            said = exits.evidence(
                code,
                termination_log=child.termination_log,
                log=Path(log_dir) / f"{child.id}.log" if log_dir is not None else None,
            )
            # Told to go, and gone in time: whether it drained or the signal found it still
            # starting (before it could take SIGTERM as "drain"), it held nothing and lost
            # nothing. Killed at the end of its grace, it is a loss, not a drain.
            drained = child.terminate_at is not None and code in exits.DRAINED
            out.append(
                WorkerInfo(
                    id=child.id,
                    job=child.job,
                    phase="succeeded" if code == 0 or drained else "failed",
                    started_at=child.started_at,
                    exit_code=code,
                    reason="drained: told to go" if drained else exits.reason(code, said),
                    failure=None if drained else exits.failure_kind(code),
                    node=THIS_MACHINE,
                    tier=child.tier,
                    drained=drained,
                )
            )
        return out

    async def capacity(self, jobs: list[JobStatus], workers: list[WorkerInfo]) -> Capacity:
        del jobs
        draining = sum(1 for w in workers if w.phase == "terminating")
        return Capacity.slots(self.config.max_workers - draining)

    async def launch(self, job: JobStatus, worker_id: str, *, tier: str = "") -> None:
        if worker_id in self._children:
            return
        args = [self.config.python, "-m", "ebb.worker", "--job", job.id, "--id", worker_id]
        if tier:
            args += ["--tier", tier]
        # Connection settings, secrets included, travel in the environment, not on the
        # command line (visible in ps).
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(_NOT_INHERITED)}
        nats = self.config.worker_nats or self.config.nats
        if self.config.worker_signer is not None:
            nats = dataclasses.replace(nats, creds=self.config.worker_signer.credentials(worker_id))
        env = {**inherited, **self.config.env, **nats_environment(nats)}
        grace = max(1.0, self.config.worker_grace_s - _KILL_MARGIN_S)
        env.setdefault(envvars.SHUTDOWN_GRACE_S, f"{grace:g}")
        # In a session of its own, a worker would outlive us if we were killed: this tells
        # it whom to watch, to drain when we are gone.
        env[envvars.PARENT_PID] = str(os.getpid())
        # Its share of the machine: the cores it may use are split among the workers it runs
        # beside (their model runtimes and BLAS would each take every core otherwise).
        share = machine_cores() / self._at_once(job, tier)
        env[envvars.CPUS] = f"{share:g}"
        cores = self._free_cores(max(1, int(share))) if self.config.pin_cpus else ()
        if cores:
            env[envvars.CPU_SET] = ",".join(map(str, cores))
        env.update(job_environment(job, tier))
        log_file = _open_log(self.config.log_dir, worker_id) if self.config.log_dir else None
        termination_log = None
        if self.config.log_dir:
            # The worker writes why it gave up there, as a pod's terminationMessagePath.
            termination_log = Path(self.config.log_dir) / f"{worker_id}.termination"
            env[envvars.TERMINATION_LOG] = str(termination_log)
        process = await asyncio.create_subprocess_exec(
            *args,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT if log_file else None,
            # Its own process group: a Ctrl-C at the terminal reaches the CLI, which then
            # drains workers in order, rather than every worker at once.
            start_new_session=True,
        )
        exited = asyncio.create_task(process.wait(), name=f"exit-of-{worker_id}")
        # Its end is news at once: its leases are released as soon as the master hears.
        exited.add_done_callback(lambda _: self.changed.set())
        self._children[worker_id] = _Child(
            id=worker_id,
            job=job.id,
            tier=tier,
            process=process,
            started_at=asyncio.get_running_loop().time(),
            log_file=log_file,
            termination_log=termination_log,
            exited=exited,
            cores=cores,
        )
        if self.config.log_dir:
            # For the next controller, should we be killed before we can drain this worker.
            write_pid_file(self.config.log_dir, worker_id, job.id, process.pid, tier=tier)
        tiered = f" (tier {tier})" if tier else ""
        log.info("launched worker %s for job %s%s (pid %d)", worker_id, job.id, tiered, process.pid)

    def _at_once(self, job: JobStatus, tier: str) -> int:
        """The workers this machine will run at once while tier `tier` of `job` runs (the
        job, for a job without tiers): as many as it may have, with the others' that run
        now, within the machine's slots. (A job of one worker gets the whole machine, not a
        slot's worth of it.)"""
        others = sum(
            1
            for c in self._children.values()
            if (c.job, c.tier) != (job.id, tier) and c.process.returncode is None
        )
        resources = tier_resources(job_spec(job), tier) if tier else None
        most = resources.max_workers if resources is not None else job.max_workers
        wanted = most or self.config.max_workers
        return max(1, min(self.config.max_workers, wanted + others))

    def _free_cores(self, count: int) -> tuple[int, ...]:
        """`count` cores no running worker is pinned to (the least used, when there are
        not that many free)."""
        held: Counter[int] = Counter(
            core
            for c in self._children.values()
            if c.process.returncode is None
            for core in c.cores
        )
        return least_held(allowed_cores(), held, count)

    async def terminate(self, worker_id: str, *, grace_s: float) -> None:
        child = self._children.get(worker_id)
        if child is None or child.process.returncode is not None or child.terminate_at is not None:
            return
        now = asyncio.get_running_loop().time()
        child.terminate_at = now
        child.kill_at = now + grace_s
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(signal.SIGTERM)

    async def forget(self, worker_id: str) -> None:
        child = self._children.get(worker_id)
        if child is not None and child.process.returncode is not None:
            del self._children[worker_id]
            remove_pid_file(self.config.log_dir, worker_id)

    def agents(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {}

    def grow_memory(self, job: str) -> None:
        """Local workers have no memory request to grow."""
        del job

    def pids(self) -> dict[str, int]:
        """Worker id -> pid of the live workers (for tests and `ebb up` diagnostics)."""
        return {
            c.id: c.process.pid for c in self._children.values() if c.process.returncode is None
        }

    async def close(self, *, grace_s: float) -> None:
        """Local workers are our children: drain them all, then kill what is left."""
        for worker_id in list(self._children):
            await self.terminate(worker_id, grace_s=grace_s)
        waits = [c.exited for c in self._children.values() if not c.exited.done()]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=grace_s)
            for child in self._children.values():
                if child.process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.process.kill()
            if pending:
                await asyncio.wait(pending)
        for child in self._children.values():
            if child.log_file is not None:
                child.log_file.close()
            remove_pid_file(self.config.log_dir, child.id)
        self._children.clear()
        self._orphans.kill()


_NOT_INHERITED = (
    envvars.NATS_NAME_PREFIX,
    envvars.WORKER_NATS_NAME_PREFIX,
    envvars.METRICS_PORT,
    envvars.PARENT_PID,
)
"""Ours, not the workers': they get only what `worker_nats` says (and one metrics port
cannot serve them all)."""


def _open_log(folder: str, worker_id: str) -> IO[bytes]:
    Path(folder).mkdir(parents=True, exist_ok=True)
    return open(Path(folder) / f"{worker_id}.log", "ab")
