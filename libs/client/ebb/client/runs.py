"""Where `ebb run` keeps the state of its embedded stacks: one folder per run, under one
per-user folder, the newest few failed runs' kept and every other run's removed.

    $EBB_RUNS_DIR, else $XDG_STATE_HOME/ebb/runs, else ~/.local/state/ebb/runs
        <job id>-<random>/          a run: NATS's store, the services' and workers' logs
            ebb-run.lock            held (flock) by the `ebb run` using the folder
            client.env              how a client reaches its stack (`ebb status JOB` reads it)

A folder holding no `ebb-run.lock` is none of ours and is never touched, whatever else the
runs folder holds. A run's lock goes with its process, so the folder of a run that was killed
is pruned like a failed one's.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from ebb.common import envvars

CLIENT_ENV = "client.env"
"""A stack's client credentials (KEY=VALUE lines) in its state folder: `ebb run` and `ebb up`
write them, the remote commands read them (`--stack DIR`)."""
TEAMS_DIR = "teams"
"""Where `ebb up --team NAME` writes a team's credentials in the state folder (NAME.env, and
the .creds file it names): what that team's `ebb` commands connect with."""
RUNS_KEPT = 5
"""Runs whose state is kept, the newest (failed ones, and those run with --keep-state); older
ones are removed as runs end."""
LOCK = "ebb-run.lock"


def runs_home(environ: Mapping[str, str]) -> Path:
    """The folder runs' state goes under, per user (the XDG base directory rules)."""
    explicit = environ.get(envvars.RUNS_DIR)
    if explicit:
        return Path(explicit).expanduser()
    state_home = environ.get("XDG_STATE_HOME")
    base = Path(state_home) if state_home else Path.home() / ".local" / "state"
    return base / "ebb" / "runs"


class RunFolder:
    """One run's state folder, locked for as long as the run lasts."""

    def __init__(self, path: Path, lock: IO[bytes]) -> None:
        self.path = path
        self._lock: IO[bytes] | None = lock

    @classmethod
    def create(cls, home: Path, name: str) -> RunFolder:
        home.mkdir(parents=True, exist_ok=True)
        # Made hidden, and named only once locked: `prune` never sees a run's folder unlocked.
        hidden = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=home))
        lock = (hidden / LOCK).open("wb")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a folder just made: nobody else's
        path = hidden.with_name(hidden.name[1:])
        hidden.rename(path)
        return cls(path, lock)

    def keep(self, *, kept: int = RUNS_KEPT) -> None:
        """The run is over and its state stays (it failed): among the runs kept, only the
        newest `kept` stay."""
        self._unlock()
        prune(self.path.parent, kept=kept)

    def discard(self, *, kept: int = RUNS_KEPT) -> None:
        """The run is over and nothing of it is worth keeping. Of the runs kept (failed ones,
        and killed ones, which could not say), only the newest `kept` stay."""
        self._unlock()
        shutil.rmtree(self.path, ignore_errors=True)
        prune(self.path.parent, kept=kept)

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file lets go of the lock
            self._lock = None


def running(home: Path) -> dict[str, Path]:
    """The runs under `home` whose `ebb run` is still running and whose stack is up (it wrote
    its client's credentials), by the id of the job each runs."""
    found = {}
    for path in sorted(home.iterdir()) if home.is_dir() else []:
        if path.name.startswith(".") or not (path / CLIENT_ENV).is_file():
            continue
        if _in_use(path / LOCK):
            # mkdtemp's random tail has no "-": what comes before the last one is the job id.
            found[path.name.rpartition("-")[0]] = path
    return found


def prune(home: Path, *, kept: int) -> list[Path]:
    """Remove the runs under `home` that no process uses, but the newest `kept` of them
    (by when each began). Returns the folders removed."""
    idle: list[tuple[float, Path]] = []
    for path in home.iterdir() if home.is_dir() else []:
        if path.name.startswith("."):
            continue  # a run being set up
        lock = path / LOCK
        try:
            began = lock.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError):
            continue  # not a run's folder
        if _in_use(lock):
            continue
        idle.append((began, path))
    idle.sort(reverse=True)
    removed = [path for _, path in idle[kept:]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _in_use(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the descriptor lets go of the lock, if it got it
    return False
