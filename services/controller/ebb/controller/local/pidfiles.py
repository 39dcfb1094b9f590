"""Local workers' pid files, and the orphans they reveal.

The local backend writes a pid file for each worker it starts (in its log folder), so that a
controller killed before it could drain its workers leaves the next one word of them. The
next one adopts those that still run: it counts each as a draining worker, holding its slot,
until it has exited, and kills any that outlives the grace.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..backend import WorkerInfo

log = logging.getLogger(__name__)

PID_SUFFIX = ".pid"


def write_pid_file(folder: str, worker_id: str, job: str, pid: int, *, tier: str = "") -> None:
    """Worker `worker_id` of `job` (of its tier `tier`) runs as `pid`, a child of this
    process."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    entry = {"pid": pid, "job": job, "tier": tier, "parent": os.getpid()}
    (Path(folder) / f"{worker_id}{PID_SUFFIX}").write_text(json.dumps(entry))


def remove_pid_file(folder: str | None, worker_id: str) -> None:
    if folder:
        with contextlib.suppress(FileNotFoundError):
            (Path(folder) / f"{worker_id}{PID_SUFFIX}").unlink()


@dataclass(eq=False)
class Orphan:
    """A worker an earlier controller (killed before it could drain them) started, found
    through its pid file. It drains on its own once its parent is gone; until it has exited
    it holds its slot."""

    id: str
    job: str
    process: psutil.Process
    kill_at: float
    tier: str = ""
    """The tier of its job it runs ("": none, or a pid file written before tiers)."""


class Orphans:
    """The orphans in one pid file folder: found at the first look, then watched until each
    has exited (its pid file removed then)."""

    def __init__(self, folder: str | None, *, grace_s: float) -> None:
        self.folder = folder
        self.grace_s = grace_s
        """How long an orphan may take to drain before it is killed."""
        self._found: dict[str, Orphan] | None = None
        """None until the first look at the pid files."""

    def observe(self, now: float) -> list[WorkerInfo]:
        """The orphans still running, as terminating workers; those past their grace are
        killed (and reported until they are gone)."""
        if self._found is None:
            self._found = {o.id: o for o in find_orphans(self.folder, now, self.grace_s)}
            for orphan in self._found.values():
                log.warning(
                    "worker %s (pid %d) of job %s outlived the controller that started it: "
                    "counting it until it has drained",
                    orphan.id,
                    orphan.process.pid,
                    orphan.job,
                )
        out = []
        for orphan in list(self._found.values()):
            if not _alive(orphan.process):
                del self._found[orphan.id]
                remove_pid_file(self.folder, orphan.id)
                continue
            if now >= orphan.kill_at:
                log.warning("worker %s did not drain in time: killing it", orphan.id)
                with contextlib.suppress(psutil.Error):
                    orphan.process.kill()
            out.append(
                WorkerInfo(
                    id=orphan.id,
                    job=orphan.job,
                    phase="terminating",
                    started_at=now,
                    tier=orphan.tier,
                )
            )
        return out

    def kill(self) -> None:
        """Kill every orphan still known (the controller stops); the next look finds anew."""
        for orphan in (self._found or {}).values():
            with contextlib.suppress(psutil.Error):
                orphan.process.kill()  # it was draining already: its grace is over
        self._found = None


def find_orphans(folder: str | None, now: float, grace_s: float) -> list[Orphan]:
    """Workers named in pid files that still run, and not as the child of the controller
    that wrote the file. A pid is taken for the worker only if the process's command line
    names that worker: pids are reused."""
    if not folder or not Path(folder).is_dir():
        return []
    found = []
    for path in Path(folder).glob(f"*{PID_SUFFIX}"):
        worker_id = path.name[: -len(PID_SUFFIX)]
        try:
            entry = json.loads(path.read_text())
            process = psutil.Process(int(entry["pid"]))
            command, parent = process.cmdline(), process.ppid()
        except psutil.NoSuchProcess:
            path.unlink(missing_ok=True)  # it has exited
            continue
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            continue  # unreadable, or not ours to look at: leave it to whoever wrote it
        if parent == entry.get("parent"):
            continue  # its controller lives (another one, sharing this folder)
        if "ebb.worker" in command and worker_id in command and _alive(process):
            found.append(
                Orphan(
                    id=worker_id,
                    job=str(entry["job"]),
                    process=process,
                    kill_at=now + grace_s,
                    tier=str(entry.get("tier") or ""),
                )
            )
        else:
            path.unlink(missing_ok=True)
    return found


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
