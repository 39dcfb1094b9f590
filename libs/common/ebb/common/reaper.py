"""A reaper: whatever ends the process that started some others, they end with it.

`ebb run` starts nats-server, the master and the controller each in a session of its own, so
that a Ctrl-C aimed at it reaches them only through its orderly stop (controller first, NATS
last). Nothing else ties them to its life: killed with SIGKILL (the OOM killer, a CI runner's
timeout, a closed terminal), it would leave all three running for ever, and the controller its
workers. An `llm` stage's model server (ebb.worker.llm.managed) is the same: a vLLM server's
engine processes, each holding its share of the device's memory, outlive a stage killed by its
batch timeout unless something is left to end them. Ray's local mode has the same problem and
the same cure (its process reaper):

    python -m ebb.common.reaper [GRACE_S]

a small process in a session of its own, whose standard input is a pipe from its owner. The
owner writes `watch PID` for each process it starts (that process and every one below it),
`group PGID` for a process group (every process in it, even one orphaned when the group's
leader died: a server killed by the OOM killer leaves its engine processes so), `forget PGID`
once it has stopped a group itself, and `done` once it has stopped them all. When the pipe
closes without a `done`, the owner is gone, however it went: the reaper sends SIGTERM to what
it watches, waits GRACE_S for them, then SIGKILLs them and every process below them (a
controller's workers, their stage processes), and exits.

A worker SIGKILLed mid-shard loses nothing: its lease runs out, or a later `ebb run --resume`
finds the commit records, as after any other kill.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence

import psutil

GRACE_S = 5.0
"""How long the processes of a stack whose `ebb run` died get to stop on their own."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    grace_s = float(args[0]) if args else GRACE_S
    # A terminal's signals are not ours to obey: only the pipe says when to act.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    watched: dict[int, psutil.Process] = {}
    groups: set[int] = set()
    for line in sys.stdin:
        word, _, arg = line.strip().partition(" ")
        if word == "done":
            return 0
        if not arg.isdigit():
            continue
        if word == "watch":
            try:
                watched[int(arg)] = psutil.Process(int(arg))
            except psutil.Error:
                continue  # gone already
        elif word == "group":
            groups.add(int(arg))
        elif word == "forget":
            groups.discard(int(arg))
    reap(list(watched.values()), grace_s=grace_s, groups=sorted(groups))
    return 0


def reap(roots: list[psutil.Process], *, grace_s: float, groups: Sequence[int] = ()) -> None:
    """End `roots` and everything below them, and every process of `groups`: SIGTERM to the
    roots (they stop in order, a controller draining its workers) and the groups, then, after
    `grace_s`, SIGKILL to what is left."""
    below = _descendants(roots)
    for process in roots:
        _signal(process, signal.SIGTERM)
    for group in groups:
        _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (
        any(_alive(p) for p in roots) or any(_signal_group(g, 0) for g in groups)
    ):
        time.sleep(0.1)
    for process in [*roots, *below, *_descendants(roots)]:
        _signal(process, signal.SIGKILL)
    for group in groups:
        _signal_group(group, signal.SIGKILL)


def _signal_group(group: int, sig: int) -> bool:
    """`sig` to every process of `group` (0: none sent); whether the group has any."""
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a process of it is not ours to signal: there is one
    return True


def _descendants(roots: list[psutil.Process]) -> list[psutil.Process]:
    found: list[psutil.Process] = []
    for root in roots:
        try:
            found += root.children(recursive=True)
        except psutil.Error:
            continue
    return found


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(process: psutil.Process, sig: int) -> None:
    """`sig` to `process` if it is still the process we were told of (psutil checks its
    start time: a pid reused since is left alone)."""
    try:
        if process.is_running():
            process.send_signal(sig)
    except psutil.Error:
        pass


if __name__ == "__main__":
    sys.exit(main())
