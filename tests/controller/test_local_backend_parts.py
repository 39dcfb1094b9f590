"""The local backend's parts: how a worker's end reads, how the cores are divided, and the pid
files through which a controller finds the workers that outlived the one before it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from ebb.common.messaging.messages import JobStatus
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.runner import EXIT_CONFIG, EXIT_SETUP
from ebb.controller.backend import WorkerInfo
from ebb.controller.local.backend import LocalBackend, LocalConfig
from ebb.controller.local.cores import least_held
from ebb.controller.local.exits import evidence, failure_kind, reason
from ebb.controller.local.pidfiles import Orphans, find_orphans, write_pid_file
from ebb.controller.policy.failures import Kind

from ..helpers import free_port, wait_until


@pytest.mark.parametrize(
    ("code", "kind", "text"),
    [
        (0, None, "exit code 0"),
        (1, None, "exit code 1"),
        (EXIT_CONFIG, "fatal", f"exit code {EXIT_CONFIG}"),
        (EXIT_SETUP, "setup", f"exit code {EXIT_SETUP}"),
        (-signal.SIGKILL, "capacity", "killed by SIGKILL"),
        (-signal.SIGTERM, "capacity", "killed by SIGTERM"),
        (-signal.SIGINT, "capacity", "killed by SIGINT"),
        (-signal.SIGHUP, "capacity", "killed by SIGHUP"),
        (-signal.SIGSEGV, None, "killed by SIGSEGV"),  # it crashed: its own doing
        (-signal.SIGABRT, None, "killed by SIGABRT"),
        (-200, None, "killed by signal 200"),
    ],
)
def test_a_workers_exit_code_reads_as_a_kind_of_failure(
    code: int, kind: Kind | None, text: str
) -> None:
    assert failure_kind(code) == kind
    assert reason(code, "") == text
    assert reason(code, "no model here") == f"{text}: no model here"


def test_a_worker_is_taken_at_its_word_then_at_its_log(tmp_path: Path) -> None:
    termination, log = tmp_path / "w.termination", tmp_path / "w.log"
    log.write_text("starting\n\n" + "".join(f"line {n}\n" for n in range(10)))
    last = " | ".join(f"line {n}" for n in range(5, 10))
    assert evidence(1, termination_log=termination, log=log) == last
    assert evidence(1, termination_log=None, log=None) == ""
    assert evidence(1, termination_log=termination, log=termination) == ""  # none written
    # Killed, or done: what it logged is not why.
    assert evidence(-signal.SIGKILL, termination_log=termination, log=log) == ""
    assert evidence(0, termination_log=termination, log=log) == ""
    termination.write_text("the spec names no such column\n")
    said = "the spec names no such column"
    for code in (0, 1, -signal.SIGKILL):
        assert evidence(code, termination_log=termination, log=log) == said


def test_a_long_log_tail_keeps_its_end(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("x" * 100_000 + "\nTraceback: the end\n")
    said = evidence(1, termination_log=None, log=log)
    assert len(said) == 800 and said.endswith("x | Traceback: the end")


@pytest.mark.parametrize(
    ("held", "count", "chosen"),
    [
        ({}, 2, (0, 1)),
        ({0: 1, 1: 1}, 2, (2, 3)),
        ({0: 1, 2: 1}, 3, (0, 1, 3)),  # the two free, then the lowest of the least held
        ({0: 2, 1: 1, 2: 1, 3: 1}, 4, (0, 1, 2, 3)),
        ({0: 2, 1: 1, 2: 1, 3: 1}, 1, (1,)),
        ({}, 0, ()),
    ],
)
def test_workers_are_pinned_to_the_least_held_cores(
    held: dict[int, int], count: int, chosen: tuple[int, ...]
) -> None:
    assert least_held([0, 1, 2, 3], Counter(held), count) == chosen


def test_no_cores_no_pinning() -> None:
    assert least_held([], Counter(), 2) == ()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process whose command line reads as worker w-1's (`... ebb.worker --id w-1`)."""
    code = "import time; time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code, "ebb.worker", "--id", "w-1"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def _pid_file(folder: Path, worker: str, *, pid: int, parent: int, tier: str = "") -> Path:
    """A pid file as an earlier controller wrote it (one before tiers wrote none)."""
    path = folder / f"{worker}.pid"
    entry = {"pid": pid, "job": "j", "parent": parent, **({"tier": tier} if tier else {})}
    path.write_text(json.dumps(entry))
    return path


def test_only_a_live_worker_whose_controller_is_gone_is_an_orphan(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    gone = _pid_file(tmp_path, "w-0", pid=done.pid, parent=-1)
    # Ours (this process wrote it and is its parent): another controller's living worker.
    write_pid_file(str(tmp_path), "w-1", "j", sleeper.pid)
    assert find_orphans(str(tmp_path), now=0.0, grace_s=1.0) == []
    assert not gone.exists()
    assert (tmp_path / "w-1.pid").exists()
    # Its parent is gone, but the pid names some other process now (pids are reused).
    other = _pid_file(tmp_path, "w-2", pid=sleeper.pid, parent=-1)
    assert find_orphans(str(tmp_path), now=0.0, grace_s=1.0) == []
    assert not other.exists()
    # Unreadable: someone else's to mind.
    (tmp_path / "w-3.pid").write_text("{")
    assert find_orphans(str(tmp_path), now=0.0, grace_s=1.0) == []
    assert (tmp_path / "w-3.pid").exists()
    assert find_orphans(None, now=0.0, grace_s=1.0) == []
    assert find_orphans(str(tmp_path / "none"), now=0.0, grace_s=1.0) == []


def test_an_orphan_holds_its_slot_until_it_exits_and_is_killed_after_its_grace(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    path = _pid_file(tmp_path, "w-1", pid=sleeper.pid, parent=-1, tier="model")
    orphans = Orphans(str(tmp_path), grace_s=10.0)
    found = orphans.observe(now=100.0)
    assert [(w.id, w.job, w.tier, w.phase) for w in found] == [("w-1", "j", "model", "terminating")]
    assert [w.id for w in orphans.observe(now=109.0)] == ["w-1"]
    assert sleeper.poll() is None  # within its grace
    assert [w.id for w in orphans.observe(now=110.0)] == ["w-1"]  # killed, not yet gone
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert orphans.observe(now=111.0) == []
    assert not path.exists()


async def test_a_worker_told_to_go_is_drained_and_one_killed_from_outside_is_lost(
    tmp_path: Path,
) -> None:
    """The controller's SIGTERM, whether the worker drains or the signal finds it starting
    (here: at once), is a drain; a kill from anyone else (an operator, a reclaim) is a loss."""
    nowhere = NatsConfig(url=f"nats://127.0.0.1:{free_port()}")  # they never get started
    backend = LocalBackend(LocalConfig(nats=nowhere, max_workers=2, log_dir=str(tmp_path)))
    job = JobStatus(id="j", name="j", state="RUNNING")
    await backend.launch(job, "told")
    await backend.launch(job, "killed")
    await backend.terminate("told", grace_s=30)
    os.kill(backend.pids()["killed"], signal.SIGKILL)

    async def ended() -> dict[str, WorkerInfo]:
        return {w.id: w for w in await backend.observe() if w.ended}

    seen = await wait_until(lambda: _both(ended), timeout=60, what="both workers to end")
    assert (seen["told"].phase, seen["told"].drained, seen["told"].failure) == (
        "succeeded",
        True,
        None,
    )
    assert (seen["killed"].phase, seen["killed"].drained, seen["killed"].failure) == (
        "failed",
        False,
        "capacity",
    )


async def _both(ended: Callable[[], Awaitable[dict[str, WorkerInfo]]]) -> dict[str, WorkerInfo]:
    seen = await ended()
    return seen if len(seen) == 2 else {}
