"""Failpoints: named places where a test or the chaos campaign makes a process die on purpose,
at exactly that place, as etcd's gofail or FoundationDB's BUGGIFY do.

Random kills seldom land in the narrow windows that matter most to exactly-once output (a
worker's commit record written but not yet reported; a shard recorded DONE by the master but
not yet answered). A failpoint aims at one: it fires when a file named after it is in the
folder that EBB_FAILPOINT_DIR names. The first process to reach it takes the file (an atomic
rename), writes what it was doing into it, renames it `<name>.fired-<pid>` (which tells the
test who died, when, and at what) and SIGKILLs itself, so one file kills one process once.

Some faults are not deaths: a write whose answer is lost (the server applied it, the client
timed out). `take` is the same one-shot point for those: the process that takes it goes on, and
makes the fault itself. An armed file may hold a condition: then only a process whose `detail`
contains that text takes it (a write of a DONE that names a hand-off, say).

Without EBB_FAILPOINT_DIR, `hit` and `take` return at once: nothing is read, nothing can fire.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from . import envvars

WORKER_AFTER_COMMIT_RECORD = "worker.after_commit_record"
"""A worker has written its shard's commit record and not yet told the master."""
WORKER_BEFORE_COMMIT_RECORD = "worker.before_commit_record"
"""A worker has written its shard's (or part's) files and not yet its commit record."""
MASTER_AFTER_RECORDING_DONE = "master.after_recording_done"
"""The master has recorded a shard DONE in KV and not yet replied to the worker's commit."""

MASTER_BEFORE_SUCCESSOR = "master.before_successor"
"""The master has written a DONE that names a new shard (a split's rest, a hand-off to the next
tier: its detail says which) and not yet that shard's own record."""
MASTER_KV_ANSWER_LOST = "master.kv_answer_lost"
"""The master's write to KV landed, and its answer is lost (taken, not hit: nothing dies)."""

WORKER_LLM_ENGINE_FAILS = "worker.llm_engine_fails"
"""An `llm` stage's engine fails mid-generation as a dead engine does (CUDA out of memory, an
engine process gone): taken, the engine raises; the stage restarts it."""
POINTS = (
    WORKER_BEFORE_COMMIT_RECORD,
    WORKER_AFTER_COMMIT_RECORD,
    MASTER_AFTER_RECORDING_DONE,
    MASTER_BEFORE_SUCCESSOR,
    MASTER_KV_ANSWER_LOST,
    WORKER_LLM_ENGINE_FAILS,
)


def hit(name: str, detail: str = "") -> None:
    """Die here (SIGKILL, as the OOM killer would) if `name` is armed; else nothing.
    `detail` (what the process was doing: the shard, say) is left in the fired file."""
    if take(name, detail):
        os.kill(os.getpid(), signal.SIGKILL)


def take(name: str, detail: str = "") -> bool:
    """True, once, in the first process to reach `name` while it is armed (and its condition,
    if it has one, is in `detail`): the caller then makes the fault. `detail` is left in the
    fired file."""
    folder = os.environ.get(envvars.FAILPOINT_DIR)
    if not folder:
        return False
    armed = Path(folder) / name
    try:
        condition = armed.read_text()
    except FileNotFoundError:
        return False  # not armed, or fired already
    if condition not in detail:
        return False
    taken = armed.with_name(f"{name}.taken-{os.getpid()}")
    try:
        armed.rename(taken)
    except FileNotFoundError:
        return False  # another process took it first
    taken.write_text(detail)
    # Renamed again once it says what it hit: a "fired" file is complete when seen.
    taken.rename(armed.with_name(f"{name}.fired-{os.getpid()}"))
    return True


def arm(folder: Path, name: str, *, when: str = "") -> None:
    """Arm `name` in `folder`: the next process to reach it (with `when` in its detail, if
    given) dies, or makes the fault `take` stands for."""
    if name not in POINTS:
        raise ValueError(f"no failpoint {name!r}; there are {', '.join(POINTS)}")
    (folder / name).write_text(when)


def fired(folder: Path, name: str) -> int | None:
    """The pid of the process that `name` killed, None while it has not fired."""
    for path in folder.glob(f"{name}.fired-*"):
        return int(path.name.rsplit("-", 1)[1])
    return None


def detail(folder: Path, name: str, pid: int) -> str:
    """What the process `name` killed was doing (`hit`'s detail)."""
    return (folder / f"{name}.fired-{pid}").read_text()
