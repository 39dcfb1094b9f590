"""The embedded stack's reaper: whatever ends `ebb run`, the stack it started ends with it.

`ebb run` starts nats-server, the master and the controller each in a session of its own, so
that a Ctrl-C aimed at it reaches them only through its orderly stop (controller first, NATS
last). Nothing else ties them to its life: killed with SIGKILL (the OOM killer, a CI runner's
timeout, a closed terminal), it would leave all three running for ever, and the controller its
workers. Ray's local mode has the same problem and the same cure (its process reaper):

    python -m ebb.client.reaper [GRACE_S]

a small process in a session of its own, whose standard input is a pipe from the stack. The
stack writes `watch PID` for each process it starts, and `done` once it has stopped them all.
When the pipe closes without a `done`, the stack's process is gone, however it went: the
reaper sends SIGTERM to each process it watches, waits GRACE_S for them, then SIGKILLs them and
every process below them (a controller's workers, their stage processes), and exits.

A worker SIGKILLed mid-shard loses nothing: its lease runs out, or a later `ebb run --resume`
finds the commit records, as after any other kill.
"""

from __future__ import annotations

import signal
import sys
import time

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
    for line in sys.stdin:
        word, _, arg = line.strip().partition(" ")
        if word == "done":
            return 0
        if word == "watch" and arg.isdigit():
            try:
                watched[int(arg)] = psutil.Process(int(arg))
            except psutil.Error:
                continue  # gone already
    reap(list(watched.values()), grace_s=grace_s)
    return 0


def reap(roots: list[psutil.Process], *, grace_s: float) -> None:
    """End `roots` and everything below them: SIGTERM to the roots (they stop in order, a
    controller draining its workers), then, after `grace_s`, SIGKILL to what is left."""
    below = _descendants(roots)
    for process in roots:
        _signal(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in roots):
        time.sleep(0.1)
    for process in [*roots, *below, *_descendants(roots)]:
        _signal(process, signal.SIGKILL)


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
